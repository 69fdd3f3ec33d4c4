"""Free space before a checkpoint: a save that cannot fit is refused before any of it is written.

The size a checkpoint needs is known once one was saved: the sum of its manifest's ``bytes`` (every
file of the folder). Before the first save it is estimated from the tensors that will be written:
the model's state dict and the optimizer's state on this process (``_state_bytes``); its known error:
Accelerate's RNG and scheduler files (a few KiB) and pickle framing are left out, and a sharded run
writes each rank's shard, which the estimate of rank 0 approximates (2 % margin and 1 MiB cover the
small files). A write that still fails (another process filled the disk meanwhile) ends in
``training.guard``'s sentence, its partial files removed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from memfit.errors import UserError
from memfit.training.runfolder.layout import checkpoints_dir, step_folders
from memfit.training.runfolder.manifest import MANIFEST
from memfit.units import MiB, fmt_bytes

if TYPE_CHECKING:  # training.parts imports the guard, which imports this package: a type only
    from memfit.training.parts import RunOutput

MARGIN = 1.02
SLACK = 1 * MiB


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def known_size(output: Path) -> tuple[int, str] | None:
    """``(bytes, checkpoint name)`` of the newest checkpoint with a readable manifest."""
    for _, folder in step_folders(output):
        try:
            files = json.loads((folder / MANIFEST).read_bytes())["files"]
            total = sum(int(entry["bytes"]) for entry in files.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        return total, folder.name
    return None


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors a save writes on this process: model state dict plus optimizer state."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def needed(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           output: Path) -> tuple[int, str]:
    """The bytes the next checkpoint needs and where that figure comes from."""
    known = known_size(output)
    if known is not None:
        return known[0], f"the size of {known[1]}"
    try:
        return _state_bytes(accelerator.unwrap_model(model), optimizer), "the model and optimizer state"
    except Exception:  # noqa: BLE001 - an estimate that cannot be made must not stop the run
        return 0, ""


def check_before_save(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      folder: RunOutput, step: int) -> None:
    """Stop with one sentence when the file system under the checkpoints has no room for step ``step``'s."""
    need, source = needed(accelerator, model, optimizer, folder.path)
    if need <= 0:
        return
    where = checkpoints_dir(folder.path) if checkpoints_dir(folder.path).is_dir() else folder.path
    free = free_bytes(where)
    short = free < need * MARGIN + SLACK
    if accelerator.num_processes > 1:  # every rank stops at the same save, or none does
        flag = torch.tensor(float(short), device=accelerator.device)
        short = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
    if short:
        raise UserError(f"Only {fmt_bytes(free)} is free under {where}, and the checkpoint of step {step} "
                        f"needs about {fmt_bytes(need * MARGIN + SLACK)} ({source}), so the run stopped before "
                        f"writing it (free some space, or --save-every 0); {folder.guard.saved_sentence()}")
