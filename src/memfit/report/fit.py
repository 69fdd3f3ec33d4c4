"""Tables that fit the terminal: drop whole columns, least important first, instead of cutting cells.

rich shrinks a too-wide table by wrapping cells (a preset's row grows to five lines) or cutting them
with an ellipsis. ``fitted_table`` builds the table with every column unwrapped, measures it, and
drops columns until it fits: first those with the highest ``priority`` number, then a ``key`` column
whose value is the same in every row (named with that value). Priority-0 columns are never dropped, and
neither is a key column whose removal would make two rows' keys look the same: two plans that differ
only by their optimizer must not show as twins with the deciding column gone. The caller names the
dropped columns in a caption, so nothing is lost silently.
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
    key: bool = False
    """Part of what a row *is* (a setting), not a number measured of it: rows must stay apart on these."""


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
    dropped: dict[int, str] = {}
    console = Console(width=10_000)  # measures the natural width only
    while True:
        fixed = [i for i in keep if cols[i].wrap_min is None]
        table = _build(title, cols, rows, fixed, styles, table_kw)
        table.title = None  # a long title wraps; it never decides the width
        natural = _rendered_width(console, table) + sum(cols[i].wrap_min + 3 for i in keep if i not in fixed)
        if natural <= width - 2:  # rich needs a little slack at the exact width
            break
        victim = _next_to_drop(cols, rows, keep)
        if victim is None:
            break
        keep.remove(victim)
        values = {row[victim] for row in rows if row is not None}
        constant = cols[victim].key and len(values) == 1
        dropped[victim] = f"{cols[victim].name} ({values.pop()} in every row)" if constant else cols[victim].name
    table = _build(title, cols, rows, keep, styles, table_kw)
    return table, [dropped[i] for i in sorted(dropped)]


def _rendered_width(console: Console, table: Table) -> int:
    """The widest line of the table as rendered (``Console.measure`` misjudges ``collapse_padding``)."""
    with console.capture() as capture:
        console.print(table)
    return max((len(line.rstrip()) for line in capture.get().splitlines()), default=0)


def _next_to_drop(cols: list[Col], rows: list[list[str] | None], keep: list[int]) -> int | None:
    """The column to drop next: the highest priority number, then a key column constant over the rows,
    then the widest key column the rest still tell apart; never one whose loss would make two rows' keys
    equal."""
    body = [row for row in rows if row is not None]
    keys = [i for i in keep if cols[i].key]

    def harmless(i: int) -> bool:
        if not cols[i].key:
            return True
        before = {tuple(row[k] for k in keys) for row in body}
        after = {tuple(row[k] for k in keys if k != i) for row in body}
        return len(after) == len(before)

    ranked = [i for i in keep if cols[i].priority > 0 and harmless(i)]
    if ranked:
        return max(ranked, key=lambda i: (cols[i].priority, i))
    constant = [i for i in keep if cols[i].key and cols[i].name and len({row[i] for row in body}) == 1]
    if constant:
        return constant[-1]
    # last resort, rather than cutting cells with an ellipsis: a key column the others still tell the rows
    # apart without (its values stay in --json and the line naming the choice); the widest, never the method
    spare = [i for i in keep if cols[i].key and cols[i].name and cols[i].name != "method" and harmless(i)]
    return max(spare, key=lambda i: (max(len(row[i]) for row in body), i)) if spare else None


def dropped_note(dropped: list[str]) -> str | None:
    """The caption line that names what a narrow terminal left out."""
    if not dropped:
        return None
    return f"Not shown at this width: {', '.join(dropped)} (widen the terminal, or use --json)."
