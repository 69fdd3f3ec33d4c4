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

from memfit.errors import UserError
from memfit.integrations import versions
from memfit.integrations.quant_support import shards_packed_weights
from memfit.memory import flat_params, litgpt_loop, quantized, unsloth_layer
from memfit.memory import preference_terms as pref
from memfit.memory import stack_terms as stacks
from memfit.memory.activations import (
    LayerActivations,
    LogitsTerms,
    Precisions,
    final_hidden_in_loss,
    head_side_activations,
    layer_activations,
    logits_terms,
    masks_freed_above_first_layer,
    outside_layer_activations,
)
from memfit.memory.autocast import (
    AutocastCopies,
    autocast_copies_in_recompute,
    autocast_copies_saved,
    autocast_copies_saved_per_layer,
    autocast_weight_copies,
)
from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.deepspeed_layout import ENGINES
from memfit.memory.derive import derived_estimate, hand_written_family
from memfit.memory.notes import notes
from memfit.memory.resident import resident_states, stack_notes
from memfit.memory.states import (
    ModelStates,
    largest_trainable,
    optimizer_state_bytes,
    weight_bytes,
)
from memfit.settings.config import Offload, Precision, Quantize, RunConfig
from memfit.settings.defaults import LORA_RANK
from memfit.settings.stack import Stack
from memfit.spec.engines import shard_group_size
from memfit.spec.model import ModelSpec, load_spec
from memfit.spec.optimizers import row
from memfit.spec.resolved import resolve


