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

from dataclasses import dataclass

from memfit.settings.config import Offload, Precision, RunConfig, Sharding
from memfit.spec.optimizers import row

ENGINES = ("fsdp2", "deepspeed")
"""The sharding engines the estimator models: FSDP2 (memfit's default) and DeepSpeed (a DeepSpeed launch)."""

#: DeepSpeed's ``stage3_max_reuse_distance`` default (``runtime/zero/config.py``), which memfit leaves as is.
MAX_REUSE_DISTANCE = 1_000_000_000
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


def zero_states(spec, run: RunConfig, device: str, optimizer_bytes: int, rank: int | None = None) -> ZeroStates:
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
    buckets (``buckets``); full parameters from forward into backward (``gathered_zero3``).

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
    weights = partition(spec.params, n) * w + persistent_params(spec) * w + spec.buffer_bytes
    if run.offload is Offload.PARAMS:  # offload_param: the partitions live on the host, gathered when used
        weights = persistent_params(spec) * w + spec.buffer_bytes
    # at backward's end: the embedding, still gathered, and its full gradient before the reduce-scatter
    gathered = gathered_zero3(spec, run)
    return ZeroStates(weights=weights, gradients=0, optimizer=optimizer, step_temporary=temporary,
                      gathered=gathered, gathered_forward=gathered, gathered_end=2 * embed * w,
                      buckets=part * w + bucket, backward_gradients=0)
