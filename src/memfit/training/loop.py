"""``train(config)``: the training loop on Accelerate, top to bottom.

Setup (``training.setup``) builds the pieces; this module runs them: fetch the optimizer step's
micro-batches, accumulate them with exact token normalisation (``training.step``), step, log,
evaluate, checkpoint; on an out-of-memory error inside a step, fall back to a configuration with
the same effective batch and redo that step (``training.oom``). At the end: export the model, write
``run.json``/``loss.png``, print the summary and a few generated samples.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memfit.config import RunConfig, TrainConfig
from memfit.errors import UserError
from memfit.hf_compat import enable_checkpointing
from memfit.memory import measure
from memfit.training import checkpoint, oom
from memfit.training.budget import plan_line, plan_record
from memfit.training.progress import LiveProgress
from memfit.training.sampler import RowsWithDummy, StepBatchSampler, StepSchedule
from memfit.training.samples import generate_samples
from memfit.training.setup import (
    build_accelerator,
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    preflight,
    resolve_model,
)
from memfit.training.step import evaluate, train_step
from memfit.training.threads import apply_threads


@dataclass
class LoopState:
    """Where the run is; saved in every checkpoint (``trainer_state.json``)."""

    step: int = 0
    samples: int = 0
    """Training sequences consumed: the position in the data (not a batch index)."""
    skipped_steps: int = 0
    tokens: int = 0
    train_s: float = 0.0
    last_loss: float = math.nan
    last_eval: float = math.nan
    best_eval: float = math.nan
    fallbacks: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopState:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class TrainResult:
    summary: dict[str, Any]
    model: Any
    """The trained model, unwrapped from Accelerate."""


def train(config: TrainConfig, *, show: bool = True) -> dict[str, Any]:
    """Train ``config.model`` on ``config.data`` and return the run summary (what ``--json`` prints)."""
    return run_training(config, show=show).summary


def run_training(config: TrainConfig, *, show: bool = True) -> TrainResult:
    t_start = time.perf_counter()
    preflight(config.run)
    threads = apply_threads(config.threads)
    config = resolve_output(config)
    accelerator = build_accelerator(config.run, config)
    run, plan_result = resolve_run(config, accelerator.num_processes)
    accelerator.gradient_accumulation_steps = run.grad_accum
    # Everything the user can get wrong (model, tokenizer, data, length) is checked before the output
    # folder is created, so a bad input leaves nothing behind.
    source = resolve_model(config, run)
    data = build_data(config, run, source.tokenizer)
    schedule = StepSchedule(len(data.train), run.effective_batch(), config.seed)
    total_steps = _total_steps(config, schedule)
    output = Path(config.output)
    checkpoint.prepare_output(output, resume=config.resume, overwrite=config.overwrite,
                              is_main=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    bundle = build_model(config, run, source, device=accelerator.device)
    optimizer = build_optimizer(bundle.model, run, config)
    scheduler = build_scheduler(optimizer, config, total_steps)
    model, optimizer, scheduler = accelerator.prepare(bundle.model, optimizer, scheduler)
    state = LoopState()
    if config.resume:
        state = LoopState.from_dict(checkpoint.load_checkpoint(accelerator, output))
        _reapply_schedule(optimizer, scheduler)
    if config.tracker:
        accelerator.init_trackers("memfit", config=_tracker_config(config, run))
    is_main, device = accelerator.is_main_process, accelerator.device.type
    show = show and is_main
    pad_id, vocab = bundle.tokenizer.pad_token_id, model_vocab(accelerator, model)
    initial_run = run
    predicted = predict(config.model, run, accelerator.device.type)
    bar = LiveProgress(total_steps, state.step, show)
    if plan_result is not None:
        bar.note(plan_line(config, plan_result, cuda=device == "cuda"))
    bar.note(_preamble(config, run, bundle, data, schedule, total_steps, accelerator))
    bar.note(threads.describe())
    tensor_peak = measure.StepPeak(device, total_steps - state.step)
    metrics = MetricsLog(output / "metrics.jsonl", is_main)
    batches = _micro_batches(accelerator, data.train, pad_id, schedule, state, run, total_steps)
    measure.reset_peak(device)
    with bar:
        while state.step < total_steps:
            t_step = time.perf_counter()
            micro = [next(batches) for _ in range(run.grad_accum)]
            try:
                with tensor_peak.watch(state.step + 1, model, optimizer, micro):
                    result = train_step(accelerator, model, optimizer, micro, max_grad_norm=config.max_grad_norm,
                                        uses_model_loss=bundle.uses_model_loss, vocab_size=vocab)
            except (RuntimeError, MemoryError) as err:
                if not oom.is_oom(err):
                    raise
                del micro
                run = _fall_back(accelerator, model, run, state, err, plan_result)
                bar.note(f"out of memory at step {state.step + 1}: redoing it with micro-batch {run.micro_batch} "
                         f"x {run.grad_accum}" + (" + checkpointing" if run.grad_checkpointing else ""))
                batches = _micro_batches(accelerator, data.train, pad_id, schedule, state, run, total_steps)
                continue
            if not result.skipped:
                scheduler.step()  # a step the fp16 scaler skipped does not advance the schedule
            state.step += 1
            state.samples += len(schedule.step_samples(state.samples))
            state.skipped_steps += int(result.skipped)
            state.tokens += result.tokens
            state.last_loss = result.loss
            state.train_s += time.perf_counter() - t_step
            last = state.step == total_steps
            do_eval = config.eval_every > 0 and (state.step % config.eval_every == 0 or last) and bool(data.eval)
            if do_eval:
                with not_a_batch_problem("evaluating"):
                    state.last_eval = evaluate(accelerator, model, data.eval, pad_id=pad_id,
                                               batch_size=2 * run.micro_batch, vocab_size=vocab)  # no grads: room for 2x
                if math.isnan(state.best_eval) or state.last_eval < state.best_eval:
                    state.best_eval = state.last_eval
            tokens_per_s = state.tokens / max(state.train_s, 1e-9)
            if state.step % max(config.log_every, 1) == 0 or last:
                record = {"step": state.step, "loss": result.loss, "lr": scheduler.get_last_lr()[0],
                          "tokens_per_s": tokens_per_s, "memory_bytes": measure.in_use(device),
                          "sequences": state.samples, "skipped_steps": state.skipped_steps,
                          "grad_norm": result.grad_norm, "elapsed_s": time.perf_counter() - t_start}
                if do_eval:
                    record["eval_loss"] = state.last_eval
                metrics.write(record)
                accelerator.log({k: v for k, v in record.items() if v is not None}, step=state.step)
            if config.save_every and (state.step % config.save_every == 0 or last):
                with not_a_batch_problem("saving a checkpoint"):
                    checkpoint.save_checkpoint(accelerator, output, state.step, {**asdict(state), "run": run.to_flat()})
            bar.update(state.step, loss=result.loss, lr=scheduler.get_last_lr()[0], tokens_per_s=tokens_per_s,
                       memory=measure.in_use(device), skipped=state.skipped_steps, eval_loss=state.last_eval,
                       memory_label="rss" if device == "cpu" else "mem")
    peak_mem = measure.peak(device, tensor_peak)
    net = accelerator.unwrap_model(model)
    measured = measure.measured_breakdown(peak_mem, net, optimizer, trainable_params=bundle.trainable_params)
    with not_a_batch_problem("saving the model"):
        checkpoint.export(accelerator, model, bundle.tokenizer, output, merge=config.merge,
                          base_is_preset=bundle.random_init)
    samples = []
    if is_main and config.samples > 0:
        with not_a_batch_problem("generating samples"):
            samples = generate_samples(accelerator, net, bundle.tokenizer, data.prompt_docs, count=config.samples,
                                       seed=config.seed,
                                       max_positions=getattr(net.config, "max_position_embeddings", None))
    summary = {
        "steps": state.step, "sequences": state.samples, "final_train_loss": state.last_loss,
        "final_eval_loss": state.last_eval, "best_eval_loss": state.best_eval, "unigram_loss": data.unigram,
        "tokens_per_s": state.tokens / max(state.train_s, 1e-9), "train_s": state.train_s,
        "wall_s": time.perf_counter() - t_start, "skipped_steps": state.skipped_steps,
        "peak_memory": peak_mem.to_dict(), "measured": measured.to_dict(),
        "predicted_peak_bytes": predicted.peak_bytes if predicted else None,
        "predicted": predicted.to_dict() if predicted else None,
        "compared": peak_mem.compared,
        "plan": plan_record(config, plan_result) if plan_result is not None else None,
        "fallbacks": state.fallbacks, "num_processes": accelerator.num_processes,
        "initial_run": initial_run.to_flat(), "run": run.to_flat(),
        "uses_model_loss": bundle.uses_model_loss, "params": bundle.params,
        "trainable_params": bundle.trainable_params, "output": str(output), "samples": samples,
    }
    if is_main:
        write_run_files(output, config, summary)
    accelerator.end_training()
    return TrainResult(summary=summary, model=net)


def resolve_output(config: TrainConfig) -> TrainConfig:
    """``config`` with its output folder: ``--output``, or a fresh ``runs/<model>-<timestamp>``.

    The timestamp is taken on the main process and broadcast, so the processes of a data-parallel
    launch (started a moment apart) agree on one folder.
    """
    if config.output:
        return config
    if config.resume:
        raise UserError("--resume needs --output DIR, the folder of the run to continue "
                        "(without --output every run gets a new runs/<model>-<time> folder).")
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    from memfit.training.setup import cuda_available

    state = PartialState(cpu=not cuda_available())
    chosen = [str(checkpoint.default_output(config.model)) if state.is_main_process else None]
    if state.num_processes > 1:
        broadcast_object_list(chosen)
    return dataclasses.replace(config, output=chosen[0])


def resolve_run(config: TrainConfig, num_processes: int) -> tuple[RunConfig, Any]:
    """The run settings for the processes actually launched: ``--batch`` and ``--budget`` applied."""
    run = config.run
    if run.num_processes not in (1, num_processes):
        raise UserError(f"--num-processes is {run.num_processes} but {num_processes} process(es) were launched; "
                        f"start it with `accelerate launch --num_processes {run.num_processes} -m memfit train ...`.")
    run = run.replace(num_processes=num_processes)
    if config.batch:
        per_step = run.micro_batch * num_processes
        if config.batch % per_step:
            raise UserError(f"--batch {config.batch} is not a multiple of micro-batch x processes = {per_step}.")
        run = run.replace(grad_accum=config.batch // per_step)
    if not config.budget:
        return run, None
    from memfit.training.budget import plan_run

    return plan_run(config, run)


def _reapply_schedule(optimizer, scheduler) -> None:
    """Set the learning rate the schedule gives at the resumed step.

    ``load_state`` restores the optimizer's param groups with the lr of the saved run's schedule; the
    schedule's function is not saved (it is rebuilt from this run's ``--max-steps``), so a run resumed
    with more steps must take its lr from the new schedule, not from the old one's end.
    """
    import warnings

    inner = getattr(scheduler, "scheduler", scheduler)  # unwrap Accelerate's AcceleratedScheduler
    with warnings.catch_warnings():  # get_lr() outside step() warns; here it is what we want
        warnings.simplefilter("ignore")
        lrs = inner.get_lr()
    for group, lr in zip(optimizer.param_groups, lrs, strict=False):
        group["lr"] = lr
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]


def _total_steps(config: TrainConfig, schedule: StepSchedule) -> int:
    steps = []
    if config.epochs:
        steps.append(config.epochs * schedule.steps_per_epoch())
    if config.max_steps:
        steps.append(config.max_steps)
    if not steps:
        raise UserError("Set --max-steps or --epochs to say how long to train.")
    return min(steps)


def _micro_batches(accelerator, rows, pad_id, schedule, state: LoopState, run: RunConfig, total_steps: int):
    """Iterator over this rank's micro-batches from ``state.samples`` on, for ``run``'s split."""
    import torch

    from memfit.data import collate

    sampler = StepBatchSampler(schedule, start_samples=state.samples, num_steps=total_steps - state.step,
                               micro_batch=run.micro_batch, grad_accum=run.grad_accum,
                               num_processes=run.num_processes)
    loader = torch.utils.data.DataLoader(RowsWithDummy(rows, pad_id), batch_sampler=sampler,
                                         collate_fn=lambda batch: collate(batch, pad_id))
    return iter(accelerator.prepare(loader))


def _fall_back(accelerator, model, run: RunConfig, state: LoopState, err: BaseException, plan_result) -> RunConfig:
    """Free memory, switch to the next configuration with the same effective batch, record the switch."""
    oom.free_memory(model)
    accelerator.step = 0  # the step restarts: its micro-batch counter too
    nxt = oom.next_config(run, oom.planned_fallbacks(plan_result, run))
    if nxt is None:
        ckpt = " and gradient checkpointing on" if run.grad_checkpointing else ""
        raise UserError(f"Out of memory at step {state.step + 1} with micro-batch {run.micro_batch}{ckpt}, and no "
                        "smaller configuration keeps the effective batch; lower --batch or --seq-len, or use "
                        "--lora-r.") from None
    accelerator.gradient_accumulation_steps = nxt.grad_accum
    if nxt.grad_checkpointing and not run.grad_checkpointing:
        enable_checkpointing(accelerator.unwrap_model(model))
    keys = ("micro_batch", "grad_accum", "grad_checkpointing")
    state.fallbacks.append({"step": state.step + 1, "error": str(err).strip().splitlines()[0][:200],
                            "from": {k: getattr(run, k) for k in keys}, "to": {k: getattr(nxt, k) for k in keys}})
    return nxt


@contextmanager
def not_a_batch_problem(doing: str):
    """An OOM outside a training step is not the batch's fault: say so instead of shrinking the batch."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if oom.is_oom(err):
            raise UserError(f"Ran out of memory while {doing}, outside a training step, so memfit did not "
                            "shrink the batch; free memory on the device or lower --micro-batch.") from None
        raise


