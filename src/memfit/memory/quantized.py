"""The bytes of a bitsandbytes-quantized base (QLoRA), read off bitsandbytes 0.50.2 and PEFT 0.21.

One place for what a quantized base holds and allocates; ``memory.estimate`` reads it for the weights
and the step's transients, and the measurement (``memory.measure.resident_tensors`` with
``quant_support.quant_state_tensors``) counts the same tensors on a real run
(``bench/quant_memory.py``, ``tests/test_quant_accuracy.py``).
"""

from __future__ import annotations

import math

from memfit.config import Quantize

#: bitsandbytes' NF4 block: one absmax per 64 weights (``BitsAndBytesConfig`` -> ``Linear4bit``'s default
#: ``blocksize=64``; ``functional.quantize_4bit``).
NF4_BLOCK = 64

#: Double quantization (``bnb_4bit_use_double_quant=True``, memfit's setting): the fp32 absmax values are
#: themselves quantized to uint8 in blocks of 256, with one fp32 absmax per block
#: (``functional.quantize_4bit``: ``quantize_blockwise(absmax - offset, blocksize=256)``).
NESTED_BLOCK = 256

#: Per 4-bit layer, tensors whose size does not depend on the weight: the NF4 code (16 fp32), the nested
#: state's dynamic 8-bit code (256 fp32, ``create_dynamic_map``; a new tensor per layer, not shared), and
#: ``offset`` (an fp32 scalar). Counted on a real model: 14 layers held 14 x (64 + 1,024 + 4) bytes.
NF4_FIXED_BYTES = 16 * 4 + 256 * 4 + 4


def nf4_bytes(numel: int) -> int:
    """Bytes of one NF4 weight of ``numel`` elements with double quantization: the packed uint8 payload
    (2 weights per byte, ``Params4bit`` of shape ``(ceil(numel / 2), 1)``), one uint8 absmax per 64 weights,
    one fp32 second-level absmax per 256 of those, and the fixed tables (``NF4_FIXED_BYTES``).
    About 0.5 + 1/64 + 4/16,384 = 0.516 bytes per weight (Dettmers et al. 2023, "Double Quantization")."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + NF4_FIXED_BYTES


def int8_bytes(in_features: int, out_features: int) -> int:
    """Bytes of one LLM.int8() weight: int8 ``(out, in)`` plus ``SCB``, one fp32 scale per output row
    (``Int8Params``; ``Linear8bitLt._save_to_state_dict`` saves only ``SCB`` beside it)."""
    return in_features * out_features + 4 * out_features


def packed_bytes(spec, run) -> int:
    """Bytes of every quantized projection of ``spec`` (transformers quantizes each decoder-layer ``Linear``;
    the embeddings, norms and the output head stay unquantized)."""
    if run.quantize is Quantize.Q4:
        return sum(lin.count * nf4_bytes(lin.in_features * lin.out_features) for lin in spec.linears)
    return sum(lin.count * int8_bytes(lin.in_features, lin.out_features) for lin in spec.linears)


def storage_bytes(spec, run) -> int:
    """Bytes of the quantized projections' parameters alone (``Params4bit``: 2 weights per byte;
    ``Int8Params``: 1 per byte), without their quantization state: what FSDP2 shards and all-gathers for a
    4-bit base whose storage is a float dtype (``quant_support.bnb_config``); the state (absmax, codes) is
    an attribute of the module, kept whole on every rank (``packed_bytes - storage_bytes``)."""
    if run.quantize is Quantize.Q4:
        return sum(lin.count * math.ceil(lin.in_features * lin.out_features / 2) for lin in spec.linears)
    return sum(lin.count * lin.in_features * lin.out_features for lin in spec.linears)


#: PEFT's ``prepare_model_for_kbit_training`` (``peft/utils/other.py``: "cast all non INT8 parameters to
#: fp32") casts every fp16/bf16 parameter that is not a ``Params4bit`` to fp32: embeddings, norms, the output
#: head and biases of a QLoRA model are fp32 whatever ``--dtype`` says; the residual stream, which starts at
#: the embedding, is fp32 too.
UNQUANTIZED_BYTES = 4


def dequantized_transient(spec, run) -> int:
    """Bytes of the largest quantized projection's weight dequantized for one matmul, alive only inside
    that layer's forward or backward (what a bitsandbytes layer allocates beyond a plain ``Linear``).

    - 4-bit (bitsandbytes 0.50.2): forward, ``bitsandbytes::gemm_4bit``'s default kernel
      (``backends/default/ops.py`` ``_gemm_4bit_default_impl``) dequantizes the nested absmax to fp32 and the
      whole weight to the input's dtype (the compute dtype), then runs ``linear``; backward,
      ``MatMul4Bit.backward`` (``autograd/_functions.py``) runs ``dequantize_4bit(B, state)`` (the dtype the
      weight had when it was quantized: ``--dtype``) ``.to(grad_output.dtype)`` (the compute dtype: a second
      copy when they differ). Charged: the weight in both dtypes (one when equal) + the fp32 absmax.
    - 8-bit on the CPU (``MatMul8bitFp``, the training path ``bnb.matmul`` takes for CPU tensors): forward
      ``state.CB.data.to(A.dtype).mul_(SCB / 127)``, backward ``state.CB.to(dtype_A, copy=True)``: the weight
      in the input's dtype (the fp32 residual stream after PEFT's cast) + the fp32 row scales.
      On CUDA ``MatMul8bitLt`` runs int8 kernels instead; the same bytes are charged (an over-estimate there,
      not verified on a GPU).

    The live-tensor counter (``memory.measure``) sees the backward copies (Python autograd code) and the
    8-bit forward one, but not the 4-bit forward's: it is made inside one custom operator, whose own
    allocations a dispatch mode does not see. Known error: charged at the peak of a layer's forward and
    backward although the largest projection's matmul may not be where the rest of that layer peaks.
    """
    if run.quantize is Quantize.NONE or not spec.linears:
        return 0
    lin = max(spec.linears, key=lambda x: x.in_features * x.out_features)
    numel = lin.in_features * lin.out_features
    if run.quantize is Quantize.Q4:
        from memfit.quant_support import compute_bytes

        loaded = 2 if str(run.dtype) in ("bf16", "fp16") else 4
        c = compute_bytes(run)
        return numel * (loaded + (c if c != loaded else 0)) + 4 * math.ceil(numel / NF4_BLOCK)
    return numel * UNQUANTIZED_BYTES + 4 * lin.out_features
