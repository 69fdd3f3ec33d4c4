"""Render a ``PlanResult`` as a rich table (rendering only; the numbers come from ``search``)."""

from __future__ import annotations

from rich.table import Table

from memfit.planning.search import PlanResult, method, precision
from memfit.units import fmt_gib, to_gib


def plan_table(result: PlanResult, top: int = 10) -> Table:
    """The first ``top`` ranked plans: the choice marked ``*``, plans that do not fit marked ``x``.

    The offload and sharding columns appear only when a shown plan uses them.
    """
    shown = result.plans[:top]
    multi = any(p.config.num_processes > 1 for p in shown)
    offload = any(p.config.offload.value != "none" for p in shown)
    gpu = result.gpu.name if result.gpu else "?"
    table = Table(title=f"{result.model}: budget {fmt_gib(result.budget_bytes)} "
                        f"(fits = peak + {result.safety_margin:.0%} margin), tokens/s on {gpu}",
                  title_justify="left")
    columns = [("", "center"), ("method", "left"), ("precision", "left"), ("micro x accum", "right"),
               ("ckpt", "center"), ("optimizer", "left")]
    columns += [("offload", "left")] * offload + [("sharding", "left")] * multi
    columns += [("peak", "right"), ("headroom", "right"), ("tokens/s", "right")]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
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
        row += [f"{to_gib(p.peak_bytes):.2f} GiB", f"{to_gib(headroom):+.2f} GiB", f"{p.tokens_per_s:,.0f}"]
        table.add_row(*row, style="bold green" if i == result.chosen else None if p.fits else "dim")
    return table
