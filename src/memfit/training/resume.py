"""``--resume``: continue exactly the run in ``--output``, or refuse in one sentence.

Every checkpoint's ``trainer_state.json`` (covered by its manifest) records the run's settings (model,
data, tokenizer, every flag that shapes the run, the schedule, the resolved memory settings) and a
fingerprint of what it trained (the architecture, full or LoRA, optimizer, weight dtype). ``restore``
reads them from the newest intact checkpoint before anything is built: settings the user did not give
come from the run; settings the user gave may differ only where that is safe (more steps, eval/save/log
cadence, the micro-batch split of the same effective batch); anything else is refused naming the
setting. ``check_belongs`` compares the fingerprint with the model about to be built, so a checkpoint
is never loaded into a model it does not fit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.files import user_path
from memfit.settings.config import RunConfig, TrainConfig
from memfit.settings.schema import with_rule
from memfit.settings.validate import flag
from memfit.training.runfolder import ledger, manifest
from memfit.training.runfolder.manifest import write_file
from memfit.training.runfolder.readback import read_metrics


def _rules():
    """``(SAFE, LENGTH, NOT_RESTORED)``: the settings' keys by their ``resume`` rule in the schema
    (``memfit.settings.schema.RESUME_RULES`` says what each rule means; each field of ``RunConfig`` and
    ``TrainConfig`` states its own)."""
    classes = (TrainConfig, RunConfig)
    return (with_rule(classes, "may-change", "length"), with_rule(classes, "length"),
            with_rule(classes, "never-restored"))


#: May differ from the saved run when resuming; LENGTH: how long the run trains, said two ways (when the
#: user gives one, the saved other one is not restored); NOT_RESTORED: never taken from the saved run.
SAFE, LENGTH, NOT_RESTORED = _rules()


@dataclass
class ResumePoint:
    path: Path
    """The checkpoint folder to load (verified)."""
    state: dict[str, Any]
    note: str | None
    """Which newer checkpoints were passed over and why (None when the newest was intact)."""
    data: dict[str, Any] | None = None
    """The fingerprint of the data now (``ledger.fingerprint``), checked against the checkpoint's."""


def _absolute(value: Any) -> Any:
    """A path that exists, made absolute, so the run resumes from any working directory."""
    path = user_path(value) if isinstance(value, str) and value else None
    return str(path.resolve()) if path is not None and path.exists() else value


def settings(config, run) -> dict[str, Any]:
    """The run's settings as saved in each checkpoint: flat train flags with the resolved memory settings."""
    flat = {**config.to_flat(), **run.to_flat(), "budget": None, "batch": None}
    for key in ("model", "data", "tokenizer"):
        flat[key] = _absolute(flat.get(key))
    return {k: v for k, v in flat.items() if k not in NOT_RESTORED or k == "num_processes"}


def fingerprint(run, hf_config) -> dict[str, Any]:
    """What a checkpoint's tensors fit: the architecture, what is trained, the optimizer, the weight dtype."""
    arch = {k: getattr(hf_config, k, None) for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                                     "num_hidden_layers", "num_attention_heads",
                                                     "num_key_value_heads")}
    trained = f"LoRA r={run.lora.r} on {','.join(run.lora.targets)}" if run.is_lora() else "full fine-tune"
    return {"arch": arch, "trained": trained, "optimizer": str(run.optimizer), "dtype": str(run.dtype),
            "quantize": str(run.quantize)}


def record(config, run, hf_config, total_steps: int | None = None) -> dict[str, Any]:
    """What ``save_checkpoint`` adds to the loop state so ``--resume`` can continue this exact run;
    ``total_steps``: the run's length, over which its learning-rate schedule runs (``check_extension``)."""
    out = {"run": run.to_flat(), "settings": settings(config, run), "fingerprint": fingerprint(run, hf_config)}
    if total_steps is not None:
        out["total_steps"] = total_steps
    return out


