"""Render a ``PlanResult`` as a rich table (rendering only; the numbers come from ``search``)."""

from __future__ import annotations

from rich import box
from rich.table import Table

from memfit.planning.search import PlanResult, method, precision
from memfit.report.fit import Col, fitted_table
from memfit.units import binary_scale, fmt_gib


def plan_table(result: PlanResult, top: int = 10, width: int = 200) -> tuple[Table, list[str]]:
    """The first ``top`` ranked plans: the choice marked ``*``, plans that do not fit marked ``x``.

    The offload and sharding columns appear only when a shown plan uses them. On a terminal narrower
    than the table, whole columns go, least important first (headroom = budget - peak, then the
    optimizer variant); the returned list names them.
    """
    shown = result.plans[:top]
    multi = any(p.config.num_processes > 1 for p in shown)
    offload = any(p.config.offload.value != "none" for p in shown)
    gpu = result.gpu.name if result.gpu else "?"
    cols = [Col("", "center"), Col("method"), Col("precision"), Col("mb x acc", "right"), Col("ckpt", "center"),
            Col("optimizer", priority=2)]
    cols += [Col("offload", priority=1)] * offload + [Col("sharding", priority=1)] * multi
    unit, size = binary_scale(max((p.peak_bytes for p in shown), default=0))
    cols += [Col(f"peak {unit}", "right"), Col("headroom", "right", 3), Col("tokens/s", "right")]
    rows, styles = [], []
    for i, p in enumerate(shown):
        run = p.config
        headroom = result.budget_bytes - p.peak_bytes
        row = ["*" if i == result.chosen else "" if p.fits else "x", method(run), precision(run),
               f"{run.micro_batch} x {run.grad_accum}", "yes" if run.grad_checkpointing else "no",
               str(run.optimizer)]
        if offload:
            row.append(str(run.offload))
        if multi:
            row.append(str(run.sharding))
        row += [f"{p.peak_bytes / size:.2f}", f"{headroom / size:+.2f}", f"{p.tokens_per_s:,.0f}"]
        rows.append(row)
        styles.append("bold green" if i == result.chosen else None if p.fits else "dim")
    title = (f"{result.model}: budget {fmt_gib(result.budget_bytes)} (fits = peak + {result.safety_margin:.0%} "
             f"margin), tokens/s on {gpu}")
    return fitted_table(title, cols, rows, width, styles=styles, box=box.SIMPLE_HEAD, show_edge=False,
                        pad_edge=False)
