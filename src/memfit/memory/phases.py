"""Every phase of a run on one rank's device, as the caching allocator and nvidia-smi see it.

A run holds its most not always in the step: loading (a 4-bit base quantized on the device, one projection at a
time), wrapping for FSDP/DeepSpeed, evaluation, the full-state gather of a checkpoint or an export, and the
samples. Per phase ``device_phases`` gives the tensor peak and the predicted ``max_memory_reserved`` by then:

- **loading**: ``memory.loading.loading_replay`` (the load stream through the allocator model: what stays reserved
  afterwards; a 4-bit base quantized by the stack's quantizer: bitsandbytes, or torchao where torchtune builds
  it); a sharded unquantized model arrives as this rank's shards (rank 0 builds it on the host:
  ``training.sharding.builds_empty``), priced with the fitted overhead (``memory.fragmentation``).
- **wrapping** (sharded): a 4-bit base is whole on every rank until FSDP2 shards it (``memory.outside``'s
  ``loading``), and stays whole until every layer is sharded (Accelerate 1.15's ``fsdp2_prepare_model`` holds
  ``original_sd = model.state_dict()`` across ``fully_shard``): the shards are new allocations beside it, reserved
  on top of what loading kept; an unquantized one receives one full tensor at a time beside its shards (the largest
  tensor).
- **loading** and **wrapping** of a stack that loads low-memory (``settings.stack.Stack.loads_low_memory``: fsdp_qlora,
  torchtune's distributed recipes, transformers' Trainer under Accelerate's ``fsdp_cpu_ram_efficient_loading`` or
  ZeRO-3): the base is never whole on a rank. Loading quantizes one projection at a time on the device and moves
  it off (``memory.loading.moved_off_replay``); wrapping holds this rank's shards and what one unit brings
  (``wrapping_transient``).
- **step**: the breakdown's reserved memory (the replay of ``--exact``, or the fitted term of the analytic
  estimate) plus what a worst-case expert routing adds (mixture-of-experts).
  Under FSDP (1) the unshard stream's blocks (``memory.flat_params.unshard_stream_bytes``) come on top of the
  larger of the step's compute-stream share and what loading and wrapping cached there.
- **evaluation**, **checkpoint** (``--state-dict full``'s gather), **export**, **samples**: ``memory.outside``'s
  tensor figures with the fitted overhead.

The caching allocator gives nothing back between phases (no ``empty_cache``), so the run's reserved peak is the
largest phase's, each phase being taken to reuse the blocks earlier ones cached (known error: a later phase whose
requests fit none of those blocks reserves more). nvidia-smi adds the CUDA context and, with several processes,
NCCL's buffers, which NCCL allocates itself, outside torch's allocator: ``NCCL_BYTES`` per rank and process group.
On a CPU there is no allocator to model: each phase's reserved memory is its tensor peak, and the host is the device
(a sharded unquantized run's rank 0 holds the whole model while it loads and wraps: ``_host_is_device_phases``; a
quantized base peaks while it loads at the tensor being quantized on top of what is loaded so far, with the
checkpoint's mapped storage where its dtype is not ``--dtype``, or at the random model memfit builds before it saves
and quantizes it: ``memory.host_loading``).
``memfit train`` on a CPU measures each phase it runs with memfit's tensor counter (``training.phase_peaks``) and
shows it beside this prediction; tests/test_phases_measured.py (loading a safetensors checkpoint, evaluation, the
checkpoint, the export, the samples: within 1%, a full-length sample within 2%), tests/test_quant_loading_measured.py
(loading a 4-bit or 8-bit base: within 0.5%; a QLoRA run's loading, checkpoint and export: within 1%) and
tests/test_shard_setup.py (loading and wrapping on 2 ranks: within 0.5%) hold them to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory import flat_params
from memfit.memory.activations import Precisions
from memfit.memory.device_terms import CUDA_CONTEXT_BYTES, reserved_from_tensors
from memfit.memory.host_loading import LoadedFrom, host_loading_peak
from memfit.memory.stack_terms import rope_caches
from memfit.settings.config import Quantize, RunConfig, Sharding
from memfit.settings.stack import Stack
from memfit.units import MiB

#: NCCL's own device buffers for one process group after its first all-reduce, per rank: 544 MiB with 2 ranks and
#: 688 MiB with 3 or 4 (4 x A100 with NVLink, PyTorch; NVIDIA/nccl#964). They scale with NCCL's channels (more on
#: faster links: H100 NVLink), not with the model: ~1.6 GB were reported for one communicator elsewhere
#: (NVIDIA/nccl#864), 484 MiB at initialisation on RTX 3090s over PCIe (NVIDIA/nccl#2366). Known error: +-0.5 GiB.
NCCL_BYTES = {2: 544 * MiB}
NCCL_BYTES_MORE = 688 * MiB


@dataclass(frozen=True)
class Phase:
    name: str
    tensors: int
    """Tensor peak of the phase (``max_memory_allocated``)."""
    reserved: int
    """Predicted ``max_memory_reserved`` by the end of the phase (the tensor peak on a CPU)."""


@dataclass(frozen=True)
class DevicePhases:
    """One rank's phases (module docstring) and what the device holds outside torch's allocator."""

    phases: tuple[Phase, ...]
    context: int
    """The CUDA context (0 on a CPU)."""
    nccl: int
    """NCCL's buffers (0 with one process or on a CPU)."""

    @property
    def worst(self) -> Phase:
        """The phase with the most reserved memory (the earlier on a tie)."""
        return max(self.phases, key=lambda p: p.reserved)

    def needed(self) -> int:
        """What the device must hold for the run: the largest phase's reserved memory + context + NCCL."""
        return self.worst.reserved + self.context + self.nccl

    def outside_step(self) -> int:
        """The same, over the phases other than the step."""
        rest = [p.reserved for p in self.phases if p.name != "step"]
        return max(rest, default=0) + self.context + self.nccl

    def to_dict(self) -> dict:
        return {"phases": {p.name: {"tensor_bytes": int(p.tensors), "reserved_bytes": int(p.reserved)}
                           for p in self.phases},
                "worst": self.worst.name, "context_bytes": int(self.context), "nccl_bytes": int(self.nccl),
                "needed_bytes": int(self.needed())}


