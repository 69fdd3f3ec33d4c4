"""The typed parts ``training.loop.fit`` takes besides the Accelerator, model, optimizer and schedule.

As litgpt's ``fit(fabric, model, optimizer, scheduler, train_dataloader, val_dataloader, ...)``
(litgpt/finetune/lora.py): the training batches (``TrainLoader``), the held-out data (``HeldOut``), the run
folder (``RunOutput``) and what the step needs beside its model and optimizer (``StepParts``). What the run
was planned as (``Planned``) and how it is shown (``Reporting``) are grouped here too, so ``TrainSession``
holds a few named groups rather than one flat list of fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator

from memfit.data.dataset import collate
from memfit.data.pairs import collate_pairs
from memfit.files import append_line
from memfit.memory import measure
from memfit.memory.breakdown import MemoryBreakdown
from memfit.settings.config import RunConfig
from memfit.training.guard import RunGuard
from memfit.training.phase_peaks import PhasePeaks
from memfit.training.progress import LiveProgress
from memfit.training.rollback import OptimizerSnapshot
from memfit.training.router import RouterBalance
from memfit.training.sampler import RowsWithDummy, StepBatchSampler, StepSchedule
from memfit.training.step import PreferenceRun

if TYPE_CHECKING:  # planning.search takes ~0.85 s to import (python -X importtime, this machine): --budget's alone
    from memfit.planning.search import PlanResult


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step (appended, so a resumed run continues it)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            append_line(self.path, json.dumps(record))  # never through a link planted as metrics.jsonl


@dataclass
class RunOutput:
    """The run folder as the loop writes it: ``--output``, the guard that owns it (its lock and checks are
    ``runfolder.RunFolder``'s), the metrics log and how a checkpoint's state is written."""

    path: Path
    guard: RunGuard
    """Ctrl-C, non-finite steps, failing writes, the run folder's lock."""
    metrics: MetricsLog
    save_state: Callable[[str], None] | None = None
    """``sharding.state_saver``: how a sharded run writes its checkpoint state (None: Accelerate's ``save_state``)."""


@dataclass
class TrainLoader:
    """This rank's training micro-batches: the rows, their order over the run (``StepSchedule``) and how they are
    joined into a batch; ``batches`` starts them at any position, for any split of the effective batch (an OOM
    fallback restarts them on its own split)."""

    rows: list[dict]
    schedule: StepSchedule
    total_steps: int
    pad_id: int
    pairs: bool
    """Preference pairs (``collate_pairs``), else sequences (``collate``)."""
    accelerator: Accelerator

    def batches(self, run: RunConfig, *, samples: int, step: int) -> Iterator[dict[str, torch.Tensor]]:
        """The micro-batches from ``samples`` sequences consumed and ``step`` steps done on, for ``run``'s split."""
        pad_id = self.pad_id
        join = collate_pairs if self.pairs else collate
        sampler = StepBatchSampler(self.schedule, start_samples=samples, num_steps=self.total_steps - step,
                                   micro_batch=run.micro_batch, grad_accum=run.grad_accum,
                                   num_processes=run.num_processes)
        loader = torch.utils.data.DataLoader(RowsWithDummy(self.rows, pad_id), batch_sampler=sampler,
                                             collate_fn=lambda batch: join(batch, pad_id))
        return iter(self.accelerator.prepare(loader))


@dataclass
class HeldOut:
    """The held-out data: the rows the evaluation loss is taken on and the documents that prompt the samples."""

    rows: list[dict]
    prompt_docs: list
    """Held-out ``Example`` records (training ones when nothing is held out), evenly spread over the corpus."""
    pad_id: int
    unigram: float
    """The unigram baseline loss of the training tokens (the summary compares the run with it)."""


@dataclass
class StepParts:
    """What ``train_step`` needs besides the model, the optimizer and the micro-batches."""

    tensor_peak: measure.StepPeak
    """On CPU, the live tensor bytes of one training step (compared with the prediction)."""
    in_backward: torch.optim.Optimizer | None = None
    """The optimizer when it steps inside backward (``--optimizer-in-backward``): no clipping, no step."""
    preference: PreferenceRun | None = None
    """The loss of ``--method dpo|orpo|simpo`` (``training.step``); None for sft."""
    snapshot: OptimizerSnapshot = field(default_factory=OptimizerSnapshot)
    """Undoes an optimizer step that runs out of memory half way (reused host buffers)."""


@dataclass
class Planned:
    """What the run was chosen as before it started: the settings, ``--budget``'s plan and the estimate."""

    initial_run: RunConfig
    plan_result: PlanResult | None = None
    """The planner's result for ``--budget``, else None."""
    predicted: MemoryBreakdown | None = None
    """The estimator's ``MemoryBreakdown`` for the run on this device, or None."""


@dataclass
class Reporting:
    """How the run is shown, timed and measured: the progress, the MoE routing balance, the clocks, the phases."""

    bar: LiveProgress
    t_start: float
    """``time.perf_counter()`` at the start of the whole run: earlier than ``t_process`` by the wall time of the
    parts a resumed run continues."""
    t_process: float
    """``time.perf_counter()`` when this process began the run."""
    router: RouterBalance | None = None
    """The routing balance of a mixture-of-experts model (``training.router``; None for a dense one), logged."""
    phase_peaks: PhasePeaks = field(default_factory=PhasePeaks.disabled)
    """On CPU, the tensor peak of each phase outside the step, measured the first time it runs."""
