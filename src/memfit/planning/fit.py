"""The one rule of whether a run fits a device: read by ``plan``, ``train --budget`` and the OOM fallback (all through
``planning.search.evaluate``).

A run fits when what its device must hold at its worst moment, times ``1 + margin``, is within the budget. What it
must hold (``memory.phases.DevicePhases.needed``) is the predicted ``max_memory_reserved`` of every phase (loading
and what it leaves reserved, wrapping, the step, evaluation, a full-state save, samples) at its largest, plus the
CUDA context and NCCL's buffers: what nvidia-smi shows and what an out-of-memory error is about, not the tensor
peak. On a CPU it is the largest phase's tensor peak.

The margin (``SAFETY_MARGIN``, 5%) sits on top of an estimate that already carries the caching allocator's overhead
(``memory.fragmentation``, a least-squares fit to allocator replays): it covers that term's median case, not its
worst under-prediction of large steps (``fragmentation.SPREAD``, -13.7% with each replay left out of the fit), nor the CUDA context's variation (+-200 MiB,
``memory.device_terms``) beyond it; ``margin_note`` states what is left of a budget, whether that covers the
term's worst case, and how many of the published GPU runs' errors it covers (``memory.gpu_evidence``: memfit
under-predicts most of them, so a bare 5% margin does not cover every one).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory import fragmentation, gpu_evidence
from memfit.memory.phases import DevicePhases, device_phases
from memfit.units import fmt_gib

#: Fraction of the predicted need kept free on top of it: fits iff ``needed * (1 + margin) <= budget``.
SAFETY_MARGIN = 0.05


def fits(needed_bytes: int, budget_bytes: int, margin: float = SAFETY_MARGIN) -> bool:
    """Whether a predicted need fits the budget with the safety margin."""
    return needed_bytes * (1.0 + margin) <= budget_bytes


@dataclass(frozen=True)
class FitDecision:
    phases: DevicePhases
    fits: bool

    @property
    def needed_bytes(self) -> int:
        return self.phases.needed()


def decide(spec, run, breakdown, budget_bytes: int, margin: float = SAFETY_MARGIN, *, cpu: bool = False,
           extra_step: int = 0, stack=None) -> FitDecision:
    """Every phase of ``run`` (``memory.phases``) and whether their worst fits ``budget_bytes`` with ``margin``;
    ``extra_step``: tensor bytes the step may add beyond ``breakdown`` (a mixture-of-experts' worst routing);
    ``stack``: the trainer that runs it, which decides how its base is loaded and wrapped (as ``estimate`` prices it)."""
    phases = device_phases(spec, run, breakdown, "cpu" if cpu else "cuda", extra_step, stack=stack)
    return FitDecision(phases, fits(phases.needed(), budget_bytes, margin))


def margin_note(phases: DevicePhases, budget_bytes: int, margin: float = SAFETY_MARGIN) -> str:
    """One line: what the decision read (the worst phase's reserved memory, context, NCCL), what is left of the
    budget and the error spread that leftover covers."""
    needed = phases.needed()
    left = budget_bytes - needed
    extras = (f" + CUDA context {fmt_gib(phases.context)}" if phases.context else "") + \
             (f" + NCCL buffers {fmt_gib(phases.nccl)}" if phases.nccl else "")
    head = (f"fit decided on the {'predicted reserved memory' if phases.context else 'predicted peak'} of every "
            f"phase (worst: {phases.worst.name}, {fmt_gib(phases.worst.reserved)}){extras} = {fmt_gib(needed)}; "
            f"{fmt_gib(left)} of {fmt_gib(budget_bytes)} left ({left / needed:.1%} of the need; the safety margin is "
            f"{margin:.0%})")
    if not phases.context:  # a CPU: no caching allocator to model
        return head + "."
    low = -fragmentation.SPREAD[0]
    covered = "covers" if left >= low * needed else "does not cover"
    return (f"{head}: it {covered} the allocator term's worst under-prediction of allocator replays, {low:.1%} "
            f"(memory/fragmentation.py), before the tensor estimate's own error; "
            f"{gpu_evidence.describe(left, needed)}.")
