"""The batch a model's forward takes: read by the step, the trace and the chunked loss alike."""

from __future__ import annotations

import torch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keys of a collated batch the model's forward takes.

    A packed batch (it has ``position_ids``) goes without its ``attention_mask``: transformers looks for
    packed documents in the position ids only when no attention mask is given. The mask stays in the
    batch for counting real tokens.
    """
    if "position_ids" in batch:
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return batch
