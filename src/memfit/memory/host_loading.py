"""Loading a quantized (QLoRA) base on a CPU, where the host is the device: the tensor peak memfit's counter sees.

``memory.loading`` prices loading on CUDA, as the caching allocator sees it; on a CPU there is no allocator, and the
loading phase's tensor peak is what ``memory.measure.counted`` counts (``training.phase_peaks``). Until the last
layer is in, that peak is not the loaded model: the tensor being quantized sits on top of what is loaded so far.

transformers 5.25's ``from_pretrained`` with an on-the-fly quantizer loads one checkpoint tensor at a time on the
calling thread (``core_model_loading.py`` L1866-1872: no thread pool when ``hf_quantizer`` is not pre-quantized),
in ``dot_natural_key`` order of the checkpoint's keys (L1885, L1498: ``lm_head`` before ``model.*``, layers by
number, names alphabetically within a layer: Llama's ``mlp.*`` before ``self_attn.*``). Per tensor of ``n``
elements:

1. safetensors maps it (``safe_open(...).get_slice(key)[...]``, ``_materialize_copy`` L1464): a storage over the
   file of ``n s`` bytes (``s``: the checkpoint's dtype), which the counter sees (``aten.set_``);
2. ``.to(dtype)`` (L1466): where the checkpoint's dtype is not the target, a copy of ``n t`` bytes, and the mapped
   storage is freed as ``_materialize_copy`` returns. The target is ``--dtype`` for a quantized projection (L1919:
   ``_dtype = dtype`` when the parameter needs quantization) and for the rest (the meta model's dtype, L1926);
3. a 4-bit projection: ``Bnb4bitQuantize.convert`` (``integrations/bitsandbytes.py`` L58) wraps it in
   ``Params4bit`` and ``.to(cpu)`` quantizes it (bitsandbytes 0.50.2 ``nn/modules.py`` L381 ``_quantize``,
   ``functional.quantize_4bit`` L929-951): ``memory.loading``'s steps 2-4 (the CPU op returns the packed payload and
   the fp32 ``absmax``, as the CUDA op does), plus the 16-fp32 NF4 code (``get_4bit_type``, L936), which is kept;
   the ``n t``-byte weight is freed once ``Params4bit`` holds the packed payload.
   An 8-bit projection: ``Int8Params._quantize`` (``nn/modules.py`` L737) copies the weight to fp16 (``n 2``
   bytes unless it is fp16 already) and ``int8_vectorwise_quant`` returns the int8 weight (``n``) and one fp32
   scale per output row, beside the ``n t``-byte weight until ``convert`` returns.

CPU against CUDA: on CUDA the mapped storage stays in host memory and only the ``--dtype`` copy reaches the device
(``memory.loading``); on a CPU both are in the one memory, so a checkpoint stored in another dtype than ``--dtype``
(fp32 loaded as bf16) peaks at ``n (s + t)`` on that tensor, above its quantization's ``n t + n / 2 + ...``.

Before the first tensor the model's buffers exist (rotary ``inv_freq``, built with the model); after the last, memfit
adds the LoRA adapters (``builder.parts.adapt``): the phase's peak is the larger of this stream's and the finished
model's (``memory.states.model_states``' weights). Random weights (a preset, a bare config.json) come from a model
memfit builds whole in ``--dtype``, saves in ``--dtype`` and drops before loading it back quantized
(``quant_support.quantized_copy``): the larger of that model and the stream. Known error: a layer's other parameters (norms, biases: summed,
``memory.loading``) are taken as loaded before its projections, where Llama's ``post_attention_layernorm`` comes
after its MLP's (over by one norm); the final norm is spread over the layers; a checkpoint whose keys are renamed
as they load (transformers' ``WeightConverter``) keeps the model's order here.

Measured (tests/test_quant_loading_measured.py: a 2-layer hidden-256 Llama, vocabulary 384, saved in 16-17
safetensors shards, loaded by ``training.setup.build_model`` with LoRA r 8 under ``memory.measure.counted``), peak
against this prediction: 4-bit, bf16 loaded as bf16 1,287,272 B / 1,282,008 B (the finished model with its adapters
is the peak: +0.41%, LoRA's initialisation temporaries); fp32 as bf16 1,630,516 / 1,631,796; bf16 as fp32 2,025,268
/ 2,027,572; fp32 as fp32 1,848,216 / 1,850,456; 8-bit, fp32 as fp32 2,572,288 / 2,574,592 (-0.1% each). The
finished model alone, the prediction before, was 10% to 27% under (4-bit) and 3% to 14% (8-bit).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from memfit.memory.loading import other_elements, quantize_events
from memfit.settings.config import Quantize, RunConfig
from memfit.units import dtype_bytes


@dataclass(frozen=True)
class LoadedFrom:
    """Where a quantized base's weights come from, which decides its loading on a CPU."""

    dtype: str | None = None
    """The checkpoint's dtype (None: ``--dtype``)."""
    random: bool = False
    """Random weights memfit builds in ``--dtype``, saves in ``--dtype`` and loads back quantized
    (``quant_support.quantized_copy``): the whole unquantized model is held once, before it is saved and dropped."""


#: bitsandbytes' NF4 lookup table (``functional.get_4bit_type``): 16 fp32 values, one tensor per 4-bit projection.
NF4_CODE_BYTES = 16 * 4


