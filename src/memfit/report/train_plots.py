"""``loss.png``: training loss per logged step, held-out loss, and the unigram baseline (matplotlib, lazy)."""

# Inside functions: matplotlib.pyplot (0.46 s to import; python -X importtime, 2026-12-06, this shared 2-core machine), at the end of a run only.
from __future__ import annotations

import math
from pathlib import Path

from memfit.files import figure_bytes, write_atomic


def plot_loss(records: list[dict], out_path: Path, *, unigram: float | None = None) -> Path | None:
    """Plot the losses logged in ``metrics.jsonl`` (its records, read and checked by the caller:
    ``training.runfolder.readback.read_metrics``); returns the written path (None when nothing was logged)."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None
             and not math.isnan(r["eval_loss"])]
    if train:
        ax.plot(*zip(*train, strict=False), label="train loss (mean per target token of the step)")
    if evals:
        ax.plot(*zip(*evals, strict=False), "o-", label="held-out loss")
    if unigram is not None and not math.isnan(unigram):
        ax.axhline(unigram, color="grey", linestyle="--", label=f"unigram baseline ({unigram:.2f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("memfit train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()

    try:  # in memory, then replaced whole: a link planted as loss.png is replaced, never written through
        write_atomic(Path(out_path), figure_bytes(fig, out_path), root=Path(out_path).parent, user_error=False)
    finally:
        plt.close(fig)
    return Path(out_path)
