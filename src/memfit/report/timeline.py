"""Memory timeline of one traced training step (``memfit estimate --exact --timeline FILE.png``).

Stacked areas of allocated bytes by category after every operator, the forward / backward / optimizer
phases shaded and labelled, the peak annotated. matplotlib is imported lazily (the CLI stays fast).
"""

# Inside functions: matplotlib.pyplot (0.46 s to import; python -X importtime, 2026-12-06, this shared 2-core machine), only for --timeline.
from __future__ import annotations

from pathlib import Path

from memfit.errors import UserError
from memfit.files import figure_bytes, write_atomic
from memfit.memory.breakdown import CATEGORIES
from memfit.units import GiB, MiB, fmt_bytes

_COLORS = {
    "weights": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",
    "logits": "#8172b3",
    "temporary": "#937860",
    "other": "#bbbbbb",
}
_PHASE_SHADES = {"forward": "#f2f2f2", "backward": "#e3ecf7", "optimizer": "#eaf5e6"}


def plot_timeline(timeline, path) -> None:
    """Write a stacked-area plot of ``timeline`` (a ``memfit.memory.trace.Timeline``) to ``path``.

    The y axis is in GiB (MiB for small models); ``other`` (CUDA context, reserve) is the bottom band
    when the trace was made for ``device="cuda"``.
    """
    if not timeline.samples:
        raise UserError("The traced step recorded no operations, so there is no timeline to plot.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals = timeline.totals()
    unit, scale = ("GiB", GiB) if max(totals) >= GiB else ("MiB", MiB)
    steps = list(range(len(timeline.samples)))
    cats = [c for c in CATEGORIES if c != "other"]
    layers = ([[timeline.other / scale] * len(steps)] if timeline.other else []) + [
        [s[c] / scale for s in timeline.samples] for c in cats
    ]
    labels = (["other"] if timeline.other else []) + cats
    fig, ax = plt.subplots(figsize=(10, 5))
    for phase, (start, end) in timeline.phase_bounds().items():
        ax.axvspan(start, end + 1, color=_PHASE_SHADES.get(phase, "#ffffff"), zorder=0)
        ax.text((start + end) / 2, 1.01, phase, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
    ax.stackplot(steps, layers, labels=labels, colors=[_COLORS[c] for c in labels], zorder=2)
    peak = timeline.peak_index()
    ax.annotate(f"peak {fmt_bytes(totals[peak])}\n({timeline.phases[peak]})", xy=(peak, totals[peak] / scale),
                xytext=(0, 18), textcoords="offset points", ha="center",
                arrowprops={"arrowstyle": "->"}, zorder=3)
    ax.set_xlim(0, len(steps))
    ax.set_ylim(0, max(totals) / scale * 1.18)
    ax.set_xlabel("operator index in the traced (second) training step")
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_title(f"Memory over one training step{': ' + timeline.title if timeline.title else ''}", pad=18)
    ax.legend(loc="upper left", fontsize="small", ncol=2)
    fig.tight_layout()
    path = Path(path)

    try:  # rendered in memory, then written whole (a full disk or a device node: one sentence)
        write_atomic(path, figure_bytes(fig, path, dpi=120), what="--timeline")
    finally:
        plt.close(fig)
