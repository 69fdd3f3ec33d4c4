"""The output folder: refusing to clobber another run, atomic checkpoints, resume, and export.

Layout of ``--output DIR``::

    DIR/config.json, model.safetensors      full fine-tune: the model (save_pretrained, safetensors)
    DIR/adapter_config.json, adapter_model.safetensors   LoRA: the adapter ...
    DIR/base/                               ... and, for a preset base (random weights), that base
    DIR/merged/                             LoRA with --merge: adapter merged into the base
    DIR/tokenizer.json ...                  the tokenizer
    DIR/metrics.jsonl, run.json, loss.png   what happened
    DIR/checkpoints/step-N/                 Accelerate save_state + trainer_state.json

A checkpoint is written to ``checkpoints/.tmp-step-N`` by every rank and renamed into place by the
main process once all ranks are done, so a crash mid-save never leaves a half checkpoint that
``--resume`` would pick.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memfit.errors import UserError

STATE_FILE = "trainer_state.json"
RUN_MARKERS = ("run.json", "metrics.jsonl", "checkpoints")
_STEP_RE = re.compile(r"^step-(\d+)$")


def default_output(model: str, root: Path = Path("runs"), now: float | None = None) -> Path:
    """``runs/<model-name>-<YYYYmmdd-HHMMSS>``: a fresh folder per run, so the same command runs twice.

    The model name is the preset name, or the checkpoint folder's name (a bare ``config.json``: its
    folder's). Two runs started in the same second get ``-2``, ``-3``, ... rather than colliding.
    """
    path = Path(model).expanduser()
    name = path.parent.name if path.is_file() else path.name or "model"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    base = root / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def checkpoints_dir(output: Path) -> Path:
    return output / "checkpoints"


def holds_run(output: Path) -> bool:
    return any((output / name).exists() for name in RUN_MARKERS)


def prepare_output(output: Path, *, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Refuse an output folder that holds another run, unless resuming it or told to overwrite.

    ``--overwrite`` removes only what a memfit run writes and appends to (checkpoints, metrics.jsonl),
    never other files the folder may hold.
    """
    if resume:
        if latest_checkpoint(output) is None:
            raise UserError(f"--resume found no checkpoint under {checkpoints_dir(output)}; "
                            "train with --save-every N first, or drop --resume.")
        return
    if holds_run(output) and not overwrite:
        raise UserError(f"{output} already holds a training run; pass --overwrite to replace it, "
                        "--resume to continue it, or choose another --output.")
    if is_main:
        if overwrite:
            shutil.rmtree(checkpoints_dir(output), ignore_errors=True)
            (output / "metrics.jsonl").unlink(missing_ok=True)
        output.mkdir(parents=True, exist_ok=True)


def latest_checkpoint(output: Path) -> Path | None:
    found = []
    folder = checkpoints_dir(output)
    if folder.is_dir():
        for child in folder.iterdir():
            match = _STEP_RE.match(child.name)
            if match and (child / STATE_FILE).is_file():
                found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def save_checkpoint(accelerator, output: Path, step: int, state: dict[str, Any], save_state=None) -> Path:
    """Accelerate ``save_state`` (model, optimizer, scheduler, scaler, RNG) plus memfit's loop state.

    ``save_state(folder)``: another writer of the training state (sharded runs: ``training.sharding``).
    """
    final = checkpoints_dir(output) / f"step-{step}"
    tmp = checkpoints_dir(output) / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    (save_state or accelerator.save_state)(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        if final.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        tmp.rename(final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, output: Path, load_state=None) -> dict[str, Any]:
    """Restore the latest checkpoint into the prepared objects; return memfit's loop state.

    ``load_state(folder)``: another reader of the training state (sharded runs: ``training.sharding``).
    """
    path = latest_checkpoint(output)
    if path is None:  # prepare_output checked already; this guards library callers
        raise UserError(f"--resume found no checkpoint under {checkpoints_dir(output)}.")
    (load_state or accelerator.load_state)(str(path))
    accelerator.step = 0  # checkpoints fall on optimizer-step boundaries, whatever the accumulation
    return json.loads((path / STATE_FILE).read_text())


def export(accelerator, model, tokenizer, output: Path, *, merge: bool, base_is_preset: bool) -> list[str]:
    """Save the trained model the way ``AutoModelForCausalLM.from_pretrained(output)`` loads it.

    Returns the paths written (relative to ``output``).
    """
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    if not accelerator.is_main_process:
        return []
    written = []
    tokenizer.save_pretrained(output)
    with _quiet_transformers():
        if hasattr(model, "peft_config"):
            written += _export_lora(model, output, merge=merge, base_is_preset=base_is_preset)
        else:
            model.save_pretrained(output)
            written.append("model.safetensors")
    return written


@contextmanager
def _quiet_transformers():
    """No "Writing model shards" bar under memfit's own output (transformers' bars are a global switch)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _export_lora(model, output: Path, *, merge: bool, base_is_preset: bool) -> list[str]:
    written = []
    if base_is_preset:
        # The base has random weights that exist nowhere else: save them and point the adapter at them,
        # so transformers' PEFT integration can rebuild base + adapter from this folder alone.
        import copy

        base = output / "base"
        copy.deepcopy(model).unload().save_pretrained(base)  # unload: the base without LoRA layers
        for cfg in model.peft_config.values():
            cfg.base_model_name_or_path = str(base.resolve())
        written.append("base/")
    model.save_pretrained(output)
    written.append("adapter_model.safetensors")
    if merge:
        import copy

        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(output / "merged")
        written.append("merged/")
    return written
