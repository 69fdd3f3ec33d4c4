"""The run's own manifest, ``.memfit-files.json``: which run this folder is, what data it trains, what memfit wrote.

Written at the start of a run (and updated after each checkpoint and the export) by the process that
holds the folder's lock (``folder``), through ``memfit.files.write_atomic``::

    {"version": 1, "run_id": "3f2a...", "data": {fingerprint}, "files": ["metrics.jsonl", "checkpoints/step-4", ...]}

- ``run_id`` (random, 128 bits) is also saved in every checkpoint's ``trainer_state.json``; ``--resume``
  refuses a checkpoint whose run id is not the folder's (a checkpoint of another run swapped in).
- ``data``: ``fingerprint(path)`` of the training data, also saved in every checkpoint; ``--resume``
  refuses data that changed since (``--allow-data-change`` to train on the new data).
- ``files``: what ``--overwrite`` may remove. Anything else in the folder (another tool's
  ``checkpoints/epoch=3.ckpt``, a ``memfit/README.md``) is never removed; a file memfit would replace
  but did not write (a foreign ``run.json``) is refused in one sentence.

A folder written by an older memfit has no ledger: its ``checkpoints/step-N`` folders that hold a
``trainer_state.json``, ``metrics.jsonl``, ``loss.png`` and a ``run.json`` that names memfit's version are
taken as memfit's (``legacy_files``).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.files import user_path, write_atomic
from memfit.training.runfolder.layout import STATE_FILE, checkpoints_dir, step_folders

LEDGER = ".memfit-files.json"
#: The names a run writes at the top of its folder whatever it trains (the export adds its own).
RUN_FILES = ("metrics.jsonl", "run.json", "loss.png", "samples.jsonl")
#: What the export (``checkpoint.export``: ``save_pretrained`` of the model, the adapter and the tokenizer) writes at
#: the top of the folder, as files ...
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
#: ... and as folders (a preset's random base beside its adapter; ``--merge``'s merged model).
EXPORT_FOLDERS = ("base", "merged")
_FP_KEYS = {"kind": str, "bytes": int, "sha256": str}


def new_run_id() -> str:
    return secrets.token_hex(16)


def fingerprint(data: str | None) -> dict[str, Any] | None:
    """What identifies the training data's content: a file's size and sha256 (read once, as tokenizing
    reads it), a folder's listing (names, sizes, mtimes: a ``save_to_disk`` folder is rewritten as a whole,
    and hashing gigabytes of arrow files per resume would cost more than the check is worth; its known
    error: a file rewritten in place with the same size and mtime is not seen). None for a Hub id."""
    if not data:
        return None
    path = user_path(data)
    if path.is_file():
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
        return {"kind": "file", "bytes": path.stat().st_size, "sha256": digest.hexdigest()}
    if path.is_dir():
        digest, total = hashlib.sha256(), 0
        for child in sorted(p for p in path.rglob("*") if p.is_file()):
            info = child.stat()
            total += info.st_size
            digest.update(f"{child.relative_to(path)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
        return {"kind": "folder", "bytes": total, "sha256": digest.hexdigest()}
    return None


def describe(fp: dict[str, Any] | None) -> str:
    if not fp:
        return "unknown"
    return f"{fp['bytes']:,} bytes, sha256 {fp['sha256'][:12]}"


def valid_fingerprint(fp: Any) -> bool:
    return isinstance(fp, dict) and all(isinstance(fp.get(k), t) and not isinstance(fp.get(k), bool)
                                        for k, t in _FP_KEYS.items())


# ------------------------------------------------------------------------------------------------ the file
def read(output: Path) -> dict[str, Any] | None:
    """The ledger of ``output`` (None when there is none); ``UserError`` naming the field when damaged."""
    path = Path(output) / LEDGER
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        raise UserError(f"{path} is not a regular file (memfit writes it as one); remove it, or choose another "
                        "--output.")
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path} cannot be read as JSON ({type(err).__name__}); remove it to treat the folder "
                        "as one written by an older memfit.") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not a JSON object; remove it to treat the folder as one written by an older "
                        "memfit.")
    files = doc.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) and _relative(f) for f in files):
        raise UserError(f"{path}: its field files is not a list of paths inside the folder; remove the file to "
                        "treat the folder as one written by an older memfit.")
    if not isinstance(doc.get("run_id"), str) or not doc["run_id"]:
        raise UserError(f"{path}: its field run_id is {doc.get('run_id')!r}, not a run id; remove the file to "
                        "treat the folder as one written by an older memfit.")
    if doc.get("data") is not None and not valid_fingerprint(doc["data"]):
        raise UserError(f"{path}: its field data is not a data fingerprint; remove the file to treat the folder "
                        "as one written by an older memfit.")
    return doc


def _relative(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def write(output: Path, doc: dict[str, Any]) -> None:
    write_atomic(Path(output) / LEDGER, json.dumps(doc, indent=1), root=Path(output), user_error=False)


def add(output: Path, doc: dict[str, Any] | None, *names: str) -> None:
    """Record ``names`` (relative to ``output``) as memfit's and rewrite the ledger (lock holder only)."""
    if doc is None:
        return
    known = set(doc["files"])
    new = [n for n in names if n not in known]
    if new:
        doc["files"] = [*doc["files"], *new]
        write(output, doc)


def legacy_files(output: Path) -> list[str]:
    """What an older memfit (no ledger) wrote here, recognised by its form (see the module's docstring)."""
    found = [f"checkpoints/{p.name}" for _, p in step_folders(output) if (p / STATE_FILE).is_file()]
    found += [f"checkpoints/{p.name}" for p in checkpoints_dir(output).glob(".tmp-step-*")]
    found += [name for name in ("metrics.jsonl", "loss.png", "samples.jsonl") if (output / name).is_file()]
    if _is_memfit_run_json(output / "run.json"):  # then the export beside it is an older memfit's too
        found.append("run.json")
        found += [name for name in (*EXPORT_FILES, *EXPORT_FOLDERS) if (output / name).exists()]
    return found


def _is_memfit_run_json(path: Path) -> bool:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("versions"), dict) and "memfit" in doc["versions"]
