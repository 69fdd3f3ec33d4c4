"""Schemas for the files memfit writes and reads back: a damaged one is one sentence naming file and field.

``trainer_state.json`` (``check_state``), a checkpoint's manifest entries (``manifest_entry_problem``),
``metrics.jsonl`` (``read_metrics``), the RNG state files Accelerate writes (``rng_problem``). The run's
ledger and lock file are checked where they are read (``ledger.read``, ``folder.read_holder``).
Each rule is a type and a range; the checks say what is wrong in a few words, and the callers say what
happens next (``manifest.pick_intact`` passes over a checkpoint that fails, to the newest intact one).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

from accelerate.utils import load

from memfit.errors import UserError
from memfit.training.runfolder.ledger import valid_fingerprint

_COUNT = "a whole number >= 0"
_SHA = re.compile(r"^[0-9a-f]{64}$")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _loss(value: Any) -> bool:  # NaN: not measured yet (json writes it as NaN and reads it back)
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


#: trainer_state.json: field -> (check, what it must be). Missing fields take the loop's defaults.
STATE_FIELDS = {
    "step": (_count, _COUNT), "samples": (_count, _COUNT), "skipped_steps": (_count, _COUNT),
    "tokens": (_count, _COUNT), "train_s": (_seconds, "a number of seconds >= 0"),
    "wall_s": (_seconds, "a number of seconds >= 0"), "last_loss": (_loss, "a number"),
    "last_eval": (_loss, "a number"), "best_eval": (_loss, "a number"),
    "total_steps": (lambda v: _count(v) and v >= 1, "a whole number >= 1"),
    "resumes": (lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of objects"),
    "fallbacks": (lambda v: isinstance(v, list) and all(_fallback(r) for r in v), "a list of fallback records"),
    "settings": (lambda v: isinstance(v, dict), "an object"), "run": (lambda v: isinstance(v, dict), "an object"),
    "fingerprint": (lambda v: isinstance(v, dict), "an object"),
    "run_id": (lambda v: isinstance(v, str) and 0 < len(v) <= 64, "a run id"),
}


def _fallback(record: Any) -> bool:
    return (isinstance(record, dict) and _count(record.get("step")) and isinstance(record.get("error"), str)
            and isinstance(record.get("from"), dict) and isinstance(record.get("to"), dict)
            and isinstance(record.get("phase", "forward"), str))


def state_problem(state: Any) -> str | None:
    """What is wrong with a loaded ``trainer_state.json`` (None when it fits the schema)."""
    if not isinstance(state, dict):
        return "is not a JSON object"
    for key, (check, want) in STATE_FIELDS.items():
        if key in state and not check(state[key]):
            return f"has {key} = {_show(state[key])}, not {want}"
    fp = state.get("data_fingerprint")
    if fp is not None:
        if not valid_fingerprint(fp):
            return f"has data_fingerprint = {_show(fp)}, not a data fingerprint"
    return None


def manifest_entry_problem(name: Any, entry: Any) -> str | None:
    """What is wrong with one ``manifest.json`` entry (a relative path to ``{"bytes", "sha256"}``)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return f"lists {_show(name)}, not a file inside the checkpoint"
    if not isinstance(entry, dict):
        return f"has the entry for {name} = {_show(entry)}, not an object with bytes and sha256"
    if not _count(entry.get("bytes")):
        return f"has the entry for {name} without a byte count (bytes = {_show(entry.get('bytes'))})"
    if not isinstance(entry.get("sha256"), str) or not _SHA.match(entry["sha256"]):
        return f"has the entry for {name} without a sha256"
    return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``; a last line cut by a kill is dropped; any other line that is not
    UTF-8 JSON, not an object, or whose step/loss has the wrong type is one sentence (file, line, field)."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            if number == len(lines):
                break  # the last line, cut by a kill
            raise UserError(f"{path} line {number} is not UTF-8 text (byte {err.start}); memfit writes this file "
                            "itself, so it was altered: remove that line.") from None
        except ValueError:
            if number == len(lines):
                break
            raise UserError(f"{path} line {number} is not valid JSON; memfit writes this file itself, so it was "
                            "altered: remove that line.") from None
        why = _record_problem(record)
        if why:
            raise UserError(f"{path} line {number} {why}; memfit writes this file itself, so it was altered: "
                            "remove that line.")
        records.append(record)
    return records


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "is not a JSON object"
    if "step" in record and not _count(record["step"]):
        return f"has step = {_show(record['step'])}, not {_COUNT}"
    if "step" not in record and not record.get("event"):
        return "has no step"
    for key in ("loss", "eval_loss"):
        if key in record and not _loss(record[key]):
            return f"has {key} = {_show(record[key])}, not a number"
    return None


def rng_problem(path: Path) -> str | None:
    """Why Accelerate's ``random_states_<rank>.pkl`` cannot be restored (None when it can): Accelerate
    itself skips such a file with an info-level log line, which would resume with other random numbers
    (dropout, sampling) than the run had. Loaded as Accelerate loads it (``weights_only``)."""
    if not path.is_file():
        return f"lacks {path.name}"

    try:
        with warnings.catch_warnings():  # torch's note on a foreign pickle precedes the refusal anyway
            warnings.simplefilter("ignore")
            states = load(path)
    except Exception:  # noqa: BLE001 - truncated, hostile or foreign: any failure to unpickle it
        return f"has {path.name} that cannot be read back (truncated, or not written by this save)"
    keys = ("random_state", "numpy_random_seed", "torch_manual_seed")
    if not isinstance(states, dict) or any(k not in states for k in keys):
        return f"has {path.name} without the random states it should hold"
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
