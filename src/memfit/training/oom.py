"""Out-of-memory inside a training step: recognise it, free memory, and pick the next configuration.

Unlike Accelerate's ``find_executable_batch_size`` (shrinks the batch by 10% and keeps the
accumulation, so the effective batch silently changes), every fallback here keeps the effective batch
exactly: ``micro_batch x grad_accum x num_processes`` is unchanged. The loop then redoes the current
optimizer step from its start on the same samples (the step schedule fixes which samples a step
covers), so no step is lost or counted twice.
"""

from __future__ import annotations

import gc

from memfit.config import RunConfig


def is_oom(err: BaseException) -> bool:
    """True for torch's out-of-memory error (CUDA, or any accelerator), and allocator failures on CPU."""
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def free_memory(model) -> None:
    """Drop gradients and cached blocks left by the failed step."""
    import torch

    model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fallback_ladder(run: RunConfig) -> list[RunConfig]:
    """Configurations to try after ``run`` ran out of memory, in order, each with the same effective batch.

    First smaller micro-batches (each divisor of ``micro_batch``, largest first, with accumulation raised
    to match: fewer activations at the same step semantics), then gradient checkpointing on at the
    smallest micro-batch (activations of one layer at a time, ~33% more compute).
    """
    per_rank = run.micro_batch * run.grad_accum
    ladder = [
        run.replace(micro_batch=m, grad_accum=per_rank // m)
        for m in range(run.micro_batch - 1, 0, -1)
        if run.micro_batch % m == 0
    ]
    if not run.grad_checkpointing:
        ladder.append(run.replace(micro_batch=1, grad_accum=per_rank, grad_checkpointing=True))
    return ladder


def next_config(run: RunConfig, planned: list[RunConfig] | None = None) -> RunConfig | None:
    """The next fallback: from the planner's list when the run was planned (``--budget``), else the ladder."""
    candidates = planned if planned else fallback_ladder(run)
    for cand in candidates:
        if cand != run and cand.effective_batch() == run.effective_batch():
            return cand
    return None


def planned_fallbacks(plan_result, run: RunConfig) -> list[RunConfig] | None:
    """``memfit.planning.search.fallbacks`` for a planned run (``--budget``), else None."""
    if plan_result is None:
        return None
    from memfit.planning.search import fallbacks

    return list(fallbacks(plan_result, run, live_only=True))  # the loop switches these without a rebuild
