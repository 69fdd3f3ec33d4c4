"""Every value a user gives, checked once at the boundary, in the same words from the command line or YAML.

Each settings dataclass's ``__post_init__`` (``RunConfig``, ``TrainConfig`` and their nested groups) calls
``check_fields`` (``TrainConfig``, ``ModelSource`` and ``FolderSettings`` through ``check_train``), which checks
each setting as its field declares (``check`` in ``memfit.settings.schema``), so a value is refused
whether it came from a flag, a ``--config`` YAML file or a library call, and the sentence always names
the flag (``--lr``), never the Python field. Model configs are checked by
``check_model_config`` (read by estimate, plan and train through ``modelspec.resolve_config``) before
anything is built, so a zero size or heads that do not divide never reach torch.
"""

# Inside functions: torch (2.6 s) and transformers' activation and RoPE tables (transformers 1.1 s; python -X importtime, 2026-12-06, this shared 2-core machine):
# settings/ is on every command's path, `memfit presets` and the refused-input ones included.
from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re
import reprlib
from pathlib import Path
from typing import Any

import psutil  # an Accelerate dependency

from memfit.errors import UserError
from memfit.files import user_path
from memfit.integrations.hf_compat import config_value
from memfit.settings.schema import key_of, settings
from memfit.units import fmt_count, fmt_gib


def flag(name: str) -> str:
    """A setting's key (``max_steps``, ``lora_r``) -> its flag (``--max-steps``, ``--lora-r``): the words the user typed."""
    return "--" + name.replace("_", "-")


INT_MAX = 2**63 - 1
"""The largest whole number a setting may hold: torch's and numpy's int64 (a ``--seed`` beyond it overflows
``torch.Generator.manual_seed``; a step count beyond it is no run)."""


def _shown(value: Any) -> str:
    """A value as the error sentence shows it, cut short: a YAML alias bomb (a list of lists of lists ...)
    would otherwise print for ever (``reprlib`` bounds the depth and the items shown)."""

    shower = reprlib.Repr()
    shower.maxlevel, shower.maxlist, shower.maxdict, shower.maxstring, shower.maxother = 2, 4, 4, 60, 60
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a whole number of {value.bit_length()} bits"  # str() of a huge int is slow, or refused
    return shower.repr(value) if isinstance(value, (str, list, dict, tuple, set)) else str(value)[:60]


# ------------------------------------------------------------------------------------- scalar checks
_WHOLE = re.compile(r"\s*[+-]?[0-9]{1,40}\s*")
"""A whole number written as text: ASCII digits, one sign at most (``str.isdigit`` also takes ``²`` and
``٣``, which ``int`` refuses; 40 digits is beyond int64 already, and ``int`` of thousands of digits is refused)."""

def whole(name: str, value: Any, *, minimum: int, what: str) -> int:
    """An int >= ``minimum`` (a bool, a float like 3.5 or a string like "ten" is refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str) and _WHOLE.fullmatch(value):
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
    try:
        value = float(value)
    except OverflowError:  # a whole number beyond a float's range (YAML's 400-digit ``lr:``)
        raise UserError(f"{flag(name)} must be {what}, got {_shown(value)}.") from None
    bad = (not math.isfinite(value) or value < low or value > high or (low_open and value == low)
           or (high_open and value == high))
    if bad:
        raise UserError(f"{flag(name)} must be {what}, got {value:g}.")
    return value


_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def boolean(name: str, value: Any) -> bool:
    """True or false; YAML's words ``yes``/``no``/``on``/``off`` too (``memfit.settings.config_file`` leaves them words)."""
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
    """Checked, normalised values of a config's settings, by each field's ``check`` (``memfit.settings.schema``)
    and its ``choices`` (click checks a flag's; a YAML file's or a library call's value is checked here).

    A setting whose default is None may be None: not given, derived later (``memfit.settings.defaults``)."""
    out: dict[str, Any] = {}
    for f in settings(config):
        kind, value, key = f.metadata["check"], getattr(config, f.name), key_of(f)  # key: a nested group's flag
        if value is None and f.default is None:
            continue
        choices = f.metadata["click"].get("choices")
        if choices and value not in choices:
            raise UserError(f"Unknown {flag(key)} {_shown(value)}; choose one of: {', '.join(choices)}.")
        if kind is None:
            continue
        what = f.metadata["what"]
        if kind in ("int>=0", "int>=1"):
            minimum = int(kind[-1])
            out[f.name] = whole(key, value, minimum=minimum, what=what or (POSITIVE if minimum else NON_NEGATIVE))
        elif kind == "pos":
            out[f.name] = number(key, value, low=0.0, low_open=True, what=what or "a finite positive number")
        elif kind == "nonneg":
            out[f.name] = number(key, value, low=0.0, what=what or "a finite number >= 0")
        elif kind == "frac":
            out[f.name] = number(key, value, low=0.0, high=1.0, high_open=True, what=what or "a number in [0, 1)")
        elif kind == "bool":
            out[f.name] = boolean(key, value)
        else:
            out[f.name] = text(key, value)
    return out


