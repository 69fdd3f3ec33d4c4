"""Tables that fit the terminal: drop whole columns, least important first, instead of cutting cells.

rich shrinks a too-wide table by wrapping cells (a preset's row grows to five lines) or cutting them
with an ellipsis. ``fitted_table`` builds the table with every column unwrapped, measures it, and
drops the column with the highest ``priority`` number until it fits; priority-0 columns are never
dropped. The caller names the dropped columns in a caption, so nothing is lost silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Col:
    name: str
    justify: str = "left"
    priority: int = 0
    """0: always shown; otherwise columns with higher numbers are dropped first."""
    wrap_min: int | None = None
    """A prose column (a description) that may wrap: kept while at least this many columns are left for it."""


def _build(title: str, cols: list[Col], rows: list[list[str]], keep: list[int], styles, table_kw) -> Table:
    table = Table(title=title, title_justify="left", **table_kw)
    for i in keep:
        table.add_column(cols[i].name, justify=cols[i].justify, no_wrap=cols[i].wrap_min is None)
    for r, row in enumerate(rows):
        if row is None:
            table.add_section()
            continue
        table.add_row(*(row[i] for i in keep), style=styles[r] if styles else None)
    return table


def fitted_table(title: str, cols: list[Col], rows: list[list[str] | None], width: int,
                 styles: list[str | None] | None = None, **table_kw) -> tuple[Table, list[str]]:
    """The table with as many columns as fit ``width`` (a ``None`` row is a section line), and the
    names of the columns it had to drop."""
    keep = list(range(len(cols)))
    console = Console(width=10_000)  # measures the natural width only
    while True:
        fixed = [i for i in keep if cols[i].wrap_min is None]
        table = _build(title, cols, rows, fixed, styles, table_kw)
        table.title = None  # a long title wraps; it never decides the width
        natural = console.measure(table).maximum + sum(cols[i].wrap_min + 3 for i in keep if i not in fixed)
        droppable = [i for i in keep if cols[i].priority > 0]
        if natural <= width - 2 or not droppable:  # rich needs a little slack at the exact width
            break
        keep.remove(max(droppable, key=lambda i: (cols[i].priority, i)))
    table = _build(title, cols, rows, keep, styles, table_kw)
    return table, [c.name for i, c in enumerate(cols) if i not in keep]


def dropped_note(dropped: list[str]) -> str | None:
    """The caption line that names what a narrow terminal left out."""
    if not dropped:
        return None
    return f"Not shown at this width: {', '.join(dropped)} (widen the terminal, or use --json)."