def model_vocab(accelerator, model) -> int:
    return accelerator.unwrap_model(model).config.vocab_size


def predict(model_name: str, run: RunConfig, device: str = "cuda"):
    """The estimator's predicted peak for this run on ``device`` (None when unavailable or failing).

    On CPU the estimator models CPU kernels and leaves out the CUDA context and allocator terms.
    """
    try:
        from memfit.memory.estimate import estimate

        return estimate(model_name, run, device="cpu" if device == "cpu" else "cuda")
    except ImportError:
        return None
    except Exception:  # noqa: BLE001 - a prediction must never stop a training run
        return None


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step (appended, so a resumed run continues it)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")


def _preamble(config, run, bundle, data, schedule, total_steps, accelerator) -> str:
    """Derived numbers shown before the long work starts."""
    from memfit.units import fmt_count

    return (f"model {config.model}: {fmt_count(bundle.params)} params, {fmt_count(bundle.trainable_params)} trainable | "
            f"{len(data.train):,} train / {len(data.eval):,} held-out sequences of <= {run.seq_len} tokens\n"
            f"effective batch {run.effective_batch()} = micro-batch {run.micro_batch} x accumulation "
            f"{run.grad_accum} x {run.num_processes} process(es); tokens per optimizer step: "
            f"{run.tokens_per_step():,} (padding included); {total_steps} step(s) "
            f"({schedule.steps_per_epoch()} per epoch) on {accelerator.device.type}, "
            f"mixed precision {run.mixed_precision}, weights {run.dtype}")


def _tracker_config(config: TrainConfig, run: RunConfig) -> dict[str, Any]:
    flat = {**config.to_flat(), **run.to_flat()}
    return {k: v for k, v in flat.items() if isinstance(v, (int, float, str, bool))}


def write_run_files(output: Path, config: TrainConfig, summary: dict[str, Any]) -> None:
    """``run.json`` (settings, versions, summary) and ``loss.png``."""
    import accelerate
    import peft
    import torch
    import transformers

    from memfit import __version__

    versions = {"memfit": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "accelerate": accelerate.__version__,
                "peft": peft.__version__}
    doc = {"settings": config.to_flat(), "versions": versions, **summary}
    (output / "run.json").write_text(json.dumps(doc, indent=2, default=str))
    from memfit.report.train_plots import plot_loss

    plot_loss(output / "metrics.jsonl", output / "loss.png", unigram=summary["unigram_loss"])
