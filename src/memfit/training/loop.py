"""``train(config)``: build the run, fit it, finish.

    train (or run_training, which keeps the model)
      build_session   (training.session)  the run settled first (--batch, --budget's plan), then the Accelerator,
                                          model, data, optimizer and schedule built from it, resume
      fit             (here)              litgpt's ``fit``: the Accelerator, model, optimizer, schedule, training
                                          batches, held-out data and run folder are its arguments
                                          (``training.parts``); top to bottom, one optimizer step per iteration:
        train_step      forward, backward, clip and the optimizer step of the step's micro-batches under the run's
                        loss (training.step: one accumulation loop for sft, dpo, orpo, simpo); on out of memory:
                        undo the step (training.rollback), fall back (training.oom), redo it (``redo_lower``)
        record_step     advance the position in the data and the counters
        evaluate_due    held-out loss when --eval-every says so
        log_step        metrics.jsonl and the trackers
        save_due        a checkpoint when --save-every says so
        show_step       the progress: a live line on a terminal, plain lines elsewhere
      finish          (training.finish)   export, samples, RunSummary, run.json / loss.png

From ``memfit.train`` to ``loss.backward()`` are four frames: ``train``, ``fit``, ``train_step`` and Accelerate's
``backward``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memfit.errors import UserError
from memfit.integrations.hf_compat import quiet_import_notices
from memfit.memory import measure
from memfit.memory.outside import eval_batch
from memfit.settings.config import TrainConfig
from memfit.training import oom, resume, sharding
from memfit.training.finish import finish
from memfit.training.guard import RunGuard
from memfit.training.oom import not_a_batch_problem
from memfit.training.parts import HeldOut, RunOutput, TrainLoader
from memfit.training.rollback import RngState, undo_step
from memfit.training.runfolder import checkpoint, space
from memfit.training.samples import samples_at_eval
from memfit.training.session import LoopState, TrainSession, build_session, predict
from memfit.training.step import (
    PreferenceRun,
    StepOutOfMemory,
    StepResult,
    TokenLoss,
    evaluate,
    pool_preference,
    preference_window,
    train_step,
)
from memfit.training.summary import FallbackRecord, RunSummary

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.scheduler import AcceleratedScheduler

__all__ = ["train", "run_training", "fit", "TrainResult", "LoopState", "not_a_batch_problem"]


@dataclass
class TrainResult:
    summary: RunSummary
    model: object
    """The trained model, unwrapped from Accelerate."""


@contextmanager
def built(config: TrainConfig, show: bool) -> Iterator[TrainSession]:
    """The run built (``build_session``) under its ``RunGuard`` (Ctrl-C, non-finite steps, failing writes, the run
    folder's lock). bitsandbytes may be imported first in here (by PEFT or transformers), on every rank: its
    import-time notice is not memfit's users'. (A context manager, not a caller: no frame of its own under ``fit``.)"""
    with quiet_import_notices(), RunGuard() as guard:
        yield build_session(config, guard, show=show)


def train(config: TrainConfig, *, show: bool = True) -> dict:
    """Train ``config.source.model`` on ``config.data`` and return the run summary as JSON (what ``--json`` prints)."""
    with built(config, show) as s:
        fit(s.accelerator, s.model, s.optimizer, s.scheduler, s.train, s.held_out, s.folder, s)
        return finish(s)[0].to_dict()


def run_training(config: TrainConfig, *, show: bool = True) -> TrainResult:
    """``train``, keeping the typed summary and the trained model."""
    with built(config, show) as s:
        fit(s.accelerator, s.model, s.optimizer, s.scheduler, s.train, s.held_out, s.folder, s)
        summary, model = finish(s)
        return TrainResult(summary=summary, model=model)


def fit(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: AcceleratedScheduler, train_loader: TrainLoader, held_out: HeldOut, folder: RunOutput,
        s: TrainSession) -> None:
    """The optimizer steps from ``s.state.step`` to ``train_loader.total_steps``, read top to bottom.

    The step is ``train_step`` on the parts given here: its micro-batches come from ``train_loader``, the held-out
    loss from ``held_out``, the checkpoints and metrics go to ``folder``; ``s`` holds the run's settings in force,
    its position and counters, and its progress. An out-of-memory step is undone and redone on a lower
    configuration (``redo_lower``): the same parameters, optimizer state, random state and samples, so the run
    goes on as if the fallback had been used for this step from the start.
    """
    batches = train_loader.batches(s.run, samples=s.state.samples, step=s.state.step)
    measure.reset_peak(s.device)
    with s.report.bar:
        while s.state.step < train_loader.total_steps:
            t_step, rng = time.perf_counter(), RngState.capture()
            micro = [next(batches) for _ in range(s.run.grad_accum)]
            try:
                with s.parts.tensor_peak.watch(s.state.step + 1, model, optimizer, micro,  # CPU: live tensor bytes
                                               resident=s.parts.snapshot.buffers()):
                    result = train_step(accelerator, model, optimizer, micro, step_loss(s),
                                        max_grad_norm=s.config.optim.max_grad_norm, snapshot=s.parts.snapshot,
                                        in_backward=s.parts.in_backward)
            except StepOutOfMemory as err:
                del micro
                redo_lower(s, err, rng)
                batches = train_loader.batches(s.run, samples=s.state.samples, step=s.state.step)  # the new split
                continue
            folder.guard.check_finite(s.state.step + 1, result, model)  # a NaN/inf step stops the run before any save
            if not result.skipped:
                scheduler.step()  # a step the fp16 scaler skipped does not advance the schedule
            record_step(s, result, t_step)
            evaluated = evaluate_due(s, held_out)
            log_step(s, result, evaluated, folder)
            save_due(s, folder)
            show_step(s, result, evaluated)


def step_loss(s: TrainSession) -> TokenLoss | PreferenceRun:
    """The loss the step accumulates: the preference method's, else the next-token loss of ``s.run`` (an OOM
    fallback may have changed its loss implementation or offload)."""
    if s.parts.preference is not None:
        return s.parts.preference
    return TokenLoss(s.bundle.uses_model_loss, s.vocab, s.run.loss, activations_on_cpu=str(s.run.offload) == "activations")


def redo_lower(s: TrainSession, err: StepOutOfMemory, rng: RngState) -> None:
    """After an out-of-memory step: stop the ranks together, undo the step, restore the random state and fall back
    to a lower configuration, for ``fit`` to restart the micro-batches at the step's samples and redo it."""
    sharding.stop_on_rank_oom(s.accelerator, s.state.step + 1)  # ranks stop together, no hang
    undo_step(s.accelerator, s.model, s.optimizer)
    rng.restore()
    fall_back(s, err)


