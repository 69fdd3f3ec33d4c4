"""Checkpoints (atomic, verified, rotated), loading them for a resume, and the final export.

Layout of ``--output DIR``::

    DIR/config.json, model.safetensors      full fine-tune: the model (save_pretrained, safetensors)
    DIR/adapter_config.json, adapter_model.safetensors   LoRA: the adapter ...
    DIR/base/                               ... and, for a preset base (random weights), that base
    DIR/merged/                             LoRA with --merge: adapter merged into the base
    DIR/tokenizer.json ...                  the tokenizer
    DIR/metrics.jsonl, run.json, loss.png   what happened
    DIR/checkpoints/step-N/                 Accelerate save_state + trainer_state.json

A checkpoint is written to ``checkpoints/.tmp-step-N-<pid>-<random>`` (the run's staging tag,
``folder``) by every rank; the main process then writes
``manifest.json`` (every file's size and sha256) last, and renames the folder into place once all
ranks are done, so a crash mid-save never leaves a half checkpoint that ``--resume`` would pick.
``--resume`` verifies the manifest before loading anything (``manifest``) and falls back to
the newest intact checkpoint. Older checkpoints are removed (``--keep-last``) only after a newer one
is complete. Before each save the free space is checked against the checkpoint's size (``space``). The
final export is written to ``.tmp-export-<tag>`` and moved into place file by file
(``os.replace``), so a failing write never leaves a half-written file under a final name.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers.utils import logging as hf_logging

from memfit.errors import UserError
from memfit.files import check_no_links, user_path
from memfit.integrations.hf_compat import quiet_4bit_merge, quiet_tied_weight_save
from memfit.training.runfolder import manifest
from memfit.training.runfolder.folder import remove_entry
from memfit.training.runfolder.layout import STATE_FILE, STEP_RE, checkpoints_dir, step_folders


def default_output(model: str, root: Path = Path("runs"), now: float | None = None) -> Path:
    """``runs/<model-name>-<YYYYmmdd-HHMMSS>``: a fresh folder per run, so the same command runs twice.

    The model name is the preset name, or the checkpoint folder's name (a bare ``config.json``: its
    folder's). Two runs started in the same second get ``-2``, ``-3``, ... rather than colliding.
    """
    path = user_path(model)
    name = path.parent.name if path.is_file() else path.name or "model"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    base = root / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def save_checkpoint(accelerator, output: Path, step: int, state: dict[str, Any], keep_last: int | None = None,
                    save_state=None, tag: str | None = None) -> Path:
    """Accelerate ``save_state`` (model, optimizer, scheduler, scaler, RNG) plus memfit's loop state, then
    the manifest (last), then the rename; then, and only then, older checkpoints beyond ``keep_last`` go.
    ``tag``: the run's staging tag (the same on every rank); the staging folder is made new (``mkdir``
    fails on anything already there, a planted link included), never reused."""
    final = checkpoints_dir(output) / f"step-{step}"
    tmp = checkpoints_dir(output) / f".tmp-step-{step}-{tag or os.getpid()}"
    if accelerator.is_main_process:
        check_no_links(output, tmp / STATE_FILE)  # ``checkpoints -> elsewhere`` is refused, not followed
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with quiet_tied_weight_save():  # a tied head is saved once, and restored on load (memfit.integrations.hf_compat)
        (save_state or accelerator.save_state)(str(tmp))  # sharded runs: training.sharding.state_saver
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        manifest.write_file(tmp / STATE_FILE, json.dumps(state, indent=2))  # memfit.files: the one writer
        manifest.write_manifest(tmp)  # last: its presence says every file above is complete
        _put_in_place(tmp, final)
        manifest.fsync_dir(final.parent)
        if keep_last:
            remove_old(output, keep=keep_last, newest=final)
    accelerator.wait_for_everyone()
    return final


def _put_in_place(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; whatever held that name before (the same step saved by an
    earlier try, or a stray file) is moved aside first and removed only after the rename."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".old-{final.name}")
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


def due(config, step: int, total_steps: int) -> bool:
    """Whether step ``step`` ends with a checkpoint: every ``--save-every`` steps and at the end; by default
    ten times per run (every ``total_steps // 10`` steps, at least every step); ``--save-every 0``: never."""
    every = config.checkpoints.save_every if config.checkpoints.save_every is not None else max(total_steps // 10, 1)
    return every > 0 and (step % every == 0 or step == total_steps)


def remove_old(output: Path, *, keep: int, newest: Path) -> None:
    """Keep the ``keep`` newest complete checkpoints (``newest`` among them); remove older ones and
    leftovers of interrupted saves. Never called before ``newest`` is complete."""
    newest_step = int(STEP_RE.match(newest.name).group(1))
    # Checkpoints of later steps than the new one were passed over by a resume as damaged: left as they are.
    complete = [path for step, path in step_folders(output)
                if step <= newest_step and path.is_dir() and manifest.has_manifest(path)]
    for path in complete[max(keep, 1):]:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)

    for leftover in checkpoints_dir(output).glob(".tmp-step-*"):  # the lock holder's call: none is in use
        remove_entry(leftover)


def load_checkpoint(accelerator, output: Path, path: Path | None = None, load_state=None) -> dict[str, Any]:
    """Restore a verified checkpoint (``path``; default: the newest intact one) into the prepared
    objects; return memfit's loop state. Only tensors and plain data are unpickled (``weights_only``)."""
    if path is None:
        path, _ = manifest.pick_intact(output)
    state = manifest.read_state(path)
    try:
        with warnings.catch_warnings():  # torch's note on a foreign pickle's protocol precedes a refusal anyway
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            (load_state or accelerator.load_state)(str(path))  # sharded: training.sharding.state_loader
    except Exception as err:  # noqa: BLE001 - whatever the loader raises, the answer is one sentence
        raise manifest.load_error(path, err) from None
    accelerator.step = 0  # checkpoints fall on optimizer-step boundaries, whatever the accumulation
    return state


def export(accelerator, model, tokenizer, output: Path, *, merge: bool, base_is_preset: bool, tag: str | None = None,
           record=None) -> list[str]:
    """Save the trained model the way ``AutoModelForCausalLM.from_pretrained(output)`` loads it.

    Returns the paths written (relative to ``output``); ``record`` is called with the top-level names moved
    into ``output`` (the run's ledger: what ``--overwrite`` may remove later).
    """
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(model, keep_fp32_wrapper=False, keep_torch_compile=False)
    if not accelerator.is_main_process:
        return []
    written = []
    staging = output / f".tmp-export-{tag or os.getpid()}"  # written whole, then moved into place
    staging.mkdir(parents=True)
    tokenizer.save_pretrained(staging)
    with _quiet_transformers():
        if hasattr(model, "peft_config"):
            written += _export_lora(model, staging, merge=merge, base_is_preset=base_is_preset, final=output,
                                    tokenizer=tokenizer)
        else:
            model.save_pretrained(staging)
            written.append("model.safetensors")
    moved = _move_into_place(staging, output)
    if record is not None:
        record(*moved)
    return written


def _move_into_place(staging: Path, output: Path) -> list[str]:
    """Move every file of ``staging`` to the same place under ``output`` (``os.replace``: atomic per file, a
    link at the name replaced, never followed; a link on the way is refused); the top-level names moved."""
    files = [src for src in sorted(staging.rglob("*")) if src.is_file()]
    for src in files:
        check_no_links(output, output / src.relative_to(staging))
        _check_kind(output, src.relative_to(staging))
    for src in files:
        dst = output / src.relative_to(staging)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
    shutil.rmtree(staging, ignore_errors=True)
    return list(dict.fromkeys(src.relative_to(staging).parts[0] for src in files))


def _check_kind(output: Path, name: Path) -> None:
    """Refuse a folder where the export writes a file (or a file where it writes a folder), before anything is
    moved. ``folder`` refuses the names it knows before the first step; this catches one put there since."""
    top = output / name.parts[0]
    clash = top.is_dir() if len(name.parts) == 1 else top.exists() and not top.is_dir()
    if clash and not top.is_symlink():
        raise UserError(f"{top} is a {'folder' if top.is_dir() else 'file'}, where the export writes a "
                        f"{'file' if top.is_dir() else 'folder'}, so the trained model was not exported (the newest "
                        "checkpoint under checkpoints/ holds it); move it away and choose another --output.")


@contextmanager
def _quiet_transformers():
    """No "Writing model shards" bar under memfit's own output (transformers' bars are a global switch)."""

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _base_state_dict(model) -> dict:
    """The base model's weights as ``from_pretrained`` names them, without the adapters: the tensors of
    ``model`` itself, not a copy. PEFT's ``unload()`` gives the same model but works in place (the run still
    needs its adapters for the samples), and unloading a deep copy held a second model in memory, which for a
    2.6 B base in fp32 (10.5 GB) ran a 24 GiB machine out of memory. A LoRA-wrapped layer keeps its original
    weight as ``<layer>.base_layer.weight`` next to ``<layer>.lora_A.<adapter>.weight`` (peft/tuners/lora/layer.py)."""
    state = {}
    for name, tensor in model.get_base_model().state_dict().items():
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        state[".".join(part for part in parts if part != "base_layer")] = tensor
    return state


def _export_lora(model, output: Path, *, merge: bool, base_is_preset: bool, final: Path | None = None,
                 tokenizer=None) -> list[str]:
    """The adapter (and a preset's random base, and the merged model) under ``output``; ``final`` is where
    ``output``'s files end up, which the adapter's base path must name."""
    written = []
    final = final or output
    if base_is_preset:
        # The base has random weights that exist nowhere else: save them and point the adapter at them,
        # so transformers' PEFT integration can rebuild base + adapter from this folder alone.
        base = output / "base"
        model.get_base_model().save_pretrained(base, state_dict=_base_state_dict(model))
        for cfg in model.peft_config.values():
            cfg.base_model_name_or_path = str(base.resolve())
        written.append("base/")
    # The embeddings are never adapted nor resized (memfit.spec.resolved wraps projections only), so PEFT's "auto"
    # check of the base's vocabulary, which reads the base's config.json (from the Hub for a Hub id, warning
    # when offline), has nothing to find.
    model.save_pretrained(output, save_embedding_layers=False)
    if base_is_preset and final != output:  # the adapter must name where the base ends up, not the staging folder
        adapter_config = output / "adapter_config.json"
        doc = json.loads(adapter_config.read_text())
        doc["base_model_name_or_path"] = str((final / "base").resolve())
        adapter_config.write_text(json.dumps(doc, indent=2, sort_keys=True))
        for cfg in model.peft_config.values():
            cfg.base_model_name_or_path = doc["base_model_name_or_path"]
    written.append("adapter_model.safetensors")
    if merge:
        with quiet_4bit_merge():  # a 4-bit base is quantized again after the merge: the docs say so
            merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(output / "merged")
        if tokenizer is not None:  # self-contained: from_pretrained(merged) needs no other folder
            tokenizer.save_pretrained(output / "merged")
        written.append("merged/")
    return written
