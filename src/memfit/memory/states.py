"""What a rank holds for the model itself: weights, gradients, optimizer state, their step temporaries,
and the unsharded parameters FSDP2/ZeRO gather (``ModelStates``, ``model_states``).

Part of the analytic estimator (``memory.estimate`` composes its phases from these states, ``memory.derive``
and ``memory.outside`` read them too); kept apart so that those modules depend on it and not on each
other. Each term says its formula, its source and how far off it is known to be, as in ``memory.estimate``.

Size: ``fsdp2_gathered`` is over 60 lines, most of them the measurements each term is checked against;
its terms share the same unit boundaries (tail, layers, embedding) and are read together.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.integrations import quant_support
from memfit.memory import quantized
from memfit.memory.deepspeed_layout import zero_states
from memfit.settings.config import Offload, Quantize, RunConfig, Sharding
from memfit.spec.engines import shard_group_size
from memfit.spec.model import ModelSpec
from memfit.spec.optimizers import row

FP32_BYTES = 4  # DeepSpeed steps fp32 master partitions: its optimizer state is fp32 whatever the weights

@dataclass(frozen=True)
class ModelStates:
    """Per-rank bytes of weights, gradients and optimizer state, plus step-time temporaries."""

    weights: int
    gradients: int
    optimizer: int
    step_temporary: int
    """Extra bytes alive only inside ``optimizer.step()`` (foreach temporaries)."""
    gathered: int
    """FSDP/ZeRO: unsharded parameters alive while forward and backward compute (temporary)."""
    gathered_end: int = 0
    """FSDP/ZeRO: what the last unit to finish backward holds at the end of backward (temporary)."""
    buckets: int = 0
    """DDP: the gradient buckets' flat buffers, resident for the whole run (counted as gradients); the
    gradients are views into them (``gradients`` is then 0: ``ddp_bucket_bytes``)."""
    gathered_forward: int | None = None
    """FSDP/ZeRO: the unsharded bytes at forward's peak where they differ from ``gathered`` (ZeRO-2's
    all-gather buffers: ``fsdp2_gathered``); None: the same as ``gathered``."""
    released_per_layer: int = 0
    """Of ``gathered``, what each layer frees after its backward (FSDP2 zero2: ``released_after_backward``)."""
    backward_gradients: int = 0
    """Gradients that exist whole from backward's start (DeepSpeed ZeRO-2's flat gradient partition,
    ``memory.deepspeed_layout``); they then do not build up layer by layer. 0: they build up (or live in
    ``buckets``)."""
    gradients_after_layers: int = 0
    """How many decoder layers backward has finished when ``backward_gradients`` appear (DeepSpeed ZeRO-2:
    0 on the last rank, later on the others: ``deepspeed_layout.partition_reached``)."""
    engine: str = "fsdp2"
    """The sharding engine these states model (``deepspeed_layout.ENGINES``)."""

    gathered_layer: int | None = None
    """FSDP/ZeRO: the unsharded bytes while a decoder layer computes (its forward, its backward) where they
    differ from ``gathered`` (``fsdp``/``zero3``: two layers, the tail not; ``fsdp2_gathered``)."""

    gathered_entry: int = 0
    """FSDP/ZeRO: the unsharded bytes as the last layer enters its forward (``fsdp``/``zero3``: three layers,
    and a tied tail; 0 where no such moment is modelled; ``fsdp2_gathered``)."""
    gathered_first_entry: int = 0
    """FSDP/ZeRO: the same as the first layer enters its forward, where the unit before it is the embedding's
    (tied: the tail's, kept gathered); 0 where not modelled."""
    reducing: int = 0
    """FSDP2: the reduce-scatter input of the layer above, still held while a layer computes its backward
    (``fsdp2_gathered``); 0 unsharded."""
    gathered_start: int | None = None
    """FSDP2: the unsharded bytes at backward's start where they differ from ``gathered`` (``fsdp2_gathered``)."""
    unit_gradients: int = 0
    """FSDP (1): the gradients alive as the top layer's flat gradient is concatenated (its views' and the
    concatenation, the head's held beside them; ``memory.flat_params``); 0: no such moment."""
    accumulated: int | None = None
    """The gradients a micro-batch keeps for the next under gradient accumulation, where they are not ``gradients``
    (FSDP (1) under ``no_sync``: every trainable unit's unsharded flat gradient, ``memory.flat_params``); None:
    ``gradients``."""

    @property
    def from_backward_start(self) -> int:
        """The ``backward_gradients`` that exist from backward's start (none when they appear later)."""
        return 0 if self.gradients_after_layers else self.backward_gradients

    @property
    def forward_gathered(self) -> int:
        """The unsharded bytes alive at forward's peak (``gathered`` unless ZeRO-2's forward differs)."""
        return self.gathered if self.gathered_forward is None else self.gathered_forward

    @property
    def layer_gathered(self) -> int:
        """The unsharded bytes alive while a decoder layer computes (``gathered`` unless it differs)."""
        return self.gathered if self.gathered_layer is None else self.gathered_layer


# ----------------------------------------------------------------------------------------------
# Model states
# ----------------------------------------------------------------------------------------------
def model_states(spec: ModelSpec, run: RunConfig, device: str = "cuda", engine: str = "fsdp2",
                 rank: int | None = None, stack=None) -> ModelStates:
    """Weights, gradients and optimizer state per rank.

    Full fine-tune: weights and grads at the stored dtype (fp32 stays fp32 under AMP: autocast casts
    on the fly, it never changes ``param.dtype``), optimizer state from ``optimizer_state_bytes``.
    LoRA: frozen base at its dtype (or quantized), adapters in fp32 (PEFT's ``autocast_adapter_dtype=True``
    upcasts bf16/fp16 adapters to fp32), grads and optimizer state for adapters only.
    Sharding (``num_processes`` > 1): FSDP/ZeRO-3/ZeRO-2 (all FSDP2) divide all three by N (hybrid: by the
    processes of one node, ``engines.shard_group_size``; ``memory.hybrid_shard`` writes the terms out) and gather
    parameters while computing (``fsdp2_gathered``); DDP divides nothing and keeps gradient buckets
    (``ddp_bucket_bytes``). Offload moves optimizer state (and with ``params`` the weights) to CPU.
    ``device`` picks the optimizer implementation torch runs there (its step temporaries).
    ``engine="deepspeed"`` with ``--sharding zero2|zero3`` on several processes: DeepSpeed's layout instead
    (``memory.deepspeed_layout.zero_states``; ``rank``: which rank, None the last; ``stack``: whose ZeRO-3 build).
    Ignores: FSDP's flat-parameter padding (< N elements per tensor), the optimizer's ``step`` scalars
    (fp32, one per tensor: < 1 MiB).
    """
    w = weight_bytes(run)
    trainable = spec.trainable_params(run)
    grad_bytes = 4 if run.is_lora() else w
    weights = base_weight_bytes(spec, run) + (spec.lora_params(run) * 4 if run.is_lora() else 0)
    gradients = trainable * grad_bytes
    optimizer = optimizer_state_bytes(spec, run, trainable, grad_bytes)
    step_temp = optimizer_step_temporary(spec, run, trainable, grad_bytes, device)
    n = run.num_processes
    if engine == "deepspeed" and n > 1 and run.sharding in (Sharding.ZERO2, Sharding.ZERO3):
        zero = zero_states(spec, run, device, optimizer_state_bytes(spec, run, trainable, FP32_BYTES), rank, stack)
        return ModelStates(zero.weights, zero.gradients, zero.optimizer, zero.step_temporary, zero.gathered,
                           zero.gathered_end, zero.buckets, gathered_forward=zero.gathered_forward,
                           backward_gradients=zero.backward_gradients, gradients_after_layers=zero.after_layers,
                           engine=engine)
    gathered, gathered_end, buckets = Gathered(0, 0), 0, 0
    if n > 1 and run.sharding is Sharding.DDP:
        buckets, gradients = ddp_bucket_bytes(gradients), 0  # param.grad are views into the buckets
        gathered_end = ddp_embedding_grad_end(spec, run)
    if n > 1 and run.sharding is not Sharding.DDP:
        gathered = fsdp2_gathered(spec, run)
        gathered_end = gathered.end
        shards = shard_group_size(run)  # every rank; under --sharding hybrid the ranks of one node (HSDP)
        replicated = quant_state_bytes(spec, run)  # module attributes, not parameters: whole on every rank
        weights = (weights - replicated) // shards + replicated
        gradients //= shards
        optimizer //= shards
        step_temp //= shards
    if run.offload in (Offload.OPTIMIZER, Offload.PARAMS):
        optimizer, step_temp = 0, 0  # the step runs on the CPU (DeepSpeed CPU Adam / FSDP offload)
    computing = gathered.computing
    if run.offload is Offload.PARAMS:
        computing = max(computing, 2 * gathered_layer_bytes(spec, run))
        weights = quant_state_bytes(spec, run)  # a 4-bit base's quantization state: module attributes, not offloaded
        # FSDP2's CPUOffloadPolicy copies every reduce-scattered gradient shard to the host
        # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce: ``.to("cpu")``), and
        # the optimizer steps there: no sharded gradient stays on the GPU. The unsharded gradients of the
        # unit being reduced are in ``gathered_end`` and the layers' backward transients.
        gradients = 0
    return ModelStates(int(weights), int(gradients), int(optimizer), int(step_temp), int(computing),
                       int(gathered_end), int(buckets), gathered_forward=gathered.forward,
                       gathered_layer=gathered.layer, gathered_entry=gathered.entry,
                       gathered_first_entry=gathered.first_entry, reducing=gathered.reducing,
                       gathered_start=gathered.start,
                       released_per_layer=released_after_backward(spec, run))


def ddp_embedding_grad_end(spec: ModelSpec, run: RunConfig) -> int:
    """DDP with bucket views at the end of backward: the input embedding's gradient is computed outside
    its bucket and copied in by DDP's hook, so for a moment it exists beside the bucket. Tied: the head's
    contribution, the embedding's and their sum, 3 copies (measured: smollm2-135m ddp on 2 CPU ranks,
    3 x 113 MB of TEMP at the peak, the end of backward; -2.8% without, +1.6% with: the estimate keeps the
    last activations alive there); untied: the gradient and its accumulated copy, 2 (not measured;
    tiny's embedding is too small to show). LoRA: a frozen embedding has no gradient."""
    if run.is_lora():
        return 0
    embed = spec.embedding_params or spec.vocab_size * spec.hidden_size
    return int((3 if spec.tie_word_embeddings else 2) * embed * weight_bytes(run))


def ddp_bucket_bytes(gradients: int) -> int:
    """DDP's gradient buckets: flat buffers the size of all trainable gradients, for the whole run.

    torch's ``Reducer`` allocates each bucket's flat tensor when DDP is built (``initialize_buckets``).
    memfit passes ``gradient_as_bucket_view=True`` (``training.sharding.accelerator_kwargs``), so every
    ``param.grad`` is a view into its bucket: the gradients live in these buffers (``model_states`` counts
    them here and 0 as ``gradients``), resident from the first step to the last, in forward too, where
    one process holds no gradients (grad_accum 1). A gradient autograd has just accumulated is copied
    into its bucket by DDP's hook and freed at once: one parameter's gradient transient, ignored (so
    backward's head/embedding gradients add nothing). Without views (torch's default) the buckets were a
    second copy: +538 MB per rank measured for smollm2-135m fp32 (bench/sharding_memory.py, 2026-11-29).
    """
    return int(gradients)


@dataclass(frozen=True)
class Gathered:
    """The unsharded bytes FSDP2 holds per rank at each moment it is modelled (``fsdp2_gathered``)."""

    computing: int
    """While forward and backward compute: the tail unit, and the layers gathered at once."""
    end: int
    """At backward's end: the last unit to finish, its full gradients (and late in backward, a layer's)."""
    forward: int | None = None
    """At forward's peak where it differs from ``computing`` (ZeRO-2's all-gather buffers); else None."""
    layer: int | None = None
    """While a decoder layer computes where it differs (``fsdp``/``zero3``: two layers); else None."""
    entry: int = 0
    """As the last layer enters its forward (``fsdp``/``zero3``); else 0."""
    first_entry: int = 0
    """As the first layer enters its forward (``fsdp``/``zero3``); else 0."""
    reducing: int = 0
    """While a layer below the top computes its backward: the layer above's reduce-scatter input, beyond
    ``layer`` (``fsdp``/``zero3``) or ``computing`` (``zero2``)."""
    start: int | None = None
    """At backward's start (the loss and the head's backward) where it differs from ``computing``
    (``fsdp``/``zero3``: the tail only); else None."""


def fsdp2_gathered(spec: ModelSpec, run: RunConfig) -> Gathered:
    """Unsharded bytes FSDP2 holds per rank (Accelerate's wrapping): while computing, at backward's end, at
    forward's peak where it differs (ZeRO-2; else None), while a decoder layer computes where it differs
    (``fsdp``/``zero3``; else None) and as the last and the first layer enter their forward (``fsdp``/``zero3``;
    else 0).

    Accelerate's ``fsdp2_prepare_model`` makes a unit of each decoder layer, one of the input embedding
    (untied only), one of [final norm, output head] (tied: and the embedding) with
    ``reshard_after_forward=False``, then the root. So while forward and backward compute:

    - the tail unit's full parameters, gathered at its first use and kept until its gradients are
      reduced (tied: from the embedding at forward start to the end of backward);
    - ``fsdp``/``zero3`` (reshard): the layer computing and the prefetched next one, 2 layers;
      ``zero2`` (no reshard): every layer (and an untied embedding) stays gathered from its forward to
      its backward, so at the end of forward all of them; and at backward's start FSDPMemTracker shows
      one more tail-sized all-gather buffer (smollm2-135m on 2 ranks: 113 MB under ``ALL_GATHER`` next to
      the 538 MB of unsharded parameters; measured, its cause in FSDP2 not pinned down), counted here.
      In forward instead, the last layer computes beside two layer-sized all-gather outputs (its own and
      the one prefetched; every layer is gathered again each step, since backward reshards them:
      ``released_after_backward``): FSDPMemTracker at the last layer's forward, ``ALL_GATHER`` = 2 layers
      on smollm2-135m (28.3 MB) and on the tiny preset (6.3 MB), where it is the step's peak (-3.8% without).

    At the end of backward the last unit to finish (tied: the tail with the embedding; untied: the
    embedding unit) holds its full parameters and full-size gradients: tied, the head's unsharded
    gradient, the embedding's and their sum (``AccumulateGrad``), 3 copies; untied, the embedding's
    gradient and the reduce-scatter input, 2; (tied) its sharded gradient does not exist yet, while the
    first layer's reduce-scatter buffer (a full layer's gradient) is still in flight. Frozen (LoRA) parameters
    have no gradient there. Measured on CPU/gloo with FSDPMemTracker (bench/sharding_memory.py: smollm2-135m
    on 2 ranks, at the peak 3 x 113 MB temporaries + 14 MB reduce-scatter); ignores the all-gather's flat
    output buffer (freed after copy-out).
    """
    u = unquantized_param_bytes(run)
    embed = spec.embedding_params or spec.vocab_size * spec.hidden_size
    head = 0 if spec.tie_word_embeddings else (spec.lm_head_params or spec.vocab_size * spec.hidden_size)
    norm = spec.hidden_size  # the final norm's weight
    tail = head + norm + (embed if spec.tie_word_embeddings else 0)
    layer_bytes = gathered_layer_bytes(spec, run)
    layers = (2 if run.sharding is not Sharding.ZERO2 else spec.num_layers) * layer_bytes
    untied_embed = embed if run.sharding is Sharding.ZERO2 and not spec.tie_word_embeddings else 0
    all_gather_buffer = tail if run.sharding is Sharding.ZERO2 else 0
    gathered = (tail + untied_embed + all_gather_buffer) * u + layers
    gathered_forward, gathered_layer, gathered_entry, gathered_first_entry = None, None, 0, 0
    if run.sharding is Sharding.ZERO2:
        gathered_forward = (tail + untied_embed) * u + layers + 2 * layer_bytes
    else:
        # While a layer computes (its forward, its backward) only two layers are gathered: its own parameters
        # and the next layer's all-gather output. The tail is gathered from the head's forward to the end of
        # its own backward, which comes before any layer's (FSDPParamGroup.post_backward reshards it).
        # FSDPMemTracker, tiny preset, LoRA and QLoRA on 2 ranks: at the last layer's backward 1 layer of
        # UNSHARDED_PARAM and 1 of ALL_GATHER, no tail (+3.0% of that peak with the tail counted).
        gathered_layer = layers
        # As a unit enters its forward (FSDPParamGroup.pre_forward: unshard, then wait_for_unshard) its new
        # all-gather output and its copied-out parameters exist beside the previous unit's all-gather output:
        # kept for overlap in ``comm_ctx.all_gather_state``, it is released in wait_for_unshard, but the
        # local ``prev_all_gather_state`` holds it until that function returns (torch 2.13
        # _fsdp_param_group.py). A tied tail, gathered at the embedding, stays gathered all forward.
        # FSDPMemTracker at PEAK_FW, 2 ranks: tiny preset LoRA, every layer 1 x 3.30 MB UNSHARDED_PARAM +
        # 2 x 3.30 MB ALL_GATHER, the step's peak at the last layer (-6.0% without); smollm2-135m (tied)
        # QLoRA, the first layer: 113.2 + 2.1 MB UNSHARDED_PARAM + 113.2 + 2.1 MB ALL_GATHER, the step's
        # peak (-16.2% without).
        kept_tail = tail * u if spec.tie_word_embeddings else 0
        gathered_entry = 3 * layer_bytes + kept_tail
        previous = 2 * tail * u if spec.tie_word_embeddings else embed * u  # untied: the embedding's output only
        gathered_first_entry = 2 * layer_bytes + previous
    last = tail if spec.tie_word_embeddings else embed
    grad_bytes = 0 if run.is_lora() else weight_bytes(run)  # adapters live in the layers; the tail's base is frozen
    copies = 3 if spec.tie_word_embeddings else 2
    # tied: the first layer's reduce-scatter is still in flight when the tail's embedding backward runs
    # (measured, smollm2-135m); untied: not seen at the embedding's end (tiny preset, 2 ranks).
    in_flight = _layer_params(spec) * grad_bytes if spec.tie_word_embeddings else 0
    # tied: the peak comes before the tail's reduce-scatter, so its shard (in ``gradients``) does not exist
    # yet; untied: during the embedding's reduce-scatter, whose output shard already does (a 6-layer Llama
    # and Qwen3 with a 16,384 x 512 untied embedding on 2 ranks: -2.7% without; FSDPMemTracker there:
    # 33.5 MB each of UNSHARDED_GRAD and REDUCE_SCATTER, 50.3 MB of TEMP, the embedding already resharded).
    not_yet_sharded = last // shard_group_size(run) if spec.tie_word_embeddings else 0
    gathered_end = last * u + (copies * last - not_yet_sharded) * grad_bytes + in_flight
    # Late in backward, any layer's: its full parameters and the next layer's all-gathered ahead, its
    # full-size gradients and the previous layer's reduce-scatter input in flight, while the last 2 layers'
    # sharded gradients do not exist yet (FSDPMemTracker, tiny preset on 2 ranks, steady state: 4 x 3.15 MB
    # of UNSHARDED_PARAM, ALL_GATHER, TEMP, REDUCE_SCATTER; the peak there, -8.9% without). Below the tied
    # tail's end (smollm2-135m) it changes nothing.
    layer = _layer_params(spec)
    late_layer = 2 * layer_bytes + (2 * layer - 2 * layer // shard_group_size(run)) * grad_bytes
    # While a layer computes its backward, the layer above's reduce-scatter input (its full-size gradients)
    # is still held: FSDP2 waits on a unit's reduce-scatter only when the next one is issued
    # (``FSDPParamGroup.post_backward``: ``comm_ctx.reduce_scatter_state``). Seen where a layer's own backward
    # holds much (a mixture-of-experts layer's partial expert gradients: FSDPMemTracker, 2-layer Mixtral on
    # 2 ranks, the first layer's backward: 443,904 B of REDUCE_SCATTER, one layer's fp32 gradients, beside
    # 937,728 B of TEMP; -4.3% of that peak without). Under LoRA the adapters' only. ``fsdp``/``zero3``: the
    # layer computing and the unit prefetched below it (a layer; the first layer's: the untied embedding,
    # nothing for a tied one, gathered in the tail) are in ``gathered_layer``'s two layers; what this adds
    # is the in-flight input beyond them (2-layer Mixtral above: the embedding prefetched, 282,624 B).
    reducing = layer * grad_bytes + (spec.lora_params(run) * 4 // max(spec.num_layers, 1) if run.is_lora() else 0)
    if run.sharding is not Sharding.ZERO2:
        below = layer_bytes if spec.num_layers >= 3 else (0 if spec.tie_word_embeddings else embed * u)
        reducing = max(0, layer_bytes + below + reducing - layers)
    # At backward's start (the loss, the head's backward) the layers are resharded since their forward and
    # none is prefetched yet: the tail only (FSDPMemTracker, 2-layer Mixtral on 2 ranks, micro-batch 2 x 64:
    # at the head's backward 282,880 B of UNSHARDED_PARAM, the tail, no ALL_GATHER; the first layer's
    # all-gather comes with the norm's backward, after the logits' gradients are freed; +10.4% over the
    # measured peak, the loss's moment, with two layers counted there).
    start = tail * u if run.sharding is not Sharding.ZERO2 else None
    return Gathered(int(gathered), int(max(gathered_end, late_layer)), gathered_forward, gathered_layer,
                    int(gathered_entry), int(gathered_first_entry), int(reducing), start)


def gathered_layer_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """Bytes of one decoder layer's FSDP2 unit when gathered: its parameters as stored (a 4-bit base's
    projections packed, ``memory.quantized.storage_bytes``, 2 weights per byte; its norms fp32 under
    PEFT's kbit cast; ``--dtype`` when lean) and its LoRA adapters (fp32). What each all-gather of a layer brings, and what a layer
    frees when it reshards. The quantization state is not gathered (it is whole on every rank)."""
    adapters = spec.lora_params(run) * 4 // max(spec.num_layers, 1) if run.is_lora() else 0
    if run.quantize is Quantize.NONE:
        return _layer_params(spec) * weight_bytes(run) + adapters

    rest = _layer_params(spec) - spec.linear_params // max(spec.num_layers, 1)
    return int(quantized.storage_bytes(spec, run) // max(spec.num_layers, 1) + rest * unquantized_param_bytes(run)
               + adapters)


def unquantized_param_bytes(run: RunConfig) -> int:
    """Bytes per parameter outside the quantized projections: ``memory.quantized.unquantized_bytes`` under
    QLoRA (fp32 with PEFT's kbit cast, ``--qlora-upcast full``), else the stored dtype."""
    if run.quantize is Quantize.NONE:
        return weight_bytes(run)

    return quantized.unquantized_bytes(run)


def quant_state_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """A quantized base's quantization state (absmax, code tables, 8-bit row scales): bytes beside the
    packed parameters, which FSDP2 does not shard."""
    if run.quantize is Quantize.NONE:
        return 0

    return quantized.packed_bytes(spec, run) - quantized.storage_bytes(spec, run)


def base_weight_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """Bytes of the model's own parameters and buffers as stored (no adapters).

    QLoRA: bitsandbytes packs every decoder-layer projection (``memory.quantized.packed_bytes``: NF4 with
    double quantization ~0.516 bytes/param, int8 1 byte/param + one fp32 scale per output row); PEFT's
    ``prepare_model_for_kbit_training`` (``--qlora-upcast full``) leaves every other parameter (embeddings,
    norms, head, biases) in fp32, the lean default in ``--dtype`` (``memory.quantized.unquantized_bytes``).
    Buffers (rotary ``inv_freq``) stay fp32. A 4-bit projection's bias is held in the compute dtype from the
    first forward on: ``Linear4bit.forward`` casts ``bias.data`` to its input's dtype once that is the compute
    dtype (bitsandbytes 0.50.2 ``nn/modules.py``; Qwen2's q/k/v biases under full upcast or autocast: counted
    by the exact trace, which runs that forward).
    """
    w = weight_bytes(run)
    if run.quantize is Quantize.NONE:
        return int(spec.params * w + spec.buffer_bytes)

    bias = spec.linear_bias_params if run.quantize is Quantize.Q4 else 0
    rest = spec.params - spec.linear_params - bias
    return int(quantized.packed_bytes(spec, run) + rest * quantized.unquantized_bytes(run)
               + bias * quant_support.compute_bytes(run) + spec.buffer_bytes)


def optimizer_state_bytes(spec: ModelSpec, run: RunConfig, trainable: int, grad_bytes: int) -> int:
    """Optimizer state, from the optimizer's row of ``memfit.spec.optimizers.OPTIMIZERS``.

    Per trainable parameter: ``moments`` tensors in the parameter's dtype (AdamW: ``exp_avg`` +
    ``exp_avg_sq``, ``zeros_like(p)`` in ``torch/optim/adam.py``), plus dtype-independent bytes (8-bit
    AdamW: 2.004 B/param); a factored row (Adafactor as ``memfit train`` builds it, beta1=None) keeps one
    row and one column vector per matrix and the full second moment for vectors, in the param dtype.
    """
    opt = row(run.optimizer)
    total = int(trainable * opt.state_bytes_per_param(grad_bytes))
    if opt.factored:
        total += _adafactor_elements(spec, run) * grad_bytes
    return total


def _adafactor_elements(spec: ModelSpec, run: RunConfig) -> int:
    """Elements of Adafactor's factored second moment: rows + cols per matrix, numel per vector."""
    if run.is_lora():
        lins = spec.lora_linears(run.lora.targets)
        return sum(lin.count * (run.lora.r + lin.in_features + lin.out_features + run.lora.r) for lin in lins)
    mats = sum(lin.count * (lin.in_features + lin.out_features) for lin in spec.linears)
    embed = spec.vocab_size + spec.hidden_size
    head = 0 if spec.tie_word_embeddings else spec.vocab_size + spec.hidden_size
    return int(mats + embed + head + _vector_params(spec, run))


def optimizer_step_temporary(spec: ModelSpec, run: RunConfig, trainable: int, grad_bytes: int,
                             device: str = "cuda") -> int:
    """Bytes alive only inside ``optimizer.step()``, from the optimizer row's ``step_temporary_on(device)``.

    ``group``: torch's foreach Adam(W) (``_multi_tensor_adam``) computes ``exp_avg_sq_sqrt =
    _foreach_sqrt(...)`` for every parameter of the group at once: one param-sized temporary in the
    state dtype (``adamw``, torch's default, is foreach on CUDA), freed when the group is done; train's
    groups (``memfit.builder.parts.parameter_groups``) put the matrices in the first, so that group's size is
    the peak (``trainable`` less the norms and biases of a full fine-tune). ``largest-x2``: a per-tensor update
    (Adafactor; ``adamw`` on CPU, where torch runs the single-tensor loop) bounded by two copies of the
    largest trainable tensor. ``none``: in place (fused, 8-bit, SGD).
    """
    kind = row(run.optimizer).step_temporary_on(device)
    if kind == "group":
        return (trainable - _vector_params(spec, run)) * grad_bytes
    if kind == "largest-x2":
        return largest_trainable(spec, run) * grad_bytes * 2
    if kind == "per-tensor":
        return _per_tensor_peak(spec, run) * grad_bytes
    return 0


def _per_tensor_peak(spec: ModelSpec, run: RunConfig) -> int:
    """Elements a per-parameter loop holding ``previous + 2 x current`` peaks at (single-tensor AdamW).

    torch runs the loop once per parameter group, the previous quotient freed between groups; train's
    first group (``memfit.builder.parts.parameter_groups``) holds the matrices in the order transformers registers
    them: the token embedding (and learned positions), each layer's projections in ``spec.linears`` order
    (the last of one layer next to the first of the next: two layers' worth), the untied head. The second
    group (norms, biases: vectors) peaks far lower. LoRA: the largest adapter matrix twice (adapters are
    small and alike). Checked to the byte against the exact trace on CPU (tiny Llama: the last layer's
    down projection then the head; GPT-2: wte then wpe).
    """
    if run.is_lora():
        return 2 * largest_trainable(spec, run)
    tokens = spec.vocab_size * spec.hidden_size
    order = [tokens, max((spec.embedding_params or tokens) - tokens, 0)]
    order += [lin.in_features * lin.out_features for lin in spec.linears] * min(spec.num_layers, 2)
    if not spec.tie_word_embeddings:
        order += [spec.lm_head_params or tokens]
    sizes = [n for n in order if n]
    return max(prev + 2 * cur for prev, cur in zip([0] + sizes, sizes, strict=False))


def _vector_params(spec: ModelSpec, run: RunConfig) -> int:
    """Trainable parameters of fewer than two dimensions (norms, biases): the second of train's parameter
    groups (``memfit.builder.parts.parameter_groups``); none under LoRA (adapters are matrices)."""
    if run.is_lora():
        return 0
    return max(spec.params - spec.linear_params - spec.embedding_params - spec.lm_head_params, 0)


def largest_trainable(spec: ModelSpec, run: RunConfig) -> int:
    """Elements of the largest trainable tensor (a LoRA adapter's largest matrix, else the largest of the
    embedding and the linears): what the optimizer step's per-tensor temporaries scale with."""
    if run.is_lora():
        return max((run.lora.r * max(lin.in_features, lin.out_features) for lin in spec.lora_linears(run.lora.targets)),
                   default=0)
    return max([spec.vocab_size * spec.hidden_size] + [lin.in_features * lin.out_features for lin in spec.linears])


def _layer_params(spec: ModelSpec) -> int:
    return (spec.params - spec.embedding_params - spec.lm_head_params) // max(spec.num_layers, 1)


def weight_bytes(run: RunConfig) -> int:
    """Bytes of one stored weight in ``--dtype``: 2 for bf16/fp16, else 4."""
    return int(2 if str(run.dtype) in ("bf16", "fp16") else 4)


def released_after_backward(spec: ModelSpec, run: RunConfig) -> int:
    """Gathered parameter bytes one layer frees after its backward that ``states.gathered`` counts as held.

    FSDP2 reshards every unit after its backward (``FSDPParamGroup.post_backward``:
    ``reshard_after_backward`` is True unless set otherwise; torch 2.13
    ``distributed/fsdp/_fully_shard/_fsdp_param_group.py``), ZeRO-2's ``reshard_after_forward=False``
    included. ``fsdp2_gathered`` keeps every layer gathered under ``zero2`` (true up to backward's start),
    so by the first layer's backward the N - 1 layers above have each freed one layer's parameters.
    ``fsdp``/``zero3`` count only the 2 layers computing, which stay. Measured (bench/sharding_memory.py,
    smollm2-135m, zero2 on 2 ranks): without this term the first-layer moment was predicted +6.9% over
    the measured peak (backward's start, where every layer is still gathered)."""
    if run.num_processes < 2 or run.sharding is not Sharding.ZERO2:
        return 0
    return gathered_layer_bytes(spec, run)
