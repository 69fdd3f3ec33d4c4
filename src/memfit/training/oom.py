"""Out-of-memory inside a training step: recognise it, and pick a configuration that lowers the phase that ran out.

Unlike Accelerate's ``find_executable_batch_size`` (shrinks the batch by 10% and keeps the
accumulation, so the effective batch silently changes), every fallback here keeps the effective batch
exactly: ``micro_batch x grad_accum x num_processes`` is unchanged. The loop undoes the step
(``training.rollback``) and redoes it from its start on the same samples (the step schedule fixes
which samples a step covers), so no step is lost, counted twice, or half applied.

Which configuration helps depends on the phase that ran out (the estimator's ``phase_peaks``):

- **forward / backward** peak with the activations and logits: a smaller micro-batch (accumulation
  raised to match), then gradient checkpointing, lower them.
- **clip / optimizer** run when the activations are gone: weights, gradients and optimizer state are
  all that is left, plus the optimizer's step temporaries (foreach AdamW: one parameter-sized
  temporary per parameter of the group). A smaller micro-batch changes none of that; fused AdamW
  (in place, no temporaries) does. Clipping's own temporaries are a few scalars, so an OOM there
  means the same floor is already too high; the fused step is the one live switch that lowers the
  step's maximum. Lowering the state itself (LoRA, 8-bit, offload) needs a rebuilt run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from accelerate.utils.memory import should_reduce_batch_size

from memfit.errors import UserError
from memfit.integrations.hf_compat import enable_checkpointing
from memfit.planning.search import fallbacks
from memfit.settings.config import Optimizer, RunConfig
from memfit.spec.optimizers import inner_optimizer

#: Optimizers whose step allocates parameter-sized temporaries, and the in-place implementation that does not.
LOWER_TEMPORARY_OPTIMIZER = {Optimizer.ADAMW: Optimizer.ADAMW_FUSED, Optimizer.ADAMW_FOREACH: Optimizer.ADAMW_FUSED}

#: Devices torch's fused AdamW kernel runs on (torch >= 2.4; ``_get_fused_kernels_supported_devices``).
FUSED_ADAMW_DEVICES = ("cuda", "cpu", "xpu", "mps")

#: The estimator's phase that an OOM in each step phase is compared against (clipping runs at the
#: optimizer phase's floor: weights + gradients + state).
ESTIMATOR_PHASE = {"forward": "forward", "backward": "backward", "clip": "optimizer", "optimizer": "optimizer"}


def is_oom(err: BaseException) -> bool:
    """True for an out-of-memory error: torch's (CUDA or any accelerator), the CPU allocator's, Python's.

    Accelerate's ``should_reduce_batch_size`` knows the allocators' messages (CUDA/HIP/XPU
    " out of memory.", MPS, "DefaultCPUAllocator: can't allocate memory", HPU, and cuDNN's "not
    supported", which a smaller batch also cures); ``MemoryError`` is Python's own.
    """

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    # "CUDA error: out of memory" (a CUDA call, not the caching allocator, e.g. creating a cuBLAS
    # handle) has no trailing period, so Accelerate's list misses it.
    return isinstance(err, RuntimeError) and (should_reduce_batch_size(err) or "CUDA error: out of memory" in str(err))


def fallback_ladder(run: RunConfig) -> list[RunConfig]:
    """Configurations that lower the forward/backward peak, in order, each with the same effective batch.

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


def optimizer_ladder(run: RunConfig, device: str) -> list[RunConfig]:
    """Configurations that lower the optimizer step's peak and can be switched live: the fused AdamW kernel."""
    lower = LOWER_TEMPORARY_OPTIMIZER.get(run.optimizer)
    if lower is None or device not in FUSED_ADAMW_DEVICES:
        return []
    return [run.replace(optimizer=lower)]


def next_config(run: RunConfig, planned: list[RunConfig] | None = None, *, phase: str = "forward",
                device: str = "cuda", estimate: Callable[[RunConfig], object | None] | None = None
                ) -> RunConfig | None:
    """The next configuration for a step that ran out of memory in ``phase``, or None when there is none.

    Args:
        run: the configuration that ran out.
        planned: the planner's fallbacks for a planned run (``--budget``); they lower forward/backward.
        phase: one of ``training.step.PHASES``.
        device: the device type (the fused optimizer needs a device torch ships the kernel for).
        estimate: ``RunConfig -> MemoryBreakdown`` (or None); when given, a candidate is kept only if
            the estimator predicts a lower peak for the phase that ran out.
    """
    if ESTIMATOR_PHASE[phase] == "optimizer":
        candidates = optimizer_ladder(run, device)
    else:
        candidates = planned if planned else fallback_ladder(run)
    candidates = [c for c in candidates if c != run and c.effective_batch() == run.effective_batch()]
    if estimate is not None:
        candidates = [c for c in candidates if lowers(estimate, run, c, ESTIMATOR_PHASE[phase])]
    return candidates[0] if candidates else None


def lowers(estimate: Callable[[RunConfig], object | None], run: RunConfig, cand: RunConfig, phase: str) -> bool:
    """Whether the estimator predicts ``cand`` a lower peak than ``run`` in ``phase`` (True when it cannot say)."""
    now, then = estimate(run), estimate(cand)
    if now is None or then is None or phase not in now.phase_peaks or phase not in then.phase_peaks:
        return True
    return then.phase_peaks[phase] < now.phase_peaks[phase]


def nothing_lower_message(run: RunConfig, phase: str, step: int) -> str:
    """The one sentence for an OOM that no live switch can lower."""
    if ESTIMATOR_PHASE[phase] == "optimizer":
        return (f"Out of memory in the {phase} phase of step {step} with --optimizer {run.optimizer}, which has no "
                "lower-memory implementation to switch to during a run; lower the optimizer state instead "
                "(--lora-r, --optimizer adamw-8bit or sgd, or --offload optimizer).")
    ckpt = " and gradient checkpointing on" if run.grad_checkpointing else ""
    return (f"Out of memory in the {phase} phase of step {step} with micro-batch {run.micro_batch}{ckpt}, and no "
            "smaller configuration keeps the effective batch; lower --batch or --seq-len, or use --lora-r.")


def planned_fallbacks(plan_result, run: RunConfig) -> list[RunConfig] | None:
    """``memfit.planning.search.fallbacks`` for a planned run (``--budget``), else None."""
    if plan_result is None:
        return None

    return list(fallbacks(plan_result, run, live_only=True))  # the loop switches these without a rebuild


def switch_live(accelerator, model, optimizer, before: RunConfig, after: RunConfig) -> None:
    """Apply ``after`` to the running objects: accumulation, checkpointing, the optimizer implementation."""
    accelerator.gradient_accumulation_steps = after.grad_accum
    if after.grad_checkpointing and not before.grad_checkpointing:
        enable_checkpointing(accelerator.unwrap_model(model))
    if after.optimizer is Optimizer.ADAMW_FUSED and before.optimizer is not Optimizer.ADAMW_FUSED:
        use_fused_adamw(optimizer)


def use_fused_adamw(optimizer) -> None:
    """Switch a torch AdamW to its fused kernel in place, keeping its state.

    The fused kernel reads each param group's ``fused`` flag at every step and keeps its step counts
    on the parameter's device as float32; ``Optimizer.load_state_dict`` converts the steps the same
    way when a fused optimizer loads a foreach one's state.
    """

    opt = inner_optimizer(optimizer)
    for group in opt.param_groups:
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            state = opt.state.get(p)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


@contextmanager
def not_a_batch_problem(doing: str) -> Iterator[None]:
    """An OOM outside a training step is not the batch's fault: say so instead of shrinking the batch."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if is_oom(err):
            raise UserError(f"Ran out of memory while {doing}, outside a training step, so memfit did not "
                            "shrink the batch; free memory on the device or lower --micro-batch.") from None
        raise
