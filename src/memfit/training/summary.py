"""What a finished training run reports: one typed object, rendered three ways.

``RunSummary`` is built once by ``training.finish``; the rich table (``report.summary.summary_table``),
``run.json`` and ``memfit train --json`` all render it, through ``to_dict`` for the two JSON forms, so
the three can never disagree on a number or a key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.measure import PeakMemory
from memfit.report.summary import fallback_line, json_safe
from memfit.settings.config import RunConfig

#: The run settings a fallback may change; ``FallbackRecord`` shows them before and after.
FALLBACK_KEYS = ("micro_batch", "grad_accum", "grad_checkpointing", "optimizer")


@dataclass(frozen=True)
class FallbackRecord:
    """One switch made after an out-of-memory error inside a training step."""

    step: int
    """The optimizer step (1-based) that ran out of memory and was redone."""
    phase: str
    """The part of the step that raised: forward, backward, clip or optimizer."""
    error: str
    """The first line of the error, at most 200 characters."""
    before: dict[str, Any]
    """``FALLBACK_KEYS`` of the settings that ran out of memory."""
    after: dict[str, Any]
    """``FALLBACK_KEYS`` of the settings the step was redone with."""

    @classmethod
    def of(cls, step: int, phase: str, err: BaseException, before: RunConfig, after: RunConfig) -> FallbackRecord:
        def keys(run: RunConfig) -> dict[str, Any]:
            flat = run.to_flat()
            return {k: flat[k] for k in FALLBACK_KEYS}

        return cls(step, phase, str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__,
                   keys(before), keys(after))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FallbackRecord:
        return cls(data["step"], data.get("phase", "forward"), data["error"], dict(data["from"]), dict(data["to"]))

    def describe(self) -> str:
        """One line: ``step 2 (forward): micro-batch 4 x 1 -> 2 x 2`` (``report.summary.fallback_line``)."""
        return fallback_line(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "error": self.error, "from": dict(self.before),
                "to": dict(self.after)}


@dataclass
class RunSummary:
    """The end of a run: progress, losses, speed, memory measured against predicted, where it went."""

    steps: int
    sequences: int
    """Training sequences consumed (all processes)."""
    final_train_loss: float
    final_eval_loss: float
    """NaN when no held-out evaluation ran (``null`` in JSON)."""
    best_eval_loss: float
    unigram_loss: float
    """The loss of predicting every token by its training-set frequency: the baseline to beat."""
    tokens_per_s: float
    train_s: float
    """Seconds inside optimizer steps (setup, evaluation and saving excluded), over every part of a resumed run."""
    wall_s: float
    """Wall time of the whole run: this process plus, for a resumed run, the earlier parts up to the
    checkpoint it resumed from (``LoopState.wall_s``)."""
    skipped_steps: int
    """fp16 steps the loss scaler skipped (inf/NaN gradients)."""
    peak_memory: PeakMemory
    measured: MemoryBreakdown
    predicted: MemoryBreakdown | None
    plan: dict[str, Any] | None
    """``training.budget.plan_record`` of the planned run (``--budget``)."""
    fallbacks: list[FallbackRecord]
    num_processes: int
    rank_peak_bytes: list[int]
    """Each rank's measured peak (one entry per process)."""
    resumes: list[dict[str, Any]]
    """One record per ``--resume`` of this run."""
    initial_run: RunConfig
    run: RunConfig
    """The settings the run ended with (after any OOM fallback)."""
    uses_model_loss: bool
    params: int
    trainable_params: int
    output: str
    samples: list[dict[str, str]] = field(default_factory=list)
    attn_implementation: str = ""
    """The attention implementation the built model runs (``memfit.spec.resolved``)."""
    lora_targets: tuple[str, ...] = ()
    outside_step: dict[str, int] | None = None
    """Predicted per-rank peaks outside the step (``memory.outside.OutsideStep.to_dict``), or None."""
    measured_phases: dict[str, int] | None = None
    """CPU: the tensor peak of each phase outside the step this rank measured (``training.phase_peaks``), beside
    ``outside_step``'s predicted ``phase_<name>``; None where nothing was measured (CUDA)."""
    hub: dict[str, Any] | None = None
    """A Hub ``--model``: its id, the revision asked, the commit trained on and the cached snapshot
    (``memfit.integrations.hub.HubModel.to_dict``); None for presets and local folders."""
    process_wall_s: float | None = None
    """Wall time of this process alone (``wall_s`` less the resumed parts); None when not measured."""
    preference: dict[str, Any] | None = None
    """Preference methods: ``{"method", "first", "last"}``, the first and last steps' reward accuracy and
    margin (``training.step.StepResult.preference``); None for sft."""
    predicted_at_measured_rows: int | None = None
    """CPU: the predicted peak at the measured step's own micro-batch shape (``PeakMemory.cpu_tensor_peak_rows``)
    where it differs from the run's full ``micro-batch x seq-len`` rows: like for like with the measurement."""

    @property
    def predicted_peak_bytes(self) -> int | None:
        return self.predicted.peak_bytes if self.predicted else None

    @property
    def compared(self) -> str:
        """What the measured and predicted peaks are (``measure.PeakMemory.compared``)."""
        return self.peak_memory.compared

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``run.json`` and ``--json``): plain values, NaN as ``None``."""
        out = {
            "steps": self.steps, "sequences": self.sequences, "final_train_loss": self.final_train_loss,
            "final_eval_loss": self.final_eval_loss, "best_eval_loss": self.best_eval_loss,
            "unigram_loss": self.unigram_loss, "tokens_per_s": self.tokens_per_s, "train_s": self.train_s,
            "wall_s": self.wall_s, "skipped_steps": self.skipped_steps, "peak_memory": self.peak_memory.to_dict(),
            "measured": self.measured.to_dict(), "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted": self.predicted.to_dict() if self.predicted else None, "compared": self.compared,
            "predicted_at_measured_rows": self.predicted_at_measured_rows,
            "plan": self.plan, "fallbacks": [fb.to_dict() for fb in self.fallbacks],
            "num_processes": self.num_processes, "rank_peak_bytes": list(self.rank_peak_bytes),
            "resumes": list(self.resumes), "initial_run": self.initial_run.to_flat(),
            "run": self.run.to_flat(), "uses_model_loss": self.uses_model_loss, "params": self.params,
            "trainable_params": self.trainable_params, "output": self.output, "samples": list(self.samples),
            "attn_implementation": self.attn_implementation, "lora_targets": list(self.lora_targets),
            "outside_step": self.outside_step, "measured_phases": self.measured_phases, "hub": self.hub, "process_wall_s": self.process_wall_s,
            "preference": self.preference,
        }
        return json_safe(out)
