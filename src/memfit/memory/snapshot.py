"""What a device holds when the host is the device (CPU), and where ``memfit train``'s rollback
snapshot adds to the predicted peak: the one place estimate's callers (``memfit train``'s prediction
line, the planner for a CPU budget (``plan(..., cpu=True)``), the sharding benches) ask (``device_estimate``).

On CPU ``--offload params`` moves nothing (FSDP2's ``CPUOffloadPolicy`` keeps the sharded state on the
CPU, which is where it already is): the device holds what the run without offload holds (measured:
bench/sharding_memory.py, smollm2-135m fsdp on 2 and 4 ranks, the same bytes with and without).

Before ``optimizer.step()`` memfit copies what the step mutates into host buffers, so a step that runs
out of memory half way can be undone (``training/rollback.py``). On a GPU that is host RAM, outside the
device's budget; on CPU the host is the device, so the copy counts. How much and when follows the
optimizer table's ``rollback`` (``memfit.spec.optimizers.OptimizerRow.rollback``: when an OOM can leave the
step half applied):

- ``every-step`` (torch's foreach and single-tensor AdamW, Adafactor, 8-bit AdamW): the copy of the
  trainable parameters and their state (``estimate.rollback_snapshot_bytes``) is taken every step into
  buffers kept for the run: it adds to every phase of the steady-state step.
- ``first-step`` (fused AdamW): only the first step needs it (a later param group's state is created
  after an earlier group stepped); no state exists yet, so the copy is the parameters alone, alive
  during that step's optimizer phase and freed after it: ``max(peak, optimizer phase + parameters)``.
- ``never`` (SGD without momentum or weight decay) and ``--optimizer-in-backward`` (no gradients left
  at ``step()``: nothing is copied): no snapshot. Nor on the DeepSpeed engine (``engine="deepspeed"``, a
  DeepSpeed launch: ``training.deepspeed_engine``): DeepSpeed steps inside the last micro-batch's backward
  and leaves no gradients on its partitions, so memfit's ``step()`` finds nothing to copy (measured: the
  tiny preset under ZeRO-2 on 2 CPU ranks counted 111.4/112.9 MiB per rank, 37.1 MiB of snapshot below the
  prediction that included it).

Known error: the ``first-step`` case takes the steady-state optimizer phase (all state allocated) for the
first step's, which is exact for fused AdamW (its state is allocated inside that step, before the peak)
and reports the rise under ``optimizer``.
"""

# Inside a function: memory.trace (5.5 s to import, python -X importtime, 2026-12-06, this shared 2-core machine), only
# for a --compile run: an analytic estimate never loads torch's tracing.
from __future__ import annotations

import dataclasses

from memfit.memory.estimate import estimate, rollback_snapshot_bytes
from memfit.memory.states import model_states, quant_state_bytes
from memfit.settings.config import Offload, RunConfig
from memfit.spec.engines import estimator_engine
from memfit.spec.optimizers import row
from memfit.units import fmt_bytes


def rollback_copy(spec, run: RunConfig, engine: str = "fsdp2") -> tuple[str, int]:
    """The rollback snapshot ``run`` keeps (module docstring): its kind (the optimizer row's ``rollback``,
    ``never`` where no snapshot is taken: optimizer-in-backward, the DeepSpeed engine) and its bytes per rank
    (``every-step``: parameters and state; ``first-step``: the parameters)."""

    kind = row(run.optimizer).rollback
    if kind == "never" or run.optimizer_in_backward or engine == "deepspeed":
        return "never", 0
    return kind, rollback_snapshot_bytes(spec, run, state=kind == "every-step")


def host_bytes(spec, run: RunConfig) -> int:
    """Host RAM a GPU run keeps per machine (its ``processes_per_node`` ranks), beside the device.

    Per rank: what ``--offload`` moves there (``params``: the rank's shard of weights, gradients and optimizer
    state, all on the host under FSDP2's ``CPUOffloadPolicy``; a 4-bit base's quantization state stays on the
    device; ``optimizer``: the optimizer state) and the rollback snapshot (``every-step`` rows: the
    trainable parameters and their state; ``first-step``: the parameters, during the first step). Llama 2
    70B's offloaded bf16 LoRA base is 138 GB, its 4-bit one about 36 GB (packed NF4 projections, fp32
    embeddings and head): whether a workstation holds it decides between them. Ignores: activation offload's copies, pinned staging buffers, the Python/torch runtime
    and the dataset (a few GB per process).
    """

    on_device = model_states(spec, run.replace(offload=Offload.NONE), "cuda")
    per_rank = 0
    if run.offload is Offload.PARAMS:
        per_rank += on_device.weights - quant_state_bytes(spec, run) + on_device.gradients + on_device.optimizer
    elif run.offload is Offload.OPTIMIZER:
        per_rank += on_device.optimizer
    per_rank += rollback_copy(spec, run)[1]
    return int(per_rank * max(run.processes_per_node(), 1))


def device_estimate(spec, run: RunConfig, device: str, engine: str | None = None, derived: bool | None = None,
                    stack=None):
    """``estimate(spec, run, device=device, engine=engine, stack=stack)`` as the device holds it: on CPU, offloaded state
    stays in the same memory (the run without offload is estimated) and the rollback snapshot counts.
    ``engine`` None: the launch's (``engines.estimator_engine``). ``--compile``: the exact trace with the
    compiled graph's saved set (``memory/compiled.py``; the analytic recipes price eager autograd). ``derived``:
    ``estimate``'s choice of recipe (None: its own)."""

    if engine is None:
        engine = estimator_engine()
    held = run.replace(offload=Offload.NONE) if device == "cpu" and run.offload in (
        Offload.PARAMS, Offload.OPTIMIZER) else run
    if run.compile:
        from memfit.memory.trace import trace

        return with_rollback_snapshot(spec, run, trace(spec, held, device=device), device, engine)
    breakdown = estimate(spec, held, device=device, engine=engine, derived=derived, stack=stack)
    return with_rollback_snapshot(spec, run, breakdown, device, engine)


def with_rollback_snapshot(spec, run: RunConfig, breakdown, device: str, engine: str = "fsdp2"):
    """``breakdown`` (from ``estimate(spec, run, device=device)``) with the snapshot's bytes where they
    live on ``device`` (CPU only), added to the ``optimizer`` category and the phase peaks, with a note;
    ``breakdown`` itself when nothing is added."""
    if breakdown is None or device != "cpu":
        return breakdown
    kind, copy = rollback_copy(spec, run, engine)
    if kind == "never":
        return breakdown
    phases = dict(breakdown.phase_peaks)
    if kind == "every-step":
        rise = copy
        phases = {k: v + copy for k, v in phases.items()}
        note = f"optimizer: + {fmt_bytes(copy)} rollback snapshot (a host copy of the trainable parameters and " \
               "their state, to undo a step that runs out of memory; on CPU the host is the device)."
    else:
        first = phases.get("optimizer", 0) + copy
        rise = max(first - breakdown.peak_bytes, 0)
        phases["optimizer"] = max(phases.get("optimizer", 0), first)
        note = f"optimizer: the first step's rollback snapshot ({fmt_bytes(copy)}, the trainable parameters) " \
               "is alive during its optimizer step only (fused AdamW steps in place afterwards)."
    out = dataclasses.replace(breakdown, optimizer=breakdown.optimizer + rise, phase_peaks=phases,
                              notes=[*breakdown.notes, note])
    if phases:
        out.phase = max(phases, key=lambda k: phases[k]) if rise else breakdown.phase
    return out
