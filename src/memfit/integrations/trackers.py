"""Experiment trackers through Accelerate (``--tracker``): which package each needs, checked up front.

Accelerate owns the integrations (``accelerate.tracking``); memfit only checks that the package is
installed before the run starts, so a missing one is one sentence naming the extra to install, not a
traceback after the model is built. Local/offline use (``local_init_kwargs``): TensorBoard and Aim write
under ``--output`` (Accelerate's ``logging_dir``); wandb writes its run under ``--output/wandb``
(offline with ``WANDB_MODE=offline``); MLflow writes a SQLite store ``--output/mlflow.db`` unless
``MLFLOW_TRACKING_URI`` names another; trackio keeps its local database (``TRACKIO_DIR``, default
``~/.cache/huggingface/trackio``) unless a Space is set.
"""

# Inside a function: mlflow, an optional extra (the tracker's own package), asked for only by --tracker mlflow.
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from memfit.errors import UserError

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
            "aim": "aim"}
"""``--tracker`` name -> the Python package Accelerate's tracker imports (also memfit's extra's name)."""


def check_tracker(name: str | None) -> None:
    """Refuse a tracker whose package is not installed, naming the extra that installs it (an unknown name is
    refused with the config: ``TrainConfig.tracker``'s choices are ``TRACKERS``)."""
    if not name:
        return
    if importlib.util.find_spec(TRACKERS[name]) is None:
        raise UserError(f"--tracker {name} needs the {TRACKERS[name]} package; install it with "
                        f"pip install 'memfit[{name}]'.")


def local_init_kwargs(name: str | None, output) -> dict:
    """``init_kwargs`` for ``Accelerator.init_trackers`` that keep a tracker's records under ``output``
    where it would otherwise write to the current folder (wandb) or its own default store (MLflow)."""

    output = Path(output).resolve()
    if name == "wandb":
        return {"wandb": {"dir": str(output)}}
    if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow

        output.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(f"sqlite:///{output / 'mlflow.db'}")  # MLflow 3 refuses a file store
    return {}
