"""Loading a checkpoint onto a CUDA device, as the caching allocator sees it: what stays reserved afterwards.

``from_pretrained(..., device_map={"": cuda})`` moves each checkpoint tensor to the device in the load dtype
(a CPU-to-CUDA copy that changes the dtype converts on the host first: ``copy_kernel_cuda`` in
``aten/src/ATen/native/cuda/Copy.cu``, so an fp32 checkpoint loaded as bf16 never holds fp32 on the
device). A plain model keeps each tensor as it lands. A 4-bit (QLoRA) base quantizes each projection where
it lands, one tensor at a time (transformers' bitsandbytes quantizer -> ``Params4bit._quantize`` ->
``bitsandbytes.functional.quantize_4bit``, bitsandbytes 0.50.2), which allocates and frees, per projection:

1. the weight in the load dtype (``--dtype``), ``2 n`` bytes for bf16 (``n`` weights);
2. ``absmax``, one fp32 per 64 weights, then the packed payload, ``n / 2`` bytes (``quantize_4bit``'s
   CUDA op allocates ``absmax`` first);
3. with double quantization: ``offset = absmax.mean()`` (a scalar), ``absmax - offset`` (fp32, as large as
   ``absmax``), the nested 8-bit code (256 fp32), the uint8 ``absmax`` and its fp32 second-level absmax
   (``quantize_blockwise``); then the temporary and the fp32 ``absmax`` are freed;
4. the load-dtype weight is freed when ``Params4bit`` takes the packed payload.

What is kept is a few small tensors after each large freed block: the caching allocator splits the cached
``2 n``-byte block for the next projection's smaller tensors (best fit), so reserved memory grows well past
what the quantized model holds. ``loading_replay`` runs that stream through ``memory/allocator.py``: the
reserved peak of loading and what stays reserved afterwards (no ``empty_cache`` follows in transformers or
memfit). The model is walked in its order: embedding, each decoder layer's projections (``spec.linears``,
grouped by name) and its other parameters (norms, biases) as one tensor, the final norm, the head.

Known error: the checkpoint's tensor order (safetensors files are read in key order, which sorts layer 10
before layer 2) and transformers' parallel loading (``HF_ENABLE_PARALLEL_LOADING``, off by default) change
which freed blocks later tensors land in (transformers 5.25 loads in ``dot_natural_key`` order: ``lm_head``
first, layers by number, a layer's names alphabetically, ``core_model_loading.py`` L1885; ``memory.host_loading``
follows it on a CPU); LLM.int8()'s quantization (an fp16 copy, the int8 weight, row scales) is not replayed here
(an 8-bit base is replayed as its stored tensors); a random base memfit builds on the device before it quantizes
it (``quant_support.quantized_copy``: the whole model in ``--dtype``, freed before loading) is not replayed.
bitsandbytes' CPU path is ``memory.host_loading``'s, checked against the tensor counter. Not yet checked on a GPU
(``bench/gpu_allocator_check.py`` measures the step).

A stack whose trainer builds its 4-bit base on the device (torchtune: ``settings.stack.Trainer.nf4_on_build``) runs
torchao's ``to_nf4`` per projection instead of steps 1-4 (``memory.torchao_nf4``, ``quantizer``). With torchao 0.1
(torchtune v0.1) the build is three passes of it, one layer, its deep copies and the checkpoint copied in on the
device (``memory.torchtune_build``): against torchtune's Llama-2 7B QLoRA tutorial (9.13 GB = 8.50 GiB reserved after
init) the replay gives 8.49 GiB (one pass per projection: 7.35 GiB).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from memfit.memory.alloc_stream import predicted_reserved
from memfit.memory.allocator_config import AllocatorSettings, settings_from_env
from memfit.memory.quantized import NESTED_BLOCK, NF4_BLOCK
from memfit.memory.torchao_nf4 import kept_keys, to_nf4_events
from memfit.memory.torchtune_build import build_events
from memfit.settings.config import Quantize, RunConfig
from memfit.settings.stack import Stack
from memfit.units import dtype_bytes

#: The nested state's dynamic 8-bit code (``create_dynamic_map``): 256 fp32 values, one tensor per projection.
NESTED_CODE_BYTES = 256 * 4


@dataclass(frozen=True)
class LoadingReplay:
    """The replay of loading one rank's model (bytes)."""

    peak_reserved: int
    """``max_memory_reserved`` while loading."""
    reserved_after: int
    """Reserved once loading is done (kept: nothing calls ``empty_cache``)."""
    allocated_after: int
    """What the loaded model's tensors hold (blocks as handed out)."""
    peak_allocated: int = 0
    """``max_memory_allocated`` while loading (set by ``moved_off_replay``, whose model leaves the device)."""


