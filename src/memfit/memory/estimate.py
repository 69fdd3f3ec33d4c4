"""Analytic estimate of one training step's memory: ``estimate(model, run) -> MemoryBreakdown``.

Pure arithmetic on a ``ModelSpec`` and a ``RunConfig`` (no torch import, microseconds), modelling how
Accelerate + transformers + torch actually run a step:

1. forward under Accelerate's autocast (``mixed_precision``), with the loss computed by transformers'
   ``ForCausalLMLoss`` inside the model's forward;
2. ``accelerator.backward(loss)``;
3. ``optimizer.step()`` then ``optimizer.zero_grad(set_to_none=True)``.

The breakdown is the steady state (second step: optimizer state exists). Each term is documented where it
is computed: the formula, its source, what it ignores, how far off it is known to be. Activation terms
are counted op by op from what autograd saves for backward in transformers 5's modeling code; the
per-family recipes live in ``memory/activations.py``. They were checked tensor by tensor against
``torch.autograd.graph.saved_tensors_hooks`` on 1-layer models, and held to the exact tracer
(``memory/trace.py``) by ``tests/test_estimate_accuracy.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit import versions
from memfit.config import Offload, Precision, Quantize, RunConfig, Sharding
from memfit.errors import UserError
from memfit.memory import quantized
from memfit.memory.activations import (
    ATTN_IN,
    Precisions,
    final_hidden_in_loss,
    head_side_activations,
    layer_activations,
    logits_terms,
    masks_freed_above_first_layer,
    outside_layer_activations,
)
from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.deepspeed_layout import ENGINES, zero_states
from memfit.modelspec import ModelSpec, load_spec
from memfit.optimizers import row
from memfit.quant_support import shards_packed_weights
from memfit.resolved import resolve
from memfit.units import MiB, fmt_gb, fmt_gib

#: CUDA context + kernels loaded by torch on first use. Measured ~300-600 MiB across A100/H100/L4 with
#: CUDA 12 (it grows with the number of kernels loaded; lazy loading ``CUDA_MODULE_LOADING=LAZY``, the
#: default since CUDA 11.7, keeps it near the low end). It is not visible to ``max_memory_allocated``,
#: only to ``nvidia-smi``. Varies by GPU, driver and torch build: +-200 MiB.
CUDA_CONTEXT_BYTES = 500 * MiB

#: cuBLAS workspace torch allocates per stream on the first matmul (``CUBLAS_WORKSPACE_CONFIG`` default
#: on Hopper is 32 MiB (4096 KiB x 8); 4 MiB x 2 + 16 KiB x 8 earlier). It is held by the caching
#: allocator, so it shows in ``memory_reserved`` but not as a tensor.
CUBLAS_WORKSPACE_BYTES = 32 * MiB

#: Fraction of allocated bytes the caching allocator holds on top (fragmentation and rounding to
#: 2 MiB segments / 512-byte blocks). 5% is a typical ``memory_reserved / max_memory_allocated - 1``
#: for a steady training loop; it ranges 2-15% (more with variable sequence lengths; set
#: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` to shrink it).
ALLOCATOR_RESERVE_FRACTION = 0.05

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


def estimate(model: str | ModelSpec, run: RunConfig, *, device: str = "cuda",
             derived: bool | None = None, engine: str = "fsdp2", rank: int | None = None) -> MemoryBreakdown:
    """Analytic memory breakdown of one steady-state training step, per rank.

    Args:
        model: a ``ModelSpec`` or anything ``load_spec`` accepts (preset, folder, config.json).
        run: the training configuration.
        device: ``"cuda"`` adds the CUDA context, cuBLAS workspace and allocator reserve (``other``) and
            models CUDA kernels (flash/mem-efficient attention, fused dropout masks); ``"cpu"`` models the
            CPU kernels and drops those terms (this is what ``memory/trace.py`` runs).
        derived: None picks the hand-written recipe where one models the run, else derives one from
            traces (``memory/derive.py``, seconds once, then cached); True forces the derived recipe,
            False the hand-written one (Llama's for a family without one: the old behaviour).
        engine: which engine shards ``--sharding zero2|zero3``: ``"fsdp2"`` (memfit's default) or
            ``"deepspeed"`` (a DeepSpeed launch: ``memory.deepspeed_layout``). DDP and FSDP are FSDP2's.
        rank: DeepSpeed ZeRO-2 only, whose ranks differ: this rank's peak; None: the largest (the last rank's).

    Returns:
        A ``MemoryBreakdown`` with ``method="analytic"``; ``peak_bytes`` is the maximum over phases.
    """
    spec = model if isinstance(model, ModelSpec) else load_spec(str(model))
    _check(spec, run, device, engine)
    # What gets built (LoRA modules, the attention transformers runs, the optimizer's row): the same
    # answer trace, plan and train use. From here on ``run`` names what is built.
    resolved = resolve(spec, run, device)
    run = resolved.run
    from memfit.memory.derive import derived_estimate, hand_written_family

    family = hand_written_family(spec, run, device)
    if derived is None and versions.unverified():
        derived = True  # outside the verified versions the hand-written recipes may not hold: trace instead
    if derived or (family is None and derived is None):
        return _described(derived_estimate(spec, run, device, engine, rank), resolved)
    prec = Precisions.of(run)
    states = model_states(spec, run, device, engine, rank)
    acts = layer_activations(spec, run, prec, device)
    outside = outside_layer_activations(spec, run, prec, device)
    logit = logits_terms(spec, run, prec)
    saved_copies = autocast_copies_saved(spec, run, prec)
    # in forward; saved for backward; alive one layer into backward (fewer at the first layer's moment)
    copies = (autocast_weight_copies(spec, run, prec), saved_copies,
              autocast_copies_in_recompute(spec, run, prec, saved_copies))

    activations = acts.all_layers + outside
    if run.offload is Offload.ACTIVATIONS:
        activations, acts = offloaded_activations(acts, outside, run.grad_checkpointing,
                                                  offloaded_node_bytes(spec, run, prec))
        # autocast's weight copies saved for backward go to the host too; its cache (trainable weights) stays
        copies = (0 if run.is_lora() else copies[0], 0, 0)
    # QLoRA: one projection's weight dequantized inside a layer's forward and backward (memory/quantized.py);
    # a checkpointed layer's backward moment has it already (activations.quantized_mlp_moment)
    dequant = quantized.dequantized_transient(spec, run, "forward")
    if not run.grad_checkpointing:
        acts = dataclasses.replace(acts, backward_transient=acts.backward_transient
                                   + quantized.dequantized_transient(spec, run, "backward"))
    # what the layers keep to the end of backward (an 8-bit base's ctx.A) is alive there beside the gradients
    at_end = outside + acts.held_all_layers
    # forward end: everything saved, logits + loss alive; the autocast cache holds half weight copies.
    grads_in_fwd = states.gradients if run.grad_accum > 1 else 0
    base = states.weights + states.optimizer + states.buckets
    in_loss = final_hidden_in_loss(spec, run, prec)
    forward = base + grads_in_fwd + activations + in_loss + logit.forward + copies[0] + states.forward_gathered
    if str(run.loss) != "standard":
        # the chunked loss runs after model.forward's autocast exited (its weight cache freed): the decoder's
        # end holds the cache, the loss only the copies saved for backward (the head's included).
        forward = (base + grads_in_fwd + activations + states.forward_gathered
                   + max(copies[0], copies[1] + logit.forward))
    # backward start: logits' gradient chain is the transient; all activations and the weight copies
    # saved for backward still alive (the autocast cache itself is cleared when forward returns).
    backward_start = (base + grads_in_fwd + activations + logit.backward + copies[1] + states.gathered
                      + states.from_backward_start)
    # backward, one layer in: grads of head/embedding exist, plus one layer's recompute and input grads.
    # (DDP: the gradients live in its buckets, counted in ``base`` from the first step)
    # (DeepSpeed ZeRO-2: its bucket reduces the head's gradient into the flat partition, whole from the start)
    whole = grads_in_fwd or states.buckets or states.backward_gradients
    head_grads = _head_grad_bytes(spec, run, prec) if not whole else 0
    # the head's and the loss' saved tensors are freed before the first layer's backward (offloaded without
    # checkpointing: they were never counted on the device)
    offloaded_all = run.offload is Offload.ACTIVATIONS and not run.grad_checkpointing
    head_side = 0 if offloaded_all else head_side_activations(spec, run, prec, device)
    backward_layer = (base + grads_in_fwd + head_grads + activations - head_side + copies[2] + logit.retained
                      + acts.backward_transient + states.layer_gathered + states.from_backward_start)
    # the first layer's backward: the layers above hold their weight gradients instead of their saved
    # tensors (a middle layer's moment lies between the two, linear in its depth).
    below = 0
    # (optimizer-in-backward frees each gradient as it lands: nothing builds up)
    if not grads_in_fwd and not run.optimizer_in_backward and not states.backward_gradients:
        # offloaded activations: the layers above kept nothing on the device, so they free nothing there
        kept = 0 if run.offload is Offload.ACTIVATIONS else acts.saved - acts.held
        below = _layers_below_top(spec, run, states, dataclasses.replace(acts, saved=kept))
        freed = masks_freed_above_first_layer(spec, run, prec) if kept else 0
        # AMP: the layers above also freed the half weight copies their linears saved for backward
        copies_freed = (spec.num_layers - 1) * autocast_copies_saved_per_layer(spec, run, prec) if kept else 0
        below -= freed + copies_freed
    late = states.gradients_after_layers
    if late and states.backward_gradients > late * acts.saved:
        # DeepSpeed ZeRO-2 off the last rank: its gradient partition appears once backward has finished
        # ``late`` layers, whose saved tensors are gone by then (the moment is shown as one layer in)
        backward_layer += states.backward_gradients - late * acts.saved
        head_grads += states.backward_gradients  # shown as gradients
        head_side += late * acts.saved  # shown as freed activations
    if below > 0:
        backward_layer += below
        head_grads += below + freed + copies_freed + (spec.num_layers - 1) * kept  # shown as gradients
        head_side += freed + (spec.num_layers - 1) * kept  # shown as freed activations
        copies = (copies[0], copies[1], copies[2] - copies_freed)  # shown as freed temporaries
    backward_end = base + states.gradients + at_end + logit.retained + states.gathered_end
    optimizer = base + states.gradients + states.step_temporary + logit.retained
    step_one = 0
    if run.optimizer_in_backward:
        # No full set of gradients: each is stepped and freed as it lands (grad_accum is 1).
        step_one = in_backward_step_bytes(spec, run, prec, device)
        hidden_grad = prec.w * run.micro_batch * run.seq_len * spec.hidden_size
        # the head (first gradient) is stepped while every activation is alive; one layer's backward
        # transient as without the technique; the embedding (tied: the head too) at the end.
        if step_one + hidden_grad >= acts.backward_transient:
            head_grads, acts = step_one + hidden_grad, dataclasses.replace(acts, backward_transient=0)
        else:
            head_grads = 0  # a layer's weight gradients come after its recompute peak (+2.8% on the grid without)
        backward_layer = (base + activations - head_side + copies[2] + states.layer_gathered + head_grads
                          + acts.backward_transient)
        backward_end = base + at_end + step_one + states.gathered_end
        optimizer = base + logit.retained
    forward_moment = "head"
    if dequant:  # inside the last layer's forward: its dequantized weight, before the logits exist
        layer_forward = base + grads_in_fwd + activations + states.layer_gathered + dequant
        forward, forward_moment = max((forward, forward_moment), (layer_forward, "layer"), key=lambda m: m[0])
    if states.gathered_entry:  # the last layer's entry: its own saved tensors not made yet
        entry = base + grads_in_fwd + activations - acts.saved + states.gathered_entry
        forward, forward_moment = max((forward, forward_moment), (entry, "entry"), key=lambda m: m[0])
    if states.gathered_first_entry:  # the first layer's entry: nothing saved yet (the embedding's output ignored)
        first = base + grads_in_fwd + states.gathered_first_entry
        forward, forward_moment = max((forward, forward_moment), (first, "first entry"), key=lambda m: m[0])
    phases = {
        "forward": forward,
        "backward": max(backward_start, backward_layer, backward_end),
        "optimizer": optimizer,
    }
    phase = max(phases, key=lambda k: phases[k])
    moment = max((backward_start, "start"), (backward_layer, "layer"), (backward_end, "end"),
                 key=lambda m: m[0])[1]  # ties: the earlier moment, as before
    if phase == "forward":
        moment = forward_moment
    end_temporary = states.gathered_end + (step_one if run.optimizer_in_backward else 0)
    out = _breakdown_at(phase, spec, run, states, (activations, at_end), logit, copies, acts,
                        (head_grads, end_temporary), moment, head_side, in_loss)
    out.phase_peaks = dict(phases)
    out.activations_per_layer = acts.saved
    if device == "cuda":
        out.other = cuda_other(out.peak_bytes)
    out.recipe = f"hand-written recipe: {family or spec.family}"
    out.notes = notes(spec, run, out) + [f"recipe: {out.recipe} (memory/activations.py)."]
    return _described(out, resolved)


def _described(out: MemoryBreakdown, resolved) -> MemoryBreakdown:
    """Name what is built (attention, LoRA targets) and the versions caveat on an estimate."""
    out.attn_implementation = resolved.attention
    out.lora_targets = resolved.lora.names if resolved.lora else ()
    out.notes = resolved.describe() + out.notes + versions.notes()
    return out


def _breakdown_at(phase, spec, run, states, saved, logit, copies, acts, grads_and_end, moment,
                  head_side=0, in_loss=0) -> MemoryBreakdown:
    """Assign the bytes of the peak phase to categories (``saved``: all activations and those outside the
    layers; ``copies``: autocast weight copies in forward, those saved for backward and those alive one
    layer into backward; ``moment``: which
    of backward's ``start``/``layer``/``end`` is its peak; ``grads_and_end``: the weight gradients one layer
    into backward and the temporaries at backward's end; ``head_side``: activations freed before the first
    layer's backward; ``in_loss``: activations alive only while the forward's loss runs)."""
    activations, outside = saved
    head_grads, end_temporary = grads_and_end
    out = MemoryBreakdown(method="analytic", phase=phase, params=spec.params,
                          trainable_params=spec.trainable_params(run))
    out.weights = states.weights
    out.optimizer = states.optimizer
    grads_in_fwd = (states.gradients if run.grad_accum > 1 else 0) + states.buckets
    in_backward = grads_in_fwd + states.from_backward_start  # gradients from backward's start on
    if phase == "forward" and moment == "layer":  # inside the last layer (QLoRA: its dequantized weight)
        out.gradients = grads_in_fwd
        out.activations = activations
        out.temporary = quantized.dequantized_transient(spec, run, "forward") + states.layer_gathered
    elif phase == "forward" and moment == "entry":  # the last layer's unshard, before it saves anything
        out.gradients = grads_in_fwd
        out.activations = activations - acts.saved
        out.temporary = states.gathered_entry
    elif phase == "forward" and moment == "first entry":  # the first layer's unshard
        out.gradients = grads_in_fwd
        out.temporary = states.gathered_first_entry
    elif phase == "forward":
        out.gradients = grads_in_fwd
        out.activations = activations + in_loss
        out.logits = logit.forward
        out.temporary = copies[0] + states.forward_gathered
    elif phase == "backward" and moment == "end":
        in_bw = run.optimizer_in_backward
        out.gradients = states.buckets + (0 if in_bw else states.gradients)
        out.activations = outside
        out.logits = 0 if in_bw else logit.retained
        out.temporary = end_temporary
    elif phase == "backward" and moment == "start":
        out.gradients = in_backward
        out.activations = activations
        out.logits = logit.backward
        out.temporary = copies[1] + states.gathered
    elif phase == "backward":
        out.gradients = in_backward + head_grads
        out.activations = activations - head_side
        out.logits = logit.retained
        out.temporary = copies[2] + acts.backward_transient + states.layer_gathered
    else:
        in_bw = run.optimizer_in_backward  # stepped in backward: no gradients, no temporaries left
        out.gradients = states.buckets + (0 if in_bw else states.gradients)
        out.logits = logit.retained
        out.temporary = 0 if in_bw else states.step_temporary
    return out


def _check(spec: ModelSpec, run: RunConfig, device: str, engine: str = "fsdp2") -> None:
    if device not in ("cuda", "cpu"):
        raise UserError(f"device must be 'cuda' or 'cpu', got {device!r}.")
    if engine not in ENGINES:
        raise UserError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}.")
    if run.quantize is not Quantize.NONE and run.offload is Offload.PARAMS and not shards_packed_weights(run):
        raise UserError("--offload params with --quantize needs a 4-bit base sharded by --sharding fsdp or zero3 "
                        "(FSDP2 then offloads its packed weights); otherwise bitsandbytes' weights stay on the GPU.")


# ----------------------------------------------------------------------------------------------
# Model states
# ----------------------------------------------------------------------------------------------
def model_states(spec: ModelSpec, run: RunConfig, device: str = "cuda", engine: str = "fsdp2",
                 rank: int | None = None) -> ModelStates:
    """Weights, gradients and optimizer state per rank.

    Full fine-tune: weights and grads at the stored dtype (fp32 stays fp32 under AMP: autocast casts
    on the fly, it never changes ``param.dtype``), optimizer state from ``optimizer_state_bytes``.
    LoRA: frozen base at its dtype (or quantized), adapters in fp32 (PEFT's ``autocast_adapter_dtype=True``
    upcasts bf16/fp16 adapters to fp32), grads and optimizer state for adapters only.
    Sharding (``num_processes`` > 1): FSDP/ZeRO-3/ZeRO-2 (all FSDP2) divide all three by N and gather
    parameters while computing (``fsdp2_gathered``); DDP divides nothing and keeps gradient buckets
    (``ddp_bucket_bytes``). Offload moves optimizer state (and with ``params`` the weights) to CPU.
    ``device`` picks the optimizer implementation torch runs there (its step temporaries).
    ``engine="deepspeed"`` with ``--sharding zero2|zero3`` on several processes: DeepSpeed's layout instead
    (``memory.deepspeed_layout.zero_states``; ``rank``: which rank, None the last).
    Ignores: FSDP's flat-parameter padding (< N elements per tensor), the optimizer's ``step`` scalars
    (fp32, one per tensor: < 1 MiB).
    """
    w = _weight_bytes(run)
    trainable = spec.trainable_params(run)
    grad_bytes = 4 if run.is_lora() else w
    weights = base_weight_bytes(spec, run) + (spec.lora_params(run) * 4 if run.is_lora() else 0)
    gradients = trainable * grad_bytes
    optimizer = optimizer_state_bytes(spec, run, trainable, grad_bytes)
    step_temp = optimizer_step_temporary(spec, run, trainable, grad_bytes, device)
    n = run.num_processes
    if engine == "deepspeed" and n > 1 and run.sharding in (Sharding.ZERO2, Sharding.ZERO3):
        zero = zero_states(spec, run, device, optimizer_state_bytes(spec, run, trainable, FP32_BYTES), rank)
        return ModelStates(zero.weights, zero.gradients, zero.optimizer, zero.step_temporary, zero.gathered,
                           zero.gathered_end, zero.buckets, gathered_forward=zero.gathered_forward,
                           backward_gradients=zero.backward_gradients, gradients_after_layers=zero.after_layers,
                           engine=engine)
    gathered, gathered_end, buckets, gathered_forward, gathered_layer, entry = 0, 0, 0, None, None, (0, 0)
    if n > 1 and run.sharding is Sharding.DDP:
        buckets, gradients = ddp_bucket_bytes(gradients), 0  # param.grad are views into the buckets
        gathered_end = ddp_embedding_grad_end(spec, run)
    if n > 1 and run.sharding is not Sharding.DDP:
        gathered, gathered_end, gathered_forward, gathered_layer, entry = fsdp2_gathered(spec, run)
        replicated = _quant_state_bytes(spec, run)  # module attributes, not parameters: whole on every rank
        weights = (weights - replicated) // n + replicated
        gradients //= n
        optimizer //= n
        step_temp //= n
    if run.offload in (Offload.OPTIMIZER, Offload.PARAMS):
        optimizer, step_temp = 0, 0  # the step runs on the CPU (DeepSpeed CPU Adam / FSDP offload)
    if run.offload is Offload.PARAMS:
        gathered = max(gathered, 2 * gathered_layer_bytes(spec, run))
        weights = _quant_state_bytes(spec, run)  # a 4-bit base's quantization state: module attributes, not offloaded
        # FSDP2's CPUOffloadPolicy copies every reduce-scattered gradient shard to the host
        # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce: ``.to("cpu")``), and
        # the optimizer steps there: no sharded gradient stays on the GPU. The unsharded gradients of the
        # unit being reduced are in ``gathered_end`` and the layers' backward transients.
        gradients = 0
    return ModelStates(int(weights), int(gradients), int(optimizer), int(step_temp), int(gathered),
                       int(gathered_end), int(buckets), gathered_forward=gathered_forward,
                       gathered_layer=gathered_layer, gathered_entry=entry[0], gathered_first_entry=entry[1],
                       released_per_layer=released_after_backward(spec, run))


def rollback_snapshot_bytes(spec: ModelSpec, run: RunConfig, *, state: bool = True) -> int:
    """Host bytes per rank of ``memfit train``'s step-rollback snapshot (``training/rollback.py``).

    Before every ``optimizer.step()`` memfit copies what the step mutates (each trainable parameter's
    local shard and its optimizer state tensors) into host buffers it keeps for the whole run, so an
    out-of-memory step can be undone. On a GPU this is host RAM, not device memory (``estimate`` leaves
    it out); on CPU the host is the device, so a CPU run's tensor peak is ``estimate(..., "cpu")`` plus
    this (resident from the first step on). Equals the per-rank gradient bytes (a parameter and its
    gradient share the dtype) plus the optimizer state; offloaded state is counted too (it is copied from
    the host). Measured: bench/sharding_memory.py (+807 MB per rank for smollm2-135m fp32 AdamW, FSDP on 2).
    ``state=False``: the parameters alone (a step before any state exists). Which runs keep it, and where it
    adds to a peak: ``memory.snapshot``.
    """
    trainable = spec.trainable_params(run)
    grad_bytes = 4 if run.is_lora() else _weight_bytes(run)
    total = trainable * grad_bytes + (optimizer_state_bytes(spec, run, trainable, grad_bytes) if state else 0)
    shards = run.num_processes if run.num_processes > 1 and run.sharding is not Sharding.DDP else 1
    return int(total // shards)


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
    return int((3 if spec.tie_word_embeddings else 2) * embed * _weight_bytes(run))


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


def fsdp2_gathered(spec: ModelSpec, run: RunConfig) -> tuple[int, int, int | None, int | None, tuple[int, int]]:
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
    u = _unquantized_bytes(run)
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
    grad_bytes = 0 if run.is_lora() else _weight_bytes(run)  # adapters live in the layers; the tail's base is frozen
    copies = 3 if spec.tie_word_embeddings else 2
    # tied: the first layer's reduce-scatter is still in flight when the tail's embedding backward runs
    # (measured, smollm2-135m); untied: not seen at the embedding's end (tiny preset, 2 ranks).
    in_flight = _layer_params(spec) * grad_bytes if spec.tie_word_embeddings else 0
    # tied: the peak comes before the tail's reduce-scatter, so its shard (in ``gradients``) does not exist
    # yet; untied: during the embedding's reduce-scatter, whose output shard already does (a 6-layer Llama
    # and Qwen3 with a 16,384 x 512 untied embedding on 2 ranks: -2.7% without; FSDPMemTracker there:
    # 33.5 MB each of UNSHARDED_GRAD and REDUCE_SCATTER, 50.3 MB of TEMP, the embedding already resharded).
    not_yet_sharded = last // run.num_processes if spec.tie_word_embeddings else 0
    gathered_end = last * u + (copies * last - not_yet_sharded) * grad_bytes + in_flight
    # Late in backward, any layer's: its full parameters and the next layer's all-gathered ahead, its
    # full-size gradients and the previous layer's reduce-scatter input in flight, while the last 2 layers'
    # sharded gradients do not exist yet (FSDPMemTracker, tiny preset on 2 ranks, steady state: 4 x 3.15 MB
    # of UNSHARDED_PARAM, ALL_GATHER, TEMP, REDUCE_SCATTER; the peak there, -8.9% without). Below the tied
    # tail's end (smollm2-135m) it changes nothing.
    layer = _layer_params(spec)
    late_layer = 2 * layer_bytes + (2 * layer - 2 * layer // run.num_processes) * grad_bytes
    entries = (int(gathered_entry), int(gathered_first_entry))
    return int(gathered), int(max(gathered_end, late_layer)), gathered_forward, gathered_layer, entries


def gathered_layer_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """Bytes of one decoder layer's FSDP2 unit when gathered: its parameters as stored (a 4-bit base's
    projections packed, ``memory.quantized.storage_bytes``, 2 weights per byte; its norms fp32 under
    PEFT's kbit cast) and its LoRA adapters (fp32). What each all-gather of a layer brings, and what a layer
    frees when it reshards. The quantization state is not gathered (it is whole on every rank)."""
    adapters = spec.lora_params(run) * 4 // max(spec.num_layers, 1) if run.is_lora() else 0
    if run.quantize is Quantize.NONE:
        return _layer_params(spec) * _weight_bytes(run) + adapters
    from memfit.memory import quantized

    rest = _layer_params(spec) - spec.linear_params // max(spec.num_layers, 1)
    return int(quantized.storage_bytes(spec, run) // max(spec.num_layers, 1) + rest * _unquantized_bytes(run)
               + adapters)


def _unquantized_bytes(run: RunConfig) -> int:
    """Bytes per parameter outside the quantized projections: fp32 under QLoRA (PEFT's kbit cast,
    ``memory.quantized.UNQUANTIZED_BYTES``), else the stored dtype."""
    if run.quantize is Quantize.NONE:
        return _weight_bytes(run)
    from memfit.memory import quantized

    return quantized.UNQUANTIZED_BYTES


def _quant_state_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """A quantized base's quantization state (absmax, code tables, 8-bit row scales): bytes beside the
    packed parameters, which FSDP2 does not shard."""
    if run.quantize is Quantize.NONE:
        return 0
    from memfit.memory import quantized

    return quantized.packed_bytes(spec, run) - quantized.storage_bytes(spec, run)


def base_weight_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """Bytes of the model's own parameters and buffers as stored (no adapters).

    QLoRA: bitsandbytes packs every decoder-layer projection (``memory.quantized.packed_bytes``: NF4 with
    double quantization ~0.516 bytes/param, int8 1 byte/param + one fp32 scale per output row); PEFT's
    ``prepare_model_for_kbit_training`` leaves every other parameter (embeddings, norms, head, biases) in
    fp32 (``memory.quantized.UNQUANTIZED_BYTES``). Buffers (rotary ``inv_freq``) stay fp32.
    """
    w = _weight_bytes(run)
    if run.quantize is Quantize.NONE:
        return int(spec.params * w + spec.buffer_bytes)
    from memfit.memory import quantized

    rest = spec.params - spec.linear_params
    return int(quantized.packed_bytes(spec, run) + rest * quantized.UNQUANTIZED_BYTES + spec.buffer_bytes)


def optimizer_state_bytes(spec: ModelSpec, run: RunConfig, trainable: int, grad_bytes: int) -> int:
    """Optimizer state, from the optimizer's row of ``memfit.optimizers.OPTIMIZERS``.

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
        lins = spec.lora_linears(run.lora_targets)
        return sum(lin.count * (run.lora_r + lin.in_features + lin.out_features + run.lora_r) for lin in lins)
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
    groups (``memfit.build.parameter_groups``) put the matrices in the first, so that group's size is
    the peak (``trainable`` less the norms and biases of a full fine-tune). ``largest-x2``: a per-tensor update
    (Adafactor; ``adamw`` on CPU, where torch runs the single-tensor loop) bounded by two copies of the
    largest trainable tensor. ``none``: in place (fused, 8-bit, SGD).
    """
    kind = row(run.optimizer).step_temporary_on(device)
    if kind == "group":
        return (trainable - _vector_params(spec, run)) * grad_bytes
    if kind == "largest-x2":
        return _largest_trainable(spec, run) * grad_bytes * 2
    if kind == "per-tensor":
        return _per_tensor_peak(spec, run) * grad_bytes
    return 0


def _per_tensor_peak(spec: ModelSpec, run: RunConfig) -> int:
    """Elements a per-parameter loop holding ``previous + 2 x current`` peaks at (single-tensor AdamW).

    torch runs the loop once per parameter group, the previous quotient freed between groups; train's
    first group (``memfit.build.parameter_groups``) holds the matrices in the order transformers registers
    them: the token embedding (and learned positions), each layer's projections in ``spec.linears`` order
    (the last of one layer next to the first of the next: two layers' worth), the untied head. The second
    group (norms, biases: vectors) peaks far lower. LoRA: the largest adapter matrix twice (adapters are
    small and alike). Checked to the byte against the exact trace on CPU (tiny Llama: the last layer's
    down projection then the head; GPT-2: wte then wpe).
    """
    if run.is_lora():
        return 2 * _largest_trainable(spec, run)
    tokens = spec.vocab_size * spec.hidden_size
    order = [tokens, max((spec.embedding_params or tokens) - tokens, 0)]
    order += [lin.in_features * lin.out_features for lin in spec.linears] * min(spec.num_layers, 2)
    if not spec.tie_word_embeddings:
        order += [spec.lm_head_params or tokens]
    sizes = [n for n in order if n]
    return max(prev + 2 * cur for prev, cur in zip([0] + sizes, sizes, strict=False))


def _vector_params(spec: ModelSpec, run: RunConfig) -> int:
    """Trainable parameters of fewer than two dimensions (norms, biases): the second of train's parameter
    groups (``memfit.build.parameter_groups``); none under LoRA (adapters are matrices)."""
    if run.is_lora():
        return 0
    return max(spec.params - spec.linear_params - spec.embedding_params - spec.lm_head_params, 0)


def _largest_trainable(spec: ModelSpec, run: RunConfig) -> int:
    if run.is_lora():
        return max((run.lora_r * max(lin.in_features, lin.out_features) for lin in spec.lora_linears(run.lora_targets)),
                   default=0)
    return max([spec.vocab_size * spec.hidden_size] + [lin.in_features * lin.out_features for lin in spec.linears])


def _layer_params(spec: ModelSpec) -> int:
    return (spec.params - spec.embedding_params - spec.lm_head_params) // max(spec.num_layers, 1)


def _weight_bytes(run: RunConfig) -> int:
    return int(2 if str(run.dtype) in ("bf16", "fp16") else 4)


def offloaded_activations(acts, outside: int, checkpointing: bool = False, node: int = 0):
    """``--offload activations`` (torch's ``save_on_cpu``): saved tensors wait in pinned CPU memory.

    Every tensor autograd saves (the layers' activations, those outside the layers, autocast's weight
    copies) is copied to the host the moment it is saved, and its device copy is freed once Python no
    longer holds it; so after forward the device holds no saved tensor, only what the loss still holds
    (the logits terms, counted on their own). In backward each node copies back only the tensors it uses,
    for as long as it runs: a layer's backward transient is then ``node`` (``offloaded_node_bytes``, its
    widest node's moment), not its whole saved set. With checkpointing only the layers' checkpoint inputs
    are saved under these hooks (the recompute runs under checkpoint's own): the transient is the
    recompute's as without offload plus the layer's input copied back, and the terms outside the layers are
    kept as without offload (the trace agrees within 1%). Returns (resident activations, layer terms).
    Source: ``torch.autograd.graph.save_on_cpu`` (pack: ``torch.empty`` + ``copy_`` to pinned host memory;
    unpack: ``.to(device)`` per use), played on fake tensors by the exact trace (``memory/offload_trace.py``).
    Ignores: host RAM (the CPU copies, parameters' included).
    """
    if checkpointing:
        return outside, dataclasses.replace(acts, backward_transient=acts.backward_transient + acts.saved)
    return 0, dataclasses.replace(acts, backward_transient=node)


def offloaded_node_bytes(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """``--offload activations`` without checkpointing: the most a decoder layer's backward holds on the device.

    Its widest node is the MLP's product of its two I-wide branches (Llama's ``act(gate) * up``, GPT-2's
    ``gelu_new`` halves): while it runs, its two saved operands are copied back (2 c I per token), and the
    gradient of its output (down projection's input gradient, c I), the two gradients it makes (2 c I) and
    the gradient of the layer's output (w H) are alive: ``w H + 5 c I`` per token. Read off the exact trace
    (tiny Llama, fp32: the backward peak in the first layer's MLP, exact to the byte for these tensors).
    Ignores: attention's nodes (eager attention at long sequences: its (B, n, T, T) tensors copied back
    with their gradients can exceed it), and under autocast the half copy of the MLP output's gradient
    (c H per token).
    """
    tokens = run.micro_batch * run.seq_len
    return int((prec.w * spec.hidden_size + 5 * prec.c * spec.intermediate_size) * tokens)


def in_backward_step_bytes(spec: ModelSpec, run: RunConfig, prec: Precisions, device: str = "cuda") -> int:
    """``--optimizer-in-backward``: the most gradient + step-temporary bytes alive at once in backward.

    Each parameter's gradient lives from its accumulation to the end of its own ``step()``, which (a
    per-parameter foreach AdamW) adds one temporary its size; taken for the largest trainable tensor
    (the head or embedding for a full fine-tune), the upper bound of what one step holds. Ignores the
    overlap of a gradient being written while the previous one is stepped (hooks run synchronously).
    """
    grad_bytes = 4 if run.is_lora() else prec.w
    largest = _largest_trainable(spec, run) * grad_bytes
    # The optimizer's row says what its step allocates; per parameter a foreach "group" is that one tensor.
    copies = {"group": 1, "largest-x2": 2, "per-tensor": 2, "none": 0}[row(run.optimizer).step_temporary_on(device)]
    return int(largest + copies * largest)


def _layers_below_top(spec: ModelSpec, run: RunConfig, states: ModelStates, acts) -> int:
    """How many more bytes the first layer's backward holds than the top layer's: N - 1 layers' weight
    gradients (trainable parameters outside the embedding and an untied head, shared by N layers, at the
    gradients' bytes per parameter) less their saved tensors; negative when saved tensors outweigh
    gradients (without checkpointing). Ignores: norms outside the layers (H parameters)."""
    trainable = spec.trainable_params(run)
    if trainable == 0 or spec.num_layers < 2:
        return 0
    outside = 0 if run.is_lora() else spec.vocab_size * spec.hidden_size + spec.lm_head_params
    per_layer = max(0, trainable - outside) / spec.num_layers * states.gradients / trainable
    return int((spec.num_layers - 1) * (per_layer - acts.saved - states.released_per_layer))


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


def _head_grad_bytes(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Weight gradients that exist one layer into backward (full fine-tune): the output head's (produced
    first; a head tied to the embedding gets its ``.grad`` only with the embedding's, at the end of
    backward, but autograd holds the head's part in the weight's input buffer from the head's backward
    on, to sum both uses: the same bytes, as a temporary) and the last layer's down projection's (the
    first weight gradient of a layer's backward). Trace: Qwen2 (tied), fp32, checkpointing, T 512, B 2:
    the buffer (V H fp32, 537,088 bytes) alive through the first layer's backward."""
    if run.is_lora():
        return 0
    head = spec.lm_head_params or spec.vocab_size * spec.hidden_size
    down = spec.intermediate_size * spec.hidden_size
    return (head + down) * prec.w


# ----------------------------------------------------------------------------------------------
# Temporaries and 'other'
# ----------------------------------------------------------------------------------------------
def autocast_weight_copies(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Half-precision copies of weights alive at the end of forward under autocast.

    Under ``mixed_precision`` fp16/bf16 with fp32 weights, every ``linear`` casts its weight to the compute
    dtype. For trainable leaf weights the copy is cached for the whole forward (torch autocast's weight
    cache, cleared when the autocast context exits); frozen ones (LoRA base) are cast per call and live
    only while ``linear`` saves them for the input gradient. Full fine-tune: decoder projections + head
    (all cached). LoRA: the copies saved for backward (``autocast_copies_saved``). QLoRA: every adapter's
    copy (cached, checkpointed or not) and the head's (saved): measured on real tensors
    (bench/quant_memory.py --quick, 4-bit, bf16, checkpointing: 131,072 B of adapter copies and the
    head's 131,072 B at the forward's peak).
    Source: ``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``. 0 without autocast or when the weights
    are already in the compute dtype (pure bf16).
    """
    if not prec.amp or prec.w == prec.c:
        return 0
    if run.quantize is not Quantize.NONE:
        return int((_head_params(spec) + spec.lora_params(run)) * prec.c)
    if run.is_lora():
        return autocast_copies_saved(spec, run, prec)
    return int((spec.linear_params + _head_params(spec)) * prec.c)


def _head_params(spec: ModelSpec) -> int:
    return spec.lm_head_params or spec.vocab_size * spec.hidden_size


def _autocast_copied_linear_params(spec: ModelSpec, run: RunConfig) -> int:
    """Decoder-projection weights autocast casts: none for a quantized base (bitsandbytes dequantizes per
    call, ``memory.quantized.dequantized_transient``, and its autograd functions keep no weight copy)."""
    return 0 if run.quantize is not Quantize.NONE else spec.linear_params


def autocast_copies_saved(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Half weight copies that ``linear`` saves for backward, alive from the end of forward into backward.

    Without checkpointing: every projection's and the head's copy, except, under LoRA, the projections
    reading the first layer's input (q/k/v, qkv_proj, c_attn: their input needs no gradient, so they save
    nothing); plus the (cached) adapter copies. With checkpointing the layers save only their input, so
    only the head's copy survives forward. Freed layer by layer in backward. QLoRA: the adapters' and the
    head's (``_autocast_copied_linear_params``).
    """
    if not prec.amp or prec.w == prec.c:
        return 0
    head = _head_params(spec)
    if run.grad_checkpointing:
        return int(head * prec.c)
    layers = _autocast_copied_linear_params(spec, run)
    if run.is_lora():
        if layers:
            layers -= sum(lin.in_features * lin.out_features for lin in spec.linears if lin.name in ATTN_IN)
        layers += spec.lora_params(run)
    return int((layers + head) * prec.c)


def autocast_copies_in_recompute(spec: ModelSpec, run: RunConfig, prec: Precisions, saved: int) -> int:
    """Half weight copies alive one layer into backward (``saved``: those alive at its start).

    QLoRA with checkpointing under autocast: the head's copy is freed by the head's backward, and the
    recomputed layer's ``linear`` calls save their adapters' cast weights (the recompute runs under the forward's
    autocast, ``torch.utils.checkpoint``): one layer's adapter copies. Measured (bench/quant_memory.py --quick,
    4-bit, bf16): 53,248 B of adapter copies at the first layer's peak (the down projection's already
    freed: this charges 65,536) and no head copy (charged as ``saved``, 131,072 B: +1.7% on the backward).
    Other runs: ``saved`` (not re-measured for a plain LoRA, whose head copy is held to the trace).
    """
    if run.quantize is Quantize.NONE or not run.grad_checkpointing or not saved:
        return saved
    return int(spec.lora_params(run) / max(spec.num_layers, 1) * prec.c)


def autocast_copies_saved_per_layer(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Of ``autocast_copies_saved``, those one decoder layer above the first holds (its projections' and
    adapters' half weight copies: ``linear`` saves its cast weight), freed when that layer's backward is
    done. 0 with checkpointing (a layer saves only its input; its recompute's copies are its backward's
    transient) and without autocast."""
    if not prec.amp or prec.w == prec.c or run.grad_checkpointing:
        return 0
    layers = _autocast_copied_linear_params(spec, run) + (spec.lora_params(run) if run.is_lora() else 0)
    return int(layers * prec.c / max(spec.num_layers, 1))


def cuda_other(allocated_peak: int) -> int:
    """CUDA context + cuBLAS workspace + the caching allocator's reserve over what tensors hold."""
    return int(CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + ALLOCATOR_RESERVE_FRACTION * allocated_peak)


# ----------------------------------------------------------------------------------------------
# Notes
# ----------------------------------------------------------------------------------------------
def notes(spec: ModelSpec, run: RunConfig, out: MemoryBreakdown) -> list[str]:
    """One-line explanations of the terms that surprise people."""
    lines = []
    n = out.trainable_params
    if not run.is_lora() and run.dtype.value == "fp32" and n:
        # The full states, not their composition at the peak: at a backward peak the grads are partial.
        states = model_states(spec, run)
        shards = max(run.num_processes if run.sharding is not Sharding.DDP else 1, 1)
        per = (states.weights + states.gradients + states.buckets + states.optimizer) * shards / n
        opt = row(run.optimizer)
        state = opt.state_bytes_per_param(4)
        lines.append(f"model states: {per:.1f} bytes/param (weights 4 + grads 4 + {opt.label} {state:g})."
                     if state and not opt.factored else f"model states: {per:.1f} bytes/param.")
    if (run.mixed_precision is Precision.NO and run.dtype.value == "fp32" and not run.is_lora()
            and row(run.optimizer).moments == 2):
        lines.append(f"AMP (--mixed-precision bf16) would not shrink these: autocast keeps fp32 weights, grads and "
                     f"moments, so model states stay 16 B/param = {fmt_gb(16 * n)}, not the 12 B/param "
                     f"({fmt_gb(12 * n)}) often quoted for mixed precision; it only shrinks activations.")
    if run.mixed_precision is not Precision.NO and run.dtype.value == "fp32":
        lines.append("AMP does not shrink model states: autocast casts on the fly, so weights, grads and moments "
                     "stay fp32 (16 B/param with AdamW); it shrinks activations and adds half weight copies.")
    if out.phase == "backward" and out.logits > out.activations:
        lines.append(f"the logits ({spec.vocab_size:,} vocab x {run.micro_batch * run.seq_len:,} tokens, fp32 for "
                     "the loss, plus their gradient) are the largest term at the peak.")
    if out.other:
        lines.append(f"other = CUDA context ~{CUDA_CONTEXT_BYTES // MiB} MiB + cuBLAS workspace + "
                     f"{ALLOCATOR_RESERVE_FRACTION:.0%} allocator reserve (varies by GPU/driver).")
    if run.num_processes > 1:
        lines.append(f"per-rank numbers for {run.num_processes} processes with {run.sharding.value}; activations "
                     "are never sharded.")
    if out.peak_bytes:
        lines.append(f"peak {fmt_gib(out.peak_bytes)} ({fmt_gb(out.peak_bytes)}) in the {out.phase} phase.")
    return lines


# ----------------------------------------------------------------------------------------------
# The classic regimes, side by side (``memfit estimate --compare``)
# ----------------------------------------------------------------------------------------------
#: LoRA rank used by --compare when the user did not give one.
COMPARE_LORA_R = 16


def classic_regimes(run: RunConfig) -> list[tuple[str, RunConfig]]:
    """fp32, AMP fp16, AMP bf16, pure bf16, LoRA and QLoRA, each without and with checkpointing.

    Sequence length, batch, optimizer and processes come from ``run``. LoRA trains rank
    ``run.lora_r`` (16 if unset) adapters on a bf16 base; QLoRA on an NF4 base.
    """
    r = run.lora_r or COMPARE_LORA_R
    full = run.replace(lora_r=0, quantize=Quantize.NONE)
    regimes = [
        ("fp32", full.replace(mixed_precision=Precision.NO, dtype="fp32")),
        ("AMP fp16", full.replace(mixed_precision=Precision.FP16, dtype="fp32")),
        ("AMP bf16", full.replace(mixed_precision=Precision.BF16, dtype="fp32")),
        ("pure bf16", full.replace(mixed_precision=Precision.NO, dtype="bf16")),
        (f"LoRA r{r} bf16", full.replace(mixed_precision=Precision.NO, dtype="bf16", lora_r=r)),
        (f"QLoRA r{r} NF4", full.replace(mixed_precision=Precision.NO, dtype="bf16", lora_r=r,
                                                 quantize=Quantize.Q4)),
    ]
    out = []
    for name, cfg in regimes:
        out.append((name, cfg.replace(grad_checkpointing=False)))
        out.append((f"{name} + ckpt", cfg.replace(grad_checkpointing=True)))
    return out


def compare(model: str | ModelSpec, run: RunConfig, *, device: str = "cuda") -> list[tuple[str, MemoryBreakdown]]:
    """``estimate`` for each of ``classic_regimes(run)``."""
    spec = model if isinstance(model, ModelSpec) else load_spec(str(model))
    return [(name, estimate(spec, cfg, device=device)) for name, cfg in classic_regimes(run)]
