"""The settings schema: each field of ``RunConfig`` and ``TrainConfig`` declares itself once.

A setting is one dataclass field made by ``setting()``; its metadata says everything the rest of
memfit derives from it, so adding a setting is adding one field (plus the code it changes):

``help``
    The ``--help`` text of its flag (``None``: no text). The field's docstring is the longer story.
``flag``
    The command-line flag, when it is not ``--`` + the name with ``-`` (a nested group's prefix included:
    ``LoraSettings.r`` is ``--lora-r``).
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
    ``memfit data preview`` shares). A group whose settings the code hands around together is a nested
    dataclass of its own (``settings_group``: ``RunConfig.lora`` is ``LoraSettings``), held by a
    ``nested`` field; its flags keep the group's prefix (``lora.r`` is ``--lora-r``, key ``lora_r``),
    so flags, YAML keys and run.json are flat whatever the nesting. ``walk`` lists every setting of a
    config, nested ones included, with the path that reaches it.
``click``
    Plain-data hints for the click option: ``choices`` (a tuple of names), ``min`` (click checks the
    bound itself), ``path`` (a file path), ``show_default`` (text instead of the value).

Nothing here imports torch, click or the rest of memfit: ``memfit.settings.config`` builds on it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
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


def settings(cls) -> tuple[Field, ...]:
    """The setting fields declared on a config class itself, in declaration order (its nested groups, and
    ``TrainConfig.run``, left out: ``walk`` reaches into them)."""
    return _settings(cls if isinstance(cls, type) else type(cls))


@functools.cache
def _settings(cls: type) -> tuple[Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if is_setting(f))


def settings_group(name: str, *, prefix: str = ""):
    """Class decorator: a frozen dataclass of settings that belong together (``name``: their ``group``),
    held by its parent config's ``nested`` field. Each setting's flag is ``--`` + ``prefix`` + its name
    unless it declares its own, so nesting never changes what a user types or writes in YAML."""

    def mark(cls):
        for f in settings(cls):
            meta = dict(f.metadata)
            meta["group"] = name
            meta["flag"] = meta["flag"] or "--" + (prefix + f.name).replace("_", "-")
            f.metadata = MappingProxyType(meta)
        cls.__settings_group__ = name
        return cls

    return mark


def nested(cls) -> Any:
    """The field of a config that holds a ``settings_group`` (default: the group's defaults)."""
    if not hasattr(cls, "__settings_group__"):
        raise ValueError(f"{cls.__name__} is not a settings_group")
    return dataclasses.field(default_factory=cls, metadata=MappingProxyType({"nested": cls}))


@functools.cache
def groups(cls) -> tuple[Field, ...]:
    """The fields of ``cls`` that hold a nested group of settings (``nested``)."""
    return tuple(f for f in dataclasses.fields(cls) if "nested" in f.metadata)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of a config, nested or not: the field that declares it and the attributes that reach it."""

    field: Field
    path: tuple[str, ...]
    """Attribute names from the config to the value: ``("seq_len",)``, ``("lora", "r")``."""
    owner: type
    """The dataclass that declares the field (its type hints give the setting's type)."""

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def metadata(self):
        return self.field.metadata

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def default_factory(self) -> Any:
        return self.field.default_factory

    @property
    def key(self) -> str:
        return key_of(self.field)

    def value_type(self) -> Any:
        """The setting's type with ``None`` taken out of an optional one (``int | None`` -> ``int``): what a
        flag or a form control for it takes."""
        hint = typing.get_type_hints(self.owner)[self.name]
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        return hint

    def get(self, config) -> Any:
        for name in self.path:
            config = getattr(config, name)
        return config


@functools.cache
def walk(cls, _path: tuple[str, ...] = ()) -> tuple[Setting, ...]:
    """Every setting of config class ``cls`` in declaration order, reaching into its nested groups (cached:
    the planner replaces settings of hundreds of runs per search)."""
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        if is_setting(f):
            out.append(Setting(f, (*_path, f.name), cls))
        elif "nested" in f.metadata:
            out += walk(f.metadata["nested"], (*_path, f.name))
    return tuple(out)


@functools.cache
def _by_key(cls) -> dict[str, Setting]:
    return {s.key: s for s in walk(cls)}


def build(cls, values: dict[str, Any]):
    """``cls`` from settings by key (``key_of``: the names flags and YAML use; a setting of ``cls`` itself
    also by its field name), nested groups built from their keys (a field that is no setting,
    ``TrainConfig.run``, by its name); any other key raises ``TypeError`` as a dataclass does."""
    own = {key_of(f): f.name for f in settings(cls)} | {f.name: f.name for f in settings(cls)}
    own.update({f.name: f.name for f in dataclasses.fields(cls) if not is_setting(f) and "nested" not in f.metadata})
    inner = {f.name: {s.key for s in walk(f.metadata["nested"])} for f in groups(cls)}
    unknown = set(values) - set(own) - set().union(*inner.values())
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting(s) {sorted(unknown)}")
    kwargs = {own[k]: v for k, v in values.items() if k in own}
    for f in groups(cls):
        part = {k: v for k, v in values.items() if k in inner[f.name]}
        kwargs[f.name] = build(f.metadata["nested"], part)
    return cls(**kwargs)


def replaced(config, changes: dict[str, Any]):
    """``config`` with settings changed by key (``lora_r=8``) or by field name (a whole group: ``lora=...``)."""
    fields_ = type(config).__dataclass_fields__
    direct = {k: v for k, v in changes.items() if k in fields_}
    by_key = _by_key(type(config))
    for key, value in changes.items():
        if key in direct:
            continue
        if key not in by_key:
            raise TypeError(f"{type(config).__name__} has no setting {key!r}")
        setting_ = by_key[key]
        if len(setting_.path) == 1:
            direct[setting_.path[0]] = value
            continue
        head = setting_.path[0]
        inner = direct.get(head, getattr(config, head))
        direct[head] = replaced(inner, {setting_.key: value})
    return dataclasses.replace(config, **direct)


@functools.cache  # Fields hash by identity, Settings by (field, path, owner); metadata is final once a class is made
def flag_of(f: Field) -> str:
    """The flag the user types for the field (``--seq-len``, ``--lr``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def key_of(f: Field) -> str:
    """The field's key in YAML files, ``to_flat()`` and run.json: the flag's words (``seq_len``, ``lr``)."""
    return _key(flag_of(f))


@functools.cache
def _key(flag: str) -> str:
    return flag[2:].replace("-", "_")


def with_rule(classes, *rules: str) -> frozenset[str]:
    """The keys (``key_of``) of the settings of ``classes`` whose resume rule is one of ``rules``."""
    return frozenset(s.key for cls in classes for s in walk(cls) if s.metadata["resume"] in rules)


def for_command(cls, command: str) -> list[Setting]:
    """The settings of ``cls`` (nested ones included) that ``command`` takes as flags."""
    return [s for s in walk(cls) if command in s.metadata["commands"]]


def option_spec(f: Field, command: str) -> dict[str, Any]:
    """``default`` and ``help`` of the field's flag in ``command`` (its override, else the schema's)."""
    spec = {"default": f.default if f.default is not MISSING else f.default_factory(), "help": f.metadata["help"]}
    if command == "plan" and f.metadata["plan"] == "searched":
        spec["default"] = None  # PLAN_ROLES["searched"]: not given, the planner chooses
    spec.update({k: v for k, v in f.metadata["overrides"].get(command, {}).items() if k != "why"})
    return spec


def searched(cls) -> list[Setting]:
    """The settings of ``cls`` the planner chooses (``PLAN_ROLES``), each a field of its constraints."""
    return [s for s in walk(cls) if s.metadata["plan"] == "searched"]


def in_group(cls, group: str) -> list[Setting]:
    """The settings of ``cls`` in ``group`` (a nested group's, or those marked ``group=``)."""
    return [s for s in walk(cls) if s.metadata["group"] == group]


def own_defaults(cls, command: str) -> dict[str, Any]:
    """The settings of ``cls`` whose default in ``command`` differs from the schema's: ``{key: default}``."""
    return {s.key: spec["default"] for s in for_command(cls, command)
            if "default" in s.metadata["overrides"].get(command, {}) for spec in [option_spec(s, command)]}
