"""AMP's half-precision weight copies: what autocast casts, caches and saves for backward, in bytes.

Read by the analytic estimate (``memory.estimate``) at each moment of the step: the cache alive in forward,
the copies ``linear`` saves for backward, those alive one layer into backward. Source: torch's
``aten/src/ATen/autocast_mode.cpp`` (``cached_cast``); each function says what it was measured against.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory.activations import Precisions
from memfit.settings.config import Quantize, RunConfig
from memfit.spec.linears import ATTN_IN
from memfit.spec.model import ModelSpec


@dataclass(frozen=True)
class AutocastCopies:
    """AMP's half-precision weight copies (``autocast_weight_copies`` and below), bytes."""

    forward: int
    """Alive in forward: the autocast cache of every weight cast so far."""
    saved: int
    """Saved for backward by the linears (the cache itself is cleared when forward returns)."""
    in_recompute: int
    """Alive one layer into backward (fewer at the first layer's moment)."""



def autocast_weight_copies(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Half-precision copies of weights alive at the end of forward under autocast.

    Under ``mixed_precision`` fp16/bf16 with fp32 weights, every ``linear`` casts its weight to the compute
    dtype. For trainable leaf weights the copy is cached for the whole forward (torch autocast's weight
    cache, cleared when the autocast context exits); frozen ones (LoRA base) are cast per call and live
    only while ``linear`` saves them for the input gradient. Full fine-tune: decoder projections + head
    (all cached). LoRA: the copies saved for backward (``autocast_copies_saved``). QLoRA: every adapter's
    copy (cached, checkpointed or not) and the head's (saved): measured on real tensors
    (bench/quant_memory.py --quick, 4-bit, bf16, checkpointing: 131,072 B of adapter copies and the
    head's 131,072 B at the forward's peak).
    Source: ``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``. 0 without autocast or when the weights
    are already in the compute dtype (pure bf16).
    """
    if _half_base_adapters(run, prec):
        return int(spec.lora_params(run) * prec.c)
    if not prec.amp or prec.w == prec.c:
        return 0
    if run.quantize is not Quantize.NONE:
        return int((_head_params(spec) + spec.lora_params(run)) * prec.c)
    if run.is_lora():
        return autocast_copies_saved(spec, run, prec)
    return int((spec.linear_params + _head_params(spec)) * prec.c)


def _half_base_adapters(run: RunConfig, prec: Precisions) -> bool:
    """LoRA on a half-precision base (plain, or a lean QLoRA's) under autocast: ``prec.amp`` is False (nothing of
    the base is cast) but the fp32 adapters are, cached like any trainable weight and saved by their ``linear``:
    their copies alone (real tensors, bench/quant_memory.py --quick, bf16 base and autocast: 131,072 B of adapter
    copies at the forward's peak, -3.9% on it without them)."""
    return run.is_lora() and str(run.mixed_precision) in ("bf16", "fp16") and prec.w == prec.c != prec.adapter


def _head_params(spec: ModelSpec) -> int:
    return spec.lm_head_params or spec.vocab_size * spec.hidden_size


def _autocast_copied_linear_params(spec: ModelSpec, run: RunConfig) -> int:
    """Decoder-projection weights autocast casts: none for a quantized base (bitsandbytes dequantizes per
    call, ``memory.quantized.dequantized_transient``, and its autograd functions keep no weight copy)."""
    return 0 if run.quantize is not Quantize.NONE else spec.linear_params


def autocast_copies_saved(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Half weight copies that ``linear`` saves for backward, alive from the end of forward into backward.

    Without checkpointing: every projection's and the head's copy, except, under LoRA, the projections
    reading the first layer's input (q/k/v, qkv_proj, c_attn: their input needs no gradient, so they save
    nothing); plus the (cached) adapter copies. With checkpointing the layers save only their input, so
    only the head's copy survives forward. Freed layer by layer in backward. QLoRA: the adapters' and the
    head's (``_autocast_copied_linear_params``).
    """
    if _half_base_adapters(run, prec):
        return 0 if run.grad_checkpointing else int(spec.lora_params(run) * prec.c)
    if not prec.amp or prec.w == prec.c:
        return 0
    head = _head_params(spec)
    if run.grad_checkpointing:
        return int(head * prec.c)
    layers = _autocast_copied_linear_params(spec, run)
    if run.is_lora():
        if layers:
            layers -= sum(lin.in_features * lin.out_features for lin in spec.linears if lin.name in ATTN_IN)
        layers += spec.lora_params(run)
    return int((layers + head) * prec.c)


def autocast_copies_in_recompute(spec: ModelSpec, run: RunConfig, prec: Precisions, saved: int) -> int:
    """Half weight copies alive one layer into backward (``saved``: those alive at its start).

    QLoRA with checkpointing under autocast: the head's copy is freed by the head's backward, and the
    recomputed layer's ``linear`` calls save their adapters' cast weights (the recompute runs under the forward's
    autocast, ``torch.utils.checkpoint``): one layer's adapter copies. Measured (bench/quant_memory.py --quick,
    4-bit, bf16): 53,248 B of adapter copies at the first layer's peak (the down projection's already
    freed: this charges 65,536) and no head copy (charged as ``saved``, 131,072 B: +1.7% on the backward).
    Other runs: ``saved`` (not re-measured for a plain LoRA, whose head copy is held to the trace).
    """
    if not run.grad_checkpointing or not (saved or _half_base_adapters(run, prec)):
        return saved
    if run.quantize is Quantize.NONE and not _half_base_adapters(run, prec):
        return saved
    return int(spec.lora_params(run) / max(spec.num_layers, 1) * prec.c)


def autocast_copies_saved_per_layer(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Of ``autocast_copies_saved``, those one decoder layer above the first holds (its projections' and
    adapters' half weight copies: ``linear`` saves its cast weight), freed when that layer's backward is
    done. 0 with checkpointing (a layer saves only its input; its recompute's copies are its backward's
    transient) and without autocast."""
    if run.grad_checkpointing or not (prec.amp and prec.w != prec.c or _half_base_adapters(run, prec)):
        return 0
    layers = _autocast_copied_linear_params(spec, run) if prec.amp else 0
    layers += spec.lora_params(run) if run.is_lora() else 0
    return int(layers * prec.c / max(spec.num_layers, 1))
