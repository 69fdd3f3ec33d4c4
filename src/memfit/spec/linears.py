"""A model's linear projections as memfit counts them: the shape of one group, and which read what.

Read by the model spec (``modelspec.ModelSpec.linears``), the resolved LoRA targets (``resolved``) and
the estimator (``memory.estimate``, ``memory.quantized``); a leaf, so that none of them imports another
for these.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Projections that read a layer's (normalised) input, per family: frozen in LoRA's first layer.
ATTN_IN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn")


@dataclass(frozen=True)
class LinearShape:
    """One linear projection of the model, grouped by module name (``q_proj``) over all layers.

    ``in_features``/``out_features`` are the mathematical shape (for GPT-2's ``Conv1D`` the weight is
    stored transposed, the shape here is the same as an ``nn.Linear`` would have).
    """

    name: str
    in_features: int
    out_features: int
    bias: bool
    count: int
    """How many modules carry this name (usually one per decoder layer)."""

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features * self.count
