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
from memfit.memory.activations import (
    ATTN_IN,
    Precisions,
    head_side_activations,
    layer_activations,
    logits_terms,
    masks_freed_above_first_layer,
    outside_layer_activations,
)
from memfit.memory.breakdown import MemoryBreakdown
from memfit.modelspec import ModelSpec, load_spec
from memfit.optimizers import row
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

#: bitsandbytes NF4 (QLoRA, double quantization): 4 bits per weight, one 8-bit absmax per 64 weights,
#: and per 256 of those absmax values one fp32 second-level scale:
#: 0.5 + 1/64 + 4/(64*256) = 0.516 bytes/param (Dettmers et al. 2023, section 2 "Double Quantization").
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)

#: bitsandbytes LLM.int8(): int8 weight + one fp32 scale per output row (counted separately).
INT8_BYTES_PER_PARAM = 1.0


@dataclass(frozen=True)
class ModelStates:
    """Per-rank bytes of weights, gradients and optimizer state, plus step-time temporaries."""

    weights: int
    gradients: int
    optimizer: int
    step_temporary: int
    """Extra bytes alive only inside ``optimizer.step()`` (foreach temporaries)."""
    gathered: int
    """FSDP/ZeRO-3: unsharded parameters of the layers being computed (temporary)."""


def estimate(model: str | ModelSpec, run: RunConfig, *, device: str = "cuda",
             derived: bool | None = None) -> MemoryBreakdown:
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

    Returns:
        A ``MemoryBreakdown`` with ``method="analytic"``; ``peak_bytes`` is the maximum over phases.
    """
    spec = model if isinstance(model, ModelSpec) else load_spec(str(model))
    _check(spec, run, device)
    # What gets built (LoRA modules, the attention transformers runs, the optimizer's row): the same
    # answer trace, plan and train use. From here on ``run`` names what is built.
    resolved = resolve(spec, run, device)
    run = resolved.run
    from memfit.memory.derive import derived_estimate, hand_written_family

    family = hand_written_family(spec, run, device)
    if derived is None and versions.unverified():
        derived = True  # outside the verified versions the hand-written recipes may not hold: trace instead
    if derived or (family is None and derived is None):
        return _described(derived_estimate(spec, run, device), resolved)
    prec = Precisions.of(run)
    states = model_states(spec, run)
    acts = layer_activations(spec, run, prec, device)
    outside = outside_layer_activations(spec, run, prec, device)
    logit = logits_terms(spec, run, prec)
    copies = (autocast_weight_copies(spec, run, prec), autocast_copies_saved(spec, run, prec))

    activations = acts.all_layers + outside
    if run.offload is Offload.ACTIVATIONS:
        activations, acts = offloaded_activations(acts, outside)
    # forward end: everything saved, logits + loss alive; the autocast cache holds half weight copies.
    grads_in_fwd = states.gradients if run.grad_accum > 1 else 0
    base = states.weights + states.optimizer
    forward = base + grads_in_fwd + activations + logit.forward + copies[0] + states.gathered
    if str(run.loss) != "standard":
        # the chunked loss runs after model.forward's autocast exited (its weight cache freed): the decoder's
        # end holds the cache, the loss only the copies saved for backward (the head's included).
        forward = base + grads_in_fwd + activations + states.gathered + max(copies[0], copies[1] + logit.forward)
    # backward start: logits' gradient chain is the transient; all activations and the weight copies
    # saved for backward still alive (the autocast cache itself is cleared when forward returns).
    backward_start = base + grads_in_fwd + activations + logit.backward + copies[1] + states.gathered
    # backward, one layer in: grads of head/embedding exist, plus one layer's recompute and input grads.
    head_grads = _head_grad_bytes(spec, run, prec) if not grads_in_fwd else 0
    # the head's and the loss' saved tensors are freed before the first layer's backward
    head_side = 0 if run.offload is Offload.ACTIVATIONS else head_side_activations(spec, run, prec, device)
    backward_layer = (base + grads_in_fwd + head_grads + activations - head_side + copies[1] + logit.retained
                      + acts.backward_transient + states.gathered)
    # the first layer's backward: the layers above hold their weight gradients instead of their saved
    # tensors (a middle layer's moment lies between the two, linear in its depth).
    below = 0
    # (optimizer-in-backward frees each gradient as it lands: nothing builds up)
    if not grads_in_fwd and run.offload is not Offload.ACTIVATIONS and not run.optimizer_in_backward:
        below = _layers_below_top(spec, run, states, acts)
        freed = masks_freed_above_first_layer(spec, run, prec)
        below -= freed
    if below > 0:
        backward_layer += below
        head_grads += below + freed + (spec.num_layers - 1) * acts.saved  # shown as gradients
        head_side += freed + (spec.num_layers - 1) * acts.saved  # shown as freed activations
    backward_end = base + states.gradients + outside + logit.retained + states.gathered
    optimizer = base + states.gradients + states.step_temporary + logit.retained
    if run.optimizer_in_backward:
        # No full set of gradients: each is stepped and freed as it lands (grad_accum is 1).
        step_one = in_backward_step_bytes(spec, run, prec)
        hidden_grad = prec.w * run.micro_batch * run.seq_len * spec.hidden_size
        # the head (first gradient) is stepped while every activation is alive; one layer's backward
        # transient as without the technique; the embedding (tied: the head too) at the end.
        if step_one + hidden_grad >= acts.backward_transient:
            head_grads, acts = step_one + hidden_grad, dataclasses.replace(acts, backward_transient=0)
        else:
            head_grads = 0  # a layer's weight gradients come after its recompute peak (+2.8% on the grid without)
        backward_layer = base + activations + copies[1] + states.gathered + head_grads + acts.backward_transient
        backward_end = base + outside + step_one + states.gathered
        optimizer = base + logit.retained
    phases = {
        "forward": forward,
        "backward": max(backward_start, backward_layer, backward_end),
        "optimizer": optimizer,
    }
    phase = max(phases, key=lambda k: phases[k])
    out = _breakdown_at(phase, spec, run, states, activations, logit, copies, acts, head_grads,
                        backward_start >= backward_layer, head_side)
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


def _breakdown_at(phase, spec, run, states, activations, logit, copies, acts, head_grads,
                  start_is_peak, head_side=0) -> MemoryBreakdown:
    """Assign the bytes of the peak phase to categories (``copies``: autocast weight copies in forward,
    and those saved for backward; ``head_side``: activations freed before the first layer's backward)."""
    out = MemoryBreakdown(method="analytic", phase=phase, params=spec.params,
                          trainable_params=spec.trainable_params(run))
    out.weights = states.weights
    out.optimizer = states.optimizer
    grads_in_fwd = states.gradients if run.grad_accum > 1 else 0
    if phase == "forward":
        out.gradients = grads_in_fwd
        out.activations = activations
        out.logits = logit.forward
        out.temporary = copies[0] + states.gathered
    elif phase == "backward" and start_is_peak:
        out.gradients = grads_in_fwd
        out.activations = activations
        out.logits = logit.backward
        out.temporary = copies[1] + states.gathered
    elif phase == "backward":
        out.gradients = grads_in_fwd + head_grads
        out.activations = activations - head_side
        out.logits = logit.retained
        out.temporary = copies[1] + acts.backward_transient + states.gathered
    else:
        in_bw = run.optimizer_in_backward  # stepped in backward: no gradients, no temporaries left
        out.gradients = 0 if in_bw else states.gradients
        out.logits = logit.retained
        out.temporary = 0 if in_bw else states.step_temporary
    return out


def _check(spec: ModelSpec, run: RunConfig, device: str) -> None:
    if device not in ("cuda", "cpu"):
        raise UserError(f"device must be 'cuda' or 'cpu', got {device!r}.")
    if run.quantize is not Quantize.NONE and run.offload is Offload.PARAMS:
        raise UserError("--offload params cannot be combined with --quantize (bitsandbytes weights stay on the GPU).")


# ----------------------------------------------------------------------------------------------
# Model states
# ----------------------------------------------------------------------------------------------
def model_states(spec: ModelSpec, run: RunConfig) -> ModelStates:
    """Weights, gradients and optimizer state per rank.

    Full fine-tune: weights and grads at the stored dtype (fp32 stays fp32 under AMP: autocast casts
    on the fly, it never changes ``param.dtype``), optimizer state from ``optimizer_state_bytes``.
    LoRA: frozen base at its dtype (or quantized), adapters in fp32 (PEFT's ``autocast_adapter_dtype=True``
    upcasts bf16/fp16 adapters to fp32), grads and optimizer state for adapters only.
    Sharding (``num_processes`` > 1): FSDP/ZeRO-3 divide all three by N, ZeRO-2 divides grads and optimizer
    state; DDP divides nothing. Offload moves optimizer state (and with ``params`` the weights) to CPU.
    Ignores: FSDP's flat-parameter padding (< N elements per tensor), the optimizer's ``step`` scalars
    (fp32, one per tensor: < 1 MiB).
    """
    w = _weight_bytes(run)
    trainable = spec.trainable_params(run)
    grad_bytes = 4 if run.is_lora() else w
    weights = base_weight_bytes(spec, run) + (spec.lora_params(run) * 4 if run.is_lora() else 0)
    gradients = trainable * grad_bytes
    optimizer = optimizer_state_bytes(spec, run, trainable, grad_bytes)
    step_temp = optimizer_step_temporary(spec, run, trainable, grad_bytes)
    n = run.num_processes
    gathered = 0
    if n > 1 and run.sharding in (Sharding.FSDP, Sharding.ZERO3):
        # The all-gathered (unsharded) parameters of the layer computing now and the prefetched next one
        # (FSDP's default forward/backward prefetch): 2 layers at the stored dtype.
        gathered = 2 * _layer_params(spec) * w
        weights //= n
    if n > 1 and run.sharding is not Sharding.DDP:
        gradients //= n
        optimizer //= n
        step_temp //= n
    if run.offload in (Offload.OPTIMIZER, Offload.PARAMS):
        optimizer, step_temp = 0, 0  # the step runs on the CPU (DeepSpeed CPU Adam / FSDP offload)
    if run.offload is Offload.PARAMS:
        gathered = max(gathered, 2 * _layer_params(spec) * w)
        weights = 0
    return ModelStates(int(weights), int(gradients), int(optimizer), int(step_temp), int(gathered))


def base_weight_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """Bytes of the model's own parameters and buffers as stored (no adapters).

    QLoRA: bitsandbytes packs every decoder-layer projection (not embeddings, norms or the output head,
    which transformers keeps in ``bnb_4bit_compute_dtype`` = bf16): NF4 = 0.516 bytes/param
    (``NF4_BYTES_PER_PARAM``), int8 = 1 byte/param + one fp32 scale per output row.
    Buffers (rotary ``inv_freq``) stay fp32.
    """
    w = _weight_bytes(run)
    if run.quantize is Quantize.NONE:
        return int(spec.params * w + spec.buffer_bytes)
    packed = spec.linear_params
    rest = spec.params - packed
    if run.quantize is Quantize.Q4:
        quant = packed * NF4_BYTES_PER_PARAM
    else:
        quant = packed * INT8_BYTES_PER_PARAM + sum(lin.out_features * lin.count for lin in spec.linears) * 4
    return int(quant + rest * 2 + spec.buffer_bytes)


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
    vectors = spec.params - spec.linear_params - spec.embedding_params - spec.lm_head_params
    return int(mats + embed + head + max(vectors, 0))


def optimizer_step_temporary(spec: ModelSpec, run: RunConfig, trainable: int, grad_bytes: int) -> int:
    """Bytes alive only inside ``optimizer.step()``, from the optimizer row's ``step_temporary``.

    ``group``: torch's foreach Adam(W) (``_multi_tensor_adam``) computes ``exp_avg_sq_sqrt =
    _foreach_sqrt(...)`` for every parameter of the group at once: one param-sized temporary in the
    state dtype (``adamw``, torch's default, is foreach on CUDA). ``largest-x2``: a per-tensor update
    (Adafactor) bounded by two copies of the largest trainable tensor. ``none``: in place (fused, 8-bit, SGD).
    """
    kind = row(run.optimizer).step_temporary
    if kind == "group":
        return trainable * grad_bytes
    if kind == "largest-x2":
        return _largest_trainable(spec, run) * grad_bytes * 2
    return 0


def _largest_trainable(spec: ModelSpec, run: RunConfig) -> int:
    if run.is_lora():
        return max((run.lora_r * max(lin.in_features, lin.out_features) for lin in spec.lora_linears(run.lora_targets)),
                   default=0)
    return max([spec.vocab_size * spec.hidden_size] + [lin.in_features * lin.out_features for lin in spec.linears])


def _layer_params(spec: ModelSpec) -> int:
    return (spec.params - spec.embedding_params - spec.lm_head_params) // max(spec.num_layers, 1)


def _weight_bytes(run: RunConfig) -> int:
    return int(2 if str(run.dtype) in ("bf16", "fp16") else 4)


def offloaded_activations(acts, outside: int):
    """``--offload activations`` (torch's ``save_on_cpu``): saved tensors wait in pinned CPU memory.

    On the GPU stay the tensors outside the decoder layers (counted whole: conservative) and the layer
    being computed; in backward one layer's saved set is copied back while it runs (added to its
    transient). Source: ``torch.autograd.graph.save_on_cpu`` packs every saved tensor to CPU in forward
    and unpacks it to the device on use. Ignores: the CPU copies of parameters it also makes (host RAM).
    """
    resident = acts.saved + outside
    back = dataclasses.replace(acts, backward_transient=acts.backward_transient + acts.saved)
    return resident, back


def in_backward_step_bytes(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """``--optimizer-in-backward``: the most gradient + step-temporary bytes alive at once in backward.

    Each parameter's gradient lives from its accumulation to the end of its own ``step()``, which (a
    per-parameter foreach AdamW) adds one temporary its size; taken for the largest trainable tensor
    (the head or embedding for a full fine-tune), the upper bound of what one step holds. Ignores the
    overlap of a gradient being written while the previous one is stepped (hooks run synchronously).
    """
    grad_bytes = 4 if run.is_lora() else prec.w
    largest = _largest_trainable(spec, run) * grad_bytes
    # The optimizer's row says what its step allocates; per parameter a foreach "group" is that one tensor.
    copies = {"group": 1, "largest-x2": 2, "none": 0}[row(run.optimizer).step_temporary]
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
    return int((spec.num_layers - 1) * (per_layer - acts.saved))


def _head_grad_bytes(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Weight gradients that exist one layer into backward (full fine-tune): the output head's (produced
    first; a head tied to the embedding gets its gradient only with the embedding's, at the end of
    backward, as autograd sums both uses first) and the last layer's down projection's (the first weight
    gradient of a layer's backward)."""
    if run.is_lora():
        return 0
    head = 0 if spec.tie_word_embeddings else spec.lm_head_params or spec.vocab_size * spec.hidden_size
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
    (all cached). LoRA: the copies saved for backward (``autocast_copies_saved``).
    Source: ``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``. 0 without autocast or when the weights
    are already in the compute dtype (pure bf16; QLoRA dequantizes per layer instead).
    """
    if not prec.amp or prec.w == prec.c or run.quantize is not Quantize.NONE:
        return 0
    if run.is_lora():
        return autocast_copies_saved(spec, run, prec)
    head = spec.lm_head_params or spec.vocab_size * spec.hidden_size
    return int((spec.linear_params + head) * prec.c)


def autocast_copies_saved(spec: ModelSpec, run: RunConfig, prec: Precisions) -> int:
    """Half weight copies that ``linear`` saves for backward, alive from the end of forward into backward.

    Without checkpointing: every projection's and the head's copy, except, under LoRA, the projections
    reading the first layer's input (q/k/v, qkv_proj, c_attn: their input needs no gradient, so they save
    nothing); plus the (cached) adapter copies. With checkpointing the layers save only their input, so
    only the head's copy survives forward. Freed layer by layer in backward.
    """
    if not prec.amp or prec.w == prec.c or run.quantize is not Quantize.NONE:
        return 0
    head = spec.lm_head_params or spec.vocab_size * spec.hidden_size
    if run.grad_checkpointing:
        return int(head * prec.c)
    layers = spec.linear_params
    if run.is_lora():
        first = sum(lin.in_features * lin.out_features for lin in spec.linears if lin.name in ATTN_IN)
        layers -= first
        layers += spec.lora_params(run)
    return int((layers + head) * prec.c)


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
        per = (states.weights + states.gradients + states.optimizer) * shards / n
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