def estimate(model: str | ModelSpec, run: RunConfig, *, device: str = "cuda",
             derived: bool | None = None, engine: str = "fsdp2", rank: int | None = None,
             stack: Stack | None = None) -> MemoryBreakdown:
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
        stack: the trainer and versions that run the step (``memfit.settings.stack``; ``memory.stack_terms``);
            None: memfit's own. Another stack is priced with the hand-written recipes, whose terms it changes.

    Returns:
        A ``MemoryBreakdown`` with ``method="analytic"``; ``peak_bytes`` is the maximum over phases.
    """
    spec = model if isinstance(model, ModelSpec) else load_spec(str(model))
    _check(spec, run, device, engine)
    # What gets built (LoRA modules, the attention transformers runs, the optimizer's row): the same
    # answer trace, plan and train use. From here on ``run`` names what is built.
    resolved = resolve(spec, run, device)
    run = resolved.run

    family = hand_written_family(spec, run, device)
    if derived is None and versions.unverified():
        derived = True  # outside the verified versions the hand-written recipes may not hold: trace instead
    stack = stack or Stack()
    if derived or (family is None and derived is None):  # traced on memfit's stack: said if another's differs
        return _described(derived_estimate(spec, run, device, engine, rank, stack), resolved, stacks.notes(stack, True))
    run = pref.pair_forward_run(run)  # a preference method: chosen and rejected in one forward of 2B sequences
    prec = stacks.precisions(Precisions.of(run), run, stack)
    states, head, kernels = resident_states(spec, run, prec, device, engine, rank, stack)
    terms = step_terms(spec, run, prec, states, device, stack, head, kernels)
    moments = [*_forward_moments(spec, run, states, terms), *_backward_moments(spec, run, prec, states, terms, device),
               _optimizer_moment(run, states, terms)]
    resident = states.weights + states.optimizer  # the same at every moment
    phases = {name: resident + max(m.bytes for m in moments if m.phase == name)
              for name in ("forward", "backward", "optimizer")}
    phase = max(phases, key=lambda k: phases[k])  # ties: the earlier phase
    # the phase's peak moment; ties by name ("start" > "layer" > "end"; "layer" > "head" > "entry"), as before
    peak = max((m for m in moments if m.phase == phase), key=lambda m: (m.bytes, m.name))
    out = MemoryBreakdown(method="analytic", phase=phase, params=spec.params,
                          trainable_params=spec.trainable_params(run), weights=states.weights,
                          optimizer=states.optimizer, gradients=peak.gradients, activations=peak.activations,
                          logits=peak.logits, temporary=peak.temporary)
    out.phase_peaks = dict(phases)
    out.activations_per_layer = terms.acts.saved
    if device == "cuda":  # the fitted allocator term; under FSDP (1) its unshard stream's blocks beside it
        flat_params.with_reserved(out, spec, run, stack, engine)
    out.recipe = f"hand-written recipe: {family or spec.family}"
    out.notes = notes(spec, run, out) + [f"recipe: {out.recipe} (memory/activations.py)."]
    return _described(out, resolved, stack_notes(spec, run, prec, stack, engine, states))


def _described(out: MemoryBreakdown, resolved, stack_notes: list[str] = ()) -> MemoryBreakdown:
    """Name what is built (attention, LoRA targets), the versions caveat and ``stack_notes`` on an estimate."""
    out.attn_implementation = resolved.attention
    out.experts_implementation = resolved.experts
    out.lora_targets = resolved.lora.names if resolved.lora else ()
    out.notes = resolved.describe() + out.notes + list(stack_notes) + versions.notes()
    return out


@dataclass(frozen=True)
class Moment:
    """One instant of the step: what exists then besides the weights and optimizer state, by category.

    The estimate is the largest of these; its categories are the breakdown shown, so a moment's total and
    its categories are one sum (``bytes``), never two computations that could drift apart.
    """

    phase: str
    """``forward``, ``backward`` or ``optimizer``."""
    name: str
    """Which instant of the phase: forward's ``head`` (logits and loss), ``layer`` (inside the last layer),
    ``entry``/``first entry`` (a sharded layer's unshard); backward's ``start``, ``layer``, ``end``; ``step``."""
    gradients: int = 0
    activations: int = 0
    logits: int = 0
    temporary: int = 0

    @property
    def bytes(self) -> int:
        return self.gradients + self.activations + self.logits + self.temporary


@dataclass(frozen=True)
class StepTerms:
    """The terms of one step that every moment reads, computed once (``step_terms``)."""

    acts: LayerActivations
    """Per decoder layer (after offload and a 4-bit base's dequantized transient are applied)."""
    outside: int
    """Activations outside the decoder layers (embeddings, final norm, head side)."""
    activations: int
    """Every activation saved for backward at forward's end, on the device."""
    at_end: int
    """What is still alive at backward's end (``outside`` and what the layers hold to the end)."""
    logit: LogitsTerms
    copies: AutocastCopies
    in_loss: int
    """The decoder's last hidden state, alive only while the forward's loss runs."""
    dequant: int
    """QLoRA: one projection's weight dequantized inside a layer's forward (``memory/quantized.py``)."""
    accumulated: int
    """Gradients accumulated from earlier micro-batches (``grad_accum`` > 1), alive in forward."""
    reference: int = 0
    """DPO's reference forward (no_grad, before the policy's): its transient (``memory.preference_terms``)."""
    head_dequant: int = 0
    """A quantized head dequantized while it runs forward and its backward (``memory.stack_terms.quantized_head``)."""
    head_side: int = 0
    """Of ``outside``, what the head's and the loss' backward free before the first layer's backward."""
    previous: litgpt_loop.PreviousOutputs | None = None
    """What the loop still holds of the previous micro-batch at the end of a forward (``memory.litgpt_loop``)."""


def step_terms(spec: ModelSpec, run: RunConfig, prec: Precisions, states: ModelStates, device: str,
               stack: Stack | None = None, head: stacks.HeadTerms = stacks.HeadTerms(),
               kernels: unsloth_layer.UnslothTerms | None = None) -> StepTerms:
    """The per-step terms: the recipes of ``memory/activations.py`` (Unsloth's, ``kernels``, where its own layer and
    loss run), with offload and quantization applied, and what ``stack``'s head holds (``stacks.quantized_head``)."""
    acts = kernels.acts if kernels else layer_activations(spec, run, prec, device, stack)
    outside = kernels.outside if kernels else outside_layer_activations(spec, run, prec, device)
    saved_copies = autocast_copies_saved(spec, run, prec)
    copies = AutocastCopies(autocast_weight_copies(spec, run, prec), saved_copies,
                            autocast_copies_in_recompute(spec, run, prec, saved_copies))
    if kernels:  # Unsloth casts its fp32 adapters itself (A.to(dtype): memory.unsloth_layer), never through the cache
        copies = AutocastCopies(0, 0, 0)
    activations = acts.all_layers + outside
    if run.offload is Offload.ACTIVATIONS:
        activations, acts = offloaded_activations(acts, outside, run.grad_checkpointing,
                                                  offloaded_node_bytes(spec, run, prec))
        # autocast's weight copies saved for backward go to the host too; its cache (trainable weights) stays
        copies = AutocastCopies(0 if run.is_lora() else copies.forward, 0, 0)
    # QLoRA: one projection's weight dequantized inside a layer's forward and backward (memory/quantized.py);
    # a checkpointed layer's backward moment has it already (activations.quantized_mlp_moment)
    if not run.grad_checkpointing:
        acts = dataclasses.replace(acts, backward_transient=acts.backward_transient
                                   + quantized.dequantized_transient(spec, run, "backward"))
    # what the layers keep to the end of backward (an 8-bit base's ctx.A) is alive there beside the gradients
    return StepTerms(acts=acts, outside=outside, activations=activations + head.held,
                     at_end=outside + acts.held_all_layers + head.held, head_dequant=head.transient,
                     logit=(kernels.logits if kernels else
                            stacks.logits(spec, run, prec, stack or Stack()) or logits_terms(spec, run, prec, device)),
                     head_side=kernels.head_side if kernels else head_side_activations(spec, run, prec, device),
                     copies=copies, in_loss=final_hidden_in_loss(spec, run, prec),
                     dequant=quantized.dequantized_transient(spec, run, "forward"),
                     accumulated=(states.gradients if states.accumulated is None else states.accumulated)
                     if run.grad_accum > 1 else 0,
                     reference=pref.reference_transient(spec, run, prec),
                     previous=litgpt_loop.previous_outputs(spec, run, stack or Stack(),
                                                           acts.held_all_layers + head.held))


def _forward_moments(spec: ModelSpec, run: RunConfig, states: ModelStates, terms: StepTerms) -> list[Moment]:
    """Forward's candidate peaks: the head and loss; inside the last layer; a sharded layer's unshard."""
    grads = terms.accumulated + states.buckets  # DDP: the gradients live in its buckets from the first step
    copies, logit = terms.copies, terms.logit
    if str(run.loss) == "standard":
        # forward's end: everything saved, logits + loss alive; the autocast cache holds the half weight copies
        head = Moment("forward", "head", grads, terms.activations + terms.in_loss, logit.forward,
                      copies.forward + states.forward_gathered + terms.head_dequant)
    else:
        # the chunked loss runs after model.forward's autocast exited (its weight cache freed): the decoder's
        # end holds the cache, the loss only the copies saved for backward (the head's included)
        held = max(copies.forward, copies.saved + logit.forward)
        head = Moment("forward", "head", grads, terms.activations, logit.forward,
                      held - logit.forward + states.forward_gathered + terms.head_dequant)
    moments = [head]
    if terms.previous:  # litgpt's loop: the previous micro-batch's chunks and kept inputs, until this forward returns
        before, previous, held = terms.activations + terms.previous.held, terms.previous, copies.forward
        moments += [Moment("forward", "previous", grads, before, previous.logits, held + states.forward_gathered),
                    Moment("forward", "previous head", grads, before, previous.logits_in_head,
                           held + states.forward_gathered + terms.head_dequant)]
    if terms.reference:  # DPO's reference forward (no_grad), before the policy's: its logits beside the states
        moments.append(Moment("forward", "reference", grads, logits=terms.reference))
    if terms.dequant:  # inside the last layer's forward: its dequantized weight, before the logits exist
        moments.append(Moment("forward", "layer", grads, terms.activations,
                              temporary=terms.dequant + states.layer_gathered))
    if states.gathered_entry:  # the last layer's entry: its own saved tensors not made yet
        moments.append(Moment("forward", "entry", grads, terms.activations - terms.acts.saved,
                              temporary=states.gathered_entry))
    if states.gathered_first_entry:  # the first layer's entry: nothing saved yet (the embedding's output ignored)
        moments.append(Moment("forward", "first entry", grads, temporary=states.gathered_first_entry))
    return moments


def _backward_moments(spec: ModelSpec, run: RunConfig, prec: Precisions, states: ModelStates, terms: StepTerms,
                      device: str) -> list[Moment]:
    """Backward's start, one layer in (the first layer's backward where that is higher), and its end."""
    if run.optimizer_in_backward:
        return _backward_moments_stepping(spec, run, prec, states, terms, device)
    acts, logit, copies = terms.acts, terms.logit, terms.copies
    in_backward = terms.accumulated + states.buckets + states.from_backward_start  # gradients from the start on
    # backward start: the logits' gradient chain is the transient; all activations and the weight copies
    # saved for backward still alive (the autocast cache itself is cleared when forward returns).
    start = Moment("backward", "start", in_backward, terms.activations, logit.backward,
                   copies.saved + states.gathered + terms.head_dequant)
    # one layer in: the head's/embedding's gradients exist, plus one layer's recompute and input gradients
    # (DDP: the gradients live in its buckets; DeepSpeed ZeRO-2: its bucket reduces the head's gradient into
    # the flat partition, whole from the start)
    whole = terms.accumulated or states.buckets or states.backward_gradients
    grads = _head_grad_bytes(spec, run, prec) if not whole else 0
    # the head's and the loss' saved tensors are freed before the first layer's backward (offloaded without
    # checkpointing: they were never counted on the device)
    offloaded_all = run.offload is Offload.ACTIVATIONS and not run.grad_checkpointing
    freed = freed_at_head = 0 if offloaded_all else terms.head_side
    recompute = copies.in_recompute
    # the first layer's backward: the layers above hold their weight gradients instead of their saved
    # tensors (a middle layer's moment lies between the two, linear in its depth); nothing builds up where
    # the gradients exist whole (accumulation, DeepSpeed's partition)
    if not terms.accumulated and not states.backward_gradients:
        # offloaded activations: the layers above kept nothing on the device, so they free nothing there
        kept = 0 if run.offload is Offload.ACTIVATIONS else acts.saved - acts.held
        below = _layers_below_top(spec, run, states, dataclasses.replace(acts, saved=kept))
        masks = masks_freed_above_first_layer(spec, run, prec) if kept else 0
        # AMP: the layers above also freed the half weight copies their linears saved for backward
        copies_freed = (spec.num_layers - 1) * autocast_copies_saved_per_layer(spec, run, prec) if kept else 0
        if below - masks - copies_freed > 0:
            grads += below + (spec.num_layers - 1) * kept  # the layers above: their gradients
            freed += masks + (spec.num_layers - 1) * kept  # ... instead of their saved tensors
            recompute -= copies_freed
    late = states.gradients_after_layers
    if late and states.backward_gradients > late * acts.saved:
        # DeepSpeed ZeRO-2 off the last rank: its gradient partition appears once backward has finished
        # ``late`` layers, whose saved tensors are gone by then (the moment is shown as one layer in)
        grads += states.backward_gradients
        freed += late * acts.saved
    layer = Moment("backward", "layer", in_backward + grads, terms.activations - freed, logit.retained,
                   recompute + acts.backward_transient + states.layer_gathered)
    end = Moment("backward", "end", states.buckets + states.gradients, terms.at_end, logit.retained,
                 states.gathered_end)
    if not states.unit_gradients:
        return [start, layer, end]
    # FSDP (1): the top layer's flat gradient concatenated from its views' (memory.flat_params), its saved tensors
    # and the head side's freed
    top = Moment("backward", "flat gradient", in_backward + states.unit_gradients,
                 terms.activations - freed_at_head - (acts.saved - acts.held), logit.retained, states.layer_gathered)
    return [start, layer, end, top]


def _backward_moments_stepping(spec: ModelSpec, run: RunConfig, prec: Precisions, states: ModelStates,
                               terms: StepTerms, device: str) -> list[Moment]:
    """``--optimizer-in-backward``: no full set of gradients; each is stepped and freed as it lands
    (``grad_accum`` is 1), so nothing builds up layer by layer."""
    acts, logit, copies = terms.acts, terms.logit, terms.copies
    in_backward = states.buckets + states.from_backward_start
    start = Moment("backward", "start", in_backward, terms.activations, logit.backward,
                   copies.saved + states.gathered + terms.head_dequant)
    offloaded_all = run.offload is Offload.ACTIVATIONS and not run.grad_checkpointing
    freed = 0 if offloaded_all else terms.head_side
    step_one = in_backward_step_bytes(spec, run, prec, device)
    hidden_grad = prec.w * run.micro_batch * run.seq_len * spec.hidden_size
    # the head (first gradient) is stepped while every activation is alive; one layer's backward
    # transient as without the technique; the embedding (tied: the head too) at the end.
    transient = acts.backward_transient
    if step_one + hidden_grad >= transient:
        grads, transient = step_one + hidden_grad, 0
    else:
        grads = 0  # a layer's weight gradients come after its recompute peak (+2.8% on the grid without)
    layer = Moment("backward", "layer", in_backward + grads, terms.activations - freed, logit.retained,
                   copies.in_recompute + transient + states.layer_gathered)
    end = Moment("backward", "end", states.buckets, terms.at_end, 0, states.gathered_end + step_one)
    return [start, layer, end]


def _optimizer_moment(run: RunConfig, states: ModelStates, terms: StepTerms) -> Moment:
    """``optimizer.step()``: every gradient and the step's temporaries (stepped in backward: neither)."""
    kept = terms.previous.held if terms.previous else 0  # litgpt's loop still holds the graph (memory.litgpt_loop)
    if run.optimizer_in_backward:
        return Moment("optimizer", "step", states.buckets, kept, logits=terms.logit.retained)
    return Moment("optimizer", "step", states.buckets + states.gradients, kept, logits=terms.logit.retained,
                  temporary=states.step_temporary)


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
    grad_bytes = 4 if run.is_lora() else weight_bytes(run)
    total = trainable * grad_bytes + (optimizer_state_bytes(spec, run, trainable, grad_bytes) if state else 0)
    shards = shard_group_size(run) if run.num_processes > 1 else 1
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
    largest = largest_trainable(spec, run) * grad_bytes
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
# The classic regimes, side by side (``memfit estimate --compare``)
# ----------------------------------------------------------------------------------------------
def classic_regimes(run: RunConfig) -> list[tuple[str, RunConfig]]:
    """fp32, AMP fp16, AMP bf16, pure bf16, LoRA and QLoRA, each without and with checkpointing.

    Sequence length, batch, optimizer and processes come from ``run``. LoRA trains rank
    ``run.lora.r`` (``memfit.settings.defaults.LORA_RANK`` if unset) adapters on a bf16 base; QLoRA on an NF4 base.
    """
    r = run.lora.r or LORA_RANK
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


def compare(model: str | ModelSpec, run: RunConfig, *, device: str = "cuda",
            engine: str = "fsdp2", stack: Stack | None = None) -> list[tuple[str, MemoryBreakdown]]:
    """``estimate`` for each of ``classic_regimes(run)`` (``engine``, ``stack``: as ``estimate``'s)."""
    spec = model if isinstance(model, ModelSpec) else load_spec(str(model))
    return [(name, estimate(spec, cfg, device=device, engine=engine, stack=stack))
            for name, cfg in classic_regimes(run)]
