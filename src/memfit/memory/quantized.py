"""The bytes of a bitsandbytes-quantized base (QLoRA), read off bitsandbytes 0.50.2 and PEFT 0.21.

One place for what a quantized base holds and allocates; ``memory.estimate`` reads it for the weights
and the step's transients, and the measurement (``memory.measure.resident_tensors`` with
``quant_support.quant_state_tensors``) counts the same tensors on a real run
(``bench/quant_memory.py``, ``tests/test_quant_accuracy.py``).
"""

from __future__ import annotations

import json
import math

from memfit.integrations.quant_support import compute_bytes
from memfit.integrations.quant_support import unquantized_bytes as rule
from memfit.settings.config import Quantize
from memfit.spec.linears import ATTN_IN
from memfit.units import torch_dtype_name

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


def nf4_bytes(numel: int, double_quant: bool = True) -> int:
    """Bytes of one NF4 weight of ``numel`` elements with double quantization: the packed uint8 payload
    (2 weights per byte, ``Params4bit`` of shape ``(ceil(numel / 2), 1)``), one uint8 absmax per 64 weights,
    one fp32 second-level absmax per 256 of those, and the fixed tables (``NF4_FIXED_BYTES``).
    About 0.5 + 1/64 + 4/16,384 = 0.516 bytes per weight (Dettmers et al. 2023, "Double Quantization").
    ``double_quant=False`` (``compress_statistics=False``: litgpt's ``bnb.nf4``): one fp32 absmax per 64
    weights and the NF4 code alone (16 fp32): 0.5 + 4/64 = 0.5625 bytes per weight."""
    blocks = math.ceil(numel / NF4_BLOCK)
    if not double_quant:
        return math.ceil(numel / 2) + 4 * blocks + 16 * 4
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


#: A 4-bit projection's quantization state as ``state_dict()`` packs it (``QuantState.as_dict(packed=True)``,
#: bitsandbytes 0.50.2 ``functional.py`` L572-577): its non-tensor items, JSON-encoded into a uint8 tensor
#: (``utils.pack_dict_to_tensor`` L176-178). ``nested_offset`` is the mean of the fp32 absmax, which JSON writes with
#: up to 17 significant digits (a typical value here, ~20 characters: the known error, a few bytes per projection).
PACKED_STATE_ITEMS = {"quant_type": "nf4", "blocksize": NF4_BLOCK, "dtype": "float32", "shape": None,
                      "nested_blocksize": NESTED_BLOCK, "nested_dtype": "float32", "nested_offset": 0.012345678901234567}


def state_dict_bytes(spec, run) -> int:
    """Bytes a quantized base's ``state_dict()`` creates beyond the tensors the model holds, alive while a
    checkpoint or an export is written (each save takes one state dict, then drops it).

    - 4-bit, per projection (``Linear4bit._save_to_state_dict``, ``nn/modules.py`` L605-607, calls ``as_dict``):
      ``nested_quant_map``, a clone of the nested state's 256-fp32 code (``functional.py`` L563: "un-shared ...
      removed by safetensors"), and ``PACKED_STATE_ITEMS`` as JSON bytes, its ``dtype`` the weight's as quantized
      (``--dtype``). The packed weight, ``absmax`` and ``quant_map`` are the held tensors, not copies.
    - 8-bit, per projection (``Linear8bitLt._save_to_state_dict`` L1114): a 1-byte ``weight_format`` tensor.

    Measured (2-layer hidden-64 Llama, 14 4-bit projections, ``model.state_dict()`` under memfit's counter):
    16,681 bytes beyond the held tensors; this gives 16,694.
    """
    if run.quantize is Quantize.NONE:
        return 0
    if run.quantize is Quantize.Q8:
        return sum(lin.count for lin in spec.linears)
    dtype = torch_dtype_name(run.dtype)
    total = 0
    for lin in spec.linears:
        items = {**PACKED_STATE_ITEMS, "dtype": dtype, "shape": [lin.out_features, lin.in_features]}
        total += lin.count * (256 * 4 + len(json.dumps(items).encode()))
    return total


