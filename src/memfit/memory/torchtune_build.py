"""torchtune v0.1's QLoRA model build and checkpoint copy on the device, as the caching allocator sees them.

torchtune v0.1 (it pins ``torchao==0.1``: 0914d5c ``pyproject.toml`` L24; v0.2.0 pins 0.3.1) builds a 4-bit Llama on
the device in the recipe's dtype (``recipes/lora_finetune_single_device.py`` L254 ``with
utils.set_default_dtype(self._dtype), self._device``) in three passes, each running torchao's ``to_nf4`` over every
projection it touches (``memory.torchao_nf4``):

1. **One layer.** ``lora_llama2`` builds a single ``TransformerDecoderLayer`` (``models/llama2/_component_builders.py``
   L199-231): each projection's bf16 ``nn.Linear`` quantized by ``to_nf4`` (``modules/peft/lora.py`` L93-94), its
   bf16 LoRA ``A`` and ``B`` beside it, then the two norms; then the bf16 embedding and head (L233-240) (the final
   norm's few bytes are counted with the layers' norms).
2. **Its clones.** ``TransformerDecoder`` deep-copies that layer once per layer (``modules/transformer.py`` L137
   ``_get_clones``, L93 ``copy.deepcopy``). A parameter's deep copy clones its tensor, and torchtune registers
   ``NF4Tensor``'s ``clone`` as ``to_nf4(get_original_weight())`` (``utils/_register_nf4_dispatch_ops.py`` L12-19,
   imported by ``modules/peft/lora.py`` L15): every projection of every layer is dequantized on the device
   (``torchao_nf4.original_weight_events``) and quantized again; the adapters and norms are plain copies. The
   first layer is freed when ``lora_llama2`` returns.
3. **The checkpoint copy.** ``model.load_state_dict`` (recipe L267) copies each checkpoint tensor in, and for an
   ``NF4Tensor`` torchtune's ``inplace_copy`` (L22-42; registered over torchao's own ``copy_``, which quantizes on
   the host: torchao's ``implements`` overwrites the op's entry, ``nf4tensor.py`` L28-35; torchtune v0.2 keeps it
   only for torchao older than 0.2.0) moves the host tensor to the device, quantizes it there and points the
   parameter at the new inner tensors, freeing the old ones. The embedding, norms and head are copied in place.

The interleaving of kept tensors (a projection's packed data, a few MiB) with freed ``68 n``-byte transients is what
the allocator keeps reserved: for Llama-2 7B this replay reaches 8.49 GiB reserved after init, against torchtune's
tutorial's 9.13 GB (8.50 GiB: ``docs/source/tutorials/qlora_finetune.rst`` L166); one pass of ``to_nf4`` per
projection (the stream memfit replayed before this module) gives 7.35 GiB.

Known error: the checkpoint tensor is taken to arrive in bf16; an fp16 one (Llama-2-7b-hf's ``.bin`` files) gets a
bf16 copy beside it inside ``to_nf4`` (2 n bytes of one projection at a time; the Llama-2 7B replay reads 8.49 GiB
either way); the RoPE cache (a few MiB) and ``to_nf4``'s small temporaries (``memory.torchao_nf4``) are left out;
the projections are built in ``spec.linears``' order (torchtune builds gate, down, up; the replay is the same).
"""

from __future__ import annotations

import itertools

from memfit.memory.torchao_nf4 import BF16, kept_keys, original_weight_events, to_nf4_events


def build_events(projections: tuple[int, ...], adapters: tuple[tuple[int, int], ...], layers: int, norms: int,
                 embedding: int, head: int) -> list[tuple]:
    """The allocation stream of torchtune v0.1 building and loading a model with a 4-bit base (module docstring).

    ``projections``: the weights of each projection of a decoder layer (``spec.linears``' order); ``adapters``: for
    each, the LoRA ``A`` and ``B`` elements it carries ((0, 0) where none); ``layers``: how many decoder layers;
    ``norms``, ``embedding``, ``head``: bytes of a layer's other parameters, of the embedding and of the head."""
    keys = itertools.count()

    def alloc(nbytes: int) -> tuple[object, tuple]:
        key = next(keys)
        return key, ("alloc", key, int(nbytes), 0)

    def adapter_events(index: int) -> tuple[list, list[tuple]]:
        made = [alloc(n * BF16) for n in adapters[index] if n]
        return [k for k, _ in made], [e for _, e in made]

    # 1. one layer, quantized as it is built; the embedding and head
    events: list[tuple] = []
    first: list = []
    for index, numel in enumerate(projections):
        stream = to_nf4_events(numel, keys, chunked=False)
        owned, made = adapter_events(index)
        events += stream + made
        first += kept_keys(stream) + owned
    if norms:
        key, event = alloc(norms)
        events.append(event)
        first.append(key)
    events += [alloc(nbytes)[1] for nbytes in (embedding, head) if nbytes]
    # 2. every layer a deep copy of it: each projection dequantized and quantized again
    built: list[list[list]] = []
    for _ in range(layers):
        layer = []
        for index, numel in enumerate(projections):
            weight, stream = original_weight_events(numel, keys)
            quantized = to_nf4_events(numel, keys, chunked=False, built=False)
            events += stream + quantized + [("free", weight)] + adapter_events(index)[1]
            layer.append(kept_keys(quantized))
        events += [alloc(norms)[1]] if norms else []
        built.append(layer)
    events += [("free", k) for k in first]
    # 3. the checkpoint: each projection moved to the device, quantized there, the old inner tensors freed
    for layer in built:
        for index, numel in enumerate(projections):
            source, event = alloc(numel * BF16)
            quantized = to_nf4_events(numel, keys, chunked=False, built=False)
            events += [event, *quantized, *(("free", k) for k in layer[index]), ("free", source)]
            layer[index] = kept_keys(quantized)
    return events
