"""A model folder's weights, checked before the run folder is created: present, and not truncated.

A folder with only ``config.json`` (a common download) trains from random weights only when the user
says so (``--init random``); otherwise one sentence says the folder has no weights. Safetensors
headers are read (no tensor data) so a truncated or emptied file is refused before anything is built;
``loading`` turns what ``from_pretrained`` raises on a damaged file into one sentence too.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open

from memfit.errors import UserError
from memfit.training.oom import is_oom

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model*.bin.index.json")


def weight_files(folder: Path) -> list[Path]:
    return sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})


def check_weights(folder: Path) -> None:
    """Refuse a model folder without weights, or with a safetensors file whose header does not cover it."""
    files = weight_files(folder)
    if not files:
        raise UserError(f"{folder} has a config.json but no weights (model.safetensors or pytorch_model.bin); "
                        "pass --init random to train this architecture from random weights, or point --model "
                        "at a folder with weights.")

    for path in files:
        if path.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(path), framework="pt") as fh:
                fh.keys()
        except Exception as err:  # noqa: BLE001 - any header failure means a damaged file
            raise UserError(f"{path} is truncated or damaged ({_first(err)}); download or save it again.") from None


@contextmanager
def loading(folder: Path):
    """One sentence for weights ``from_pretrained`` cannot load (damaged, missing shards, wrong shapes)."""

    try:
        yield
    except pickle.UnpicklingError:  # torch's weights-only loader refused it; its advice (turn that off) is not ours
        raise UserError(f"The weights in {folder} are a pickle holding more than tensors (code that would run "
                        "when loaded); memfit does not run such files: use a safetensors copy of the model from "
                        "a source you trust.") from None
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        if _is_oom(err):
            raise
        raise UserError(f"The weights in {folder} cannot be loaded ({_first(err)}).") from None
    except Exception as err:  # safetensors' SafetensorError derives from Exception only
        if type(err).__name__ != "SafetensorError":
            raise
        raise UserError(f"The weights in {folder} cannot be loaded ({_first(err)}).") from None


def _is_oom(err: BaseException) -> bool:
    return is_oom(err)


def _first(err: BaseException) -> str:
    return " ".join(str(err).split())[:160] or type(err).__name__