def storage_bytes(spec, run) -> int:
    """Bytes of the quantized projections' parameters alone (``Params4bit``: 2 weights per byte;
    ``Int8Params``: 1 per byte), without their quantization state: what FSDP2 shards and all-gathers for a
    4-bit base whose storage is a float dtype (``quant_support.bnb_config``); the state (absmax, codes) is
    an attribute of the module, kept whole on every rank (``packed_bytes - storage_bytes``)."""
    if run.quantize is Quantize.Q4:
        return sum(lin.count * math.ceil(lin.in_features * lin.out_features / 2) for lin in spec.linears)
    return sum(lin.count * lin.in_features * lin.out_features for lin in spec.linears)


def unquantized_bytes(run) -> int:
    """Bytes per element of what a quantized base keeps unquantized (embeddings, norms, head, biases), hence of
    its residual stream: the one rule, ``quant_support.unquantized_dtype`` (fp32 under ``--qlora-upcast full``,
    PEFT's kbit cast; ``--dtype`` under the lean default), which the builder applies too."""

    return rule(run)


def projection_output_bytes(run, c: int, device: str) -> int:
    """Bytes per element of what a quantized projection returns for the residual stream's input (``c``: the
    compute dtype's bytes), hence of the MLP's I-wide tensors and their gradients.

    - 4-bit: ``Linear4bit.forward`` casts its input to ``bnb_4bit_compute_dtype`` and its output back with
      ``.to(inp_dtype)`` (bitsandbytes 0.50.2 ``nn/modules.py``): the input's dtype, the stream's
      (``unquantized_bytes``: fp32 after PEFT's cast, ``--dtype`` when lean).
    - 8-bit on the CPU: ``MatMul8bitFp.forward`` calls ``torch.nn.functional.linear`` inside the autograd
      function, so under autocast the output is ``c`` (measured: bf16 gate/up outputs); without autocast fp32.
    - 8-bit on CUDA: ``MatMul8bitLt`` returns ``int8_scaled_mm(..., dtype=A.dtype)``: the input's dtype (read
      in the source, not measured on a GPU).
    """
    if run.quantize is Quantize.Q8 and device == "cpu":
        return c
    return unquantized_bytes(run)


def int8_input_groups(spec, run, prec, device: str,
                      keeps_4bit_input: bool = False) -> dict[str, tuple[int, int, tuple[str, ...]]]:
    """The inputs a decoder layer's 8-bit projections keep alive as ``ctx.A``: role -> (width, bytes per
    element, the projections reading it); empty for an unquantized base, and for a 4-bit one unless
    ``keeps_4bit_input`` (bitsandbytes before 0.43.2, ``memfit.settings.stack.Stack.keeps_4bit_input``: its
    ``MatMul4Bit.forward`` keeps ``ctx.tensors = (A, B)``, the same kind of attribute, 0.42.0
    ``autograd/_functions.py`` L523).

    ``MatMul8bitFp.forward`` (CPU) stores its input as a Python attribute ``ctx.A = A``, and ``MatMul8bitLt``
    (CUDA) in ``ctx.tensors``, not through ``save_for_backward`` (bitsandbytes 0.50.2
    ``autograd/_functions.py``; ``MatMul4Bit`` keeps only the packed weight), with two consequences:

    - autograd's engine frees a node's saved variables after it runs (``release_variables``) but not its
      ``ctx`` attributes: they live until the graph itself is freed, after backward, when the loss is dropped;
    - checkpointing's saved-tensor hooks (``torch.utils.checkpoint``, non-reentrant) never see them, so a
      checkpointed layer keeps them from its forward to the end of backward, beside its input.

    One tensor per group of projections reading it. Roles: ``attn_in`` (the first norm's output, read by
    q/k/v: the stream's ``prec.w``), ``attn_out`` (the attention output: ``prec.c``), ``mlp_in`` (the second
    norm's output: ``prec.w``), ``mlp_mid`` (the MLP product: ``projection_output_bytes``). Measured on the
    CPU (bench/quant_memory.py --quick, 8-bit, fp32, non-reentrant checkpointing): the forward's peak held
    659,084 bytes beyond the layers' inputs; these groups give 655,360 (2 layers x 128 tokens x 2,560 B).
    """
    if run.quantize is Quantize.NONE or (run.quantize is Quantize.Q4 and not keeps_4bit_input):
        return {}

    groups: dict[str, tuple[int, int, tuple[str, ...]]] = {}
    for lin in spec.linears:
        if lin.name in ATTN_IN:
            role, nbytes = "attn_in", prec.w
        elif lin.in_features == spec.intermediate_size and lin.out_features == spec.hidden_size:
            role, nbytes = "mlp_mid", projection_output_bytes(run, prec.c, device)
        elif lin.out_features == spec.hidden_size:
            role, nbytes = "attn_out", prec.c
        else:
            role, nbytes = "mlp_in", prec.w
        names = groups[role][2] if role in groups else ()
        groups[role] = (lin.in_features, nbytes, (*names, lin.name))
    return groups


