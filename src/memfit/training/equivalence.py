"""``memfit train --check-equivalence``: the user's model and data, trained a few steps as one big
batch (``E x 1``) and as accumulated micro-batches (``E/k x k``); prints the largest weight difference.

Both runs are fp32 with the same seed, the same samples per step (the step schedule) and loss
normalised by the step's target tokens, so the weights should agree to float rounding (~1e-7
relative for SGD; AdamW divides by sqrt(v) and can magnify rounding in near-zero gradients to ~1e-6).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from memfit.errors import UserError
from memfit.settings.config import TrainConfig
from memfit.training.loop import run_training


def _splits(config: TrainConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    run = config.run
    per_rank = config.batch // run.num_processes if config.batch else run.micro_batch * run.grad_accum
    if run.grad_accum > 1 and not config.batch:
        return (per_rank, 1), (run.micro_batch, run.grad_accum)
    small = 1 if per_rank <= 8 else next(m for m in (4, 2, 1) if per_rank % m == 0)
    return (per_rank, 1), (small, per_rank // small)


def check_equivalence(config: TrainConfig, steps: int = 3) -> dict[str, Any]:
    """Train ``steps`` optimizer steps both ways and compare; returns the differences found."""

    big, small = _splits(config)
    if big == small:  # an effective batch of 1 has one split only: the run would be compared with itself
        raise UserError(f"--check-equivalence compares one batch with the same samples in accumulated "
                        f"micro-batches, and an effective batch of {big[0]} cannot be split; give a --micro-batch "
                        "(or --batch) of 2 or more.")
    results = []
    for micro, accum in (big, small):
        with tempfile.TemporaryDirectory(prefix="memfit-equiv-") as tmp:
            run = config.run.replace(micro_batch=micro, grad_accum=accum, mixed_precision="no", dtype="fp32")
            cfg = TrainConfig.from_flat({**config.to_flat(), **run.to_flat(), "max_steps": steps, "epochs": None,
                                         "batch": None, "budget": None, "eval_every": 0, "samples": 0,
                                         "save_every": 0, "tracker": None, "resume": False, "overwrite": True,
                                         "output": tmp, "check_equivalence": False, "log_every": 1})
            results.append(run_training(cfg, show=False))
    a, b = (r.model.state_dict() for r in results)
    max_diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())
    max_weight = max(float(a[k].float().abs().max()) for k in a if a[k].is_floating_point())
    losses = [r.summary.final_train_loss for r in results]
    return {
        "steps": steps,
        "big": {"micro_batch": big[0], "grad_accum": big[1]},
        "accumulated": {"micro_batch": small[0], "grad_accum": small[1]},
        "max_abs_weight_diff": max_diff,
        "max_abs_weight": max_weight,
        "final_losses": losses,
        "loss_diff": abs(losses[0] - losses[1]),
        "equivalent": max_diff <= 1e-5 * max(1.0, max_weight),
        "optimizer": str(config.run.optimizer),
        "note": "fp32 both ways; " + ("identical up to float rounding" if torch.isfinite(torch.tensor(max_diff))
                                     else "non-finite weights"),
    }
