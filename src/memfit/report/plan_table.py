"""Render a ``PlanResult`` as a rich table (rendering only; the numbers come from ``planning.search``).

It reads the result's fields (``plans``, ``chosen``, ``budget_bytes``, ...) and imports nothing of planning/,
which sits above report/ in the layers.
"""

from __future__ import annotations

from rich import box
from rich.table import Table

from memfit.report.fit import Col, fitted_table
from memfit.report.runs import method, precision
from memfit.units import binary_scale, fmt_gib


def plan_table(result, top: int = 10, width: int = 200) -> tuple[Table, list[str]]:
    """The first ``top`` ranked plans: the choice marked ``*``, plans that do not fit marked ``x``.

    The offload and sharding columns appear only when a shown plan uses them. On a terminal narrower
    than the table, whole columns go, least important first (headroom = budget - need, then the
    optimizer variant); the returned list names them. "need" is what the fit rule reads (``planning.fit``:
    the worst phase's predicted reserved memory + CUDA context + NCCL; the step's peak where unpriced).
    """
    shown = result.plans[:top]
    multi = any(p.config.num_processes > 1 for p in shown)
    offload = any(p.config.offload.value != "none" for p in shown)
    gpu = result.gpu.name if result.gpu else "?"
    # "adamw-fused", "adamw-foreach", "adamw-8bit": the shared family goes in the header, so the variant
    # that tells two otherwise equal plans apart fits an 80-column terminal.
    family = "adamw-" if all(str(p.config.optimizer).startswith("adamw-") for p in shown) else ""
    cols = [Col("", "center"), Col("method", key=True), Col("precision", key=True),
            Col("mb x acc", "right", key=True), Col("ckpt", "center", key=True),
            Col(family or "optimizer", priority=2, key=True)]
    cols += [Col("offload", priority=1, key=True)] * offload + [Col("sharding", priority=1, key=True)] * multi
    unit, size = binary_scale(max((p.needed_bytes for p in shown), default=0))
    cols += [Col(f"need {unit}", "right"), Col("headroom", "right", 3), Col("tokens/s", "right")]
    rows, styles = [], []
    for i, p in enumerate(shown):
        run = p.config
        headroom = result.budget_bytes - p.needed_bytes
        row = ["*" if i == result.chosen else "" if p.fits else "x", method(run), precision(run),
               f"{run.micro_batch} x {run.grad_accum}", "yes" if run.grad_checkpointing else "no",
               str(run.optimizer).removeprefix(family)]
        if offload:
            row.append(str(run.offload))
        if multi:
            row.append(str(run.sharding))
        approx = "~" if p.proxy else ""  # priced by a proxy recipe (planning.search._evaluate_deferred's note)
        row += [f"{approx}{p.needed_bytes / size:.2f}", f"{headroom / size:+.2f}", f"{p.tokens_per_s:,.0f}"]
        rows.append(row)
        styles.append("bold green" if i == result.chosen else None if p.fits else "dim")
    title = (f"{result.model}: budget {fmt_gib(result.budget_bytes)} (fits = need + {result.safety_margin:.0%} "
             f"margin; need = the worst phase's reserved memory + context), tokens/s on {gpu}")
    return fitted_table(title, cols, rows, width, styles=styles, box=box.SIMPLE_HEAD, show_edge=False,
                        pad_edge=False, collapse_padding=True)


def ranking_note(result, top: int = 10) -> str | None:
    """The sentence that explains a shown plan ranked below a slower one: the planner's ``PREFERENCE``
    weights, read from the shown plans (``Plan.weight``).

    The table sorts by weighted tokens/s, so an 8-bit AdamW row sits below exact-AdamW rows whose
    tokens/s are up to 1% lower; without this line the order looks wrong.
    """
    weights = {p.config.optimizer: p.weight for p in result.plans[:top] if p.fits and p.weight != 1.0}
    if not weights:
        return None
    parts = ", ".join(f"{opt} as if {1 - weights[opt]:.0%} slower" for opt in sorted(weights, key=str))
    return f"Ranked by tokens/s with {parts} (exact AdamW wins near-ties)."


def emit_header(result) -> str:
    """The comment line on top of a plan written as another tool's config (``plan --emit``, ``memfit serve``):
    what memfit predicted, and how to check it."""
    best = result.best
    return (f"# memfit plan: predicted peak {fmt_gib(best.peak_bytes)} of a {fmt_gib(result.budget_bytes)} "
            f"budget, ~{best.tokens_per_s:,.0f} tokens/s; check it with: memfit estimate --from THIS_FILE\n")