def dequantized_transient(spec, run, phase: str = "backward") -> int:
    """Bytes of the largest quantized projection's weight dequantized for one matmul, alive only inside
    that layer's ``phase`` (``forward`` or ``backward``): what a bitsandbytes layer allocates beyond a
    plain ``Linear``.

    - 4-bit (bitsandbytes 0.50.2): forward, ``bitsandbytes::gemm_4bit``'s default kernel
      (``backends/default/ops.py`` ``_gemm_4bit_default_impl``) dequantizes the nested absmax to fp32 and the
      whole weight to the input's dtype (the compute dtype), then runs ``linear``; backward,
      ``MatMul4Bit.backward`` (``autograd/_functions.py``) runs ``dequantize_4bit(B, state)`` (the dtype the
      weight had when it was quantized: ``--dtype``) ``.to(grad_output.dtype)`` (the compute dtype: a second
      copy when they differ). Charged: forward, the weight in the compute dtype; backward, in both dtypes
      (one when equal); + the fp32 absmax.
    - 8-bit on the CPU (``MatMul8bitFp``, the training path ``bnb.matmul`` takes for CPU tensors): forward
      ``state.CB.data.to(A.dtype).mul_(SCB / 127)`` (the stream's dtype for the norm-fed projections)
      and, under autocast, ``linear``'s cast of it to the compute dtype; backward
      ``state.CB.to(dtype_A, copy=True)``: the weight in the input's dtype. + the fp32 row scales.
      On CUDA ``MatMul8bitLt`` runs int8 kernels instead; the same bytes are charged (an over-estimate there,
      not verified on a GPU).

    The live-tensor counter (``memory.measure``) sees the backward copies (Python autograd code) and the
    8-bit forward one, but not the 4-bit forward's: it is made inside one custom operator, whose own
    allocations a dispatch mode does not see. Known error: charged at the peak of a layer's forward and
    backward although the largest projection's matmul may not be where the rest of that layer peaks; in
    the forward, the layer's own intermediates beside it (I-wide, the checkpointed forward's too) are not
    charged (hidden 512, intermediate 2,048, 64 tokens, bf16: the counter saw 3.4% more inside the last
    layer's forward than charged there, without the bf16 weight it cannot see: within it in reality);
    8-bit backward: the norm-fed projections' fp32 copy, over by half for a down projection whose input is
    half precision (8-bit under CPU autocast).
    """
    if run.quantize is Quantize.NONE or not spec.linears:
        return 0
    lin = max(spec.linears, key=lambda x: x.in_features * x.out_features)
    numel = lin.in_features * lin.out_features

    c = compute_bytes(run)
    if run.quantize is Quantize.Q4:
        loaded = 2 if str(run.dtype) in ("bf16", "fp16") else 4
        per_weight = c if phase == "forward" else loaded + (c if c != loaded else 0)
        return numel * per_weight + 4 * math.ceil(numel / NF4_BLOCK)
    autocast = str(run.mixed_precision) in ("bf16", "fp16")
    autocast_copy = c if phase == "forward" and autocast else 0
    return numel * (unquantized_bytes(run) + autocast_copy) + 4 * lin.out_features