def nccl_bytes(run: RunConfig, device: str = "cuda") -> int:
    """NCCL's buffers per rank (``NCCL_BYTES``): 0 for one process or a CPU run (gloo)."""
    if device != "cuda" or run.num_processes < 2:
        return 0
    return NCCL_BYTES.get(run.num_processes, NCCL_BYTES_MORE)


def device_phases(spec, run: RunConfig, breakdown, device: str = "cuda", extra_step: int = 0,
                  stack: Stack | None = None, loaded_from: LoadedFrom | None = None) -> DevicePhases:
    """Every phase of ``run`` on one rank (module docstring); ``breakdown`` is the step's estimate or trace for
    ``device``; ``extra_step``: tensor bytes the step may add beyond it (a mixture-of-experts' worst routing);
    ``stack``: who runs it (None: memfit's own), which decides how the base is loaded and wrapped; ``loaded_from``:
    the checkpoint's dtype, or random weights, which decide a quantized base's loading on a CPU
    (``memory.host_loading``; None: a checkpoint in ``--dtype``)."""
    from memfit.memory.outside import outside_step

    cuda = device == "cuda"
    outside = outside_step(spec, run, device, loaded_from)
    # Phases outside the step: the tensor-peak share alone; what the step's optimizer state and logits split stays in
    # the step's reserved memory, which later phases reuse (memory.fragmentation).
    reserve = reserved_from_tensors if cuda else int
    tensors = breakdown.peak_bytes - breakdown.other + extra_step
    held = (breakdown.optimizer, breakdown.logits)  # what the fitted overhead follows (memory.fragmentation)
    step_reserved = (breakdown.reserved + extra_step if breakdown.reserved else reserve(tensors, *held)) if cuda \
        else tensors
    earlier = _loading_phases(spec, run, outside, cuda, stack or Stack(), loaded_from)
    if cuda and flat_params.applies(run, stack):  # FSDP (1): its unshard stream cannot reuse what earlier phases cached
        step_reserved = flat_params.after_earlier_phases(
            spec, run, flat_params.step_reserved(spec, run, tensors, *held, stack=stack),
            max(p.reserved for p in earlier), stack)
    phases = [*earlier, Phase("step", tensors, step_reserved)]
    for name, figure in (("evaluation", outside.evaluation), ("checkpoint", max(outside.checkpoint_full)),
                         ("export", max(outside.export)), ("samples", outside.generation)):
        phases.append(Phase(name, figure, reserve(figure)))
    return DevicePhases(tuple(phases), CUDA_CONTEXT_BYTES if cuda else 0, nccl_bytes(run, device))