def fall_back(s: TrainSession, err: StepOutOfMemory) -> None:
    """Switch to a configuration that lowers the phase that ran out (same effective batch), and record it."""
    step = s.state.step + 1
    if not err.restored and err.phase == "backward":  # --optimizer-in-backward had stepped some parameters
        raise UserError(f"Out of memory in the backward pass of step {step} with --optimizer-in-backward, which had "
                        "already updated some parameters, so memfit stopped instead of redoing the step; lower "
                        "--micro-batch or add --grad-checkpointing.") from None
    if not err.restored:
        raise UserError(f"Out of memory inside the optimizer step of step {step}, and the host had no room for the "
                        "copy that undoes a half-applied step, so memfit stopped instead of redoing it; lower "
                        "the optimizer state (--lora-r, --optimizer adamw-8bit or sgd).") from None
    nxt = oom.next_config(s.run, oom.planned_fallbacks(s.planned.plan_result, s.run), phase=err.phase,
                          device=s.device, estimate=lambda run: predict(s.source.spec, run, s.device))
    if nxt is None:
        raise UserError(oom.nothing_lower_message(s.run, err.phase, step)) from None
    oom.switch_live(s.accelerator, s.model, s.optimizer, s.run, nxt)
    record = FallbackRecord.of(step, err.phase, err.error, s.run, nxt)
    s.state.fallbacks.append(record)
    s.report.bar.note(f"out of memory, redoing {record.describe()}")
    s.run = nxt


def record_step(s: TrainSession, result: StepResult, t_step: float) -> None:
    """Advance the position in the data and the counters past a finished step (``fit`` stepped the schedule)."""
    state = s.state
    state.step += 1
    state.samples += len(s.train.schedule.step_samples(state.samples))
    state.skipped_steps += int(result.skipped)
    state.tokens += result.tokens
    state.last_loss = result.loss
    if result.preference is not None:  # the first step, and the last steps pooled (``pool_preference``)
        this = {**result.preference, "step": state.step}
        state.preference_first = state.preference_first or pool_preference([this])
        state.preference_recent = (state.preference_recent + [this])[-preference_window(s.total_steps):]
    state.train_s += time.perf_counter() - t_step


