"""The flags that read another tool's configuration (``--from``, ``--from-format``) and show what was read."""

from __future__ import annotations

import click

import memfit
from memfit.errors import UserError

_FORMATS = ("trl", "axolotl", "llamafactory", "torchtune")  # memfit.interop.FORMATS (imported lazily there)

FROM = [
    click.option("--from", "from_path", type=click.Path(dir_okay=False),
                 help="Read the run from another tool's config: TRL/Trainer (YAML/JSON), Axolotl, LLaMA-Factory or "
                      "torchtune YAML; flags typed here override it."),
    click.option("--from-format", type=click.Choice(_FORMATS), help="The --from file's tool (default: detected)."),
]


def from_options(func):
    for opt in reversed(FROM):
        func = opt(func)
    return func


def read_from(path, fmt):
    """The ``Reading`` of ``--from`` (None without it)."""
    if path is None:
        if fmt is not None:
            raise UserError("--from-format names the format of a --from FILE; add --from.")
        return None

    return memfit.read_config(path, fmt)


def show_reading(console, reading, run=None) -> None:
    """What was read from the file, how the tool's own behaviour was priced, and what could not be mapped
    (``run``: the run priced, flags typed over the file, whose process count is stated when the file has none)."""
    console.print(f"Read {reading.path} ({reading.tool} configuration; model: {reading.model}).", highlight=False)
    if reading.priced:
        console.print("Priced as the tool runs it:")
        for line in reading.priced:
            console.print(f"  [dim]- {line}[/]", highlight=False)
    unmapped = reading.unmapped_for(run)
    if unmapped:
        console.print("Not mapped (the estimate leaves these out, or assumes them):")
        for line in unmapped:
            console.print(f"  - {line}", highlight=False)
    else:
        console.print("Every memory setting of the file was mapped.")
