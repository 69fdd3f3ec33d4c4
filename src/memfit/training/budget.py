"""``memfit train --budget``: let the planner choose the run settings, then train with them."""

from __future__ import annotations

from typing import Any

from memfit.config import RunConfig, TrainConfig
from memfit.errors import UserError

# Settings that define the effective batch or the launch, not a choice the planner is bound by.
_NOT_PINNED = {"micro_batch", "grad_accum", "num_processes", "seq_len"}


def plan_run(config: TrainConfig, run: RunConfig) -> tuple[RunConfig, Any]:
    """The fastest planned configuration that fits ``config.budget`` and that this machine can train.

    The effective batch (``run.effective_batch()``: the user's micro-batch x accumulation x processes,
    or ``--batch``) and the sequence length are kept; settings the user typed (``config.pinned``) are
    constraints. memfit train runs DDP without offload, and quantization/8-bit optimizers only on CUDA,
    so plans needing those are passed over (the first trainable one in rank order is taken).
    """
    from memfit.planning.search import plan
    from memfit.planning.space import Constraints
    from memfit.training.setup import cuda_available, preflight

    pinned = {k: getattr(run, k) for k in config.pinned if k in RunConfig.__dataclass_fields__ and k not in _NOT_PINNED}
    pinned = {k: (v.value if hasattr(v, "value") else v) for k, v in pinned.items()}
    pinned.setdefault("sharding", "ddp")
    constraints = Constraints.from_flat({**pinned, "allow_offload": False, "allow_quantize": cuda_available()})
    result = plan(config.model, config.budget, seq_len=run.seq_len, batch=run.effective_batch(),
                  num_processes=run.num_processes, constraints=constraints)
    for index, candidate in enumerate(result.plans):
        if not candidate.fits:
            break
        try:
            preflight(candidate.config)
        except UserError:
            continue
        result.chosen = index
        return candidate.config.replace(num_processes=run.num_processes), result
    raise UserError(f"No plan that fits {config.budget} can be trained on this machine "
                    "(the fitting ones need CUDA-only features); try a larger --budget.")
