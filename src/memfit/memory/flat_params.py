"""What FSDP (1) holds per rank: ``FullyShardedDataParallel``'s flat parameters, where memfit prices FSDP2.

A ``--sharding fsdp`` run of a stack that shards with FSDP (1) (``Stack.fsdp == 1``: Accelerate's FSDP plugin before
``fsdp_version: 2``, Answer.AI's fsdp_qlora, PEFT's FSDP examples) holds other tensors than FSDP2's per-parameter
shards. ``estimate`` reads this module once the stack says so (``applies``); memfit's own runs (FSDP2) never do.
Every line below is torch 2.13's ``torch/distributed/fsdp`` (``_flat_param.py``, ``_runtime_utils.py``,
``_limiter_utils.py``, ``fully_sharded_data_parallel.py``), with the wrap policy those stacks use: one unit per
decoder layer (``transformer_auto_wrap_policy``) and the root, which keeps the embedding, the final norm and the
head; PEFT's and fsdp_qlora's policy makes each trainable LoRA matrix a unit of its own, so a layer's unit holds
its frozen base only (``use_orig_params=False``).

- **Flat shards.** A unit's parameters are concatenated into one ``FlatParameter`` (``_flat_param.py`` L893
  ``torch.cat``), chunked over the N ranks and the last chunk padded (L1122-1140 ``_get_shard``: ``chunk.clone()``,
  ``F.pad``): each rank keeps ``ceil(numel / N)`` elements in the stored dtype (L971 ``flat_param.set_``; a
  bitsandbytes 4-bit base with ``quant_storage`` bf16: the packed bytes as bf16 elements).
- **Unshard.** The all-gather writes the unit's whole padded flat parameter, ``N ceil(numel / N)`` elements, into
  ``_full_param_padded`` (L1285-1292; in ``MixedPrecision.param_dtype`` where one is set, L1280-1284), whose views
  are the parameters: no copy-out (FSDP2 copies each parameter out of its all-gather buffer). With a param dtype
  the shard is first copied to ``_mp_shard`` (L1342-1357) and freed after the all-gather (L1533-1547).
- **How many units at once.** ``forward_prefetch=False`` and ``BackwardPrefetch.BACKWARD_PRE`` by default
  (``fully_sharded_data_parallel.py`` L404, L410): in forward one layer is unsharded at a time (each resharded after
  its forward, ``_runtime_utils.py`` L486-500) and the root stays unsharded from its forward to its own backward
  (L496-497 ``not state._is_root``); in backward a unit's pre-backward hook prefetches the next (L693): two layers,
  and at backward's start (the root's hook) the last layer beside the root.
- **Gradients.** A unit's parameters are views of one ``torch.split`` of the flat parameter (L1901), so autograd
  holds each view's gradient in the split's input buffer until the unit's backward is done, then concatenates them
  into the flat gradient (two copies of the unit's gradients at that moment); the post-backward hook reduce-scatters
  it into a new shard (L890-902 ``new_sharded_grad``) and drops it. The root's gradients (a full fine-tune) are
  concatenated only when the embedding's backward ends. Frozen units have none.

- **Adapters inside layer units** (``Stack.trains_whole_layers``: Lightning Fabric's ``use_orig_params=True`` with
  litgpt's ``auto_wrap_policy={Block}``). A layer's flat parameter holds its frozen base and its LoRA matrices, in
  one dtype, and requires a gradient as a whole (``fully_sharded_data_parallel.py`` L208-213: "higher than expected
  gradient memory usage"): every layer parameter gets a gradient, so the layer's unit gradients are a full
  fine-tune's and the layer saves what a full fine-tune saves (``memory.activations``); the root (embedding, norm,
  head) stays frozen. The optimizer steps only the adapters (the original parameters' views).
- **Accumulation under ``no_sync``** (``Trainer.fsdp_no_sync_accumulation``: Accelerate, transformers' Trainer,
  Lightning Fabric). The micro-batches before the last skip the reduce-scatter (``_runtime_utils.py``
  ``_post_backward_hook`` returns while ``_sync_gradients`` is False), so every trainable unit keeps its unsharded
  flat gradient into the next micro-batch (``no_sync``: "FSDP will accumulate the full model gradients (instead of
  gradient shards)"): the model's whole gradient on every rank in a full fine-tune or with adapters inside layer
  units (``ModelStates.accumulated``).
- **NO_SHARD** (``--sharding ddp`` of these stacks, as fsdp_qlora's ``--sharding_strategy no_shard``). Each
  flat parameter stays whole on every rank (``shard`` L957-958: no ``_get_shard``, no padding) and is never
  all-gathered (``uses_sharded_strategy`` False, L2689-2690; ``unshard`` a no-op, L1371-1378, ``needs_unshard`` L1387):
  no unsharded copy beside it. With a param dtype its low-precision copy ``_mp_shard`` is full-size (L1267-1276)
  and is what computes (L1357), freed at each reshard (``post_reshard`` L1795-1803): the units at once are those
  above, in that dtype. The post-backward hook all-reduces the flat gradient in place and keeps it
  (``_runtime_utils.py`` L765-768, L932-946 ``_reduce_grad_no_shard``), so gradients build up unit by unit through
  backward (not DDP's buckets, resident from the first step) after the same concatenation of the views'
  gradients; the optimizer steps whole flat parameters.

Known error: the alignment padding of ``use_orig_params=True`` (< 16 bytes per parameter, L609) is left out; a
``MixedPrecision`` run gathers in the compute dtype here but autocast's weight copies are still priced (over).
Checked on CPU (gloo) against memfit's tensor counter: ``tests/test_flat_params.py`` (``bench/fsdp1_memory.py``,
FULL_SHARD, ``--no-shard``, ``--accumulate`` and ``--orig-params``).
"""

