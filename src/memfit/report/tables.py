"""Rich tables for estimates (render only: every number comes from a ``MemoryBreakdown``)."""

from __future__ import annotations

from rich import box
from rich.table import Table

from memfit.memory.breakdown import CATEGORIES, MemoryBreakdown
from memfit.report.fit import Col, fitted_table
from memfit.units import GiB, binary_scale, decimal_scale, fmt_scaled

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
    """One breakdown: bytes, then binary and decimal units scaled to the peak (GiB/GB, or MiB/MB for a
    peak under 1 GiB, so small models do not show 0.00 everywhere), share, the peak and its phase."""
    binary, decimal = binary_scale(b.peak_bytes), decimal_scale(b.peak_bytes)
    exponent = {"GiB": "2^30", "MiB": "2^20", "GB": "10^9", "MB": "10^6"}
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column(f"{binary[0]} ({exponent[binary[0]]} B)", justify="right")
    table.add_column(f"{decimal[0]} ({exponent[decimal[0]]} B)", justify="right")
    table.add_column("share", justify="right")
    peak = b.peak_bytes or 1
    for cat in CATEGORIES:
        n = getattr(b, cat)
        table.add_row(cat, f"{n:,}", fmt_scaled(n, binary, unit=False), fmt_scaled(n, decimal, unit=False),
                      f"{n / peak:.0%}")
    table.add_section()
    table.add_row(f"[bold]peak ({b.phase})[/]", f"[bold]{b.peak_bytes:,}[/]", f"[bold]{fmt_scaled(b.peak_bytes, binary)}[/]",
                  f"[bold]{fmt_scaled(b.peak_bytes, decimal)}[/]", "100%")
    if b.reserved:  # the caching allocator's replay (exact mode, CUDA): beside the tensor peak it starts from
        tensors = b.peak_bytes - b.other
        table.add_section()
        table.add_row("tensor peak", f"{tensors:,}", fmt_scaled(tensors, binary), fmt_scaled(tensors, decimal), "")
        table.add_row("reserved (allocator)", f"{b.reserved:,}", fmt_scaled(b.reserved, binary),
                      fmt_scaled(b.reserved, decimal), f"{b.fragmentation_share:.0%} unused")
    return table


def legend(b: MemoryBreakdown) -> str:
    """What each category holds (printed under the breakdown table)."""
    return f"{b.params:,} params, {b.trainable_params:,} trainable; " + "; ".join(
        f"{k}: {v}" for k, v in MEANING.items())


def compare_table(rows: list[tuple[str, MemoryBreakdown]], title: str, width: int = 200) -> tuple[Table, list[str]]:
    """Regimes side by side: model states, activations+logits, peak, and which GPU sizes it fits.

    The category columns are the composition at the step's peak. A full fine-tune peaks in the
    optimizer step, when activations are already freed, so checkpointing does not move its peak; the
    "backward" column (the largest total during backward, ``phase_peaks`` plus ``other``) shows what
    checkpointing saves. Sizes are in GiB, or MiB when every peak is under 1 GiB; ``fits`` is the
    smallest of 16/24/40/80 GiB that holds the peak. On a terminal narrower than the table the least
    important columns go first (the per-size yes/no columns, which ``fits`` sums up, then temporary,
    logits, phase); the returned list names them.
    """
    name, size = binary_scale(max((b.peak_bytes for _, b in rows), default=0))
    fit_sizes = list(FIT_SIZES_GIB)
    cols = [Col("regime"), Col("weights", "right"), Col("grad+opt", "right"), Col("act", "right"),
            Col("logits", "right", 3), Col("temp", "right", 4), Col("bwd", "right"), Col("peak", "right"),
            Col("phase", priority=2), Col("fits", "right")]
    cols += [Col(f"{s} GiB", "center", 5) for s in fit_sizes]
    def g(n: int) -> str:
        return f"{n / size:.2f}" if name == "GiB" else f"{n / size:.1f}"

    body = []
    for regime, b in rows:
        fits = ["[green]yes[/]" if b.peak_bytes <= s * GiB else "[red]no[/]" for s in fit_sizes]
        smallest = next((f"{s}" for s in fit_sizes if b.peak_bytes <= s * GiB), "none")
        backward = "-" if "backward" not in b.phase_peaks else g(b.phase_peaks["backward"] + b.other)
        body.append([regime, g(b.weights), g(b.gradients + b.optimizer), g(b.activations), g(b.logits),
                     g(b.temporary), backward, f"[bold]{g(b.peak_bytes)}[/]", b.phase, smallest, *fits])
    return fitted_table(f"{title}, {name}", cols, body, width, box=box.SIMPLE_HEAD, show_edge=False,
                        pad_edge=False)


def phases_table(phases) -> Table:
    """Every phase of the run on one rank (``memory.phases.DevicePhases``): tensor peak and predicted reserved
    memory, then what the device holds outside torch's allocator and the total the fit decision reads."""
    cuda = bool(phases.context)
    table = Table(title="phases of the run, per rank" + (" (caching allocator modelled)" if cuda else ""),
                  title_justify="left", box=box.SIMPLE)
    table.add_column("phase")
    table.add_column("tensor peak", justify="right")
    table.add_column("reserved" if cuda else "peak", justify="right")
    worst = phases.worst
    for p in phases.phases:
        mark = " (worst)" if p is worst else ""
        table.add_row(p.name + mark, fmt_scaled(p.tensors, binary_scale(p.tensors)),
                      fmt_scaled(p.reserved, binary_scale(p.reserved)))
    if cuda:
        table.add_section()
        table.add_row("CUDA context", "", fmt_scaled(phases.context, binary_scale(phases.context)))
        if phases.nccl:
            table.add_row("NCCL buffers", "", fmt_scaled(phases.nccl, binary_scale(phases.nccl)))
        needed = phases.needed()
        table.add_row("[bold]device total[/] (nvidia-smi)", "", f"[bold]{fmt_scaled(needed, binary_scale(needed))}[/]")
    return table