def restore(config):
    """``(config, ResumePoint)``: with ``--resume``, ``config`` with the saved run's settings; else ``(config, None)``."""
    if config.folder.extend_schedule and not config.folder.resume:
        raise UserError("--extend-schedule continues a finished run past its end and needs --resume (and --output, "
                        "the run's folder).")
    if not config.folder.resume or not config.folder.output:
        return config, None

    output = user_path(config.folder.output)
    if not output.is_dir():
        raise UserError(f"--resume found no checkpoint under {output}: it is not a run folder (it does not exist "
                        "or is a file).")
    path, note = manifest.pick_intact(output)
    state = manifest.read_state(path)
    point = ResumePoint(path, state, note)
    check_run(point, output)
    saved = state.get("settings")
    if isinstance(saved, dict):  # else a checkpoint from before settings were saved: keep the flags given
        config = merge(config, saved, output)
    check_data(point, config)
    return config, point


def check_run(point: ResumePoint, output: Path) -> None:
    """Refuse a checkpoint whose run id is not the run folder's (one of another run, copied in)."""
    doc = ledger.read(output)
    mine, theirs = (doc or {}).get("run_id"), point.state.get("run_id")
    if mine and theirs and mine != theirs:
        raise UserError(f"{point.path} belongs to another run (run id {theirs[:12]}) than {output} (run id "
                        f"{mine[:12]}), so it was not resumed; remove it, or resume that run in its own folder.")


def check_data(point: ResumePoint, config) -> None:
    """Refuse data whose content changed since the checkpoint was saved, unless ``--allow-data-change``."""
    point.data = ledger.fingerprint(config.data)
    saved = point.state.get("data_fingerprint")
    if not ledger.valid_fingerprint(saved) or point.data is None:
        return  # a checkpoint from before fingerprints, or Hub data: nothing to compare
    if (saved["bytes"], saved["sha256"]) == (point.data["bytes"], point.data["sha256"]):
        return
    what = (f"the data {config.data} changed since {point.path.name} was saved ({ledger.describe(saved)} then, "
            f"{ledger.describe(point.data)} now)")
    if not config.folder.allow_data_change:
        raise UserError(f"--resume: {what}; restore the data the run trained on, or add --allow-data-change to "
                        "train on the new data.")
    point.note = "; ".join(n for n in (point.note, f"{what}: training on the new data (--allow-data-change)") if n)


def data_now(point: ResumePoint | None, config) -> dict[str, Any] | None:
    """The data's fingerprint, computed once per run (a resume has it from ``check_data``)."""
    return point.data if point is not None and point.data is not None else ledger.fingerprint(config.data)


def merge(config, saved: dict[str, Any], output: Path):
    """The saved settings, with the user's given ones where they are safe; ``UserError`` naming the first unsafe one."""
    current = config.to_flat()
    current.update({k: _absolute(current.get(k)) for k in ("model", "data", "tokenizer")})
    given = set(config.explicit) if config.explicit is not None else {  # lr None: not given (memfit.settings.defaults)
        k for k in current if k in saved and current[k] != saved[k] and not (k == "lr" and current[k] is None)}
    merged = dict(current)
    for key, value in saved.items():
        if key in NOT_RESTORED or key not in current:
            continue
        if key in LENGTH and given & LENGTH and key not in given:
            continue  # one length given (--epochs 20): the saved other one (--max-steps 300) does not cap it
        if key in given and current[key] != value:
            if key not in SAFE:
                raise UserError(f"--resume continues the run in {output} with its own settings, and {flag(key)} "
                                f"differs from them (the run has {value!r}, given {current[key]!r}); drop "
                                f"{flag(key)}, or start a new run in another --output.")
            continue
        merged[key] = value
    merged.pop("explicit", None)
    restored = TrainConfig.from_flat({k: v for k, v in merged.items() if k != "pinned"})
    return dataclasses.replace(restored, explicit=config.explicit, pinned=config.pinned)


