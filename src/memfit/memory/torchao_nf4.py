"""torchao's ``to_nf4`` on the device, as the caching allocator sees it: the allocation stream of one projection.

torchtune builds its 4-bit base on the device: the recipe instantiates the model under ``with
utils.set_default_dtype(self._dtype), self._device`` (torchtune@0914d5c ``recipes/lora_finetune_single_device.py``
L254), and each quantized ``LoRALinear`` builds a bf16 ``nn.Linear`` there and calls ``to_nf4(linear.weight)``
(``torchtune/modules/peft/lora.py`` L93-94); with torchao 0.2.0 and later the checkpoint is copied in afterwards on
the host (``NF4Tensor.copy_`` quantizes the CPU tensor, then copies the inner tensors; torchtune v0.1 with torchao
0.1 copies it in on the device and clones every layer through ``to_nf4``: ``memory.torchtune_build``).
So what the device sees is ``NF4Tensor.from_tensor`` (torchao 0.1 ``dtypes/nf4tensor.py`` L220-446) of ``n`` bf16
weights, blocks of 64, scaler blocks of 256:

1. the bf16 weight, ``2 n`` (freed once the projection is built: ``linear`` is a local);
2. ``double_quantize_scalers``: ``get_block_absmax``'s ``blocks.abs()``, ``2 n`` (freed); kept: the int8 scalers,
   ``n / 64``, the ``quantization_factor`` (a view of an ``(n / 64)``-element bf16 tensor: ``n / 32``) and the mean;
3. ``convert_to_norm_float_weight``: ``blocks.abs()`` again (``2 n``, freed), ``scaled_blocks = blocks / scales``
   (``2 n``); ``quantize_tensor_nearest`` compares every weight with the 16 codes in bf16: ``value - nf4`` (``32 n``),
   ``.abs()`` (``32 n``; the difference is freed), ``min(dim=-1)``'s values (``2 n``) and int64 indices (``8 n``);
   then ``indices[::2] << 4`` (``4 n``), ``| indices[1::2]`` (``4 n``) and ``.to(torch.uint8)``: ``n / 2`` kept.

torchao 0.2.0 (``nf4tensor.py`` L33 ``CHUNK_SIZE = 1024**2``, L645-651) runs step 3's search in chunks of ``C``
weights into a uint8 buffer of ``n`` bytes: ``32 C``, ``32 C``, ``2 C``, ``8 C`` and ``C`` (the chunk's ``uint8``) per
chunk, then ``<< 4`` and ``|`` on uint8 (``n / 2`` each, the second kept: ``.to(torch.uint8)`` returns it).

Known error: the double quantization's other temporaries (the ``max`` values and indices, ``n / 64`` elements each,
the scaled, rounded and clamped scalers: at most ``n / 8`` bytes together, freed within step 2) and the LoRA adapters
built beside each projection (``r (in + out)`` bf16) are left out; chunks after the second repeat the first's sizes
into the same cached blocks, so two stand for all of them.
"""

from __future__ import annotations

import math

#: torchao 0.2.0's ``CHUNK_SIZE``: weights per chunk of the nearest-code search.
CHUNK_SIZE = 1024**2
NF4_CODES = 16
BF16 = 2
INT64 = 8