from __future__ import annotations

import dataclasses
import math

from memfit.memory import device_terms, fragmentation
from memfit.memory.device_terms import CUDA_CONTEXT_BYTES, reserved_from_tensors
from memfit.memory.states import (
    ModelStates,
    base_weight_bytes,
    gathered_layer_bytes,
    quant_state_bytes,
    unquantized_param_bytes,
    weight_bytes,
)
from memfit.settings.config import Offload, Optimizer, Precision, Quantize, RunConfig, Sharding
from memfit.settings.stack import Stack
from memfit.spec.model import ModelSpec
from memfit.spec.optimizers import row

#: Unsharded flat parameters of decoder layers the unshard stream's blocks can hold at once in backward: the layer
#: computing, the one prefetched (``_runtime_utils.py`` L693) and the last one freed, whose block the caching
#: allocator cannot hand out until the compute stream passes its ``record_stream`` event (``_flat_param.py``
#: L1818-1821). ``limit_all_gathers`` (the default, ``fully_sharded_data_parallel.py`` L411) waits for the oldest
#: free event once two are queued (``_runtime_utils.py`` L297-303, ``_limiter_utils.py`` L16
#: ``_max_num_inflight_all_gathers = 2``) before it allocates the next, so no more than this.
LAYERS_IN_UNSHARD_STREAM = 3


def applies(run: RunConfig, stack: Stack | None, engine: str = "fsdp2") -> bool:
    """Whether ``run`` is held in FSDP (1)'s flat parameters (``stack.fsdp == 1``, N > 1): ``--sharding fsdp``
    (FULL_SHARD) or ``--sharding ddp`` (NO_SHARD, ``no_shard``). memfit's own DDP (no such stack) is not."""
    return (stack is not None and stack.fsdp == 1 and run.sharding in (Sharding.FSDP, Sharding.DDP)
            and run.num_processes > 1 and engine == "fsdp2")


def no_shard(run: RunConfig) -> bool:
    """Whether an FSDP (1) run keeps its flat parameters whole (``ShardingStrategy.NO_SHARD``: ``--sharding ddp``)."""
    return run.sharding is Sharding.DDP