def check_train(config) -> dict[str, Any]:
    """Checked, normalised values of the settings declared on a ``TrainConfig`` or on one of its groups (those
    present on it: ``data`` on the config, ``output`` on ``FolderSettings``, ``model`` on ``ModelSource``)."""
    out = check_fields(config)
    for name in ("output", "data"):  # `--output ~/runs/x` the shell did not expand (=, YAML); DataReading: its own
        if isinstance(out.get(name), str) and out[name].startswith("~"):
            out[name] = os.path.expanduser(out[name])
    if out.get("output"):
        check_path_names(Path(out["output"]), flag_name="--output")
    if "model" in {f.name for f in settings(config)} and config.model is None:
        raise UserError("--model must name a preset or a model folder, got nothing.")
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
def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _get(config, *names: str):
    for name in names:
        value = config_value(config, name)
        if value is not None:
            return name, value
    return None, None


MAX_LAYERS = 2048
"""The most decoder layers a model config may declare. Counting a model builds its module tree on the meta device
(``spec.model.spec_from_config``): ~6 ms per layer on this project's busy 2-core machine (1,000 layers 5.8 s,
3,000 layers 21 s, measured 2026-12-06), so 100,000 layers ran for many minutes; the deepest published decoders
have under 200 (Llama 3.1 405B: 126), so 2,048 refuses no real model and answers within ~15 s."""


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
        if field == "intermediate_size" and isinstance(value, list | tuple) and value:  # one per layer (gemma3n)
            if all(_positive_int(v) for v in value):
                continue
            raise UserError(f"{where} has {field} = {_shown(value)}; each layer's must be a positive whole number.")
        if not _positive_int(value):
            raise UserError(f"{where} has {field} = {value!r}; it must be a positive whole number.")
    field, layers = _get(config, "num_hidden_layers", "n_layer", "num_layers")
    if field is not None and not _positive_int(layers):
        raise UserError(f"{where} has {field} = {_shown(layers)}; a model needs at least one layer.")
    if field is not None and layers > MAX_LAYERS:
        raise UserError(f"{where} has {field} = {_shown(layers)}, more than the {MAX_LAYERS:,} layers memfit reads "
                        f"(the deepest published decoders have under 200; counting a model builds every layer).")
    _, heads = _get(config, "num_attention_heads", "n_head")
    _, hidden = _get(config, "hidden_size", "n_embd", "d_model")
    head_dim = config_value(config, "head_dim")
    if heads and hidden and not head_dim and hidden % heads:
        raise UserError(f"{where} has hidden_size {hidden}, which {heads} attention heads do not divide.")
    kv = config_value(config, "num_key_value_heads")
    if heads and kv and heads % kv:
        raise UserError(f"{where} has {kv} key/value heads, which do not divide its {heads} attention heads "
                        f"(each key/value head serves a whole group of query heads).")
    _check_activation(config, where)
    _check_token_ids(config, where)
    _check_rope(config, where)


def _check_activation(config, where: str) -> None:
    """The MLP's activation must be one transformers has (``transformers.activations.ACT2FN``, which the
    model looks it up in when built: an unknown name is a ``KeyError`` there)."""
    from transformers.activations import ACT2FN

    for field in ("hidden_act", "hidden_activation", "activation_function"):
        act = config_value(config, field)
        if act is None or callable(act):
            continue
        if not isinstance(act, str) or act not in ACT2FN:
            known = ", ".join(sorted(k for k in ACT2FN if k in ("gelu", "gelu_new", "relu", "silu", "gelu_pytorch_tanh")))
            raise UserError(f"{where} has {field} = {_shown(act)}, an activation transformers does not know "
                            f"(e.g. {known}).")


def _check_token_ids(config, where: str) -> None:
    """``pad_token_id`` is the embedding's ``padding_idx``, which torch requires inside the vocabulary."""
    _, vocab = _get(config, "vocab_size")
    pad = config_value(config, "pad_token_id")
    if pad is None or not isinstance(vocab, int):
        return
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab:
        raise UserError(f"{where} has pad_token_id = {_shown(pad)}; it must be a token id below its vocab_size "
                        f"{vocab} (or null).")


def _rope_dicts(config, where: str) -> list[dict]:
    """The RoPE parameter sets of a config: transformers 5's ``rope_parameters`` (one set, or one per layer
    type), a raw config.json's ``rope_scaling``, and the top-level ``rope_theta`` of older configs."""
    out = []
    for field in ("rope_parameters", "rope_scaling"):
        value = config_value(config, field)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UserError(f"{where} has {field} = "
                            f"{_shown(value)}; it must be a mapping (rope_type, factor, ...) or null.")
        nested = value and all(isinstance(v, dict) or v is None for v in value.values())
        out += [v for v in value.values() if v] if nested else [value]
    theta = config_value(config, "rope_theta")
    if theta is not None:
        out.append({"rope_theta": theta})
    return out


