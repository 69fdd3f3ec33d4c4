"""Matplotlib figures for estimates (lazy import, Agg backend: works without a display)."""

# Inside functions: matplotlib.pyplot (0.46 s to import; python -X importtime, 2026-12-06, this shared 2-core machine), only for --plot.
from __future__ import annotations

from pathlib import Path

from memfit.errors import UserError
from memfit.files import figure_bytes, write_atomic
from memfit.memory.breakdown import CATEGORIES, MemoryBreakdown
from memfit.units import GiB

COLORS = {
    "weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
    "logits": "#8172b3", "temporary": "#937860", "other": "#8c8c8c",
}


def plot_breakdowns(rows: list[tuple[str, MemoryBreakdown]], path: str | Path, title: str = "",
                     budgets_gib: tuple[int, ...] = (16, 24, 40, 80)) -> Path:
    """A stacked bar per configuration (GiB by category), with horizontal lines at common GPU sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf", ".jpg"):
        raise UserError(f"--plot needs a .png, .svg, .pdf or .jpg file name, got {str(path)!r}.")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 5))
    labels = [name for name, _ in rows]
    bottom = [0.0] * len(rows)
    for cat in CATEGORIES:
        values = [getattr(b, cat) / GiB for _, b in rows]
        ax.bar(labels, values, bottom=bottom, label=cat, color=COLORS[cat])
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    top = max(bottom, default=1.0)
    for size in budgets_gib:
        if size <= top * 1.3:
            ax.axhline(size, color="black", lw=0.8, ls="--")
            ax.text(len(rows) - 0.5, size, f" {size} GiB", va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("GiB (2^30 bytes) at the step's peak")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()

    try:  # rendered in memory, then written whole (a full disk or a device node: one sentence)
        write_atomic(path, figure_bytes(fig, path, dpi=120), what="--plot")
    finally:
        plt.close(fig)
    return path
