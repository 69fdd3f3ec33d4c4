"""Flags that say how to read the data (``memfit train`` and ``memfit data preview``)."""

from __future__ import annotations

from memfit.cli.options import train_options


def data_options() -> list:
    """The data flags as click options: ``TrainConfig``'s settings of the ``data`` group (``memfit.settings.schema``),
    as ``memfit train`` takes them."""

    return train_options("train", group="data")
