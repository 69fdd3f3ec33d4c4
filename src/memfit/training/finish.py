"""The end of a training run: measure, export the model, generate samples, write the summary.

``finish`` turns a ``TrainSession`` whose loop has ended into a ``RunSummary`` and the files of the
output folder (the model, ``run.json``, ``loss.png``); the CLI renders the summary.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import accelerate
import torch
import transformers

from memfit.files import write_atomic
from memfit.integrations.versions import MEMFIT
from memfit.memory import measure
from memfit.memory.outside import predicted_outside
from memfit.memory.phases import phase_figures  # every phase's reserved memory, loading to the last save
from memfit.report.train_plots import plot_loss
from memfit.settings.config import TrainConfig
from memfit.training import sharding
from memfit.training.budget import plan_record
from memfit.training.oom import not_a_batch_problem
from memfit.training.runfolder import checkpoint
from memfit.training.runfolder.readback import read_metrics
from memfit.training.samples import generate_samples
from memfit.training.session import TrainSession, predict
from memfit.training.setup import build_model
from memfit.training.step import pool_preference
from memfit.training.summary import RunSummary


def finish(s: TrainSession) -> tuple[RunSummary, object]:
    """Export, samples, summary and run files; returns the summary and the unwrapped model."""
    peak_mem = measure.peak(s.device, s.parts.tensor_peak)
    rank_peaks = sharding.rank_peaks(s.accelerator, peak_mem.peak_bytes)
    net = s.accelerator.unwrap_model(s.model, keep_torch_compile=False)  # --compile: the module itself
    measured = measure.measured_breakdown(peak_mem, net, s.optimizer, trainable_params=s.bundle.trainable_params)
    own, held, phases = net, (s.model, s.optimizer), s.report.phase_peaks  # the phases after the step start from held
    with not_a_batch_problem("saving the model"), phases.watch("export", *held, s.parts.snapshot.buffers()):
        # Sharded: rank 0 exports (and samples from) a plain copy holding the gathered full weights.
        net = sharding.gathered_model(s.accelerator, s.run, s.model,
                                      lambda: build_model(s.config, s.run, s.source).model) or net
        checkpoint.export(s.accelerator, net, s.bundle.tokenizer, s.output, merge=s.config.merge,
                          base_is_preset=s.bundle.random_init, tag=s.folder.guard.tag, record=s.folder.guard.record)
    plain = [] if net is own else [*net.parameters(), *net.buffers()]  # sharded: rank 0's plain copy
    with phases.watch("samples", *held, [*s.parts.snapshot.buffers(), *plain],
                      when=s.is_main and s.config.cadence.samples > 0):
        sampled = samples(s, net)
    summary = RunSummary(
        steps=s.state.step, sequences=s.state.samples, final_train_loss=s.state.last_loss,
        final_eval_loss=s.state.last_eval, best_eval_loss=s.state.best_eval, unigram_loss=s.held_out.unigram,
        tokens_per_s=s.state.tokens / max(s.state.train_s, 1e-9), train_s=s.state.train_s,
        wall_s=time.perf_counter() - s.report.t_start, skipped_steps=s.state.skipped_steps, peak_memory=peak_mem,
        measured=measured, predicted=s.planned.predicted, predicted_at_measured_rows=_predicted_at_rows(s, peak_mem),
        plan=plan_record(s.config, s.planned.plan_result) if s.planned.plan_result is not None else None,
        fallbacks=list(s.state.fallbacks), num_processes=s.accelerator.num_processes, rank_peak_bytes=rank_peaks, resumes=list(s.state.resumes),
        initial_run=s.planned.initial_run,
        run=s.run, uses_model_loss=s.bundle.uses_model_loss, params=s.bundle.params,
        trainable_params=s.bundle.trainable_params, output=str(s.output), samples=sampled,
        attn_implementation=s.bundle.attention, lora_targets=tuple(s.bundle.lora_targets),
        outside_step=_outside(s), measured_phases=phases.to_dict(),
        hub=s.source.hub.to_dict() if s.source.hub is not None else None,
        process_wall_s=time.perf_counter() - s.report.t_process,
        preference=({"method": str(s.run.method), "first": s.state.preference_first,
                     "last": pool_preference(s.state.preference_recent)} if s.state.preference_recent else None),
    )
    if s.is_main:
        write_run_files(s.output, s.config, summary)
    s.accelerator.end_training()
    return summary, net


def _predicted_at_rows(s: TrainSession, peak_mem: measure.PeakMemory) -> int | None:
    """The prediction at the measured step's micro-batch shape, where its rows were shorter or fewer than the
    run's full ``micro-batch x seq-len`` (rows are padded to the micro-batch's longest document, not to
    ``--seq-len``); None where they were full, nothing was measured on tensors, or the estimator refused."""
    rows = peak_mem.cpu_tensor_peak_rows
    if s.planned.predicted is None or not rows or tuple(rows) == (s.run.micro_batch, s.run.seq_len):
        return None
    at_rows = predict(s.source.spec, s.run.replace(micro_batch=rows[0], seq_len=rows[1]), s.device)
    return at_rows.peak_bytes if at_rows is not None else None


def _outside(s: TrainSession) -> dict | None:
    """The predicted peaks outside the step for the settings the run ended with (summary and run.json)."""
    outside = predicted_outside(s.source.spec, s.run, s.device, s.source.loaded_from)
    if outside is None:
        return None
    predicted = s.planned.predicted
    return {**outside.to_dict(), **(phase_figures(s.source.spec, s.run, predicted, s.device, s.source.loaded_from)
                            if predicted else {})}


def samples(s: TrainSession, net) -> list[dict[str, str]]:
    """A few completions of held-out prompts (main process only)."""
    if not s.is_main or s.config.cadence.samples <= 0:
        return []
    with not_a_batch_problem("generating samples"):
        return generate_samples(s.accelerator, net, s.bundle.tokenizer, s.held_out.prompt_docs,
                                count=s.config.cadence.samples,
                                seed=s.config.seed, max_positions=getattr(net.config, "max_position_embeddings", None))


def write_run_files(output: Path, config: TrainConfig, summary: RunSummary) -> None:
    """``run.json`` (settings, versions, the summary's JSON form) and ``loss.png``."""
    # imported here, inside the run's quiet_import_notices (training.loop.built): PEFT imports bitsandbytes, whose
    # import-time notice ("Failed to load CPU gemm_4bit_forward ...") a run must not print; a full fine-tune
    # never imports PEFT before this line
    import peft

    versions = {"memfit": MEMFIT, "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "accelerate": accelerate.__version__,
                "peft": peft.__version__}
    doc = {"settings": config.to_flat(), "versions": versions, **summary.to_dict()}

    # replaced whole (a link planted as run.json is replaced, never written through)
    write_atomic(output / "run.json", json.dumps(doc, indent=2, default=str), root=output, user_error=False)

    plot_loss(read_metrics(output / "metrics.jsonl"), output / "loss.png", unigram=summary.unigram_loss)
