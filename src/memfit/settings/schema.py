"""The settings schema: each field of ``RunConfig`` and ``TrainConfig`` declares itself once.

A setting is one dataclass field made by ``setting()``; its metadata says everything the rest of
memfit derives from it, so adding a setting is adding one field (plus the code it changes):

``help``
    The ``--help`` text of its flag (``None``: no text). The field's docstring is the longer story.
``flag``
    The command-line flag, when it is not ``--`` + the name with ``-`` (``optimizer_lr`` is ``--lr``).
    Its YAML key and ``to_flat()`` key is the flag without ``--``, with ``_`` (``lr``).
``check``
    How ``memfit.settings.validate.check_fields`` checks a value from a flag, a YAML file or a library call:
    ``"int>=0"``/``"int>=1"`` (a whole number at least that), ``"pos"`` (finite, > 0), ``"nonneg"``
    (finite, >= 0), ``"frac"`` (in [0, 1)), ``"bool"``, ``"text"``; ``None``: checked elsewhere (enums by
    the config, choices by click). A field whose default is ``None`` may also be ``None`` (not given:
    derived, ``memfit.settings.defaults``). ``what`` replaces the standard wording of the error sentence.
``resume``
    What ``--resume`` does with it (``RESUME_RULES``; read by ``memfit.training.resume``).
``commands``
    The commands that take it as a flag (``memfit.cli.options`` builds their click options from the
    schema). ``overrides`` holds a command's own default or help, each with the reason it differs.
``plan``
    Its part in ``memfit plan`` (``PLAN_ROLES``): ``"searched"`` settings are what the planner chooses
    (``memfit.planning.space.Constraints`` has a field for each; ``plan``'s flag pins it, default None),
    ``"given"`` ones are the problem it is given (the sequence length, the processes, the batch).
``group``
    The settings it belongs with (``"lora"``: the adapters; ``"data"``: how records are read, the flags
    ``memfit data preview`` shares).
``click``
    Plain-data hints for the click option: ``choices`` (a tuple of names), ``min`` (click checks the
    bound itself), ``path`` (a file path), ``show_default`` (text instead of the value).

Nothing here imports torch, click or the rest of memfit: ``memfit.settings.config`` builds on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, Field
from types import MappingProxyType
from typing import Any

RESUME_RULES = {
    "restored": "taken from the saved run when not given; given, it must equal the saved value (what is "
                "computed per optimizer step, and what the run is)",
    "may-change": "taken from the saved run when not given; given, it may differ: it changes how long, how "
                  "often, or how the same effective batch is split and saved, never what a step computes",
    "length": "may change, and is one of the two ways of saying how long the run trains: when the user "
              "gives one, the saved other one is not restored",
    "never-restored": "never taken from the saved run: how this invocation behaves, not what the run is "
                      "(the user passes it again, e.g. trust_remote_code is never switched on by a file)",
}
"""``--resume``'s rule for each setting, by name (``setting(resume=...)``)."""

PLAN_ROLES = {
    "searched": "the planner chooses it among its candidates unless the user pins it: plan's flag has no "
                "default (None: the planner's choice)",
    "given": "the problem the planner solves, kept exactly as given",
}
"""What ``memfit plan`` does with a setting (``setting(plan=...)``)."""

CHECKS = ("int>=0", "int>=1", "pos", "nonneg", "frac", "bool", "text")
COMMANDS = ("estimate", "plan", "train")


def setting(default: Any = MISSING, *, resume: str, help: str | None = None, check: str | None = None,
            what: str | None = None, flag: str | None = None, commands: tuple[str, ...] = ("train",),
            overrides: dict[str, dict[str, Any]] | None = None, click: dict[str, Any] | None = None,
            plan: str | None = None, group: str | None = None, default_factory: Any = MISSING) -> Any:
    """A dataclass field that declares a setting (the module docstring says what each key means).

    ``resume`` has no default: every setting states what ``--resume`` does with it.
    """
    if resume not in RESUME_RULES:
        raise ValueError(f"resume must be one of {sorted(RESUME_RULES)}, got {resume!r}")
    if check is not None and check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    if plan is not None and plan not in PLAN_ROLES:
        raise ValueError(f"plan must be one of {sorted(PLAN_ROLES)}, got {plan!r}")
    unknown = set(commands) - set(COMMANDS) or set(overrides or {}) - set(commands)
    if unknown:
        raise ValueError(f"unknown or unlisted command(s) {sorted(unknown)}")
    for command, changes in (overrides or {}).items():
        if "default" in changes and not changes.get("why"):
            raise ValueError(f"{command}'s own default needs its reason (why=...)")
    meta = {"resume": resume, "help": help, "check": check, "what": what, "flag": flag,
            "commands": tuple(commands), "plan": plan, "group": group, "overrides": dict(overrides or {}),
            "click": dict(click or {})}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=MappingProxyType(meta))


def is_setting(f: Field) -> bool:
    return "resume" in f.metadata


def settings(cls) -> list[Field]:
    """The setting fields of a config class, in declaration order (groups such as ``TrainConfig.run`` left out)."""
    return [f for f in dataclasses.fields(cls) if is_setting(f)]


def flag_of(f: Field) -> str:
    """The flag the user types for the field (``--seq-len``, ``--lr``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def key_of(f: Field) -> str:
    """The field's key in YAML files, ``to_flat()`` and run.json: the flag's words (``seq_len``, ``lr``)."""
    return flag_of(f)[2:].replace("-", "_")


def with_rule(classes, *rules: str) -> frozenset[str]:
    """The keys (``key_of``) of the settings of ``classes`` whose resume rule is one of ``rules``."""
    return frozenset(key_of(f) for cls in classes for f in settings(cls) if f.metadata["resume"] in rules)


def for_command(cls, command: str) -> list[Field]:
    """The settings of ``cls`` that ``command`` takes as flags."""
    return [f for f in settings(cls) if command in f.metadata["commands"]]


def option_spec(f: Field, command: str) -> dict[str, Any]:
    """``default`` and ``help`` of the field's flag in ``command`` (its override, else the schema's)."""
    spec = {"default": f.default if f.default is not MISSING else f.default_factory(), "help": f.metadata["help"]}
    if command == "plan" and f.metadata["plan"] == "searched":
        spec["default"] = None  # PLAN_ROLES["searched"]: not given, the planner chooses
    spec.update({k: v for k, v in f.metadata["overrides"].get(command, {}).items() if k != "why"})
    return spec


def searched(cls) -> list[Field]:
    """The settings of ``cls`` the planner chooses (``PLAN_ROLES``), each a field of its constraints."""
    return [f for f in settings(cls) if f.metadata["plan"] == "searched"]


def in_group(cls, group: str) -> list[Field]:
    """The settings of ``cls`` in ``group``."""
    return [f for f in settings(cls) if f.metadata["group"] == group]


def own_defaults(cls, command: str) -> dict[str, Any]:
    """The settings of ``cls`` whose default in ``command`` differs from the schema's: ``{name: default}``."""
    return {f.name: spec["default"] for f in for_command(cls, command)
            if "default" in f.metadata["overrides"].get(command, {}) for spec in [option_spec(f, command)]}
