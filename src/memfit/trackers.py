"""Experiment trackers through Accelerate (``--tracker``): which package each needs, checked up front.

Accelerate owns the integrations (``accelerate.tracking``); memfit only checks that the package is
installed before the run starts, so a missing one is one sentence naming the extra to install, not a
traceback after the model is built. Local/offline use: TensorBoard and Aim write under ``--output``;
MLflow writes a local ``mlruns`` store under ``--output`` (Accelerate passes ``logging_dir`` as its
tracking URI); wandb and trackio run offline with ``WANDB_MODE=offline`` / without a Space set.
"""

from __future__ import annotations

import importlib.util

from memfit.errors import UserError

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
            "aim": "aim"}
"""``--tracker`` name -> the Python package Accelerate's tracker imports (also memfit's extra's name)."""


def check_tracker(name: str | None) -> None:
    """Refuse a tracker whose package is not installed, naming the extra that installs it."""
    if not name:
        return
    if name not in TRACKERS:
        raise UserError(f"Unknown --tracker {name!r}; choose one of: {', '.join(TRACKERS)}.")
    if importlib.util.find_spec(TRACKERS[name]) is None:
        raise UserError(f"--tracker {name} needs the {TRACKERS[name]} package; install it with "
                        f"pip install 'memfit[{name}]'.")
