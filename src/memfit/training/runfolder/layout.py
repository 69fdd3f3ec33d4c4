"""Where checkpoints live in a run folder: ``checkpoints/step-N/``, each with its ``trainer_state.json``.

Read by ``checkpoint`` (save, rotate, load) and ``manifest`` (pick the newest intact
one), which sits below checkpoint: the layout is kept here so that neither imports the other for it.
"""

from __future__ import annotations

import re
from pathlib import Path

STATE_FILE = "trainer_state.json"
STEP_RE = re.compile(r"^step-(\d+)$")


def checkpoints_dir(output: Path) -> Path:
    return output / "checkpoints"


def step_folders(output: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoints/step-N`` entry, newest first (files included: they are
    reported as not a checkpoint, not skipped silently)."""
    folder = checkpoints_dir(output)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in folder.iterdir() if (m := STEP_RE.match(child.name))]
    return sorted(found, reverse=True)