def to_nf4_events(numel: int, keys, chunked: bool, built: bool = True) -> list[tuple]:
    """The events of building one bf16 projection of ``numel`` weights and quantizing it (module docstring); the
    kept tensors (packed data, scalers, quantization factor, mean) stay allocated. ``built`` False: quantize a bf16
    tensor the caller holds (a dequantized clone, a copied-in checkpoint tensor), neither allocated nor freed here."""
    weight, table, absmax, scalers, factor, mean, scaled = (next(keys) for _ in range(7))
    events = [("alloc", weight, numel * BF16, 0)] if built else []
    events += [("alloc", table, NF4_CODES * BF16, 0),
              ("alloc", absmax, numel * BF16, 0), ("free", absmax), ("alloc", mean, BF16, 0),
              ("alloc", scalers, numel // 64, 0), ("alloc", factor, numel // 64 * BF16, 0)]
    absmax = next(keys)
    events += [("alloc", absmax, numel * BF16, 0), ("free", absmax), ("alloc", scaled, numel * BF16, 0)]
    events += _chunked_search(numel, keys) if chunked else _whole_search(numel, keys)
    return events + [("free", scaled)] + ([("free", weight)] if built else [])


def kept_keys(events: list[tuple]) -> list:
    """The keys a stream allocates and does not free: what the quantized tensor holds."""
    freed = {e[1] for e in events if e[0] == "free"}
    return [e[1] for e in events if e[0] == "alloc" and e[1] not in freed]


def original_weight_events(numel: int, keys) -> tuple[object, list[tuple]]:
    """torchao 0.1's ``NF4Tensor.get_original_weight`` (``nf4tensor.py`` L409-435) of ``numel`` weights: the key of
    the bf16 result (``2 n``, left allocated) and the events. ``quantized_data >> 4`` and ``& 0b1111`` (uint8, ``n / 2``
    each, freed) widened to int64 (``4 n`` each), their codes looked up in bf16 (``n`` each), the scalers
    dequantized (``n / 32`` twice, the first freed), ``repeated.flatten()`` materialising the expanded scalers (``n``,
    freed) for each half's product (``n`` each), then ``torch.stack`` (``2 n``; ``reshape`` is a view). Everything but
    the result is a local, freed on return."""
    (narrow1, wide1, narrow2, wide2, codes1, codes2, scalers1, scalers2,
     flat1, half1, flat2, half2, result) = (next(keys) for _ in range(13))
    half = numel // 2
    events = [("alloc", narrow1, half, 0), ("alloc", wide1, half * INT64, 0), ("free", narrow1),
              ("alloc", narrow2, half, 0), ("alloc", wide2, half * INT64, 0), ("free", narrow2),
              ("alloc", codes1, half * BF16, 0), ("alloc", codes2, half * BF16, 0),
              ("alloc", scalers1, numel // 64 * BF16, 0), ("alloc", scalers2, numel // 64 * BF16, 0),
              ("free", scalers1),
              ("alloc", flat1, half * BF16, 0), ("alloc", half1, half * BF16, 0), ("free", flat1),
              ("alloc", flat2, half * BF16, 0), ("alloc", half2, half * BF16, 0), ("free", flat2),
              ("alloc", result, numel * BF16, 0)]
    return result, events + [("free", k) for k in (wide1, wide2, codes1, codes2, scalers2, half1, half2)]


def _whole_search(numel: int, keys) -> list[tuple]:
    """torchao 0.1's nearest-code search over the whole projection, then the packing (keeps the packed data)."""
    diff, diff_abs, values, indices, shifted, combined, packed = (next(keys) for _ in range(7))
    return [("alloc", diff, numel * NF4_CODES * BF16, 0), ("alloc", diff_abs, numel * NF4_CODES * BF16, 0),
            ("free", diff), ("alloc", values, numel * BF16, 0), ("alloc", indices, numel * INT64, 0),
            ("free", diff_abs), ("free", values), ("alloc", shifted, numel // 2 * INT64, 0),
            ("alloc", combined, numel // 2 * INT64, 0), ("free", shifted), ("alloc", packed, numel // 2, 0),
            ("free", combined), ("free", indices)]


def _chunked_search(numel: int, keys) -> list[tuple]:
    """torchao 0.2.0's search in chunks of ``CHUNK_SIZE`` into a uint8 buffer, then the packing on uint8."""
    buffer = next(keys)
    events = [("alloc", buffer, numel, 0)]
    full, rest = divmod(numel, CHUNK_SIZE)
    for size in [CHUNK_SIZE] * min(full, 2) + ([rest] if rest else []):
        diff, diff_abs, values, indices, small = (next(keys) for _ in range(5))
        events += [("alloc", diff, size * NF4_CODES * BF16, 0), ("alloc", diff_abs, size * NF4_CODES * BF16, 0),
                   ("free", diff), ("alloc", values, size * BF16, 0), ("alloc", indices, size * INT64, 0),
                   ("free", diff_abs), ("free", values), ("alloc", small, size, 0), ("free", small),
                   ("free", indices)]
    shifted, packed = next(keys), next(keys)
    return events + [("alloc", shifted, math.ceil(numel / 2), 0), ("alloc", packed, math.ceil(numel / 2), 0),
                     ("free", shifted), ("free", buffer)]