def _is_last(s: TrainSession) -> bool:
    return s.state.step == s.total_steps


def evaluate_due(s: TrainSession, held_out: HeldOut) -> bool:
    """The held-out loss every ``--eval-every`` steps and at the end; returns whether it ran."""
    every = s.config.cadence.eval_every
    if not (every > 0 and held_out.rows and (s.state.step % every == 0 or _is_last(s))):
        return False
    with not_a_batch_problem("evaluating"), s.report.phase_peaks.watch("evaluation", s.model, s.optimizer,
                                                                        s.parts.snapshot.buffers()):
        s.state.last_eval = evaluate(s.accelerator, s.model, held_out.rows, pad_id=held_out.pad_id,
                                     batch_size=eval_batch(s.run), vocab_size=s.vocab)
    if math.isnan(s.state.best_eval) or s.state.last_eval < s.state.best_eval:
        s.state.best_eval = s.state.last_eval
    with not_a_batch_problem("generating samples"):
        samples_at_eval(s)  # --eval-samples
    return True


def log_step(s: TrainSession, result: StepResult, evaluated: bool, folder: RunOutput) -> None:
    """One ``metrics.jsonl`` record (and tracker entry) every ``--log-every`` steps and at the end."""
    if s.state.step % max(s.config.cadence.log_every, 1) and not _is_last(s):
        return
    record = {"step": s.state.step, "loss": result.loss, "lr": s.scheduler.get_last_lr()[0],
              "tokens_per_s": s.state.tokens / max(s.state.train_s, 1e-9), "memory_bytes": measure.in_use(s.device),
              "sequences": s.state.samples, "skipped_steps": s.state.skipped_steps, "grad_norm": result.grad_norm,
              "elapsed_s": time.perf_counter() - s.report.t_start}
    if evaluated:
        record["eval_loss"] = s.state.last_eval
    if result.preference is not None:  # reward accuracy and margin of the step's pairs
        record.update({k: v for k, v in result.preference.items() if k != "pairs"})
    if s.report.router is not None:
        record.update(s.report.router.take())  # the busiest expert's load over the balanced one (training/router.py)
    folder.metrics.write(record)
    # the step is the trackers' own axis (``step=``), not a metric: trackio renames a "step" value and warns
    s.accelerator.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=s.state.step)


def save_due(s: TrainSession, folder: RunOutput) -> None:
    """A checkpoint when one is due (``checkpoint.due``) or Ctrl-C asked to stop at this step boundary."""
    guard = folder.guard
    stop = guard.should_stop(s.accelerator)
    if checkpoint.due(s.config, s.state.step, s.total_steps) or stop:
        s.state.wall_s = time.perf_counter() - s.report.t_start
        with not_a_batch_problem("saving a checkpoint"), s.report.phase_peaks.watch(
                "checkpoint", s.model, s.optimizer, s.parts.snapshot.buffers()):
            # a checkpoint that cannot fit: one sentence before writing any of it
            space.check_before_save(s.accelerator, s.model, s.optimizer, folder, s.state.step)
            guard.last_checkpoint = checkpoint.save_checkpoint(
                s.accelerator, folder.path, s.state.step,
                {**s.state.to_dict(), **resume.record(s.config, s.run, s.source.hf_config, s.total_steps),
                 **guard.lineage()},
                keep_last=s.config.checkpoints.keep_last, save_state=folder.save_state, tag=guard.tag)
            guard.record(f"checkpoints/{guard.last_checkpoint.name}")
    if stop:
        guard.stop(s.state.step)


def show_step(s: TrainSession, result: StepResult, evaluated: bool = False) -> None:
    """The progress after this step: the live line, or a plain line when due (``training.progress``)."""
    s.report.bar.update(s.state.step, loss=result.loss, lr=s.scheduler.get_last_lr()[0],
                        tokens_per_s=s.state.tokens / max(s.state.train_s, 1e-9), memory=measure.in_use(s.device),
                        skipped=s.state.skipped_steps, eval_loss=s.state.last_eval,
                        memory_label="rss" if s.device == "cpu" else "mem", evaluated=evaluated)
