"""The states a step holds throughout, as the stack that runs it holds them (``memfit.settings.stack``).

``memory.states.model_states`` gives memfit's own layout (FSDP2, PEFT's fp32 adapters, bitsandbytes' base);
each stack's differences are applied here, in one place, by the modules that price them: FSDP (1)'s flat
parameters (``memory.flat_params``), FSDP2's MixedPrecisionPolicy and torchtitan's root unit, adapters in the compute dtype, a quantized
head, a sharded quantization state and an older transformers' rotary caches (``memory.stack_terms``), Unsloth's
rotary caches (``memory.unsloth_layer``); and DPO's frozen reference copy (``memory.preference_terms``), which every
stack holds.
"""

from __future__ import annotations

import dataclasses

from memfit.memory import flat_params, unsloth_layer
from memfit.memory import preference_terms as pref
from memfit.memory import stack_terms as stacks
from memfit.memory.activations import Precisions
from memfit.memory.states import ModelStates, model_states
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack
from memfit.spec.model import ModelSpec


def resident_states(spec: ModelSpec, run: RunConfig, prec: Precisions, device: str, engine: str, rank: int | None,
            stack: Stack) -> tuple[ModelStates, stacks.HeadTerms, unsloth_layer.UnslothTerms | None]:
    """The resident states as ``stack`` holds them (FSDP (1)'s flat parameters, half gathered parameters, adapters'
    dtype, a quantized head, a sharded quantization state, Unsloth's rotary caches), DPO's reference copy included;
    and Unsloth's own layer and loss terms where they run (``memory.unsloth_layer``)."""
    states = model_states(spec, run, device, engine, rank, stack)
    states = stacks.adapter_states(spec, run, prec, states, stack)
    if flat_params.applies(run, stack, engine):  # FSDP (1)'s flat parameters instead of FSDP2's shards
        states = flat_params.flat_states(spec, run, states, device, stack)
    states = stacks.gathered_in_compute_dtype(spec, run, states, stack, device, engine, rank)
    states = stacks.root_unit_kept(spec, run, states, stack, engine)
    states = stacks.sharded_quant_state(spec, run, states, stack)
    head = stacks.quantized_head(spec, run, prec, stack)
    kernels = unsloth_layer.terms(spec, run, prec, stack)
    ref_copy = pref.reference_copy_bytes(spec, run)  # DPO's frozen copy of the base: weights beside the model's
    weights = states.weights + head.weights + stacks.single_quant_bytes(spec, run, stack) + ref_copy
    weights += stacks.rope_caches(spec, run, prec, stack)
    weights += kernels.buffers if kernels else 0
    return dataclasses.replace(states, weights=weights), head, kernels


def stack_notes(spec: ModelSpec, run: RunConfig, prec: Precisions, stack: Stack, engine: str,
                states: ModelStates) -> list[str]:
    """What an analytic estimate says about its stack: which one it priced and what of it memfit does not price;
    ``states``: the estimate's (``resident_states``), whose ``accumulated`` gradients FSDP (1)'s note states."""
    return (stacks.notes(stack) + flat_params.notes(spec, run, stack, engine, states.accumulated)
            + unsloth_layer.notes(spec, run, prec, stack))
