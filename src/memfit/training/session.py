"""Building a training run: everything the loop needs, in one typed ``TrainSession``.

``build_session`` settles the run first (``settle``: every input checked, ``--batch`` and ``--budget``
applied), then runs the builders of ``training.setup`` in order (Accelerator, model source, data, output
folder, model, optimizer, schedule, resume: ``resumed_state``) and shows what it built (``announce``), so
``training.loop`` only runs steps and ``training.finish`` only reports. Everything a user can get wrong
(model, tokenizer, data, length) is checked before the output folder is created, so a bad input leaves
nothing behind. The groups ``fit`` takes (loaders, run folder, step parts) are ``training.parts``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import broadcast_object_list, gather_object

from memfit.builder import optim_in_backward, preference
from memfit.errors import UserError
from memfit.integrations.hub import HubModel
from memfit.integrations.trackers import check_tracker, local_init_kwargs
from memfit.memory import measure
from memfit.settings.config import Method, RunConfig, TrainConfig
from memfit.spec.resolved import experts_reason
from memfit.training import deepspeed_engine, derived, resume, sharding
from memfit.training.budget import plan_line, plan_run
from memfit.training.guard import RunGuard
from memfit.training.multinode import refuse_one_of_several, with_launched_nodes
from memfit.training.parts import HeldOut, MetricsLog, Planned, Reporting, RunOutput, StepParts, TrainLoader
from memfit.training.phase_peaks import PhasePeaks
from memfit.training.progress import LiveProgress
from memfit.training.router import router_balance
from memfit.training.runfolder import checkpoint
from memfit.training.sampler import StepSchedule
from memfit.training.setup import (
    DataBundle,
    ModelBundle,
    ResolvedModel,
    build_accelerator,
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    cuda_available,
    fetch_hub_model,
    preflight,
    resolve_model,
)
from memfit.training.step import PreferenceRun
from memfit.training.summary import FallbackRecord
from memfit.training.threads import ThreadChoice, apply_threads
from memfit.units import fmt_count

if TYPE_CHECKING:  # planning.search takes ~0.85 s to import (python -X importtime, this machine): --budget's alone
    from memfit.planning.search import PlanResult


@dataclass
class LoopState:
    """Where the run is; saved in every checkpoint (``trainer_state.json``)."""

    step: int = 0
    samples: int = 0
    """Training sequences consumed: the position in the data (not a batch index)."""
    skipped_steps: int = 0
    tokens: int = 0
    train_s: float = 0.0
    wall_s: float = 0.0
    """Wall time of the run so far, over all its resumed parts (start-up included)."""
    last_loss: float = math.nan
    last_eval: float = math.nan
    best_eval: float = math.nan
    fallbacks: list[FallbackRecord] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    """One record per ``--resume`` of this run: the step and checkpoint it continued from."""
    preference_first: dict[str, Any] | None = None
    """Preference methods: the first step's reward accuracy and margin (``training.step.pool_preference``)."""
    preference_recent: list[dict[str, Any]] = field(default_factory=list)
    """... and the last ``preference_window`` steps' (``StepResult.preference`` with its ``step``), pooled in the
    summary so it shows them rising."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fallbacks"] = [fb.to_dict() for fb in self.fallbacks]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopState:
        kept = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "fallbacks"}
        return cls(**kept, fallbacks=[FallbackRecord.from_dict(fb) for fb in data.get("fallbacks", [])])


@dataclass
class TrainSession:
    """One run, built: the settings in force, the Accelerate-prepared objects, and the named groups ``fit`` and
    ``finish`` read (the data, the run folder, the step's parts, the plan, the progress) with the live state."""

    config: TrainConfig
    run: RunConfig
    """The settings in force; an OOM fallback replaces it."""
    accelerator: Accelerator
    model: torch.nn.Module
    """Prepared by Accelerate (DDP-wrapped under data parallelism)."""
    optimizer: torch.optim.Optimizer
    """Accelerate's ``AcceleratedOptimizer`` around the torch optimizer."""
    scheduler: AcceleratedScheduler
    source: ResolvedModel
    """What the model was built from (a sharded run rebuilds a plain copy to export)."""
    bundle: ModelBundle
    train: TrainLoader
    held_out: HeldOut
    folder: RunOutput
    parts: StepParts
    planned: Planned
    report: Reporting
    state: LoopState

    @property
    def total_steps(self) -> int:
        return self.train.total_steps

    @property
    def output(self) -> Path:
        return self.folder.path

    @property
    def device(self) -> str:
        return self.accelerator.device.type

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def pad_id(self) -> int:
        return self.bundle.tokenizer.pad_token_id

    @property
    def vocab(self) -> int:
        return self.accelerator.unwrap_model(self.model).config.vocab_size


@dataclass
class Settled:
    """A run's inputs checked and its settings chosen (``settle``), before anything is built or written."""

    config: TrainConfig
    run: RunConfig
    plan_result: PlanResult | None
    resume_point: resume.ResumePoint | None
    hub_model: HubModel | None
    threads: ThreadChoice
    seq_len_note: str | None


def settle(config: TrainConfig, guard: RunGuard, show: bool) -> Settled:
    """Check everything the user can get wrong before anything is built, and choose the run (``--batch``,
    ``--budget``'s plan): the Accelerator's autocast, accumulation and sharding are then the planned run's,
    never the flags' the plan replaced."""
    guard.lock_existing(config, is_main=_launched_as_main())  # before anything in --output is read or removed
    config, resume_point = resume.restore(config)  # --resume: the run's own settings, from its newest intact checkpoint
    if config.merge and not config.run.is_lora():  # after restore: a resumed LoRA run knows its own --lora-r
        raise UserError("--merge merges trained LoRA adapters into the base model, and this run trains none "
                        "(--lora-r 0: a full fine-tune is saved whole anyway); drop --merge or add --lora-r.")
    preflight(config.run)
    threads = apply_threads(config.threads)  # torch's CPU threads from the cores actually available
    optim_in_backward.check(config.run, config.optim.max_grad_norm)
    resumed = resume_point is not None and isinstance(resume_point.state.get("settings"), dict)
    check_tracker(config.tracker)  # before anything is built: a missing package is one sentence
    config = resolve_output(config, guard)
    processes = launched_processes()
    with processes.main_process_first():  # a Hub --model: one download, the other ranks read the cache
        config, hub_model = fetch_hub_model(config, progress=show and not config.json and processes.is_main_process)
        # --seq-len from the data, unless given: the main process tokenizes, the others read datasets' cache
        config, seq_len_note = derived.with_seq_len(config, resumed=resumed, hub_model=hub_model)
    run, plan_result = resolve_run(config, processes.num_processes)
    return Settled(config, run, plan_result, resume_point, hub_model, threads, seq_len_note)


def build_session(config: TrainConfig, guard: RunGuard, *, show: bool = True) -> TrainSession:
    """Check the inputs and settle the run, create the output folder, build and prepare everything, resume if asked.

    Everything the user can get wrong (model, tokenizer, data, length, a resume that does not match its
    run) is checked before the output folder is created, so a bad input leaves nothing behind.
    """
    t_process = time.perf_counter()
    settled = settle(config, guard, show)
    config, run, resume_point = settled.config, settled.run, settled.resume_point
    accelerator = build_accelerator(run, config)
    source = resolve_model(config, run, settled.hub_model)
    config, lr_note = derived.with_lr(config, random_init=source.random_init, lora=run.is_lora())
    deepspeed_engine.configure(accelerator, run, config, getattr(source.hf_config, "hidden_size", None))
    resume.check_belongs(resume_point, config, run, source.hf_config)  # before anything is loaded
    data = build_data(config, run, source.tokenizer)
    schedule = StepSchedule(len(data.train), run.effective_batch(), config.seed)
    total_steps, steps_note = derived.total_steps(config, schedule.steps_per_epoch())
    resume.check_extension(resume_point, config, total_steps)  # a finished run trained on: only when asked
    folder = open_run_folder(config, guard, accelerator, resume_point)
    phase_peaks = PhasePeaks(accelerator.device.type)  # CPU: loading, wrapping, ... measured (memory.phases')
    with phase_peaks.watch("loading"):
        bundle = build_model(config, run, source, device=accelerator.device,
                             empty=sharding.builds_empty(accelerator, run))  # ranks > 0 of CPU FSDP: rank 0's weights
    pref = preference_run(config, run, bundle, data, accelerator)  # the reference: from the base, before sharding
    with phase_peaks.watch("wrapping", bundle.model, when=sharding.shards_itself(accelerator, run)):
        bundle.model = sharding.shard_model(bundle.model, run, accelerator)  # CPU FSDP2: before the optimizer
    optimizer = build_optimizer(bundle.model, run, config)
    scheduler = build_scheduler(optimizer, config, total_steps)
    model, optimizer, scheduler = sharding.prepare(accelerator, run, bundle.model, optimizer, scheduler)
    folder.save_state = sharding.state_saver(accelerator, run, model, optimizer, scheduler, config.checkpoints.state_dict)
    state, lrs = resumed_state(config, run, accelerator, folder, resume_point, (model, optimizer, scheduler))
    if config.tracker:
        accelerator.init_trackers("memfit", config=_tracker_config(config, run),
                                  init_kwargs=local_init_kwargs(config.tracker, folder.path))
    pad_id = bundle.tokenizer.pad_token_id
    s = TrainSession(
        config=config, run=run, accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
        source=source, bundle=bundle, state=state, folder=folder,
        train=TrainLoader(data.train, schedule, total_steps, pad_id, pairs=pref is not None, accelerator=accelerator),
        held_out=HeldOut(data.eval, data.prompt_docs, pad_id, data.unigram),
        parts=StepParts(measure.StepPeak(accelerator.device.type, total_steps - state.step, run.compile),
                        in_backward=optimizer if run.optimizer_in_backward else None, preference=pref),
        planned=Planned(run, settled.plan_result),
        report=Reporting(LiveProgress(total_steps, state.step, show and accelerator.is_main_process,
                                      log_every=config.cadence.log_every),
                         t_start=t_process - state.wall_s,  # wall times add up over the parts of a resumed run
                         t_process=t_process, router=router_balance(model), phase_peaks=phase_peaks))
    announce(s, settled, [settled.seq_len_note, lr_note, steps_note], data.note, lrs)
    return s


def open_run_folder(config: TrainConfig, guard: RunGuard, accelerator: Accelerator,
                    resume_point: resume.ResumePoint | None) -> RunOutput:
    """Claim ``--output`` for this run (``guard.open_folder``: its lock and manifest, the data's fingerprint), once
    every input is checked; every rank waits for it."""
    data_fp = resume.data_now(resume_point, config) if accelerator.is_main_process else None
    guard.open_folder(config, accelerator, is_main=accelerator.is_main_process, data=data_fp,
                      run_id=resume_point.state.get("run_id") if resume_point is not None else None)
    accelerator.wait_for_everyone()
    output = Path(config.folder.output)
    return RunOutput(output, guard, MetricsLog(output / "metrics.jsonl", accelerator.is_main_process))


def resumed_state(config: TrainConfig, run: RunConfig, accelerator: Accelerator, folder: RunOutput,
                  resume_point: resume.ResumePoint | None,
                  prepared: tuple[torch.nn.Module, torch.optim.Optimizer, AcceleratedScheduler],
                  ) -> tuple[LoopState, tuple[list[float], list[float]] | None]:
    """A fresh ``LoopState``, or with ``--resume`` the checkpoint's, loaded into the prepared model, optimizer and
    schedule; with the resumed step's learning rates (as saved, and on this run's schedule)."""
    if not config.folder.resume:
        return LoopState(), None
    model, optimizer, scheduler = prepared
    state = LoopState.from_dict(checkpoint.load_checkpoint(
        accelerator, folder.path, resume_point.path, sharding.state_loader(accelerator, run, model, optimizer, scheduler)))
    state.resumes.append(resume.note_resume(folder.path, resume_point, accelerator.is_main_process))
    folder.guard.last_checkpoint = resume_point.path
    return state, _reapply_schedule(optimizer, scheduler)


def announce(s: TrainSession, settled: Settled, defaults: list[str | None], data_note: str,
             lrs: tuple[list[float], list[float]] | None) -> None:
    """The lines shown before the first step: the plan, the model, the derived numbers and defaults, the resume, and
    the estimate for this run (kept in ``s.planned.predicted``)."""
    bar, resume_point = s.report.bar, settled.resume_point
    if s.planned.plan_result is not None:
        bar.note(plan_line(s.config, s.planned.plan_result, cuda=s.device == "cuda"))
    if s.source.hub is not None:
        bar.note(s.source.hub.describe())
    bar.note(_preamble(s))
    notes = [note for note in defaults if note]
    if notes:  # the defaults derived from the data and the method, each with its reason
        bar.note("\n".join(f"default {note}" for note in notes))
    bar.note(settled.threads.describe())
    if data_note:
        bar.note(data_note)
    if resume_point is not None and resume_point.note:
        bar.note(resume_point.note)
    if resume_point is not None:
        bar.note(resume.resumed_line(resume_point, s.total_steps))
        schedule_note = resume.schedule_note(resume_point, s.total_steps, *lrs)
        if schedule_note:
            bar.note(schedule_note)
    predicted, why = predict_or_why(s.source.spec, s.run, s.device)
    s.planned.predicted = predicted
    bar.note(sharding.per_rank_line(s.source.spec, s.run, predicted, s.device, why=why, loaded_from=s.source.loaded_from))


def preference_run(config: TrainConfig, run: RunConfig, bundle: ModelBundle, data: DataBundle,
                   accelerator: Accelerator) -> PreferenceRun | None:
    """The ``PreferenceRun`` of a preference method (None for sft), built from the base weights.

    DPO's reference: ``--precompute-reference`` writes each pair's reference log-probabilities into its
    row now (``memfit.builder.preference.precompute``); else a LoRA run switches its adapter off (no copy) and a
    full fine-tune keeps a frozen copy of the base (one more set of weights, priced by the estimator).
    """
    if run.method is Method.SFT:
        return None

    spec = preference.PreferenceLoss(run.method, config.preference)
    reference = None
    if spec.needs_reference and run.precompute_reference:  # each rank with the weights its share, then all of it
        preference.precompute(bundle.model, data.train, pad_id=bundle.tokenizer.pad_token_id,
                              batch_size=run.micro_batch, autocast=accelerator.autocast,
                              rank=accelerator.process_index, holders=sharding.weight_holders(accelerator, run),
                              gather=gather_object if accelerator.num_processes > 1 else None)
    elif spec.needs_reference and not run.is_lora():
        # ranks > 0 of CPU FSDP2 built the model empty: their copy receives rank 0's weights
        reference = sharding.filled_from_rank0(preference.frozen_copy(bundle.model), accelerator, run)
    return PreferenceRun(spec, reference)


def _launched_as_main() -> bool:
    """Whether this process will be the main one (rank 0), before the Accelerator exists: ``accelerate
    launch``/``torchrun`` set ``RANK``; a plain run is the only process."""
    return os.environ.get("RANK", "0") == "0"


def launched_processes():
    """Accelerate's ``PartialState`` of this launch (rank, process count), made before the Accelerator and then
    reused by it (``deepspeed_engine.partial_state_kwargs``)."""
    return PartialState(**deepspeed_engine.partial_state_kwargs(cuda_available()))


def resolve_output(config: TrainConfig, guard: RunGuard) -> TrainConfig:
    """``config`` with its output folder: ``--output``, or a fresh ``runs/<model>-<timestamp>``.

    The main process claims the folder (``guard.claim_default``: made now, so two runs started in the same
    second get two) and broadcasts its name, so the processes of a data-parallel launch (started a moment
    apart) agree on one folder.
    """
    if config.folder.output:
        return config
    if config.folder.resume:
        raise UserError("--resume needs --output DIR, the folder of the run to continue "
                        "(without --output every run gets a new runs/<model>-<time> folder).")

    state = launched_processes()
    chosen = [str(guard.claim_default(config.source.model)) if state.is_main_process else None]
    if state.num_processes > 1:
        broadcast_object_list(chosen)
    return config.replace(output=chosen[0])


def resolve_run(config: TrainConfig, num_processes: int) -> tuple[RunConfig, PlanResult | None]:
    """The run settings for the processes actually launched: ``--batch`` and ``--budget`` applied."""
    run = config.run
    refuse_one_of_several(num_processes)  # said first: the cause of any mismatch below
    if run.num_processes not in (1, num_processes):
        raise UserError(f"--num-processes is {run.num_processes} but {num_processes} process(es) were launched; "
                        f"start it with `accelerate launch --num_processes {run.num_processes} -m memfit train ...`.")
    run = with_launched_nodes(run, num_processes)  # the launch's processes and nodes (--nodes checked)
    if config.batch:
        per_step = run.micro_batch * num_processes
        if config.batch % per_step:
            raise UserError(f"--batch {config.batch} is not a multiple of micro-batch x processes = {per_step}.")
        run = run.replace(grad_accum=config.batch // per_step)
    if not config.budget:
        return run, None

    return plan_run(config, run)


def _reapply_schedule(optimizer, scheduler) -> tuple[list[float], list[float]]:
    """Set the learning rate the schedule gives at the resumed step; returns the lrs before and after.

    ``load_state`` restores the optimizer's param groups with the lr of the saved run's schedule; the
    schedule's function is not saved (it is rebuilt from this run's ``--max-steps``), so a run resumed
    with more steps must take its lr from the new schedule, not from the old one's end (the preamble
    says so: ``resume.schedule_note``; a finished run only with ``--extend-schedule``).
    """
    before = [group["lr"] for group in optimizer.param_groups]
    inner = getattr(scheduler, "scheduler", scheduler)  # unwrap Accelerate's AcceleratedScheduler
    with warnings.catch_warnings():  # get_lr() outside step() warns; here it is what we want
        warnings.simplefilter("ignore")
        lrs = inner.get_lr()
    for group, lr in zip(optimizer.param_groups, lrs, strict=False):
        group["lr"] = lr
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]
    return before, list(inner._last_lr)


def predict(model_name, run: RunConfig, device: str = "cuda"):
    """The estimator's predicted peak for this run on ``device`` (None when unavailable or failing).

    ``model_name``: anything ``modelspec.load_spec`` takes; a run passes its resolved ``ModelSpec``.

    On CPU the estimator models CPU kernels and leaves out the CUDA context and allocator terms, and the
    rollback snapshot and offloaded state count (``memory.snapshot``: the host is the device).
    """
    return predict_or_why(model_name, run, device)[0]


def predict_or_why(model_name, run: RunConfig, device: str = "cuda"):
    """``(prediction, "")``, or ``(None, why)``: the estimator's own sentence when it refused the run (a
    ``UserError``), else the failure's first line, so the preamble never says "n/a" without a reason."""
    try:  # imported here: a missing or broken estimator is the preamble's reason, never a stopped run
        from memfit.memory.snapshot import device_estimate
        from memfit.spec.model import load_spec

        return device_estimate(load_spec(model_name), run, "cpu" if device == "cpu" else "cuda"), ""
    except ImportError as err:
        return None, f"the estimator could not be imported: {err}"
    except Exception as err:  # noqa: BLE001 - a prediction must never stop a training run
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return None, first[:200].rstrip(".")


def _preamble(s: TrainSession) -> str:
    """Derived numbers shown before the long work starts."""
    run, bundle = s.run, s.bundle
    sft = str(run.method) == "sft"  # a preference step runs both sides of its pairs: 2B sequences per micro-batch
    unit = "sequences" if sft else "pairs"
    pairs = "" if sft else f" pairs ({run.forward_sequences() * run.grad_accum * run.num_processes} sequences)"
    return (f"model {s.config.source.model}: {fmt_count(bundle.params)} params, "
            f"{fmt_count(bundle.trainable_params)} trainable | "
            f"{len(s.train.rows):,} train / {len(s.held_out.rows):,} held-out {unit} of <= {run.seq_len} tokens\n"
            f"effective batch {run.effective_batch()}{pairs} = micro-batch {run.micro_batch} x accumulation "
            f"{run.grad_accum} x {run.num_processes} process(es); tokens per optimizer step: "
            f"{run.tokens_per_step():,} (padding included); {s.total_steps} step(s) "
            f"({s.train.schedule.steps_per_epoch()} per epoch) on {s.device}, "
            f"mixed precision {run.mixed_precision}, weights {run.dtype}\n"
            f"attention {bundle.attention or '?'} (asked of transformers)"
            + (f"; experts {bundle.experts} ({_experts_why(bundle, run)})" if bundle.experts else "")
            + (f"; LoRA targets {', '.join(bundle.lora_targets)}" if bundle.lora_targets else ""))


def _experts_why(bundle: ModelBundle, run: RunConfig) -> str:
    return experts_reason(bundle.experts, run.experts_implementation, str(run.dtype))


def _tracker_config(config: TrainConfig, run: RunConfig) -> dict[str, Any]:
    flat = {**config.to_flat(), **run.to_flat()}
    return {k: v for k, v in flat.items() if isinstance(v, (int, float, str, bool))}
