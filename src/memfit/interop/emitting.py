"""What the writers of another tool's configuration share (``plan --emit``).

An emitted file changes only what the plan chose. Each writer turns a run into the tool's keys
(``settings``); for a source file of the same tool, those keys are computed twice, for the run the file
was read as and for the plan, and only the groups of keys that differ are written over the file, so the
model id, stage, attention spelling, a null sequence length and every key the plan did not decide stay
as the file wrote them.
"""

from __future__ import annotations

from typing import Any

from memfit.interop.common import Reading
from memfit.spec.model import is_preset, load_presets
from memfit.units import torch_dtype_name

#: memfit's optimizer -> transformers' ``TrainingArguments.optim`` name (Axolotl, LLaMA-Factory and TRL write it).
OPTIMIZER_NAMES = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused", "adamw-foreach": "adamw_torch",
                   "adamw-8bit": "adamw_8bit", "sgd": "sgd", "adafactor": "adafactor"}

#: A writer's groups of keys: (keys written together when any of them changes, the source's keys they replace).
Groups = tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]


def dtype_name(dtype) -> str:
    """torch's name of a memfit weight dtype (``bf16`` -> ``bfloat16``: ``memfit.units.torch_dtype_name``)."""
    return torch_dtype_name(dtype)


def model_id(model: str, source: Reading | None) -> str:
    """The model as the tools load it: the source file's own id where it names the same model, else a preset's
    Hugging Face repository (a memfit preset name is no model the tools can load), else ``model`` as given."""
    if source is not None and source.model == model:
        written = source.data.get(source.model_key)
        if isinstance(written, str) and written.strip():
            return written

    if is_preset(model):
        return load_presets()[model.lower()].get("source") or model
    return model


def changed_only(source: Reading, plan: dict[str, Any], before: dict[str, Any], groups: Groups = ()) -> dict:
    """``source``'s file with only the groups of keys where ``plan`` differs from ``before`` (the same writer's
    keys for the run the file was read as) written over it; a key the plan leaves out (None) is removed.
    Dotted keys (``tokenizer.max_seq_len``) name a key inside a mapping."""
    out = _copy(source.data)
    keys = list(dict.fromkeys([*before, *plan]))
    grouped = {k: (members, drops) for members, drops in groups for k in members}
    done: set[str] = set()
    for key in keys:
        if key in done or plan.get(key) == before.get(key):
            continue
        members, drops = grouped.get(key, ((key,), ()))
        for other in drops:
            _pop(out, other)
        for member in members:
            done.add(member)
            if plan.get(member) is None:
                _pop(out, member)
            else:
                _set(out, member, plan[member])
    return out


def _copy(data: dict) -> dict:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}


def _set(data: dict, key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    if not rest:
        data[head] = value
        return
    inner = data.get(head)
    data[head] = inner = dict(inner) if isinstance(inner, dict) else {}
    _set(inner, rest, value)


def _pop(data: dict, key: str) -> None:
    head, _, rest = key.partition(".")
    if not rest:
        data.pop(head, None)
    elif isinstance(data.get(head), dict):
        _pop(data[head], rest)


def merged(source: Reading | None, tool: str, model_key: str, model: str, run, settings,
           groups: Groups = ()) -> dict:
    """The emitted file of ``run``: for a source file of the same ``tool``, that file with only what the plan
    changed (``changed_only``; ``settings(run)``: the writer's keys for a run); else the plan's keys under the
    model id. ``model_key``: where ``tool`` names the base model."""
    plan = settings(run)
    if source is None or source.tool != tool:
        return {model_key: model_id(model, source), **{k: v for k, v in plan.items() if v is not None}}
    out = changed_only(source, plan, settings(source.run), groups)
    if model != source.model:
        out[model_key] = model_id(model, None)
    return out
