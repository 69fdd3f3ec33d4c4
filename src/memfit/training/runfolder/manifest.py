"""Checkpoint integrity: a manifest written last, verified before anything is loaded.

``manifest.json`` lists every file of a checkpoint folder with its size in bytes and its sha256; it
is written after all of them (and fsynced), so its presence says the save completed, and its
contents say whether a file was since truncated, emptied, replaced or removed. ``pick_intact`` walks
the checkpoints newest first and returns the first that verifies, with a sentence naming the ones it
passed over and why. A checkpoint from before manifests (memfit < this version) is checked by
structure instead: its state file parses, the files Accelerate needs are there, and every
safetensors header covers its file.

What ``--resume`` trusts: files listed in a matching manifest, the JSON loop state, tensors loaded
with safetensors, and optimizer/scheduler/RNG state loaded by Accelerate with torch's
``weights_only=True`` unpickler (tensors, numbers, strings, containers; no arbitrary objects). A pickle
that needs more is refused, not run.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

from safetensors import safe_open

from memfit.errors import UserError
from memfit.files import write_atomic
from memfit.training.runfolder import readback
from memfit.training.runfolder.layout import STATE_FILE, checkpoints_dir, step_folders

MANIFEST = "manifest.json"
_NEEDED = ("optimizer.bin", "scheduler.bin")  # Accelerate's names for the first optimizer and scheduler


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a power cut after it keeps it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, text: str) -> None:
    """``memfit.files.write_atomic``: the final name only ever holds a complete file, never written through a
    link; a failing write raises its ``OSError`` (``training.guard`` names the intact checkpoint)."""

    write_atomic(path, text, user_error=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """List every file under ``folder`` with size and sha256; written last, atomically."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST and not path.name.endswith(".tmp"):
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            files[str(path.relative_to(folder))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    write_file(folder / MANIFEST, json.dumps({"version": 1, "files": files}, indent=1))


def has_manifest(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not an intact checkpoint, in a few words; None when it is."""
    if not folder.is_dir():
        return "is a file, not a checkpoint folder"
    if has_manifest(folder):
        return _manifest_problem(folder)
    if _written_with_manifest(folder):
        return f"lacks {MANIFEST} (deleted, or its save never finished)"
    return _structure_problem(folder)


def _written_with_manifest(folder: Path) -> bool:
    """Whether the checkpoint was saved by a memfit that writes a manifest: its state records the run id
    (``ledger``), which came with manifests; an older memfit's checkpoint has neither and is checked by form."""
    try:
        state = json.loads((folder / STATE_FILE).read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "run_id" in state


def _manifest_problem(folder: Path) -> str | None:
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        assert isinstance(listed, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"has an unreadable {MANIFEST}"
    for name, entry in listed.items():
        why = readback.manifest_entry_problem(name, entry)
        if why:
            return f"has {MANIFEST} that {why}"
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            return f"lacks {name}"
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"has {name} of {size:,} bytes where {entry.get('bytes'):,} were saved"
        if _sha256(path) != entry.get("sha256"):
            return f"has {name} changed since it was saved (checksum differs)"
    if STATE_FILE not in listed:
        return f"lacks {STATE_FILE}"
    return _state_problem(folder) or _rng_problem(folder)


def _rng_problem(folder: Path) -> str | None:
    """Every process's RNG state must load (a manifest recomputed over a damaged one does not make it good)."""
    files = sorted(folder.glob("random_states_*.pkl")) or [folder / "random_states_0.pkl"]
    return next((why for why in map(readback.rng_problem, files) if why), None)


def _structure_problem(folder: Path) -> str | None:
    """A checkpoint without a manifest (written by an older memfit): check what can be checked."""
    state = _state_problem(folder) or _rng_problem(folder)
    if state:
        return state
    for name in _NEEDED:
        if not (folder / name).is_file() or (folder / name).stat().st_size == 0:
            return f"lacks {name}"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not list(folder.glob("pytorch_model*.bin")):
        return "holds no model weights"

    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as fh:
                fh.keys()
        except Exception:  # noqa: BLE001 - any failure to read the header means a damaged file
            return f"has {path.name} truncated or damaged"
    return None


def _state_problem(folder: Path) -> str | None:
    try:
        read_state(folder)
    except UserError as err:
        return str(err).rstrip(".").split(": ", 1)[-1]
    return None


def read_state(folder: Path) -> dict[str, Any]:
    """The loop state of a checkpoint: a JSON object with whole, non-negative ``step`` and ``samples``."""
    path = folder / STATE_FILE
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except OSError:
        raise UserError(f"{folder}: lacks {STATE_FILE}.") from None
    except ValueError:
        raise UserError(f"{folder}: has {STATE_FILE} that is not valid JSON.") from None
    why = readback.state_problem(state)
    if why:
        raise UserError(f"{folder}: has {STATE_FILE} that {why}.")
    return state


def pick_intact(output: Path) -> tuple[Path, str | None]:
    """The newest intact checkpoint of ``output`` and, when newer ones were passed over, a sentence saying
    which and why; ``UserError`` (one sentence) when there is none."""
    skipped = []
    for _, folder in step_folders(output):
        why = problem(folder)
        if why is None:
            note = None
            if skipped:
                note = (f"resuming from {folder.name}, the newest intact checkpoint: "
                        + "; ".join(f"{name} {why}" for name, why in skipped) + ".")
            return folder, note
        skipped.append((folder.name, why))
    if not skipped:
        raise UserError(f"--resume found no checkpoint under {checkpoints_dir(output)}; train with checkpoints "
                        "on (the default, or --save-every N) first, or drop --resume.")
    raise UserError(f"--resume found no intact checkpoint under {checkpoints_dir(output)} ("
                    + "; ".join(f"{name} {why}" for name, why in skipped)
                    + "); start the run again without --resume.")


def load_error(folder: Path, err: BaseException) -> UserError:
    """One sentence for a checkpoint that verified but still would not load."""

    if isinstance(err, pickle.UnpicklingError) or "weights only load failed" in str(err).lower():
        return UserError(f"{folder} holds a pickle with Python objects other than tensors and plain data; memfit "
                         "does not run such files, so this checkpoint cannot be resumed (it was not written by "
                         "memfit's save, or was altered since).")
    first = " ".join(str(err).split())[:200] or type(err).__name__
    return UserError(f"{folder} could not be loaded into this run ({first}).")
