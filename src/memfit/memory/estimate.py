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

from memfit import versions
from memfit.config import Offload, Precision, Quantize, RunConfig, Sharding
from memfit.errors import UserError
from memfit.linears import ATTN_IN
from memfit.memory import quantized
from memfit.memory.activations import (
    Precisions,
    final_hidden_in_loss,
    head_side_activations,
    layer_activations,
    logits_terms,
    masks_freed_above_first_layer,
    outside_layer_activations,
)
from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.deepspeed_layout import ENGINES
from memfit.memory.device_terms import cuda_other
from memfit.memory.notes import notes
from memfit.memory.states import (
    ModelStates,
    _largest_trainable,
    _weight_bytes,
    model_states,
    optimizer_state_bytes,
)
from memfit.modelspec import ModelSpec, load_spec
from memfit.optimizers import row
from memfit.quant_support import shards_packed_weights
from memfit.resolved import resolve


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
    out.experts_implementation = resolved.experts
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