def check_belongs(point: ResumePoint | None, config, run, hf_config) -> None:
    """Refuse, before anything is loaded, a checkpoint that does not fit this run (naming what differs)."""
    if point is None:
        return
    state = point.state
    saved_fp = state.get("fingerprint")
    now = fingerprint(run, hf_config)
    if isinstance(saved_fp, dict):
        for key, label in (("arch", "the model's architecture"), ("trained", "what is trained"),
                           ("optimizer", "the optimizer"), ("dtype", "the weight dtype"),
                           ("quantize", "the quantization")):
            if key in saved_fp and saved_fp[key] != now[key]:
                raise UserError(f"{point.path} does not belong to this run: {label} differs "
                                f"({_describe(saved_fp[key])} in the checkpoint, {_describe(now[key])} now).")
    saved_run = state.get("run")
    if isinstance(saved_run, dict):  # older checkpoints: at least what changes tensor shapes
        for key in ("lora_r", "lora_targets", "optimizer", "dtype", "quantize"):
            if key in saved_run and str(saved_run[key]) != str(run.to_flat()[key]):
                raise UserError(f"{point.path} does not belong to this run: {flag(key)} is {saved_run[key]!r} "
                                f"in the checkpoint and {run.to_flat()[key]!r} now.")
        try:
            saved_batch = int(saved_run["micro_batch"]) * int(saved_run["grad_accum"]) * int(saved_run["num_processes"])
        except (KeyError, TypeError, ValueError):
            saved_batch = None
        if saved_batch and saved_batch != run.effective_batch():
            raise UserError(f"--resume keeps the run's effective batch of {saved_batch} sequences, but micro-batch "
                            f"{run.micro_batch} x accumulation {run.grad_accum} x {run.num_processes} process(es) "
                            f"is {run.effective_batch()}; choose --micro-batch and --grad-accum whose product with "
                            "the processes is the same.")
    step = state.get("step", 0)
    total = config.length.max_steps
    if total is not None and total < step and not config.length.epochs:  # equal: nothing to train, export again
        raise UserError(f"--resume: the checkpoint is at step {step}, beyond --max-steps {total}; give --max-steps "
                        f"{step} or more.")


def check_extension(point: ResumePoint | None, config, total_steps: int) -> None:
    """Refuse to train a finished run on past its end unless ``--extend-schedule`` says to.

    The learning-rate schedule (warmup, then cosine decay to 0) is a function of the step over the run's
    total steps, and is rebuilt from the total of this invocation. A finished run's lr has decayed to 0;
    rebuilt over more steps it would rise again at the resumed step, so that is done only when asked.
    (An unfinished run given more steps just stretches its decay; ``schedule_note`` says so.) Checked
    before the run folder is touched; checkpoints without ``total_steps`` are not checked.
    """
    if point is None or config.folder.extend_schedule:
        return
    step, ended = int(point.state.get("step", 0)), point.state.get("total_steps")
    if isinstance(ended, int) and step >= ended and total_steps > step:
        raise UserError(f"--resume: the run in {config.folder.output} finished its {ended} steps with its learning "
                        f"rate decayed to 0, and training on to step {total_steps} recomputes the schedule over "
                        f"{total_steps} steps, so the lr rises again; add --extend-schedule to train on that way.")


def schedule_note(point: ResumePoint | None, total_steps: int, before: list[float], after: list[float]) -> str | None:
    """The preamble line when the resumed step's learning rate changed (the run's total steps changed)."""
    if point is None or all(math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0) for a, b in zip(before, after, strict=True)):
        return None
    step, ended = int(point.state.get("step", 0)), point.state.get("total_steps")
    was = f" (was {ended})" if isinstance(ended, int) and ended != total_steps else ""
    return (f"learning-rate schedule recomputed over {total_steps} steps{was}: at step {step} the lr is "
            f"{after[0]:.1e} (was {before[0]:.1e}), decaying to 0 at step {total_steps}")


def resumed_line(point: ResumePoint, total_steps: int) -> str:
    """``resumed from checkpoint step 120 of 300 (runs/x/checkpoints/step-120)``."""
    return f"resumed from checkpoint step {int(point.state.get('step', 0))} of {total_steps} ({point.path})"


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items() if v is not None)
    return str(value)


def note_resume(output: Path, point: ResumePoint | None, is_main: bool) -> dict[str, Any] | None:
    """Record a resume: drop ``metrics.jsonl`` records logged after the checkpoint (they will be logged
    again, so no step appears twice) and append a ``{"event": "resume"}`` record. Returns the record."""
    if point is None:
        return None
    step = int(point.state.get("step", 0))
    event = {"event": "resume", "step": step, "checkpoint": point.path.name, "time": time.time()}
    if point.note:
        event["note"] = point.note
    if not is_main:
        return event

    path = output / "metrics.jsonl"
    kept = [json.dumps(rec) for rec in read_metrics(path)  # checked; a last line cut by a kill is dropped
            if rec.get("event") or rec.get("step", 0) <= step]
    kept.append(json.dumps(event))
    write_file(path, "\n".join(kept) + "\n")
    return event