@dataclasses.dataclass(frozen=True)
class FlatUnits:
    """The units of the transformer-layer wrap policy, in bytes per rank or unsharded (``flat_units``)."""

    layer: int
    """One decoder layer's unsharded padded flat parameter (its base; LoRA matrices are units of their own), held
    beside the shard while it computes; NO_SHARD: its full-size ``_mp_shard`` (0 without a param dtype)."""
    root: int
    """The root's: embedding, final norm and (untied) head."""
    layer_shard: int
    """One rank's shard of a layer's flat parameter (``ceil(numel / N)`` elements; NO_SHARD: all of it)."""
    root_shard: int
    mp_shard: int = 0
    """A layer's ``_mp_shard``: its shard copied to ``MixedPrecision.param_dtype`` before the all-gather (0 without)."""


def _padded(nbytes: int, elem: int, n: int) -> int:
    """``nbytes`` of ``elem``-byte elements padded to a multiple of ``n`` elements (``_get_shard``'s ``F.pad``)."""
    return math.ceil(nbytes / elem / n) * n * elem


def gather_bytes(run: RunConfig) -> int:
    """Bytes per element of an unsharded flat parameter: the stored dtype, or Accelerate's ``MixedPrecision``
    ``param_dtype`` (bf16/fp16 for ``--mixed-precision``) where that is narrower (``_flat_param.py`` L1280-1284)."""
    stored = unquantized_param_bytes(run)
    narrower = run.mixed_precision is not Precision.NO and run.quantize is Quantize.NONE and stored > 2
    return 2 if narrower else stored


