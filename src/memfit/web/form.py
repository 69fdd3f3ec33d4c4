"""The page's form controls, read from the settings schema (``memfit.settings.schema``): one fact, one place.

Each control is a setting of ``RunConfig`` that ``memfit estimate`` takes as a flag, described as plain data
the page draws: its key (the ``to_flat``/YAML key, what the page sends back), its flag (what the CLI line the
page shows spells), its kind, choices and default, and the CLI's ``--help`` text. A setting added to the
schema appears on the page with no change here. The plan's two inputs (``--budget``, ``--batch``) are
``TrainConfig``'s settings as ``memfit plan`` takes them.
"""

from __future__ import annotations

import enum
from typing import Any

from memfit.settings.config import RunConfig, TrainConfig
from memfit.settings.schema import Setting, flag_of, for_command, option_spec

#: Sections of the form, in order, each with the settings' keys it shows first (the rest go in "more").
SECTIONS = {
    "shape": ("seq_len", "micro_batch", "grad_accum", "num_processes", "sharding"),
    "precision": ("mixed_precision", "dtype", "grad_checkpointing", "optimizer"),
    "method": ("method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quantize", "qlora_upcast"),
}
PLAN_KEYS = ("budget", "batch")


def _plain(value: Any) -> Any:
    """A default as the page shows it: an enum's value, a tuple of names comma-separated."""
    if isinstance(value, enum.Enum):
        return value.value
    return ",".join(value) if isinstance(value, tuple) else value


def control(setting: Setting, command: str) -> dict[str, Any]:
    """One form control for ``setting`` as ``command``'s flag declares it."""
    kind, spec, hints = setting.value_type(), option_spec(setting.field, command), setting.metadata["click"]
    out: dict[str, Any] = {"key": setting.key, "flag": flag_of(setting.field), "help": spec["help"] or "",
                           "default": _plain(spec["default"]), "section": section_of(setting.key)}
    if kind is bool:
        out.update(kind="bool", default=bool(spec["default"]))
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        out.update(kind="choice", choices=[m.value for m in kind])
    elif "choices" in hints:
        out.update(kind="choice", choices=list(hints["choices"]))
    elif kind in (int, float):
        out.update(kind="int" if kind is int else "float", min=hints.get("min"))
    else:
        out.update(kind="text")
    return out


def section_of(key: str) -> str:
    return next((name for name, keys in SECTIONS.items() if key in keys), "more")


def run_controls() -> list[dict[str, Any]]:
    """The run's settings, as ``memfit estimate`` takes them (its defaults, its help)."""
    return [control(s, "estimate") for s in for_command(RunConfig, "estimate")]


def plan_controls() -> list[dict[str, Any]]:
    """``--budget`` and ``--batch`` as ``memfit plan`` takes them."""
    by_key = {s.key: s for s in for_command(TrainConfig, "plan")}
    return [control(by_key[key], "plan") for key in PLAN_KEYS]


def flags_of() -> dict[str, str]:
    """Setting key -> its flag, for every control of the page (to find the field an error sentence names)."""
    return {c["key"]: c["flag"] for c in (*run_controls(), *plan_controls())}
