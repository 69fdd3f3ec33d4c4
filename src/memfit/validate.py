"""Every value a user gives, checked once at the boundary, in the same words from the command line or YAML.

``RunConfig.__post_init__`` and ``TrainConfig.__post_init__`` call ``check_run`` and ``check_train``,
which check each setting as its field declares (``check`` in ``memfit.schema``), so a value is refused
whether it came from a flag, a ``--config`` YAML file or a library call, and the sentence always names
the flag (``--lr``), never the Python field. Model configs are checked by
``check_model_config`` (read by estimate, plan and train through ``modelspec.resolve_config``) before
anything is built, so a zero size or heads that do not divide never reach torch.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.schema import settings


def flag(name: str) -> str:
    """``optimizer_lr``/``max_steps`` -> ``--lr``/``--max-steps``: the words the user typed."""
    return "--lr" if name in ("optimizer_lr", "lr") else "--" + name.replace("_", "-")


INT_MAX = 2**63 - 1
"""The largest whole number a setting may hold: torch's and numpy's int64 (a ``--seed`` beyond it overflows
``torch.Generator.manual_seed``; a step count beyond it is no run)."""


def _shown(value: Any) -> str:
    """A value as the error sentence shows it, cut short: a YAML alias bomb (a list of lists of lists ...)
    would otherwise print for ever (``reprlib`` bounds the depth and the items shown)."""
    import reprlib

    shower = reprlib.Repr()
    shower.maxlevel, shower.maxlist, shower.maxdict, shower.maxstring, shower.maxother = 2, 4, 4, 60, 60
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a whole number of {value.bit_length()} bits"  # str() of a huge int is slow, or refused
    return shower.repr(value) if isinstance(value, (str, list, dict, tuple, set)) else str(value)[:60]


# ------------------------------------------------------------------------------------- scalar checks
def whole(name: str, value: Any, *, minimum: int, what: str) -> int:
    """An int >= ``minimum`` (a bool, a float like 3.5 or a string like "ten" is refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
            raise UserError(f"{flag(name)} must be {what}, got {_shown(value)}.")
    if value < minimum:
        raise UserError(f"{flag(name)} must be {what}, got {value}.")
    if value > INT_MAX:
        raise UserError(f"{flag(name)} must be {what} below 2**63, got {_shown(value)}.")
    return value


def number(name: str, value: Any, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False,
           high_open: bool = False, what: str) -> float:
    """A finite float in the range (YAML's ``1e-3`` arrives as a string; it is read as the number it is)."""
    if isinstance(value, bool):
        raise UserError(f"{flag(name)} must be {what}, got {value}.")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise UserError(f"{flag(name)} must be {what}, got {_shown(value)}.") from None
    if not isinstance(value, (int, float)):
        raise UserError(f"{flag(name)} must be {what}, got {_shown(value)}.")
    value = float(value)
    bad = (not math.isfinite(value) or value < low or value > high or (low_open and value == low)
           or (high_open and value == high))
    if bad:
        raise UserError(f"{flag(name)} must be {what}, got {value:g}.")
    return value


_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def boolean(name: str, value: Any) -> bool:
    """True or false; YAML's words ``yes``/``no``/``on``/``off`` too (``memfit.config_file`` leaves them words)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _WORDS:
        return _WORDS[value.strip().lower()]
    raise UserError(f"{flag(name)} must be true or false, got {_shown(value)}.")


def text(name: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # a YAML `model: 7` or `output: 2024` is a name, not a number
    raise UserError(f"{flag(name)} must be a text value, got {_shown(value)}.")


# ------------------------------------------------------------------------------------- the configs
POSITIVE = "a positive whole number"
NON_NEGATIVE = "0 or a positive whole number"


def check_fields(config) -> dict[str, Any]:
    """Checked, normalised values of a config's settings, by each field's ``check`` (``memfit.schema``).

    A setting whose default is None may be None: not given, derived later (``memfit.defaults``)."""
    out: dict[str, Any] = {}
    for f in settings(config):
        kind, value = f.metadata["check"], getattr(config, f.name)
        if kind is None or (value is None and f.default is None):
            continue
        what = f.metadata["what"]
        if kind in ("int>=0", "int>=1"):
            minimum = int(kind[-1])
            out[f.name] = whole(f.name, value, minimum=minimum, what=what or (POSITIVE if minimum else NON_NEGATIVE))
        elif kind == "pos":
            out[f.name] = number(f.name, value, low=0.0, low_open=True, what=what or "a finite positive number")
        elif kind == "nonneg":
            out[f.name] = number(f.name, value, low=0.0, what=what or "a finite number >= 0")
        elif kind == "frac":
            out[f.name] = number(f.name, value, low=0.0, high=1.0, high_open=True, what=what or "a number in [0, 1)")
        elif kind == "bool":
            out[f.name] = boolean(f.name, value)
        else:
            out[f.name] = text(f.name, value)
    return out


def check_run(run) -> dict[str, Any]:
    """Checked, normalised values of a ``RunConfig`` (numbers only; enums are checked by the config)."""
    return check_fields(run)


def check_train(config) -> dict[str, Any]:
    """Checked, normalised values of a ``TrainConfig``'s own fields (those present on it)."""
    out = check_fields(config)
    if getattr(config, "model", None) is None:
        raise UserError("--model must name a preset or a model folder, got nothing.")
    if getattr(config, "init", "pretrained") not in ("pretrained", "random"):
        raise UserError(f"--init must be pretrained or random, got {_shown(config.init)}.")
    return out


def unknown_keys(keys: set[str], valid: set[str]) -> None:
    """Refuse config-file keys that are no setting, naming the closest valid one."""
    if not keys:
        return
    parts = []
    for key in sorted(keys):
        close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
        parts.append(f"{key} (did you mean {close[0]}?)" if close else key)
    raise UserError(f"Unknown setting(s) in config: {', '.join(parts)}.")


# ------------------------------------------------------------------------------------- model config
def _get(config, *names: str):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return name, value
    return None, None


def check_model_config(config, name: str) -> None:
    """Refuse a model config whose sizes cannot build a model, naming the field (before torch sees it).

    Checks positive sizes (hidden, vocabulary, intermediate, heads, positions), at least one layer,
    heads dividing the hidden size (unless ``head_dim`` is given) and key/value heads dividing the
    attention heads (grouped-query attention repeats each key/value head ``heads / kv_heads`` times).
    """
    where = f"The model config of {name}"
    for names in (("hidden_size", "n_embd", "d_model"), ("vocab_size",), ("intermediate_size", "n_inner"),
                  ("num_attention_heads", "n_head"), ("num_key_value_heads",),
                  ("max_position_embeddings", "n_positions"), ("head_dim",)):
        field, value = _get(config, *names)
        if field is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where} has {field} = {value!r}; it must be a positive whole number.")
    field, layers = _get(config, "num_hidden_layers", "n_layer", "num_layers")
    if field is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise UserError(f"{where} has {field} = {layers!r}; a model needs at least one layer.")
    _, heads = _get(config, "num_attention_heads", "n_head")
    _, hidden = _get(config, "hidden_size", "n_embd", "d_model")
    head_dim = getattr(config, "head_dim", None)
    if heads and hidden and not head_dim and hidden % heads:
        raise UserError(f"{where} has hidden_size {hidden}, which {heads} attention heads do not divide.")
    kv = getattr(config, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise UserError(f"{where} has {kv} key/value heads, which do not divide its {heads} attention heads "
                        f"(each key/value head serves a whole group of query heads).")


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int) -> None:
    if tokenizer_size > vocab_size:
        raise UserError(f"The tokenizer has {tokenizer_size} tokens but the model's vocabulary only {vocab_size}.")


# ------------------------------------------------------------------------------------- machine facts
def check_attention_available(attn: str) -> None:
    """``flash_attention_2`` needs the flash-attn package (and CUDA); say so before transformers does."""
    if str(attn) == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError("--attn-implementation flash_attention_2 needs the flash-attn package, which is not "
                        "installed; use --attn-implementation auto (the default: transformers chooses) or sdpa.")


def check_writable_target(path: Path, *, flag_name: str, is_dir: bool) -> None:
    """Refuse an output that cannot be written: a file where a folder must go (or the reverse), or a
    read-only place (the nearest existing folder above it is not writable)."""
    path = Path(path).expanduser()
    if path.exists():
        if is_dir and not path.is_dir():
            raise UserError(f"{flag_name} {path} is an existing file, not a folder; choose a folder.")
        if not is_dir and path.is_dir():
            raise UserError(f"{flag_name} {path} is a folder; give a file name.")
    existing = path if path.exists() and is_dir else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise UserError(f"{flag_name} {path} lies under {existing}, which is a file, not a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag_name} {path} cannot be written: {existing} is read-only for this user.")