def flat_units(spec: ModelSpec, run: RunConfig, stack: Stack | None = None) -> FlatUnits:
    """Per-unit bytes of ``run``'s model under FSDP (1) over ``run.num_processes`` ranks (module docstring); the
    adapters inside their layer's unit where ``stack`` puts them there (``Stack.trains_whole_layers``), in its stored
    dtype (a flat parameter has one dtype), else units of their own."""
    mixed = stack is not None and stack.trains_whole_layers(run)
    n, stored = run.num_processes, unquantized_param_bytes(run)
    layers = max(spec.num_layers, 1)
    adapters = spec.lora_params(run) * 4 // layers if run.is_lora() else 0
    if mixed:
        adapters -= spec.lora_params(run) * stored // layers
    # the root's own parameters: embedding, head, and the final norm's weight (H: a LayerNorm's bias is left in the
    # layers, H / L elements each); ``gathered_layer_bytes`` spreads the final norm over the layers instead
    root_numel = spec.embedding_params + spec.lm_head_params + spec.hidden_size
    spread = (spec.params - spec.embedding_params - spec.lm_head_params) // layers - (spec.params - root_numel) // layers
    # the adapters are units of their own (PEFT's and fsdp_qlora's policy)
    layer = gathered_layer_bytes(spec, run) - adapters - spread * stored
    root = root_numel * stored
    gathered = gather_bytes(run)
    if no_shard(run):  # whole, unpadded (L957-958); computed from the full-size _mp_shard, or from itself
        copy = gathered != stored
        return FlatUnits(layer=layer * gathered // stored if copy else 0, root=root * gathered // stored if copy else 0,
                         layer_shard=layer, root_shard=root)
    layer_padded, root_padded = _padded(layer, stored, n), _padded(root, stored, n)
    mp = layer_padded // n * gathered // stored if gathered != stored else 0
    return FlatUnits(layer=layer_padded * gathered // stored, root=root_padded * gathered // stored,
                     layer_shard=layer_padded // n, root_shard=root_padded // n, mp_shard=mp)


def flat_states(spec: ModelSpec, run: RunConfig, states: ModelStates, device: str = "cuda",
                stack: Stack | None = None) -> ModelStates:
    """``states`` (memfit's FSDP2 terms of ``run``, the adapters at the stack's dtype) as FSDP (1) holds them: its
    padded shards, its unsharded units at each moment the estimate models, its flat gradients, the optimizer step
    over flat shards, and what gradient accumulation keeps (``accumulated``)."""
    mixed = stack is not None and stack.trains_whole_layers(run)
    units = flat_units(spec, run, stack)
    # a full fine-tune's gradients: unsharded in the gathered dtype (MixedPrecision's param dtype), sharded in the
    # stored one (``_cast_grad_to_param_dtype``, _runtime_utils.py L1030-1057); a frozen unit has none (LoRA); a
    # unit mixing frozen and trainable parameters has its whole flat gradient (``fully_sharded_data_parallel.py``
    # L208-213: "higher than expected gradient memory usage"), the root (frozen) none
    n = 1 if no_shard(run) else run.num_processes  # NO_SHARD: each rank's "shard" is the whole flat parameter
    grad = weight_bytes(run) if not run.is_lora() or mixed else 0
    root_grad = 0 if run.is_lora() else grad
    full = gather_bytes(run) if grad else 0
    shards = spec.num_layers * units.layer_shard + units.root_shard
    offloaded = run.offload is Offload.PARAMS  # CPUOffload: the shards and their gradients (``_cpu_grad``) on the host
    # NO_SHARD: the whole units are the states' (DDP's) weights; its gradients are flat ones, not DDP's buckets
    in_units = spec.lora_params(run) * unquantized_param_bytes(run) // n if mixed else 0  # already in the shards
    kept = (states.weights if offloaded or no_shard(run)
            else states.weights - in_units - fsdp2_base_shards(spec, run) + shards)
    adapters = states.gradients + states.buckets  # LoRA: the adapters' own units, as FSDP2's (or DDP's buckets)
    trainable_shards = spec.num_layers * units.layer_shard + (units.root_shard if root_grad else 0)
    gradients = trainable_shards if grad and not offloaded else adapters
    # while a layer computes its backward: the root, that layer and the one prefetched (L693); forward holds one
    # layer (reshard after forward) and at its end, where the logits are, only the root
    layer_moment, backward_start = units.root + 2 * units.layer, units.root + units.layer
    # the end of a unit's backward: its views' gradients and their concatenation (2 x the unit) before the
    # reduce-scatter makes its shard; the root's at backward's end (a full fine-tune: its shard not made yet), the
    # first layer's just before (the root and that layer unsharded, the head's gradient held in the root's split)
    stored = unquantized_param_bytes(run)
    root_numel, layer_numel = units.root_shard * n // stored, units.layer_shard * n // stored
    root_full = full if root_grad else 0
    end = units.root + 2 * root_numel * root_full - root_numel // n * root_grad
    head = (spec.lm_head_params or spec.vocab_size * spec.hidden_size) * root_full
    late_layer = (units.root + units.layer + 2 * layer_numel * full - layer_numel // n * grad
                  - root_numel // n * root_grad + head)
    return dataclasses.replace(
        states, weights=int(kept), gradients=int(gradients), buckets=0,
        step_temporary=flat_step_temporary(spec, run, units, states, device),
        gathered=int(backward_start), gathered_forward=int(units.root), gathered_layer=int(layer_moment),
        gathered_entry=0, gathered_first_entry=0, reducing=0, gathered_start=int(backward_start),
        gathered_end=int(max(end, late_layer)), released_per_layer=0,
        unit_gradients=int(head + 2 * layer_numel * full),
        accumulated=no_sync_gradients(spec, run, units, stack, root_full, full, adapters))


def no_sync_gradients(spec: ModelSpec, run: RunConfig, units: FlatUnits, stack: Stack | None, root_full: int,
                      full: int, adapters: int) -> int | None:
    """The gradients a micro-batch before the last keeps under ``no_sync`` (``Trainer.fsdp_no_sync_accumulation``):
    every trainable unit's unsharded flat gradient, in the gathered dtype (``fully_sharded_data_parallel.py``
    ``no_sync``: "FSDP will accumulate the full model gradients (instead of gradient shards) until the eventual
    sync"; ``_runtime_utils.py`` ``_post_backward_hook`` returns before the reduce-scatter); the adapters' own units
    whole (N x their shards), on the device even with CPU offload ("the gradients will not be offloaded to CPU when
    inside the context manager"). None: as the sharded gradients (one micro-batch, NO_SHARD, or a loop that syncs
    each). Known error: the adapters' are priced at their sharded gradients' bytes (PEFT's fp32); under a
    ``MixedPrecision`` param dtype FSDP (1) makes them in that dtype (over by half of them)."""
    if run.grad_accum <= 1 or no_shard(run) or stack is None or not stack.traits.fsdp_no_sync_accumulation:
        return None
    if not full:
        offloaded = run.offload is Offload.PARAMS  # the sharded gradients went to the host: PEFT's fp32 adapters
        return int(spec.lora_params(run) * 4 if offloaded else adapters * run.num_processes)
    gathered = gather_bytes(run)  # the units' unsharded bytes are in it: each unit's elements x the gradient's bytes
    return int(spec.num_layers * units.layer // gathered * full + units.root // gathered * root_full)


def fsdp2_base_shards(spec: ModelSpec, run: RunConfig) -> int:
    """What memfit's FSDP2 terms hold per rank of the model's own parameters (``states.model_states``' division,
    buffers included there and here): replaced by the flat shards."""
    return (base_weight_bytes(spec, run) - spec.buffer_bytes - quant_state_bytes(spec, run)) // run.num_processes


def flat_step_temporary(spec: ModelSpec, run: RunConfig, units: FlatUnits, states: ModelStates, device: str) -> int:
    """The optimizer step's temporaries over flat shards: the optimizer steps one tensor per unit, so torch's
    single-tensor AdamW (``adamw`` on a CPU) holds ``previous + 2 x current`` of consecutive flat shards (the root's
    first: it is registered on the wrapped module itself, ``_unshard_param_utils.py`` L101, and ``nn.Module.parameters``
    yields a module's own parameters before its children's), and a foreach step (``adamw`` on CUDA) one temporary the
    size of every trainable shard. A full fine-tune's shards are in the gradients' dtype. LoRA: the adapters' units,
    as FSDP2's."""
    if run.is_lora() or run.optimizer is not Optimizer.ADAMW:
        return states.step_temporary
    sizes = [units.root_shard] + [units.layer_shard] * spec.num_layers
    if row(run.optimizer).step_temporary_on(device) == "group":
        return sum(sizes)
    return max(prev + 2 * cur for prev, cur in zip([0, *sizes], sizes, strict=False))


def unshard_stream_bytes(spec: ModelSpec, run: RunConfig, stack: Stack | None = None) -> int:
    """Bytes the caching allocator keeps in blocks of FSDP (1)'s unshard and pre-unshard streams (CUDA).

    The all-gather output is allocated under ``with state._device_handle.stream(unshard_stream)``
    (``_runtime_utils.py`` L304-306) and ``_mp_shard`` on the pre-unshard stream (L293-294): the caching allocator
    hands a block only to requests of the stream that allocated it (``CUDACachingAllocator.cpp``: a block pool is
    searched by (stream, size)), so these blocks are never reused by the compute stream's tensors, and a freed
    unsharded parameter waits for its ``record_stream`` event (``_flat_param.py`` L1818-1821, L1543-1547). They
    hold the root (unsharded through the step) and ``LAYERS_IN_UNSHARD_STREAM`` layers, and two ``_mp_shard``
    blocks with a param dtype. With CPU offload and no param dtype, ``pre_unshard`` copies the host shard to the
    device there instead (``_flat_param.py`` L1335-1337 ``flat_param_to(self.device)``: "a new tensor distinct from
    any attributes"), freed once the all-gather has read it (``unshard``, L1381-1383, swaps ``flat_param.data`` for the
    unsharded one): one block, of the largest unit's shard, reused by every unshard (the root's is the first, the
    layers' split from it). Known error: when the GPU keeps up with the CPU a freed layer is reusable at once (one
    layer fewer); 2 MiB rounding of each block ignored; the post-backward stream's reduce-scatter buffers (a LoRA
    matrix's, or a full fine-tune's unit gradient, ``_runtime_utils.py`` L753-774) are left out.
    """
    units = flat_units(spec, run, stack)
    offload_copy = max(units.root_shard, units.layer_shard) if run.offload is Offload.PARAMS and not units.mp_shard else 0
    return units.root + LAYERS_IN_UNSHARD_STREAM * units.layer + 2 * units.mp_shard + offload_copy


def step_reserved(spec: ModelSpec, run: RunConfig, tensor_peak: int, optimizer: int = 0, logits: int = 0,
                  stack: Stack | None = None) -> int:
    """Predicted ``max_memory_reserved`` of an FSDP (1) step whose tensors peak at ``tensor_peak`` (``optimizer`` and
    ``logits`` bytes of it optimizer state and logits): the compute stream's share (the peak less the root, which
    every moment of forward and backward holds unsharded in the unshard stream's blocks) through the fitted allocator
    overhead (``memory.fragmentation``), plus those blocks (``unshard_stream_bytes``), which the compute stream cannot
    reuse."""
    compute = max(tensor_peak - flat_units(spec, run, stack).root, 0)
    return int(reserved_from_tensors(compute, optimizer, logits) + unshard_stream_bytes(spec, run, stack))


def with_reserved(breakdown, spec: ModelSpec, run: RunConfig, stack: Stack | None,
                  engine: str = "fsdp2") -> None:
    """``device_terms.with_fitted_reserved`` on an analytic CUDA ``breakdown``; where FSDP (1) ``applies``, its reserved
    memory is then ``step_reserved`` and its ``other`` term follows (the context, the workspace and what reserved holds
    beyond the tensors, as ``device_terms.cuda_other``)."""
    device_terms.with_fitted_reserved(breakdown)
    if not applies(run, stack, engine):
        return
    tensors = breakdown.peak_bytes - breakdown.other
    breakdown.reserved = step_reserved(spec, run, tensors, breakdown.optimizer, breakdown.logits, stack)
    breakdown.other = CUDA_CONTEXT_BYTES + breakdown.reserved - tensors


def after_earlier_phases(spec: ModelSpec, run: RunConfig, step_reserved_bytes: int, earlier_reserved: int,
                         stack: Stack | None = None) -> int:
    """The step's reserved memory after phases that reserved ``earlier_reserved`` on the compute (default) stream
    (loading, wrapping): the compute stream reuses those cached blocks, the unshard stream's cannot
    (``unshard_stream_bytes``), so they add to the larger of the two."""
    pool = unshard_stream_bytes(spec, run, stack)
    return int(max(step_reserved_bytes - pool, earlier_reserved) + pool)


def notes(spec: ModelSpec, run: RunConfig, stack: Stack | None, engine: str = "fsdp2",
          accumulated: int | None = None) -> list[str]:
    """The note under an estimate priced with FSDP (1)'s flat parameters (none where ``applies`` is False);
    ``accumulated``: the states' ``ModelStates.accumulated``, said where no_sync keeps unsharded gradients."""
    if not applies(run, stack, engine):
        return []
    units = flat_units(spec, run, stack)
    kept = ""
    if accumulated is not None:
        kept = (f" Under gradient accumulation each trainable unit keeps its unsharded flat gradient between "
                f"micro-batches (no_sync): {accumulated / 2**20:,.1f} MiB.")
    if no_shard(run):
        return ["FSDP (1) NO_SHARD flat parameters (memory/flat_params.py): whole on every rank, never all-gathered; "
                "flat gradients made unit by unit in backward and all-reduced in place (not DDP's resident buckets)."
                + kept]
    return [f"FSDP (1) flat parameters (memory/flat_params.py): a layer unit {units.layer / 2**20:,.1f} MiB and the "
            f"root {units.root / 2**20:,.1f} MiB unsharded; the unshard stream's blocks "
            f"({unshard_stream_bytes(spec, run) / 2**20:,.1f} MiB) are added to reserved memory beside "
            f"{fragmentation.describe()} on a GPU." + kept]