def _check_rope(config, where: str) -> None:
    """RoPE: a known ``rope_type`` (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``, the table the model
    builds its rotary embedding from), and ``rope_theta``/``factor`` finite positive numbers (the inverse
    frequencies are ``theta ** (-2i/d)``: text there is a ``TypeError`` inside torch)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = {"default", *ROPE_INIT_FUNCTIONS}
    for params in _rope_dicts(config, where):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in known:
            raise UserError(f"{where} has the RoPE type {_shown(kind)}, which transformers does not know "
                            f"({', '.join(sorted(known))}).")
        for key in ("rope_theta", "factor"):
            value = params.get(key)
            if value is None:
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not ok:
                raise UserError(f"{where} has {'rope_theta' if key == 'rope_theta' else 'rope factor'} = "
                                f"{_shown(value)}; it must be a finite positive number.")


def check_rope_with_transformers(config, where: str) -> None:
    """transformers' own RoPE validation (``PretrainedConfig.validate_rope``: the keys each RoPE type needs),
    its error as one sentence."""
    validate_rope = getattr(config, "validate_rope", None)
    if validate_rope is None:
        return
    try:
        validate_rope()
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        raise UserError(f"The model config of {where} has RoPE parameters transformers refuses: "
                        f"{' '.join(str(err).split())[:200]}") from None


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int) -> None:
    if tokenizer_size > vocab_size:
        raise UserError(f"The tokenizer has {tokenizer_size} tokens but the model's vocabulary only {vocab_size}.")


# ------------------------------------------------------------------------------------- machine facts
def machine_memory() -> tuple[int, int]:
    """``(host RAM, GPU memory)`` of this machine in bytes: all the memory a model could be built in."""
    gpu = 0
    try:
        import torch

        if torch.cuda.is_available():
            gpu = sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    except (ImportError, RuntimeError):  # no torch / a broken driver: the host alone
        gpu = 0
    return int(psutil.virtual_memory().total), gpu


def check_buildable(name: str, params: int, bytes_per_param: float, dtype: str) -> None:
    """Refuse, before anything is allocated, a model whose weights alone exceed all the memory of this
    machine (host RAM plus every GPU): building it could only fail, or first swap the machine to a halt.
    A lower bound of what training needs (no gradients, optimizer state or activations counted), so it
    never refuses a model that could be built; ``memfit estimate`` and ``plan`` predict the rest."""

    need = params * bytes_per_param
    ram, gpu = machine_memory()
    if need > ram + gpu:
        on_gpu = f" and {fmt_gib(gpu)} of GPU memory" if gpu else " and no GPU"
        raise UserError(f"{name} has {fmt_count(params)} parameters: {fmt_gib(need)} of {dtype} weights alone, more "
                        f"than this machine's {fmt_gib(ram)} of RAM{on_gpu}, so it cannot be built here (memfit "
                        "estimate and memfit plan predict its memory without building it).")


def check_attention_available(attn: str) -> None:
    """``flash_attention_2`` needs the flash-attn package (and CUDA); say so before transformers does."""
    if str(attn) == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError("--attn-implementation flash_attention_2 needs the flash-attn package, which is not "
                        "installed; use --attn-implementation auto (the default: transformers chooses) or sdpa.")


def check_path_names(path: Path, *, flag_name: str) -> None:
    """Refuse an output path the file system cannot hold (a name over its limit, 255 bytes on most, or a
    path over 4096 bytes) or a symlink to nothing (``mkdir`` would fail on it with "File exists")."""
    path = user_path(path)
    name_max = _name_max(path)
    long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise UserError(f"{flag_name} has a name of {len(os.fsencode(long))} bytes ({long[:40]}...), longer than "
                        f"the {name_max} bytes the file system allows; choose a shorter name.")
    if len(os.fsencode(str(path.absolute()))) > 4000:  # PATH_MAX is 4096, and memfit adds names below it
        raise UserError(f"{flag_name} is a path of {len(os.fsencode(str(path.absolute())))} bytes, longer than "
                        "the file system allows; choose a shorter path.")
    if path.is_symlink() and not path.exists():
        raise UserError(f"{flag_name} {path} is a symbolic link to {os.readlink(path)}, which does not exist; "
                        "remove the link or give another path.")


def _name_max(path: Path) -> int:
    """The longest file name the file system under ``path`` takes (its nearest existing folder's)."""
    for folder in path.absolute().parents:
        try:
            if folder.is_dir():
                return os.pathconf(folder, "PC_NAME_MAX")
        except (OSError, ValueError):
            continue
    return 255


def check_writable_target(path: Path, *, flag_name: str, is_dir: bool) -> None:
    """Refuse an output that cannot be written: a file where a folder must go (or the reverse), or a
    read-only place (the nearest existing folder above it is not writable)."""
    path = user_path(path)
    check_path_names(path, flag_name=flag_name)
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
