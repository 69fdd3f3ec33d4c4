"""The tensor peak of each phase ``memfit train`` runs outside the step, measured on a CPU run.

``memory.phases`` predicts a peak for loading, wrapping (a sharded run), evaluation, the checkpoint, the export
and the samples; on a CPU, where the host is the device, each is measured here with memfit's tensor counter
(``memory.measure.counted``: live storages, never RSS) around the code that runs it, starting from what the
process holds then (``memory.measure.resident_tensors``: weights, optimizer state, the rollback snapshot's
buffers), and the summary shows it next to the prediction. On CUDA nothing is counted here
(``max_memory_allocated`` covers the run; a per-phase figure is left to the allocator model).

Each phase is measured the first time it runs (later evaluations and checkpoints repeat the same work on the
same tensors; the counter costs a Python call per operator, so it runs once per phase). What a multi-process
run records is this rank's figure; the summary shows rank 0's, the rank that gathers and exports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memfit.integrations.quant_support import quant_state_tensors
from memfit.memory.measure import counted, resident_tensors


class PhasePeaks:
    """Measured tensor peaks by phase name (``memory.phases.Phase.name``), in bytes."""

    def __init__(self, device_type: str) -> None:
        self.enabled = device_type == "cpu"
        self.peaks: dict[str, int] = {}

    @classmethod
    def disabled(cls) -> PhasePeaks:
        """One that measures nothing (a session built without a device: tests, tools)."""
        return cls("none")

    @contextlib.contextmanager
    def watch(self, name: str, model=None, optimizer=None, extra=(), *, when: bool = True) -> Iterator[None]:
        """Count the block as phase ``name`` (once, on a CPU, ``when`` it is that phase), from the tensors
        ``model`` and ``optimizer`` hold (``resident_tensors``; a model alone: its parameters, buffers and quantization
        state) and ``extra`` (the rollback snapshot's buffers, a second model)."""
        if not (self.enabled and when) or name in self.peaks:
            yield
            return
        with counted(_held(model, optimizer, list(extra))) as live:
            yield
        self.peaks[name] = int(live.peak)

    def to_dict(self) -> dict[str, int] | None:
        """The measured peaks (``run.json``'s ``measured_phases``), None where nothing was measured."""
        return dict(self.peaks) or None


def _held(model, optimizer, extra: list) -> list:
    if optimizer is not None:
        return resident_tensors(model, optimizer, extra)
    if model is None:
        return extra
    # a quantized base's absmax and codes are held beside its packed weights, which parameters() does not list
    return [*model.parameters(), *model.buffers(), *quant_state_tensors(model), *extra]
