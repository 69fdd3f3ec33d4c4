"""What DeepSpeed ZeRO-2/ZeRO-3 hold per rank (``--sharding zero2|zero3`` under a DeepSpeed launch), as the
``ModelStates`` the analytic estimator composes its phases from (``states.model_states(..., engine=DEEPSPEED)``).

DeepSpeed's layout is not FSDP2's (``states.fsdp2_gathered``): it keeps flat buffers of its own next to
the model, an fp32 master copy of its partition even when training in fp32, and steps the optimizer inside
the last micro-batch's backward (``training.deepspeed_engine``). Each term below names the DeepSpeed 0.19.8
code it reads (``deepspeed/runtime/zero/``) and was checked against memfit's tensor counter
(``memory.measure.StepPeak``, every live storage) on 2 CPU ranks, per phase and per decoder layer: the tiny
preset (6.5 M params, fp32 AdamW), seq 96 x micro-batch 1, ``--packing concat`` (every row full length, so the
two ranks compute the same shapes). Both ranks counted the same peak there (ZeRO-2 and ZeRO-3 alike).

What the bucket settings are: ``zero_sizes`` (Accelerate's ``"auto"`` rule, written into the DeepSpeed config
by ``training.deepspeed_engine.ds_config``, so the estimate reads the same numbers the run gets).

What memfit runs under DeepSpeed was measured (``engines.deepspeed_refusal``): full fine-tunes, fp32 weights, no
offload, the standard loss, torch's AdamW. Another tool's DeepSpeed config (``estimate --from``) may offload:
``offload_optimizer`` takes the fp32 master partition, its optimizer state and the step off the device, and
``offload_param`` (ZeRO-3) the parameter partitions too; read from DeepSpeed's documentation, not measured.
Known error: offloading, DeepSpeed stages gradients through host buffers; the gradient partitions are priced on
the device as without offload (an over-estimate by at most them). bf16/fp16 (DeepSpeed's own 16-bit copy on a GPU) follows
the same code paths with 2-byte parameters and gradients, read from the source but not measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.settings.config import Offload, Precision, Quantize, RunConfig, Sharding
from memfit.settings.stack import Stack
from memfit.spec.optimizers import row

ENGINES = ("fsdp2", "deepspeed")
"""The sharding engines the estimator models: FSDP2 (memfit's default) and DeepSpeed (a DeepSpeed launch)."""

#: DeepSpeed's ``sub_group_size`` default: ZeRO-3 steps its fp32 partition in sub-groups of this many elements.
SUB_GROUP_SIZE = 1_000_000_000
FP32 = 4


@dataclass(frozen=True)
class ZeroSizes:
    """The ZeRO bucket settings of a run, in elements (Accelerate's ``"auto"`` rule from the hidden size ``h``)."""

    reduce_bucket_size: int
    """``h^2``: the gradient bucket (ZeRO-2: ``ipg_buckets``; ZeRO-3: ``IPGBucketZ3.buffer``)."""
    allgather_bucket_size: int
    """``h^2``: ZeRO-2's all-gather of the updated partitions after the step."""
    prefetch_bucket_size: int
    """``0.9 h^2``: ZeRO-3's prefetch of the next modules' parameters."""
    param_persistence_threshold: int
    """``10 h``: ZeRO-3 keeps parameters of at most this many elements whole on every rank."""


def zero_sizes(hidden_size: int) -> ZeroSizes:
    """Accelerate's ``"auto"`` values (``accelerate/utils/deepspeed.py``, ``HfDeepSpeedConfig`` fill-in from
    ``hidden_size``): DeepSpeed's own defaults (5e8-element buckets, a 2 GB fp32 buffer) dwarf a small model."""
    h2 = hidden_size * hidden_size
    return ZeroSizes(h2, h2, int(0.9 * h2), 10 * hidden_size)


def param_bytes(run: RunConfig) -> int:
    """Bytes of DeepSpeed's parameters and gradients: its 16-bit copy under bf16/fp16, else fp32.

    ``engine.get_data_types``: the model dtype is fp16/bf16 when that DeepSpeed mode is on (memfit turns it on
    from ``--mixed-precision``), fp32 otherwise; ``grad_accum_dtype`` defaults to the model dtype."""
    return 2 if run.mixed_precision in (Precision.BF16, Precision.FP16) else 4


def persistent_params(spec) -> int:
    """ZeRO-3's persistent parameters: kept whole on every rank (``parameter_offload.mark_persistent_parameters``:
    ``ds_numel <= stage3_param_persistence_threshold``, 10 h). Taken as every parameter that is not a matrix
    (norms, biases: at most a few h each); a matrix is h x something >= 10 h in every supported family.
    Known error: a bias wider than 10 h (none in the presets) would be counted persistent but is sharded."""
    return max(spec.params - spec.linear_params - spec.embedding_params - spec.lm_head_params, 0)


def partition(total: int, ranks: int) -> int:
    """Elements of one rank's partition of ``total`` (the larger share when uneven).

    ZeRO-2 pads its flat buffer to a multiple of ``2 x ranks`` (``nccl_start_alignment_factor``) and splits it
    evenly (``get_data_parallel_partitions``); ZeRO-3 pads each parameter to a multiple of ``ranks``
    (``_partition_param``: ``ceil(numel / world_size)``). Known error: that padding (< ranks elements per
    parameter) is ignored, as is ZeRO-2's gradient buffer holding whole the parameters that straddle the
    partition boundary (``grads_in_partition``: + 128 elements on the tiny preset).
    """
    return -(-total // ranks)


def step_temporary(run: RunConfig, part: int, device: str) -> int:
    """Bytes alive only while DeepSpeed steps one flat fp32 partition of ``part`` elements.

    ``stage_1_and_2.step`` / ``stage3._prepare_fp32_grad_for_sub_group``: the gradient partition is flattened
    into a new tensor and cast to fp32 (``flatten(...).to(fp32)``: one fp32 copy, the 16-bit one freed at
    once), set as the master partition's ``.grad``; torch's AdamW then steps that single flat tensor: its
    single-tensor loop (CPU default) holds ``sqrt(exp_avg_sq)`` and its quotient, 2 partition-sized
    temporaries; foreach (CUDA default, ``adamw-foreach``) one; fused none (``OptimizerRow.step_temporary_on``).
    ZeRO-3 steps sub-groups of at most ``sub_group_size`` elements. Measured (tiny, 2 ranks, single-tensor
    AdamW): 3 partition-sized tensors above the resident ones, ZeRO-2 and ZeRO-3 alike.
    """

    kind = row(run.optimizer).step_temporary_on(device)
    adam = {"group": 1, "largest-x2": 2, "per-tensor": 2}.get(kind, 0)
    if run.sharding is Sharding.ZERO3:
        part = min(part, SUB_GROUP_SIZE)
    return int((1 + adam) * part * FP32)


def gathered_zero3(spec, run: RunConfig) -> int:
    """Bytes of full parameters ZeRO-3 holds per rank from the end of forward into backward.

    memfit builds the model outside ``deepspeed.zero.Init`` (``deepspeed_engine.plugin``), so ``F.linear`` is
    torch's, not DeepSpeed's ``zero3_linear_wrap``: autograd saves each projection's gathered weight (the
    ``weight.t()`` view ``mm`` saves) and DeepSpeed's release (``partition_parameters.free_param``:
    ``param.data = torch.empty(0)``) cannot free a storage autograd still holds. Besides, the parameter
    coordinator releases nothing reused within ``stage3_max_reuse_distance`` elements
    (``partitioned_param_coordinator.__params_to_release``; 1e9 by default), and every parameter is reused
    in backward. So every non-persistent parameter stays gathered until its own backward: the whole model,
    as unsharded training holds it. Measured (tiny, 2 ranks): all 56 projection weights, the embedding and the
    head alive at the end of forward (24.75 MiB), freed layer by layer in backward; no second gather in
    backward (the parameters were never released). Known error: beyond 1e9 parameters the embedding (saved by
    no one) is released early; ignored.
    """
    return int((spec.params - persistent_params(spec)) * param_bytes(run))


def built_under_zero_init(run: RunConfig, stack: Stack | None) -> bool:
    """Whether the run's model was built inside ``deepspeed.zero.Init`` (``settings.stack.Trainer.zero3_init``):
    a ZeRO-3 run of a stack that does, on a base transformers does not quantize (``get_init_context`` L3835:
    ``if not is_quantized``; a 4-bit base is loaded outside it, F.linear stays torch's)."""
    return (stack is not None and stack.traits.zero3_init and run.sharding is Sharding.ZERO3
            and run.quantize is Quantize.NONE)


def module_elements(spec, run) -> list[tuple[int, int]]:
    """``(elements, decoder layer or -1)`` of each module with parameters, in the order forward runs them: the
    embedding, every projection followed by its LoRA ``A`` and ``B`` (PEFT's ``Linear.forward``: ``base_layer``, then
    ``lora_B(lora_A(dropout(x)))``), the head (tied: the embedding's parameter used again). What DeepSpeed's trace
    records (``record_module``: each module's own parameters, ``recurse=False``). Norms (``h`` each) and biases are
    left out: under the persistence threshold, always whole (``persistent_params``)."""
    targets = {lin.name for lin in spec.lora_linears(run.lora.targets)} if run.lora.r else set()
    embed = spec.embedding_params or spec.vocab_size * spec.hidden_size
    out = [(embed, -1)]
    for name, fan_in, fan_out in spec.linear_modules:
        found = re.search(r"\.(\d+)\.", name)
        layer = int(found.group(1)) if found else -1
        out.append((fan_in * fan_out, layer))
        if name.rsplit(".", 1)[-1] in targets:
            out += [(run.lora.r * fan_in, layer), (fan_out * run.lora.r, layer)]
    out.append((spec.lm_head_params or embed, -1))
    return out


def backward_order(modules: list[tuple[int, int]], checkpointing: bool) -> list[int]:
    """The modules' indices as backward fetches them (``_run_before_backward_function``): the reverse of forward;
    with activation checkpointing each decoder layer first runs its forward again (the recompute fetches its
    modules in forward order, ``fetch_sub_module(forward=True)``), then its backward."""
    if not checkpointing:
        return list(range(len(modules)))[::-1]
    order: list[int] = []
    layer_of = [layer for _, layer in modules]
    i = len(modules) - 1
    while i >= 0:
        if layer_of[i] < 0:
            order.append(i)
            i -= 1
            continue
        start = i
        while start > 0 and layer_of[start - 1] == layer_of[i]:
            start -= 1
        block = list(range(start, i + 1))
        order += block + block[::-1]
        i = start - 1
    return order


def coordinator_gathered(spec, run: RunConfig, stack: Stack) -> int:
    """Bytes of full parameters a ZeRO-3 rank holds at once when the model was built under ``deepspeed.zero.Init``
    (``built_under_zero_init``): what DeepSpeed's parameter coordinator keeps (deepspeed 0.19.8
    ``runtime/zero/partitioned_param_coordinator.py``), with the stack's ``zero3`` settings.

    ``zero3_linear_wrap`` (``linear.py``) saves the parameter itself, so a release (``free_param``:
    ``param.data = torch.empty(0)``) frees the storage and backward gathers it again. What stays gathered:

    - the prefetch runs ahead: every module's fetch, containers' too, pops the trace's parameter queue until
      ``stage3_prefetch_bucket_size`` elements not yet gathered are fetched (L447-484: at least one parameter), and
      a transformers model has more hooked modules than parameters (a decoder layer, its attention, MLP, norms and
      activation, PEFT's wrappers), so the queue runs ahead of the computation into backward's half, where it marks
      the parameters still gathered as needed again (L470-472), which ``__params_to_release`` then keeps (L650-651).
      It stops where ``stage3_max_live_parameters`` elements are gathered (L453: ``max_live - n_available``). So
      ``min(model, max_live)`` elements stay gathered, overshot by a parameter;
    - with no prefetch (bucket 0), or above ``max_live``: what ``__params_to_release`` keeps for reuse (L653-662), a
      module whose next use comes before ``stage3_max_reuse_distance`` elements of other modules' parameters
      (forward's rest, then backward's modules before it: ``backward_order``): the head, and a tail of the model when
      the distance allows; and the unit computing its backward: a module, or with checkpointing a whole recomputed
      decoder layer (its frozen parameters held until the layer's backward: ``update_recompute_parameters``,
      L387-389) (``_reused``).

    Measured (tiny preset, LoRA r 8 on every projection, 2 CPU ranks, ``tests/test_deepspeed_zero3_init.py``): with
    ``max_live`` 1e6 the coordinator counted 1.11 M elements gathered at forward's end (of 6.4 M); with the default
    1e9, all of them. Known error: the overshoot is priced as the largest projection (the parameter that crosses the
    limit may be smaller); the first steps, before the trace is recorded, release everything (less); norms and biases
    are left out (``module_elements``); forward holds the same as backward's start (priced so)."""
    zero = stack.zero3
    sizes = zero_sizes(spec.hidden_size)
    modules = module_elements(spec, run)
    gathered = [n if n > sizes.param_persistence_threshold else 0 for n, _ in modules]
    if spec.tie_word_embeddings:
        gathered[0] = 0  # the head's parameter is the embedding's: counted once, as the head's
    largest = max(n for n, (_, layer) in zip(gathered, modules, strict=True) if layer >= 0)
    bucket = sizes.prefetch_bucket_size if zero.prefetch_bucket_size is None else zero.prefetch_bucket_size
    prefetched = zero.max_live_parameters + largest if bucket else 0
    held = max(prefetched, _reused(modules, gathered, run, zero.max_reuse_distance))
    return int(min(held, sum(gathered)) * param_bytes(run))


def _reused(modules: list[tuple[int, int]], gathered: list[int], run: RunConfig, distance: int) -> int:
    """Elements gathered at once without prefetch: the modules ``__params_to_release`` keeps for a use within
    ``distance`` (at backward's start, all of them: the head computes), or, while a unit computes its backward (a
    module, or under checkpointing a recomputed decoder layer), the kept ones below it and the unit; the kept ones
    above it were released after their backward (their next use is the next step)."""
    first_use: dict[int, int] = {}  # module -> elements backward walks before fetching it
    walked = 0
    for i in backward_order(modules, run.grad_checkpointing):
        first_use.setdefault(i, walked)
        walked += modules[i][0]
    kept, after = [False] * len(modules), 0
    for i in range(len(modules) - 1, -1, -1):
        kept[i] = after + first_use.get(i, walked) < distance
        after += modules[i][0]
    below = [0]  # below[i]: kept elements of the modules before i
    for i, n in enumerate(gathered):
        below.append(below[-1] + (n if kept[i] else 0))
    units: dict[tuple[int, int], list[int]] = {}  # a layer under checkpointing, else each module alone
    for i, (_, layer) in enumerate(modules):
        units.setdefault((layer, -1) if run.grad_checkpointing and layer >= 0 else (layer, i), []).append(i)
    computing = max(below[min(unit)] + sum(gathered[i] for i in unit) for unit in units.values())
    return max(below[-1], computing)


def partition_reached(spec, run: RunConfig, rank: int) -> int:
    """Decoder layers ZeRO-2's backward finishes before it first reduces a gradient of ``rank``'s partition,
    which allocates that rank's gradient partition (``stage_1_and_2.copy_grads_in_partition``: ``grads_in_partition``
    is created by the first gradient of its own partition, not before).

    The flat buffer holds the trainable matrices in registration order (embedding, layer 0 .. N-1, an untied
    head; norms and biases in the no-decay group's own small buffer) and rank r owns its r-th n-th
    (``get_data_parallel_partitions``); backward reduces them from the head down. So the last rank's partition
    is reached at once (0 layers) and rank r's once the ``(n - 1 - r) / n`` of the parameters above it, less
    the head, are done: ``floor((P (n-1-r)/n - head) / per-layer params)``. Measured (tiny: 8 layers, 2 ranks):
    rank 0 allocated its 12.38 MiB partition inside the 5th layer's backward from the top (4 finished); at
    seq 128 x 2 that left rank 0's backward 7.7 MiB below rank 1's (its peak is the step's, 111.43 MiB, against
    rank 1's 119.17 at backward's start): the ranks' asymmetry. Known error: the boundary falls inside a layer
    (+- 1 layer's saved tensors); the no-decay group's partition (H-sized vectors) is ignored.
    """
    if run.sharding is not Sharding.ZERO2 or rank >= run.num_processes - 1:
        return 0
    n, layers = run.num_processes, max(spec.num_layers, 1)
    head = 0 if spec.tie_word_embeddings else (spec.lm_head_params or spec.vocab_size * spec.hidden_size)
    per_layer = max((spec.params - spec.embedding_params - spec.lm_head_params) // layers, 1)
    above = spec.trainable_params(run) * (n - 1 - rank) // n - head
    return int(min(max(above, 0) // per_layer, layers))


@dataclass(frozen=True)
class ZeroStates:
    """Per-rank bytes of a ZeRO run, in the estimator's terms (``states.ModelStates`` fields)."""

    weights: int
    gradients: int
    optimizer: int
    step_temporary: int
    gathered: int
    gathered_forward: int
    gathered_end: int
    buckets: int
    backward_gradients: int
    after_layers: int = 0
    """ZeRO-2: decoder layers backward finishes before ``backward_gradients`` appear (``partition_reached``)."""


def zero_states(spec, run: RunConfig, device: str, optimizer_bytes: int, rank: int | None = None,
                stack: Stack | None = None) -> ZeroStates:
    """DeepSpeed ZeRO-2/ZeRO-3 per rank; ``optimizer_bytes``: the torch optimizer's state for all trainable
    parameters in fp32 (DeepSpeed steps fp32 partitions: ``states.optimizer_state_bytes``).

    Both stages (``stage_1_and_2.py`` / ``stage3.py`` ``__init__``): the torch optimizer steps a flat fp32
    master copy of this rank's partition (``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat``,
    a clone even when training in fp32: 4 B/param / n) with its state on it (AdamW: 8 B/param / n); both count
    as ``optimizer``.

    ZeRO-2: the parameters stay whole on every rank, as views into one flat buffer (``bit16_groups_flat``,
    w B/param); the gradient partition (``grads_in_partition``, w B/param / n) is allocated by the first
    bucket reduction that reaches this rank's partition in backward and lives until the step: on the last
    rank, which owns the head, from backward's start (``backward_gradients``), on the others later
    (``partition_reached``; ``rank`` None: the last). The reduce bucket (``reduce_bucket_size`` elements) lives
    through backward.

    ZeRO-3: this rank's partition of every parameter (``fp16_partitioned_groups_flat``, w B/param / n) plus the
    persistent parameters whole; the gradient partitions (``grad_partitions_flat_buffer``, allocated once at
    start-up) and the reduce bucket (``IPGBucketZ3.buffer``, kept between steps) are resident, like DDP's
    buckets (``buckets``); full parameters from forward into backward (``gathered_zero3``; built under
    ``deepspeed.zero.Init``: ``coordinator_gathered``). LoRA: the flat groups hold the trainable parameters only
    (``stage3.py``), every parameter keeps its own partition (``ds_tensor``), the embedding has no gradient.

    Measured against the tensor counter (tiny, seq 96 x 1, 2 ranks, both ranks the same): ZeRO-2 61.92 MiB
    resident (24.77 whole parameters + 3 x 12.38), 111.43 MiB peak in the step; ZeRO-3 62.19 MiB resident
    (5 x 12.38 + the bucket), 103.64 MiB peak at backward's start.
    """
    n = run.num_processes
    w = param_bytes(run)
    trainable = spec.trainable_params(run)
    part = partition(trainable, n)
    master = part * FP32
    optimizer = master + partition(optimizer_bytes, n)
    sizes = zero_sizes(spec.hidden_size)
    bucket = sizes.reduce_bucket_size * w
    temporary = step_temporary(run, part, device)
    if run.offload in (Offload.OPTIMIZER, Offload.PARAMS):  # offload_optimizer: DeepSpeed's CPU Adam on the host
        optimizer, temporary = 0, 0
    embed = spec.embedding_params or spec.vocab_size * spec.hidden_size
    if run.sharding is Sharding.ZERO2:
        accumulating = run.grad_accum > 1  # the partition survives the step's earlier micro-batches
        grads = part * w
        # at backward's end: the bucket and the embedding's full gradient before it is copied into it
        return ZeroStates(weights=spec.params * w + spec.buffer_bytes, gradients=grads, optimizer=optimizer,
                          step_temporary=temporary, gathered=bucket, gathered_forward=0,
                          gathered_end=bucket + embed * w, buckets=0,
                          backward_gradients=0 if accumulating else grads,
                          after_layers=partition_reached(spec, run, n - 1 if rank is None else rank))
    adapters = spec.lora_params(run)  # 0 for a full fine-tune
    weights = partition(spec.params + adapters, n) * w + persistent_params(spec) * w + spec.buffer_bytes
    if run.offload is Offload.PARAMS:  # offload_param: the partitions live on the host, gathered when used
        weights = persistent_params(spec) * w + spec.buffer_bytes
    gathered = coordinator_gathered(spec, run, stack) if built_under_zero_init(run, stack) else gathered_zero3(spec, run)
    return ZeroStates(weights=weights, gradients=0, optimizer=optimizer, step_temporary=temporary,
                      gathered=gathered, gathered_forward=gathered,  # at backward's end: the embedding and its gradient
                      gathered_end=(1 if adapters else 2) * embed * w,
                      buckets=part * w + bucket, backward_gradients=0)