def _loading_phases(spec, run: RunConfig, outside, cuda: bool, stack: Stack,
                    loaded_from: LoadedFrom | None = None) -> list[Phase]:
    """The loading phase, and wrapping's where the run is sharded. A quantized base loading on a CPU peaks at the
    larger of the finished model and the tensor it quantizes on top of what is loaded so far
    (``memory.host_loading``)."""
    from memfit.memory.loading import loading_replay
    from memfit.memory.outside import largest_tensor_bytes
    from memfit.memory.states import model_states

    # an older transformers' rotary caches are buffers: whole on every rank from the build on (memory.stack_terms)
    shards = model_states(spec, run, "cuda" if cuda else "cpu").weights + rope_caches(spec, run, Precisions.of(run), stack)
    sharded = run.num_processes > 1 and run.sharding is not Sharding.DDP
    if sharded and stack.loads_low_memory():
        return _low_memory_phases(spec, run, shards, cuda, stack)
    whole = not sharded or run.quantize is not Quantize.NONE  # every rank loads the whole (4-bit) base
    if sharded and not whole and not cuda:
        return _host_is_device_phases(spec, run, shards)
    replay = loading_replay(spec, run, stack=stack) if cuda and whole else None
    held = max(outside.loading, shards) if whole else shards  # what the loaded model holds
    if replay is not None:
        loading = Phase("loading", replay.allocated_after, replay.peak_reserved)
        held = replay.allocated_after
    else:
        peak = max(held, host_loading_peak(spec, run, loaded_from)) if not cuda and whole else held
        loading = Phase("loading", peak, reserved_from_tensors(peak) if cuda else peak)
    if not sharded:
        return [loading]
    beside = shards if whole else largest_tensor_bytes(spec, run)  # the shards beside the whole base, or a gather
    wrapped = held + beside if whole else shards + beside
    reserved = loading.reserved + beside if whole and cuda else (reserved_from_tensors(wrapped) if cuda else wrapped)
    return [loading, Phase("wrapping", wrapped, reserved)]


def _host_is_device_phases(spec, run: RunConfig, shards: int) -> list[Phase]:
    """Loading and wrapping of a sharded unquantized CPU run, on rank 0, where the host is the device.

    Rank 0 alone builds (or loads) the whole model (``training.sharding.builds_empty``): loading holds the full
    weights (``model_states`` of one process). Accelerate 1.16's ``fsdp2_prepare_model`` keeps them as
    ``original_sd = model.state_dict()`` (``utils/fsdp_utils.py`` L814) through ``fsdp2_load_full_state_dict``
    (L912), which collects this rank's shards in ``sharded_sd`` (L651: ``distribute_tensor`` copies each shard out
    of the full tensor) before ``load_state_dict(sharded_sd, assign=True)`` (L654): wrapping peaks at the full
    weights + this rank's shards. On a GPU the full model stays in host memory and reaches the device one tensor at
    a time (``_loading_phases``). Measured (tiny preset, FSDP on 2 CPU ranks, ``bench/shard_setup_memory.py``):
    rank 0 38,954,832 B against 38,954,880 B predicted; rank 1 (shards + one broadcast tensor) peaks lower.
    """
    from memfit.memory.states import model_states

    full = model_states(spec, run.replace(num_processes=1), "cpu").weights
    return [Phase("loading", full, full), Phase("wrapping", full + shards, full + shards)]