def layer_projections(spec) -> list[int]:
    """Elements of each projection weight of one decoder layer, in ``spec.linears``' order."""
    layers = max(spec.num_layers, 1)
    return [lin.in_features * lin.out_features for lin in spec.linears for _ in range(lin.count // layers)]


def other_elements(spec) -> int:
    """Parameters outside the projections, the embedding and the head, per decoder layer (norms, biases)."""
    rest = spec.params - spec.linear_params - spec.embedding_params - spec.lm_head_params
    return max(rest, 0) // max(spec.num_layers, 1)


def quantize_events(numel: int, keys, compute_bytes: int) -> list[tuple]:
    """A 4-bit projection's events (module docstring, steps 1-4); keeps the packed payload and its state."""
    blocks = math.ceil(numel / NF4_BLOCK)
    weight, absmax, packed, offset, shifted, code, qabsmax, absmax2 = (next(keys) for _ in range(8))
    return [("alloc", weight, numel * compute_bytes, 0), ("alloc", absmax, blocks * 4, 0),
            ("alloc", packed, math.ceil(numel / 2), 0), ("alloc", offset, 4, 0),
            ("alloc", shifted, blocks * 4, 0), ("alloc", code, NESTED_CODE_BYTES, 0),
            ("alloc", qabsmax, blocks, 0), ("alloc", absmax2, 4 * math.ceil(blocks / NESTED_BLOCK), 0),
            ("free", shifted), ("free", absmax), ("free", weight)]


def quantizer(stack: Stack | None) -> str:
    """Who quantizes a 4-bit base on the device for ``stack`` (None: memfit's own): ``bitsandbytes`` as the
    checkpoint is loaded (this module), or torchao's ``to_nf4`` as the model is built (``memory.torchao_nf4``):
    ``torchao`` searching in chunks, ``torchao-0.1`` over the whole projection."""
    if stack is None or not stack.traits.nf4_on_build:
        return "bitsandbytes"
    return "torchao" if stack.nf4_chunked() else "torchao-0.1"


def _projection_events(numel: int, keys, compute: int, who: str) -> list[tuple]:
    """One 4-bit projection's events: bitsandbytes' (module docstring, steps 1-4) or torchao's ``to_nf4``."""
    if who == "bitsandbytes":
        return quantize_events(numel, keys, compute)
    return to_nf4_events(numel, keys, chunked=who == "torchao")


def loading_events(spec, run: RunConfig, stack: Stack | None = None) -> list[tuple]:
    """The allocation stream of loading ``spec`` for ``run`` onto one device (module docstring)."""
    return _events(spec, *_stream_settings(spec, run, stack))


def _stream_settings(spec, run: RunConfig, stack: Stack | None) -> tuple:
    """What decides the loading stream, ``_events``' arguments after the model: the quantization, the load dtype's
    bytes (the weight a 4-bit projection is quantized from), the bytes per unquantized parameter, who quantizes
    (``quantizer``) and, for torchtune v0.1's build (``memory.torchtune_build``), each projection's adapters."""
    who = quantizer(stack)
    return (run.quantize, _load_bytes(run), _rest_bytes(run), who,
            layer_adapters(spec, run) if who == "torchao-0.1" else ())


def _load_bytes(run: RunConfig) -> int:
    """Bytes per weight a projection arrives in before it is quantized: 4 for ``--dtype fp32``, else 2."""
    return 4 if str(run.dtype) == "fp32" else 2


def layer_adapters(spec, run: RunConfig) -> tuple[tuple[int, int], ...]:
    """For each projection of a decoder layer (``layer_projections``' order), the elements of the LoRA ``A`` and ``B``
    it carries, (0, 0) where it carries none (the targets as ``spec.lora_linears`` matches them)."""
    names = {lin.name for lin in spec.lora_linears(run.lora.targets)} if run.lora.r else set()
    layers = max(spec.num_layers, 1)
    return tuple((run.lora.r * lin.in_features, lin.out_features * run.lora.r) if lin.name in names else (0, 0)
                 for lin in spec.linears for _ in range(lin.count // layers))


def _events(spec, quantize: Quantize, compute: int, rest_bytes: int, who: str = "bitsandbytes",
            adapters: tuple[tuple[int, int], ...] = ()) -> list[tuple]:
    """``loading_events`` from what decides it (``_stream_settings``)."""
    import itertools

    if quantize is Quantize.Q4 and who == "torchao-0.1":
        projections = tuple(layer_projections(spec))
        return build_events(projections, adapters or ((0, 0),) * len(projections), spec.num_layers,
                            other_elements(spec) * rest_bytes, spec.embedding_params * rest_bytes,
                            spec.lm_head_params * rest_bytes)
    keys = itertools.count()
    plain = 1 if quantize is Quantize.Q8 else rest_bytes  # bytes per projection weight as kept

    def kept(nbytes: int) -> tuple:
        return ("alloc", next(keys), int(nbytes), 0)

    events = [kept(spec.embedding_params * rest_bytes)]
    for _ in range(spec.num_layers):
        for numel in layer_projections(spec):
            events += _projection_events(numel, keys, compute, who) if quantize is Quantize.Q4 else [kept(numel * plain)]
        events.append(kept(other_elements(spec) * rest_bytes))
    if spec.lm_head_params:
        events.append(kept(spec.lm_head_params * rest_bytes))
    return events


def _rest_bytes(run: RunConfig) -> int:
    """Bytes per parameter of what is not quantized (``memory.quantized.unquantized_bytes``'s rule)."""
    from memfit.memory.quantized import unquantized_bytes

    return unquantized_bytes(run) if run.quantize is not Quantize.NONE else int(dtype_bytes(str(run.dtype)))


def loading_replay(spec, run: RunConfig, settings: AllocatorSettings | None = None,
                   stack: Stack | None = None) -> LoadingReplay | None:
    """``loading_events`` through the caching allocator model (None for a backend memfit does not model).

    Cached per model, load dtype, quantization, quantizer and allocator settings (and the adapters, for torchtune
    v0.1's build): the planner asks for it once per candidate, and only those decide the stream."""
    settings = settings_from_env() if settings is None else settings
    return _replay(spec, _stream_settings(spec, run, stack), settings)


def moved_off_events(spec, run: RunConfig, stack: Stack | None = None) -> list[tuple]:
    """One decoder layer's 4-bit projections quantized on the device, each moved off it once quantized: a
    low-memory loading (``settings.stack.Trainer.low_memory_loading``). Each projection's stream is steps 1-4 of
    the module docstring, then its packed payload and quantization state are freed (``.to("cpu")`` / ``"meta"``:
    fsdp_qlora e877dda ``train.py`` L216-220, transformers 4.4x ``_load_state_dict_into_meta_model``). Every layer
    repeats the same sizes into the same cached blocks, so one layer reaches the whole loading's reserved peak."""
    import itertools

    keys = itertools.count()
    events: list[tuple] = []
    for numel in layer_projections(spec):
        stream = _projection_events(numel, keys, _load_bytes(run), quantizer(stack))
        events += stream + [("free", key) for key in kept_keys(stream)]
    return events


def moved_off_replay(spec, run: RunConfig, settings: AllocatorSettings | None = None,
                     stack: Stack | None = None) -> LoadingReplay | None:
    """``moved_off_events`` through the caching allocator model: the reserved peak of a low-memory loading, the
    largest projection's transient; nothing of the model stays allocated (known error: fsdp_qlora quantizes with
    a thread pool, ``parallel(..., threadpool=True)`` L626, so several projections can be in flight at once)."""
    settings = settings_from_env() if settings is None else settings
    result = predicted_reserved(moved_off_events(spec, run, stack), settings)
    if result is None:
        return None
    s = result.stats
    return LoadingReplay(s.peak_reserved, s.reserved, s.allocated, s.peak_allocated)


@functools.lru_cache(maxsize=64)
def _replay(spec, stream: tuple, settings: AllocatorSettings) -> LoadingReplay | None:
    result = predicted_reserved(_events(spec, *stream), settings)
    if result is None:
        return None
    s = result.stats
    return LoadingReplay(s.peak_reserved, s.reserved, s.allocated)
