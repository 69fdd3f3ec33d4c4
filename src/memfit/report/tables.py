"""Rich tables for estimates (render only: every number comes from a ``MemoryBreakdown``)."""

from __future__ import annotations

from rich.table import Table

from memfit.memory.breakdown import CATEGORIES, MemoryBreakdown
from memfit.units import GiB, fmt_gb, fmt_gib

#: What each category holds, shown next to its bytes.
MEANING = {
    "weights": "parameters and buffers, as stored",
    "gradients": ".grad of trainable parameters",
    "optimizer": "optimizer state (moments)",
    "activations": "saved for backward",
    "logits": "LM head output, fp32 loss upcast, gradient",
    "temporary": "autocast weight copies, step buffers",
    "other": "CUDA context, workspace, allocator",
}

#: Device sizes --compare checks against (GPU memory is sold in GiB).
FIT_SIZES_GIB = (16, 24, 40, 80)


def breakdown_table(b: MemoryBreakdown, title: str) -> Table:
    """One breakdown: bytes, GiB and GB per category, the peak and its phase."""
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("GiB (2^30 B)", justify="right")
    table.add_column("GB (10^9 B)", justify="right")
    table.add_column("share", justify="right")
    peak = b.peak_bytes or 1
    for cat in CATEGORIES:
        n = getattr(b, cat)
        table.add_row(cat, f"{n:,}", fmt_gib(n).removesuffix(" GiB"), fmt_gb(n).removesuffix(" GB"),
                      f"{n / peak:.0%}")
    table.add_section()
    table.add_row(f"[bold]peak ({b.phase})[/]", f"[bold]{b.peak_bytes:,}[/]", f"[bold]{fmt_gib(b.peak_bytes)}[/]",
                  f"[bold]{fmt_gb(b.peak_bytes)}[/]", "100%")
    table.caption = f"{b.params:,} params, {b.trainable_params:,} trainable; " + "; ".join(
        f"{k}: {v}" for k, v in MEANING.items())
    table.caption_justify = "left"
    return table


def compare_table(rows: list[tuple[str, MemoryBreakdown]], title: str) -> Table:
    """Regimes side by side: model states, activations+logits, peak, and which GPU sizes it fits.

    The category columns are the composition at the step's peak. A full fine-tune peaks in the
    optimizer step, when activations are already freed, so checkpointing does not move its peak; the
    "backward" column (the largest total during backward, ``phase_peaks`` plus ``other``) shows what
    checkpointing saves.
    """
    table = Table(title=title, title_justify="left")
    table.add_column("regime", no_wrap=True)
    table.add_column("weights", justify="right")
    table.add_column("grads+optim", justify="right")
    table.add_column("activations", justify="right")
    table.add_column("logits", justify="right")
    table.add_column("temporary", justify="right")
    table.add_column("backward GiB", justify="right")
    table.add_column("peak GiB", justify="right")
    table.add_column("phase")
    for size in FIT_SIZES_GIB:
        table.add_column(f"{size} GiB", justify="center")
    for name, b in rows:
        fits = ["[green]yes[/]" if b.peak_bytes <= size * GiB else "[red]no[/]" for size in FIT_SIZES_GIB]
        table.add_row(name, _g(b.weights), _g(b.gradients + b.optimizer), _g(b.activations), _g(b.logits),
                      _g(b.temporary), _backward(b), f"[bold]{b.peak_bytes / GiB:.2f}[/]", b.phase, *fits)
    return table


def _backward(b: MemoryBreakdown) -> str:
    """Largest total during backward (phase peaks count tensors only, so ``other`` is added back)."""
    if "backward" not in b.phase_peaks:
        return "-"
    return _g(b.phase_peaks["backward"] + b.other)


def _g(n: int) -> str:
    return f"{n / GiB:.2f}"
