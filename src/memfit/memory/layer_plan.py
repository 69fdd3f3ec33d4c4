"""Which decoder layers a derived recipe traces: the first, then one layer of every other kind.

A model's layers come in kinds (``ModelSpec.layer_kinds``: lfm2's convolution and attention layers,
jamba's mamba and attention layers with an MoE or a dense MLP, deepseek_v3's dense first layer). The
derivation (``memory/derive.py``) traces a small model holding the first layer (it differs: under LoRA
with checkpointing its input needs a gradient) and one layer of each kind after it, reads each kind's
bytes off its traced layer, and extrapolates every further layer as its own kind.

The small model is the config with fewer layers. Where the config lists its layers' kinds in a
``layer_types`` it can be given (lfm2, gemma), the list names the traced layers directly; otherwise
(jamba's periods and offsets, deepseek_v3's ``first_k_dense_replace``) the first layers of the model are
traced, up to the last kind's first appearance, at most ``MAX_TRACED_LAYERS``: a kind that first appears
later is one sentence naming it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from memfit.errors import UserError

#: The most layers a derivation traces (a trace's cost grows with its layers, not its sizes).
MAX_TRACED_LAYERS = 8


@dataclass(frozen=True)
class LayerPlan:
    """The traced model: its depth, its ``layer_types`` (None: the config's own, cut to the depth), and
    the kind of each of its layers."""

    layers: int
    layer_types: tuple | None
    kinds: tuple[str, ...]


def model_kinds(spec) -> tuple[str, ...]:
    """The kind of each of ``spec``'s layers (one kind when the spec does not say)."""
    return tuple(spec.layer_kinds) or ("decoder layer",) * max(spec.num_layers, 1)


def _given_layer_types(config) -> list | None:
    """The config's ``layer_types`` list when it is a value a copy can be given: not a property computed from other
    fields (jamba's ``layer_types``; recurrent_gemma's, bamba's and falcon_h1's, whose ``attribute_map`` makes
    ``layer_types`` an alias of a read-only ``layers_block_type``)."""
    name = getattr(type(config), "attribute_map", {}).get("layer_types", "layer_types")
    if isinstance(getattr(type(config), name, None), property):
        return None
    types = getattr(config, "layer_types", None)
    return list(types) if isinstance(types, list | tuple) and types else None


def plan(spec, by_layer_types: bool = True) -> LayerPlan:
    """The layers to trace for ``spec``: by its ``layer_types`` when it has them and ``by_layer_types``,
    else its first layers; raises ``UserError`` when a kind first appears beyond ``MAX_TRACED_LAYERS``."""
    kinds = model_kinds(spec)
    firsts: dict[str, int] = {}
    for i, kind in enumerate(kinds[1:], 1):
        firsts.setdefault(kind, i)
    if not firsts:  # a 1-layer model: trace two of its kind, as for any other
        return LayerPlan(2, None, (kinds[0], kinds[0]))
    types = _given_layer_types(spec.hf_config) if by_layer_types else None
    if types is not None and len(types) == len(kinds):
        at = [0, *firsts.values()]
        return LayerPlan(len(at), tuple(types[i] for i in at), tuple(kinds[i] for i in at))
    depth = max(firsts.values()) + 1
    if depth > MAX_TRACED_LAYERS:
        kind, first = max(firsts.items(), key=lambda item: item[1])
        raise UserError(f"Cannot derive a memory recipe for {spec.model_type}: its first {kind} layer is layer "
                        f"{first}, beyond the {MAX_TRACED_LAYERS} layers a derivation traces; use --exact.")
    return LayerPlan(depth, None, kinds[:depth])


def small_config(config, layer_plan: LayerPlan):
    """A copy of ``config`` with the plan's layers."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = layer_plan.layers
    types = layer_plan.layer_types
    if types is None and _given_layer_types(config) is not None:
        types = _given_layer_types(config)[: layer_plan.layers]
    if types is not None:
        small.layer_types = list(types)
    return small


def extra_layers(spec, traced: tuple[str, ...] | list[str]) -> dict[str, int]:
    """Layers of each kind the model has beyond the traced model's (the first layer is traced as itself)."""
    have = list(model_kinds(spec)[1:])
    if len(have) + 1 != spec.num_layers:  # a spec without kinds: every layer is the traced second's kind
        have = [traced[1]] * (spec.num_layers - 1)
    out = {kind: have.count(kind) for kind in dict.fromkeys(have)}
    for kind in traced[1:]:
        out[kind] = out.get(kind, 0) - 1
    return {k: n for k, n in out.items() if n}


def kinds_note(spec) -> str:
    """A sentence naming the layer kinds of a model with more than one (empty otherwise)."""
    kinds = model_kinds(spec)
    if len(set(kinds)) < 2:
        return ""
    counts = ", ".join(f"{kinds.count(k)} x {k}" for k in dict.fromkeys(kinds))
    return f"layer kinds: {counts}; the derived recipe traces one layer of each and extrapolates each kind."