def _low_memory_phases(spec, run: RunConfig, shards: int, cuda: bool, stack: Stack) -> list[Phase]:
    """Loading and wrapping of a sharded run whose stack loads low-memory (module docstring).

    - loading: a 4-bit base's projections quantized on the device one at a time, each moved off once quantized
      (``memory.loading.moved_off_replay``: its tensor and reserved peaks); any other base is read into host
      memory (rank 0) or built on meta: nothing on the device (known error: an 8-bit base is quantized on the
      device too, one ``Int8Params`` at a time, not priced).
    - wrapping: this rank's shards (``model_states``' weights) + ``wrapping_transient``, reserved through the
      fitted overhead (``memory.fragmentation``).
    """
    from memfit.memory.loading import moved_off_replay

    replay = moved_off_replay(spec, run, stack=stack) if run.quantize is Quantize.Q4 else None
    loading = Phase("loading", replay.peak_allocated, replay.peak_reserved) if cuda and replay else Phase("loading", 0, 0)
    wrapped = shards + wrapping_transient(spec, run, stack)
    return [loading, Phase("wrapping", wrapped, reserved_from_tensors(wrapped) if cuda else wrapped)]


def wrapping_transient(spec, run: RunConfig, stack: Stack) -> int:
    """What one unit brings to a rank beside its shards while a low-memory base is wrapped (bytes).

    - FSDP (1) (``stack.fsdp == 1``, ``--sharding fsdp``): ``2 U``, ``U`` the largest unit (``largest_unit_bytes``).
      ``FullyShardedDataParallel`` moves the unit to the device (torch ``fsdp/_init_utils.py`` L603
      ``_move_module_to_device``; the other ranks' ``param_init_fn`` ``to_empty``s theirs), broadcasts it from rank 0
      in place (``sync_module_states``: buckets of ``PARAM_BROADCAST_BUCKET_SIZE`` = 250 MiB, L60, never above
      ``2 U``), concatenates it into the flat parameter (``_flat_param.py`` L893 ``torch.cat``: a second copy
      while the originals live) and keeps this rank's shard (L971 ``flat_param.set_(sharded_flat_param)``).
    - FSDP2, ZeRO-3: one full tensor at a time (``memory.outside.largest_tensor_bytes``: torchtune's
      ``load_from_full_model_state_dict`` ``distribute_tensor``s each full tensor; DeepSpeed partitions each
      parameter as it converts it).

    Known error: the originals are freed only once the flat parameter's views replace them, so a unit's reserved
    blocks can be ``2 U`` even after sharding until the next unit reuses them (taken as reused).
    """
    from memfit.memory.outside import largest_tensor_bytes

    if stack.fsdp == 1 and run.sharding is Sharding.FSDP:
        return 2 * largest_unit_bytes(spec, run)
    return largest_tensor_bytes(spec, run)


def largest_unit_bytes(spec, run: RunConfig) -> int:
    """Bytes of the largest unit a transformer-layer auto-wrap policy makes (Accelerate's
    ``TRANSFORMER_BASED_WRAP``, fsdp_qlora's ``get_wrapping_policy``): one decoder layer as stored
    (``memory.states.gathered_layer_bytes``: 4-bit projections packed) or the root, which keeps what no layer holds:
    the embedding, the head and the final norm, at the unquantized dtype (``memory.quantized.unquantized_bytes``)."""
    from memfit.memory.activations import Precisions
    from memfit.memory.quantized import unquantized_bytes
    from memfit.memory.states import gathered_layer_bytes

    rest = unquantized_bytes(run) if run.quantize is not Quantize.NONE else Precisions.of(run).w
    root = (spec.embedding_params + spec.lm_head_params + spec.hidden_size) * rest
    return int(max(gathered_layer_bytes(spec, run), root))


def phase_figures(spec, run: RunConfig, breakdown, device: str,
                  loaded_from: LoadedFrom | None = None) -> dict[str, int]:
    """The flat figures ``memfit train``'s summary keeps beside ``memory.outside``'s (``run.json``'s
    ``outside_step``): ``phase_<name>`` (each phase's reserved memory; its tensor peak on a CPU),
    ``device_needed`` (what the fit rule reads) and ``device_context`` (0 on a CPU); empty where the estimator
    cannot describe the run (a prediction never stops a training run). ``loaded_from``: ``device_phases``'."""
    try:
        phases = device_phases(spec, run, breakdown, "cpu" if device == "cpu" else "cuda", loaded_from=loaded_from)
    except Exception:  # noqa: BLE001
        return {}
    return {**{f"phase_{p.name}": int(p.reserved) for p in phases.phases}, "device_needed": int(phases.needed()),
            "device_context": int(phases.context)}