def host_loading_events(spec, run: RunConfig, stored: str | None = None) -> list[tuple]:
    """The live-tensor stream of loading ``spec``'s checkpoint quantized for ``run`` on a CPU (module docstring):
    ``("alloc", key, bytes)`` and ``("free", key)``; ``stored``: the checkpoint's dtype (None: ``--dtype``, as
    memfit's own copy of a random base is saved, ``quant_support.quantized_copy``)."""
    return _events(spec, run.quantize, str(run.dtype), stored)


def _events(spec, quantize: Quantize, dtype: str, stored: str | None) -> list[tuple]:
    """``host_loading_events`` from what decides it: the quantization, ``--dtype`` and the checkpoint's dtype."""
    load = int(dtype_bytes(dtype))
    file = int(dtype_bytes(stored)) if stored else load
    keys = itertools.count()
    events: list[tuple] = [("alloc", next(keys), int(spec.buffer_bytes))]

    def plain(numel: int) -> None:  # an unquantized tensor: mapped, converted where the dtype differs, kept
        events.extend(_materialized(numel, file, load, keys)[0])

    if spec.lm_head_params:
        plain(spec.lm_head_params)
    plain(spec.embedding_params)
    for _ in range(spec.num_layers):
        plain(other_elements(spec))
        for numel, out_features in layer_projections_in_order(spec):
            mapped, weight = _materialized(numel, file, load, keys)
            events += mapped + _quantized(quantize, dtype, numel, out_features, weight, keys)
    return events


def _materialized(numel: int, file: int, target: int, keys) -> tuple[list[tuple], int]:
    """Steps 1-2: the mapped storage and, where the dtypes differ, its copy (the mapping freed); with the key of
    the tensor that is left."""
    mapped = next(keys)
    events = [("alloc", mapped, numel * file)]
    if file == target:
        return events, mapped
    copy = next(keys)
    return events + [("alloc", copy, numel * target), ("free", mapped)], copy


def _quantized(quantize: Quantize, dtype: str, numel: int, out_features: int, weight: int, keys) -> list[tuple]:
    """Step 3 for one projection whose ``dtype`` weight is ``weight`` (already counted)."""
    if quantize is Quantize.Q4:
        stream = quantize_events(numel, keys, int(dtype_bytes(dtype)))[1:]  # its first event, the weight: counted
        return stream[:-1] + [("alloc", next(keys), NF4_CODE_BYTES), ("free", weight)]
    fp16 = weight if dtype == "fp16" else next(keys)  # ``.to(dtype=torch.float16)``: no copy when fp16
    as_fp16 = [] if fp16 == weight else [("alloc", fp16, numel * 2)]
    return [*as_fp16, ("alloc", next(keys), numel), ("alloc", next(keys), 4 * out_features),
            ("free", fp16), ("free", weight)]


def layer_projections_in_order(spec) -> list[tuple[int, int]]:
    """(elements, output features) of one decoder layer's projections in the order transformers loads them:
    ``dot_natural_key`` of their names (``spec.linear_modules``' first layer; ``spec.linears``' order without
    names)."""
    # Inside: transformers takes 1.1 s to import (quant_support), and the estimate imports this module.
    from transformers.core_model_loading import dot_natural_key

    first = [(name, i, o) for name, i, o in spec.linear_modules if _layer_index(name) == 0]
    if not first:
        layers = max(spec.num_layers, 1)
        return [(lin.in_features * lin.out_features, lin.out_features)
                for lin in spec.linears for _ in range(lin.count // layers)]
    return [(i * o, o) for _, i, o in sorted(first, key=lambda m: dot_natural_key(m[0]))]


def _layer_index(name: str) -> int | None:
    """The decoder layer a module name belongs to: its first numeric part (``model.layers.3.mlp.up_proj``: 3)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def tensor_peak(events: list[tuple]) -> tuple[int, int]:
    """(peak, held at the end) of the bytes ``events`` hold, counted as memfit's tensor counter does."""
    live: dict = {}
    held = peak = 0
    for event in events:
        if event[0] == "alloc":
            live[event[1]] = event[2]
            held += event[2]
            peak = max(peak, held)
        else:
            held -= live.pop(event[1], 0)
    return peak, held


def host_loading_peak(spec, run: RunConfig, loaded_from: LoadedFrom | None = None) -> int:
    """The tensor peak of loading a quantized base on a CPU (0 for an unquantized one: ``memory.phases`` prices it):
    ``host_loading_events``' and, for random weights, the unquantized model memfit builds first (its parameters in
    ``--dtype`` and its buffers)."""
    if run.quantize is Quantize.NONE:
        return 0
    loaded_from = loaded_from or LoadedFrom()
    stream = _stream_peak(spec, run.quantize, str(run.dtype), loaded_from.dtype)
    built = spec.params * int(dtype_bytes(str(run.dtype))) + spec.buffer_bytes if loaded_from.random else 0
    return max(stream, built)


@functools.lru_cache(maxsize=64)
def _stream_peak(spec, quantize: Quantize, dtype: str, stored: str | None) -> int:
    """Cached per model and what decides the stream: the planner prices every sharded 4-bit candidate's export with
    it (``memory.outside``), 43 ms a call for an 80-layer model."""
    return tensor_peak(_events(spec, quantize, dtype, stored))[0]
