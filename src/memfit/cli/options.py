"""Click options built from the settings schema (``memfit.settings.schema``), for ``train``, ``estimate`` and ``plan``.

Every flag that is a setting is made here from its field in ``RunConfig`` or ``TrainConfig``: the flag,
type, default (the command's own where the schema gives one, with its reason), help and choices. The
names are ``memfit train``'s interface; ``run_config_from`` turns them into a ``RunConfig``.
``explicit`` tells which flags the user typed, so a ``--config`` YAML fills only the rest.
"""

from __future__ import annotations

import enum
from typing import Any

import click

from memfit.settings.config import RunConfig, TrainConfig
from memfit.settings.schema import Setting, flag_of, for_command, option_spec, walk


def _plain(value: Any) -> Any:
    """A default as click shows and passes it: an enum's value, a tuple of names comma-separated."""
    if isinstance(value, enum.Enum):
        return value.value
    return ",".join(value) if isinstance(value, tuple) else value


def option(f: Setting, command: str):
    """The click option of setting ``f`` in ``command``."""
    spec, hints, name = option_spec(f, command), f.metadata["click"], flag_of(f)
    kind, default = f.value_type(), spec["default"]
    kwargs: dict[str, Any] = {"help": spec["help"]}
    if kind is bool and not hints.get("negatable"):
        return click.option(name, is_flag=True, **kwargs)  # off unless given
    decls = [f"{name}/--no-{name[2:]}"] if kind is bool else [name]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["type"] = click.Choice([m.value for m in kind], case_sensitive=False)
    elif "choices" in hints:
        kwargs["type"] = click.Choice(list(hints["choices"]))
    elif hints.get("path"):
        kwargs["type"] = click.Path(dir_okay=False)
    elif "min" in hints:
        kwargs["type"] = click.IntRange(min=hints["min"])
    elif kind in (int, float):
        kwargs["type"] = kind
    shown = spec.get("show_default", default is not None)
    return click.option(*decls, default=_plain(default), show_default=shown, **kwargs)


def schema_options(cls, command: str, *, group: str | None = None) -> list:
    """The click options of ``cls``'s settings that ``command`` takes (only ``group``'s when given)."""
    return [option(f, command) for f in for_command(cls, command)
            if group is None or f.metadata["group"] == group]


def apply(func, opts: list):
    """Decorate ``func`` with ``opts``, shown in ``--help`` in the order given."""
    for opt in reversed(opts):
        func = opt(func)
    return func


def with_options(opts: list):
    """Decorator: ``apply(func, opts)``."""
    return lambda func: apply(func, opts)


def flags(cls, command: str):
    """Decorator: ``command``'s flags for the settings of ``cls``."""
    return with_options(schema_options(cls, command))


def memory_options(command: str):
    """Decorator: ``command``'s flags for the memory settings (``RunConfig``'s fields)."""
    return flags(RunConfig, command)


def train_options(command: str, *, group: str | None = None) -> list:
    """``command``'s flags for ``TrainConfig``'s own settings (the model, the data, the loop)."""
    return schema_options(TrainConfig, command, group=group)


MEMORY_KEYS = tuple(s.key for s in walk(RunConfig))


def run_config_from(kwargs: dict[str, Any]) -> RunConfig:
    """``RunConfig`` from a click kwargs dict (extra keys ignored)."""
    return RunConfig.from_flat({k: v for k, v in kwargs.items() if k in MEMORY_KEYS})


def explicit(ctx: click.Context, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Only the parameters the user set on the command line (not defaults)."""
    source = click.core.ParameterSource
    return {
        k: v
        for k, v in kwargs.items()
        if ctx.get_parameter_source(k) not in (source.DEFAULT, source.DEFAULT_MAP, None)
    }
