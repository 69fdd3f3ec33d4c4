"""Bytes autograd saves for backward, per decoder layer, counted op by op for transformers 5's code.

Each family's recipe below lists the tensors its decoder layer keeps alive between forward and
backward, in bytes per token (``BT = micro_batch * seq_len`` tokens), plus the attention terms that
grow with the sequence. They were read off transformers' modeling code and checked tensor by tensor
with ``torch.autograd.graph.saved_tensors_hooks`` on 1- and 2-layer models (fp32, AMP bf16, pure bf16,
LoRA); ``tests/test_estimate_accuracy.py`` holds the sum to the exact tracer. Symbols: H hidden,
I intermediate, Q = heads x head_dim, K = kv_heads x head_dim, n = heads, T = seq_len,
c = compute-dtype bytes, w = weight/residual-stream bytes.

Rules that hold for every family (source: ``torch/csrc/autograd`` derivative formulas):
- ``linear`` saves its input only when its weight needs a gradient (full fine-tune, or a LoRA ``lora_A``),
  and its weight only when its input needs one.
- Under autocast every ``linear`` casts its own fp32 input to the compute dtype; two projections of one
  hidden state (q and k) therefore save two half copies, not one.
- ``mul`` saves each operand the other's gradient needs; element-wise activations save their input.
- LoRA without checkpointing: the first layer's input does not need a gradient (frozen embedding), so
  its first norm saves nothing; every later layer's input does (it depends on the adapters before it).
  With checkpointing transformers calls ``enable_input_require_grads`` and every layer is alike.
- A view keeps its whole storage alive: Phi-3's v is a view of the fused qkv output, so SDPA keeps all
  of it.

Size: over 500 lines because it is the one table of per-family activation formulas (each with its source and
measured error); a family's terms are read side by side with the others' when a new family is added.
"""

# Inside a function: spec.losses, which imports torch (2.6 s; python -X importtime, 2026-12-06, this shared 2-core
# machine): the analytic estimator imports no torch (`memfit serve` starts without it).
from __future__ import annotations

from dataclasses import dataclass

from memfit.memory.preference_terms import preference_logits_terms
from memfit.memory.quantized import (
    dequantized_transient,
    int8_input_groups,
    projection_output_bytes,
    unquantized_bytes,
)
from memfit.memory.selective_ac import KeptOutputs, attention_kept, kept_outputs
from memfit.memory.trl_head import trl_logits_terms
from memfit.settings.config import Attention, Offload, Packing, Quantize, RunConfig
from memfit.settings.stack import Stack

FP32 = 4
QKV = frozenset(("q_proj", "k_proj", "v_proj"))

@dataclass(frozen=True)
class Precisions:
    """Bytes per element of the tensors of a step."""

    w: int
    """Stored weights, and the residual stream (embeddings come out in the weight dtype)."""
    c: int
    """Matmul inputs/outputs (autocast dtype, else the weight dtype)."""
    amp: bool
    """Autocast casts fp32 weights and activations to ``c`` (mixed precision with fp32 weights)."""
    adapter: int = FP32
    """LoRA adapter dtype: PEFT keeps adapters in fp32 (``autocast_adapter_dtype=True``)."""

    @classmethod
    def of(cls, run: RunConfig) -> Precisions:
        if run.quantize is not Quantize.NONE:
            # QLoRA: the unquantized weights, hence the embedding output and residual stream, are in
            # memory.quantized.unquantized_bytes (fp32 under PEFT's kbit cast, --qlora-upcast full; --dtype when
            # lean). Without autocast what the layers save is in that dtype (a quantized layer returns its
            # input's dtype; a bf16 ``--dtype`` with full upcast enters only the dequantized weight). Under
            # autocast the fp32 adapters' linears and SDPA cast to the autocast dtype, as in LoRA; what the
            # quantized projections return is ``memory.quantized.projection_output_bytes``.

            w = unquantized_bytes(run)
            c = 2 if str(run.mixed_precision) in ("bf16", "fp16") else w
            return cls(w=w, c=c, amp=c != w)
        w = 2 if str(run.dtype) in ("bf16", "fp16") else 4
        c = 2 if str(run.mixed_precision) in ("bf16", "fp16") else w
        return cls(w=w, c=c, amp=c != w)


@dataclass(frozen=True)
class LayerActivations:
    saved: int
    """Bytes one (non-first) decoder layer keeps for backward (with checkpointing: its input only)."""
    backward_transient: int
    """Extra bytes while one layer runs backward: recomputed activations (checkpointing) + input grads."""
    all_layers: int = 0
    """Bytes all decoder layers keep (the first layer differs under LoRA without checkpointing)."""
    held: int = 0
    """Of ``saved``, what a layer's backward does not free: it lives until the graph is freed after backward
    (an 8-bit base's ``ctx.A``, ``int8_held``)."""
    held_all_layers: int = 0
    """``held`` summed over all decoder layers (alive at the end of backward)."""


class _Ctx:
    """The numbers a recipe needs, computed once."""

    def __init__(self, spec, run: RunConfig, prec: Precisions, device: str, stack: Stack | None = None):
        self.spec, self.run, self.prec, self.device = spec, run, prec, device
        self.stack = stack or Stack()
        """The trainer and versions (``memfit.settings.stack``): which inputs a 4-bit base keeps, LoRA's dropout."""
        self.bt = run.micro_batch * run.seq_len
        self.full = not run.is_lora()
        self.trained_base = self.full or self.stack.trains_whole_layers(run)
        """Every layer parameter gets a gradient: a full fine-tune, or LoRA in FSDP (1) units shared with the base."""
        self.lora = set()
        if run.is_lora():
            self.lora = {lin.name for lin in spec.lora_linears(run.lora.targets)}
        self.autocast = str(run.mixed_precision) in ("bf16", "fp16")
        """Accelerate's autocast is on (the fp32 adapters' linears then run in ``c``, whatever ``prec.amp`` says)."""
        self.xin = True
        """Whether this layer's input needs a gradient (False: LoRA's first layer, no checkpointing)."""
        self.proj = prec.c
        """Bytes of the MLP's I-wide tensors: the compute dtype, or what a quantized projection returns."""
        self.bnb_keeps_half_input = False
        """PEFT's bitsandbytes LoRA layers cast the adapter input to fp32 only when ``not
        torch.is_autocast_enabled()`` (peft 0.21 ``tuners/lora/bnb.py``), a check of CUDA's autocast: on
        CUDA a half input reaches ``lora_A`` as is (shared with whoever saved it); on the CPU it is cast to
        fp32 and back to the autocast dtype, a copy of its own."""
        if run.quantize is not Quantize.NONE:
            self.proj = projection_output_bytes(run, prec.c, device)
            self.bnb_keeps_half_input = device == "cuda"
        hf = spec.hf_config
        self.attn_dropout = float(getattr(hf, "attn_pdrop", None) or getattr(hf, "attention_dropout", 0.0) or 0.0)
        self.resid_dropout = float(getattr(hf, "resid_pdrop", 0.0) or 0.0)

    def linear_inputs(self, dim: int, names: tuple[str, ...], src: int, already: bool = False) -> int:
        """Bytes per token saved as the input of the projections ``names`` reading one tensor of ``src`` bytes.

        Full fine-tune: autocast casts the fp32 input once per projection (each keeps its copy); without a
        cast all share the one tensor (0 when ``already`` saved by another op). LoRA: only adapted
        projections save it (``lora_A``). PEFT first casts the input to the fp32 adapter dtype
        (``_cast_input_dtype``); under autocast ``lora_A`` casts it back to ``c``, so each adapted
        projection keeps its own ``c`` copy; without autocast a non-fp32 input gets one fp32 copy per
        projection and an fp32 input is shared. ``lora_A``'s r-wide output is saved by ``lora_B``.
        """
        p, run = self.prec, self.run
        base = 0
        if self.trained_base:  # the projections' own weights get gradients: each saves its input
            base = len(names) * p.c * dim if p.amp and src != p.c else (0 if already else src * dim)
        if self.full:
            return base
        adapted = [n for n in names if n in self.lora]
        if not adapted:
            return base
        # the fp32 adapters are cast under autocast whatever the base's dtype (a bf16 base too: p.amp is False)
        cast = self.autocast and p.adapter != p.c
        if cast and self.bnb_keeps_half_input and src == p.c:
            per_input, shared, mid = 0, (0 if already else src * dim), p.c * run.lora.r
        elif cast:
            per_input, shared, mid = p.c * dim, 0, p.c * run.lora.r
        elif src != p.adapter:
            per_input, shared, mid = p.adapter * dim, 0, p.adapter * run.lora.r
        else:
            per_input, shared, mid = 0, (0 if already else src * dim), p.adapter * run.lora.r
        if base:  # lora_A's uncast input is the tensor the base projection saved
            shared = 0
        if run.lora.dropout <= 0:
            return len(adapted) * (per_input + mid) + shared + base
        # nn.Dropout on the adapter input: lora_A saves the dropped tensor (a new one per dropout, in the dtype
        # the input reaches it: the cast copy's, else the input's), and the dropout its mask (bool on CUDA's
        # fused kernel, the input dtype on CPU). litgpt's fused qkv LoRA drops its input once for q, k and v
        # (litgpt/lora.py L426); PEFT has one dropout per adapted projection.
        dropouts = len(adapted)
        if self.stack.traits.shared_qkv_dropout and set(adapted) <= QKV:
            dropouts = 1
        mask = 1 if self.device == "cuda" else (p.c if cast else p.adapter)
        return len(adapted) * mid + dropouts * ((per_input or src * dim) + mask * dim) + base

    def rms_norm(self, hidden: int, stream: int, gemma: bool = False, xin: bool = True) -> int:
        """Bytes per token an RMSNorm saves.

        Llama: ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``; Gemma: the product with
        ``1 + weight`` is taken in fp32. ``pow`` saves the fp32 x (the input itself when the stream is
        fp32, else its fp32 copy), ``rsqrt`` its fp32 output (1/token), and the weight's product saves the
        normalised h (Llama: cast back to the stream dtype; Gemma: fp32) only when the weight is trained.
        Nothing when neither the input nor the weight needs a gradient (LoRA's first layer, its base frozen).
        """
        h = (FP32 if gemma else stream) * hidden if self.trained_base else 0
        if not xin and not self.full:
            return h  # the frozen embedding's output needs no gradient; a trained weight still saves h
        return FP32 * hidden + FP32 + h

    def dropout_mask(self, dim: int, dtype: int, p: float) -> int:
        """``nn.Dropout`` in training saves its mask: bool on CUDA (fused kernel), the input dtype on CPU."""
        if p <= 0:
            return 0
        return (1 if self.device == "cuda" else dtype) * dim


MASKED_PACKING = (Packing.DOCUMENTS, Packing.NONE)
"""The ``--packing`` modes whose batches reach SDPA with a (B, 1, T, T) mask, so transformers cannot pass
``is_causal``: ``documents`` (restarting position ids: a block-causal mask) and ``none`` (one document per
row, right-padded to the longest of the micro-batch: a padding mask as soon as two lengths differ, which is
the peak's case). ``concat`` cuts one stream into full rows: no padding, no mask. Found on a Qwen2 LoRA run
of ShareGPT data with ``--packing none`` at T 512, whose measured tensor peak was 14.8% above an estimate
that assumed no mask (the mask and the repeated k/v of every layer). Read by the estimate and the trace."""


def packed_mask_per_token(ctx: _Ctx) -> int:
    """Extra bytes per token and layer SDPA saves when its batches carry a mask (``MASKED_PACKING``), else 0.

    Packed rows reach the model without an attention mask but with restarting position ids, so
    transformers builds a block-causal (B, 1, T, T) boolean mask (``find_packed_sequence_indices``);
    padded rows (``--packing none``) bring their 2-D attention mask, which becomes the same (B, 1, T, T)
    boolean mask.
    With a mask (1) transformers does not pass ``enable_gqa`` (``use_gqa_in_sdpa``) but repeats k and v
    to all heads, so SDPA saves them ``Q`` wide instead of ``K``: ``2 (Q - K) c``; (2) each layer's SDPA
    converts the boolean mask to an additive one in the query dtype and saves it for backward:
    ``B T^2 c`` per layer, ``T c`` per token. Measured with the exact tracer on CPU (fp32 and bf16
    autocast, B 2 and 4, T 64 and 128): exact to the byte per layer. The boolean mask itself and its
    helpers (a few ``B T^2`` bytes, alive once per step, not per layer) are left out: under 100 KiB at
    those sizes. CUDA's memory-efficient kernel takes the same additive mask (its last dimension
    padded to a multiple of 16, ignored here); flash-attention 2 runs its varlen kernel instead: no mask.
    """
    run = ctx.run
    if run.packing not in MASKED_PACKING or run.attn_implementation is not Attention.SDPA:
        return 0
    s = ctx.spec
    return 2 * (s.q_dim - s.kv_dim) * ctx.prec.c + run.seq_len * ctx.prec.c


def _sdpa_core(ctx: _Ctx, fused_qkv: bool = False) -> int:
    """Bytes per token saved by SDPA without a mask (flash / mem-efficient on CUDA, flash-for-CPU on CPU).

    Saves q and k after RoPE, v, the output and the log-sum-exp (fp32, one per head and token). With GQA
    and no mask transformers passes ``enable_gqa=True``, so k and v stay kv-head sized. Phi-3 slices q, k,
    v out of one fused output: v is a view, so the whole ``Q + 2K`` storage stays alive.
    """
    s, p = ctx.spec, ctx.prec
    v = s.q_dim + 2 * s.kv_dim if fused_qkv else s.kv_dim
    return p.c * (s.q_dim + s.kv_dim + v + s.q_dim) + FP32 * s.num_heads + packed_mask_per_token(ctx)


def _eager_core(ctx: _Ctx, softcap: bool) -> int:
    """Eager attention (``matmul`` / ``softmax(dtype=fp32)`` / ``matmul``), bytes per token.

    q, and k and v repeated to all heads (``repeat_kv`` copies), in c; the (B, n, T, T) matrices: the
    ``tanh`` output of Gemma-2's score soft-capping (c), softmax's fp32 output, and the probabilities
    cast to c for the second matmul (the same tensor when c is fp32). The output is made contiguous
    (a copy, the input ``o_proj`` saves, counted there).
    """
    s, p = ctx.spec, ctx.prec
    per = s.num_heads * ctx.run.seq_len
    scores = per * (FP32 + (p.c if p.c != FP32 else 0) + (p.c if softcap else 0))
    return p.c * 3 * s.q_dim + scores


def llama_layer(ctx: _Ctx) -> int:
    """Llama / Mistral / Qwen2 / Phi-3 decoder layer, bytes per token saved for backward.

    norm1 + q,k,v inputs + attention core + o_proj input + norm2 + gate,up inputs + 4 I-wide tensors
    (gate out = act input, act out, up out, their product = down's input) in c. Phi-3's fused
    ``gate_up_proj`` keeps the same 4 I (gate and up are views of one 2I output).
    """
    s, p = ctx.spec, ctx.prec
    h, i = s.hidden_size, s.intermediate_size
    names = {lin.name for lin in s.linears}
    fused = "qkv_proj" in names
    attn_in = tuple(n for n in ("q_proj", "k_proj", "v_proj", "qkv_proj") if n in names)
    mlp_in = tuple(n for n in ("gate_proj", "up_proj", "gate_up_proj") if n in names)
    eager = ctx.run.attn_implementation is Attention.EAGER
    total = ctx.rms_norm(h, p.w, xin=ctx.xin)
    total += ctx.linear_inputs(h, attn_in, p.w)
    total += _eager_core(ctx, softcap=False) if eager else _sdpa_core(ctx, fused)
    # o_proj's input is SDPA's output (already saved), except after eager attention or Phi-3's fused path
    # (made contiguous: a copy).
    total += ctx.linear_inputs(s.q_dim, ("o_proj",), p.c, already=not (eager or fused))
    total += ctx.rms_norm(h, p.w)
    total += ctx.linear_inputs(h, mlp_in, p.w)
    total += 3 * ctx.proj * i  # gate out (act input), act out, up out
    total += ctx.linear_inputs(i, ("down_proj",), ctx.proj)
    return total


def gemma2_layer(ctx: _Ctx) -> int:
    """Gemma-2 decoder layer (eager attention, score soft-capping, four RMSNorms), bytes per token.

    norm1 + q,k,v inputs + eager core (+ tanh of the capped scores) + o_proj input (contiguous copy) +
    post-attention norm (of o_proj's output) + pre-feedforward norm + gate,up inputs + 4 I-wide tensors
    (``gelu_pytorch_tanh`` saves its input) + post-feedforward norm (of down's output).
    Gemma's norms multiply by ``1 + weight`` in fp32: the normalised h they save is fp32.
    """
    s, p = ctx.spec, ctx.prec
    h, i = s.hidden_size, s.intermediate_size
    softcap = getattr(s.hf_config, "attn_logit_softcapping", None) is not None
    # The resolved run names what transformers runs: eager for Gemma 2 (soft-capping refuses SDPA).
    eager = ctx.run.attn_implementation is Attention.EAGER
    total = ctx.rms_norm(h, p.w, gemma=True, xin=ctx.xin)
    total += ctx.linear_inputs(h, ("q_proj", "k_proj", "v_proj"), p.w)
    total += _eager_core(ctx, softcap) if eager else _sdpa_core(ctx)
    total += ctx.linear_inputs(s.q_dim, ("o_proj",), p.c, already=not eager)
    total += 3 * ctx.rms_norm(h, p.w, gemma=True)
    total += ctx.linear_inputs(h, ("gate_proj", "up_proj"), p.w)
    total += 3 * ctx.proj * i
    total += ctx.linear_inputs(i, ("down_proj",), ctx.proj)
    return total


def gpt2_layer(ctx: _Ctx) -> int:
    """GPT-2 decoder layer (LayerNorm, Conv1D, learned positions, ``gelu_new``, dropout), bytes per token.

    ln_1 (input + fp32-or-stream mean and rstd) + c_attn input + attention + c_proj input + residual
    dropout mask + ln_2 + c_fc input + ``gelu_new``'s 4 I-wide saves (x for ``pow``, ``tanh`` output,
    ``0.5 x`` and ``1 + tanh`` for the product) + c_proj input (I) + MLP dropout mask.
    Attention: on CUDA, flash/mem-efficient SDPA with dropout saves q, k, v (views of the c_attn output:
    3H), output and log-sum-exp; on CPU dropout forces SDPA's math path, which upcasts to fp32 and keeps
    q, k, v and three (B, n, T, T) matrices (softmax output, dropout mask, dropped probabilities).
    """
    s, p = ctx.spec, ctx.prec
    h, i = s.hidden_size, s.intermediate_size
    n_t = s.num_heads * ctx.run.seq_len
    ln_in = (p.w * h + 2 * p.w) if (ctx.xin or ctx.trained_base) else 0  # input, mean, rstd in the stream dtype
    total = ln_in
    total += ctx.linear_inputs(h, ("c_attn",), p.w)
    if ctx.device == "cpu" and ctx.attn_dropout > 0:
        total += FP32 * 3 * s.q_dim + 3 * FP32 * n_t
        total += ctx.linear_inputs(h, ("c_proj",), p.c)  # the contiguous copy of the output
    else:
        total += p.c * 3 * h + p.c * s.q_dim + FP32 * s.num_heads + packed_mask_per_token(ctx)
        total += ctx.linear_inputs(h, ("c_proj",), p.c, already=True)
    total += ctx.dropout_mask(h, p.c, ctx.resid_dropout)
    total += p.w * h + 2 * p.w  # ln_2
    total += ctx.linear_inputs(h, ("c_fc",), p.w)
    total += 4 * ctx.proj * i
    total += ctx.linear_inputs(i, ("c_proj",), ctx.proj)
    total += ctx.dropout_mask(h, p.c, ctx.resid_dropout)
    return total


RECIPES = {"llama": llama_layer, "phi3": llama_layer, "gemma2": gemma2_layer, "gpt2": gpt2_layer}


def layer_activations(spec, run: RunConfig, prec: Precisions, device: str,
                      stack: Stack | None = None) -> LayerActivations:
    """Saved bytes of one decoder layer, of all layers, and the transient of one layer's backward.

    Gradient checkpointing (non-reentrant, transformers' default): a layer keeps only its input
    (``w * H`` per token); in backward one layer at a time is recomputed (its full saved set, less the
    input itself where its first norm saves it uncast: that tensor is the one the checkpoint keeps; exact
    on the trace's timeline, tiny Llama fp32: no new bytes when the recompute's norm saves its input).
    Per-op selective checkpointing (torchtitan, ``Trainer.selective_ac_op``): a layer also keeps the outputs its
    policy saves (``memory.selective_ac``), which its recompute then does not allocate again.
    Backward transient of one layer without checkpointing: the gradient of its input and output
    (2 x ``w * H``) and, in the MLP's backward, the gradients of two I-wide tensors (``mul``'s two input
    grads, c), below the backward-start peak. With checkpointing: the recomputed set plus the gradients
    of the MLP-backward moment (``_recompute_grads``), the backward peak; within 0.2% of the trace on the
    accuracy grid's hand-written Llama-family cases. QLoRA: its own moment (``quantized_mlp_moment``), and an
    8-bit base's ``ctx.A`` in ``saved``/``held`` (``int8_held``); within 0.2% of real tensors at
    bench/quant_memory.py's full size, 1.9% at ``--quick`` (tests/test_quant_accuracy.py).
    """
    ctx = _Ctx(spec, run, prec, device, stack)
    recipe = RECIPES.get(spec.family, llama_layer)
    full = recipe(ctx) * ctx.bt + _per_layer_constant(spec, run)
    grads = (2 * prec.w * spec.hidden_size + 2 * ctx.proj * spec.intermediate_size) * ctx.bt
    n = spec.num_layers
    if run.grad_checkpointing:
        held = int8_held(ctx, checkpointed=True)[1] * ctx.bt
        if ctx.stack.checkpoints_reentrant():
            # reentrant checkpointing runs the forward under no_grad (no ctx kept) and frees each recomputed
            # graph after its layer's backward: the kept inputs exist for one layer, during its backward
            full, held = full + held, 0
        saved = prec.w * spec.hidden_size * ctx.bt + held
        kept = _selectively_kept(ctx)
        saved += kept.total * ctx.bt
        # the recompute's first norm saves the input as is (GPT-2's LayerNorm; an RMSNorm's x.float() of an
        # fp32 stream), the tensor the checkpoint already keeps; an RMSNorm's fp32 copy of a half stream is new
        shared = prec.w * spec.hidden_size * ctx.bt if spec.family == "gpt2" or prec.w == FP32 else 0
        moment = grads if spec.family == "gpt2" else _recompute_grads(spec, prec) * ctx.bt
        if run.quantize is not Quantize.NONE and spec.family != "gpt2":
            moment = quantized_mlp_moment(ctx)
        # what the layer kept (torchtitan's per-op policy) and its recompute takes back: not allocated again
        transient = max(full + moment - shared - kept.reached * ctx.bt, recompute_adapter_moment(ctx, full) * ctx.bt)
        return LayerActivations(saved=saved, backward_transient=transient, all_layers=saved * n,
                                held=held, held_all_layers=held * n)
    extra, held = (b * ctx.bt for b in int8_held(ctx, checkpointed=False))
    full += extra
    first, first_held = full, held
    if run.is_lora():
        ctx.xin = False
        first_extra, first_held = (b * ctx.bt for b in int8_held(ctx, checkpointed=False))
        first = recipe(ctx) * ctx.bt + _per_layer_constant(spec, run) + first_extra
    return LayerActivations(saved=full, backward_transient=grads, all_layers=first + full * (n - 1),
                            held=held, held_all_layers=first_held + held * (n - 1))


def _selectively_kept(ctx: _Ctx) -> KeptOutputs:
    """The outputs a checkpointed layer keeps besides its input: torchtitan's per-op policy
    (``memory.selective_ac``), none under whole-layer checkpointing."""
    if not ctx.stack.traits.selective_ac_op:
        return KeptOutputs(0, 0)
    sdpa = ctx.run.attn_implementation is Attention.SDPA and attention_kept(ctx.device)
    return kept_outputs(ctx.spec, ctx.prec.c, sdpa)


def int8_held(ctx: _Ctx, checkpointed: bool) -> tuple[int, int]:
    """An 8-bit base's ``ctx.A`` (``memory.quantized.int8_input_groups``), bytes per token of one layer:
    (what it adds to the recipe's saved set, what it keeps alive until the graph is freed).

    Checkpointed: every group, in every layer (checkpointing's hooks dropped everything else the forward
    saved). Without: a group the recipe already saves is the same tensor (SDPA's output for the output
    projection; without autocast and LoRA dropout the adapters' ``lora_A``, which saves its input uncast; on CUDA under
    autocast a half input, which PEFT's bitsandbytes layer passes uncast), so it adds nothing but is
    still kept until the end; q/k/v's input in LoRA's first layer needs no gradient, so no node holds it.
    """

    groups = int8_input_groups(ctx.spec, ctx.run, ctx.prec, ctx.device, ctx.stack.keeps_4bit_input())
    extra = held = 0
    for role, (width, nbytes, names) in groups.items():
        if role == "attn_in" and not ctx.xin and not checkpointed:
            continue
        held += width * nbytes
        eager = ctx.run.attn_implementation is Attention.EAGER
        uncast = not ctx.prec.amp or (ctx.bnb_keeps_half_input and nbytes == ctx.prec.c)
        # an adapter shares the input only without LoRA dropout (with it, lora_A saves the dropped copy)
        shares = uncast and ctx.run.lora.dropout == 0 and any(n in ctx.lora for n in names)
        already = (role == "attn_out" and not eager) or shares
        extra += width * nbytes if checkpointed or not already else 0
    return extra, held


def quantized_mlp_moment(ctx: _Ctx) -> int:
    """QLoRA with (non-reentrant) checkpointing: the bytes beside a recomputed layer's saved set at its
    backward peak, in place of ``_recompute_grads``; the largest of three moments, each with the layer
    output's gradient (H, stream dtype):

    - the recompute's last projection (the down projection's adapter): the recomputed graph is still alive,
      with its own 8-bit ``ctx.A`` beyond the recipe (``int8_held``), the base's output (PEFT's ``result``,
      H wide) and on the CPU under autocast PEFT's fp32 copy of a half input (``_Ctx.bnb_keeps_half_input``):
      the 8-bit bf16 peak (--quick: -4.8% without; -1.9% with: H-wide half gradients of the layer above,
      65,536 B, are still alive there, not modelled);
    - inside the down projection's base backward: PEFT adds ``lora_B(lora_A(x))`` after the base output, so
      autograd runs the adapter first and its ``lora_A`` frees its saved input (the recipe's down-input term,
      ``down_in``: checkpointing drops a recomputed tensor once unpacked); then the adapter's gradient of the
      product (``proj`` bytes), the base's (``MatMul4Bit.backward``: ``grad_output``'s compute dtype;
      ``MatMul8bitFp``: the input's) and the dequantized weight (``quantized.dequantized_transient``): the
      fp32 peaks;
    - when the two are summed (out of place) and in ``mul``'s backward: three I-wide gradients in ``proj``,
      less ``down_in``: the 4-bit bf16 peak.

    Measured on real tensors (bench/quant_memory.py, 4-bit and 8-bit, fp32 and bf16 autocast).
    ``_recompute_grads``' H w + 2 I c (a plain LoRA's moment) was +3.8% on the 4-bit fp32 --quick backward.
    """

    spec, run, prec, bt = ctx.spec, ctx.run, ctx.prec, ctx.bt
    i = spec.intermediate_size
    down_adapted = "down_proj" in ctx.lora
    peft_copy = FP32 * i * bt if prec.amp and not ctx.bnb_keeps_half_input and ctx.proj != FP32 and down_adapted else 0
    recompute_end = int8_held(ctx, checkpointed=False)[0] * bt + peft_copy + ctx.proj * spec.hidden_size * bt
    down_in = ctx.linear_inputs(i, ("down_proj",), ctx.proj) * bt
    base_grad = (prec.c if run.quantize is Quantize.Q4 else ctx.proj) * i * bt
    in_base = ctx.proj * i * bt + base_grad + dequantized_transient(spec, run, "backward") - down_in
    at_sum = 3 * ctx.proj * i * bt - down_in
    return prec.w * spec.hidden_size * bt + max(recompute_end, in_base, at_sum)


def recompute_adapter_moment(ctx: _Ctx, full: int) -> int:
    """LoRA's fp32 adapters over a half-precision stream without autocast (``--dtype bf16``, plain LoRA or lean
    QLoRA) with (non-reentrant) checkpointing: bytes per token beside the layer's input while its recompute runs
    ``up_proj``'s adapter, the backward peak there (0 where the moment does not arise).

    PEFT computes ``lora_B(lora_A(x)) * scaling`` in the adapters' fp32 (``tuners/lora/layer.py``; its
    bitsandbytes layers the same, then cast), so the recompute holds, at that ``mul``: what the layer has
    recomputed up to ``up_proj``'s ``lora_A`` (``full`` less ``up``'s output and ``down_proj``'s inputs), the
    attention block's residual sum and the second norm's output (2 H w, Python variables, not saved), the base
    projection's output (I, ``proj``), ``lora_B``'s output and its scaled copy (2 I fp32). Beside them since
    before the recompute: the layer output's gradient (H w) and what backward computed for ``down_proj``'s
    adapter before it needed a recomputed tensor: the gradient of its scaled output (H fp32) and, plain LoRA
    only, the base output's gradient cast back from the fp32 sum (H w; PEFT's bitsandbytes layers add in the
    stream's dtype: none). Read off the exact trace, which equals real tensors there to the byte (tiny Llama,
    pure bf16, LoRA and lean QLoRA); without this moment the backward peak was 5.0% (LoRA) and 7.3% (QLoRA)
    under. Known error: only Llama-style MLPs whose ``up_proj`` is adapted; the fp32 adapters' I-wide output
    under a fused ``gate_up_proj`` (Phi-3) is not modelled.
    """
    spec, run, prec, bt = ctx.spec, ctx.run, ctx.prec, ctx.bt
    if ctx.autocast or prec.w == prec.adapter or "up_proj" not in ctx.lora or spec.family == "gpt2":
        return 0
    h, i, a = spec.hidden_size, spec.intermediate_size, prec.adapter
    before = full // bt - ctx.proj * i - ctx.linear_inputs(i, ("down_proj",), ctx.proj)
    in_recompute = 2 * prec.w * h + ctx.proj * i + 2 * a * i
    pending = prec.w * h
    if "down_proj" in ctx.lora:
        pending += a * h + (prec.w * h if run.quantize is Quantize.NONE else 0)
    return before + in_recompute + pending


def _recompute_grads(spec, prec: Precisions) -> int:
    """Gradient bytes per token alive at a checkpointed layer's backward peak, beside its recomputed set.

    The peak is in the MLP's backward, once ``down_proj`` has given its input's gradient (I wide, c) and
    freed that input (its saved set minus I c): the layer output's gradient (H, stream dtype) and the
    three I-wide gradients of ``act(gate) * up`` (the product's and its two inputs'), i.e. H w + 2 I c
    net of the freed input. Read off the exact trace (Llama MHA and GQA, Qwen2, fp32 and AMP); GPT-2's
    MLP (``c_fc``, ``gelu_new``, ``c_proj``) keeps the older 2 H w + 2 I c (not re-read)."""
    return prec.w * spec.hidden_size + 2 * prec.c * spec.intermediate_size


def _per_layer_constant(spec, run: RunConfig) -> int:
    """Gemma's norms save the fp32 ``1 + weight`` vector (H) when the weight is trained: 4 per layer."""
    if spec.family == "gemma2" and not run.is_lora():
        return 4 * FP32 * spec.hidden_size
    return 0


def outside_layer_activations(spec, run: RunConfig, prec: Precisions, device: str) -> int:
    """Saved tensors outside the decoder layers, bytes.

    The embedding saves the int64 input ids (and GPT-2's position embedding its (1, T) position ids)
    when its weight is trained; the loss saves the shifted int64 targets; RoPE's cos/sin (T x head_dim
    each, in the stream dtype, shared by all layers); GPT-2's embedding dropout mask; the final norm;
    the head's input (cast per autocast; nothing when the head is frozen: LoRA): ``head_side_activations``;
    the attention masks checkpointing keeps (``checkpointed_masks``).
    """
    ctx = _Ctx(spec, run, prec, device)
    bt, h, w = ctx.bt, spec.hidden_size, prec.w
    total = 0
    if ctx.full:
        total += 8 * bt
    rows = position_rows(run)
    if spec.family == "gpt2":
        if ctx.full:
            total += 8 * rows * run.seq_len
        if ctx.full or run.grad_checkpointing:
            total += ctx.dropout_mask(h, w, float(getattr(spec.hf_config, "embd_pdrop", 0.0) or 0.0)) * bt
    else:
        total += 2 * w * rows * run.seq_len * spec.head_dim
        if spec.family == "gemma2" and ctx.full:
            total += FP32 * h
    total += head_side_activations(spec, run, prec, device) + checkpointed_masks(spec, run, prec)
    return int(total)


def position_rows(run: RunConfig) -> int:
    """Rows of the position ids the model sees: B with ``--packing documents`` (each row carries its own
    restarting (B, T) positions), else 1 (transformers numbers positions 0..T-1 once, (1, T)). Everything
    computed from them per row has that many rows: RoPE's cos and sin ((rows, T, head_dim) each, saved by
    every layer's rotation), GPT-2's position-embedding input. Read off transformers 5's rotary
    embeddings; the trace agrees to the byte (Llama, T 512, B 2, fp32: 65,536 bytes more than (1, T))."""
    return run.micro_batch if run.packing is Packing.DOCUMENTS else 1


def head_side_activations(spec, run: RunConfig, prec: Precisions, device: str) -> int:
    """Saved tensors that the head's and the loss' backward free, before any decoder layer's backward:
    the loss targets, the final norm's and the head's input (what ``outside_layer_activations`` counts
    for them). Held to the trace's timeline: gone one layer into backward (Gemma 2, fp32, checkpointing)."""
    ctx = _Ctx(spec, run, prec, device)
    bt, h, w = ctx.bt, spec.hidden_size, prec.w
    total = 8 * bt  # loss targets
    if spec.family == "gpt2":
        total += (w * h + 2 * w) * bt  # ln_f
    else:
        total += ctx.rms_norm(h, w, gemma=spec.family == "gemma2") * bt
    if str(run.loss) != "standard":
        total += w * h * bt  # the chunked loss saves the head's input itself (it casts per chunk)
    elif ctx.full:
        total += (prec.c if prec.amp else w) * h * bt
    return int(total)


def final_hidden_in_loss(spec, run: RunConfig, prec: Precisions) -> int:
    """The decoder's last hidden state (stream dtype), alive while the model's own loss runs, when the head
    does not save it, bytes (0 when it does: counted in ``head_side_activations``).

    ``*ForCausalLM.forward`` holds the decoder's output until it returns, i.e. through the head and the
    loss, the forward's peak; the head saves that tensor itself only in a full fine-tune without autocast
    (autocast saves its half copy, a frozen head saves nothing). The chunked loss saves it (counted there).
    Trace: Llama GQA, T 512, B 2, bf16 autocast: 262,144 of a 282,768-byte forward gap (the rest: the
    loss' padded and shifted int64 labels, ~16 B a token).
    A preference method has no model loss: its forward's peak (the logits' fp32 copy, made by Accelerate's
    output conversion after ``forward`` returned) comes after the decoder's output died, so 0 (the trace,
    Llama GQA ORPO AMP: the forward moment was +1.4% with it).
    Under ``--offload activations`` without checkpointing the head's saved copy waits on the host while the
    decoder's output is still alive on the device: counted here in every regime (the trace, Llama GQA fp32:
    the forward moment was -1.4% without it).
    """
    if str(run.loss) != "standard" or str(run.method) != "sft":
        return 0
    offloaded = run.offload is Offload.ACTIVATIONS and not run.grad_checkpointing
    if not run.is_lora() and not prec.amp and not offloaded:
        return 0
    return prec.w * spec.hidden_size * run.micro_batch * run.seq_len


def checkpointed_masks(spec, run: RunConfig, prec: Precisions) -> int:
    """Attention masks kept alive by checkpointing, bytes.

    Eager attention gets a materialised (B, 1, T, T) additive mask in the stream dtype, one per kind of
    layer (Gemma 2: sliding and full). SDPA gets a (B, 1, T, T) boolean mask (1 byte an element) where
    transformers cannot pass ``is_causal`` (``MASKED_PACKING``: packed rows, block-causal, and padded rows);
    ``--packing concat`` gets none (a sliding window shorter than the sequence goes to the derived recipe).
    Non-reentrant checkpointing saves each layer's inputs, the mask among them, so the masks live from
    the forward into backward (without checkpointing ``attn + mask`` saves nothing and they are freed
    when the decoder's forward returns). Read off transformers 5's ``create_causal_mask`` and the trace
    (Llama GQA, T 512, B 2, SDPA, packed: the 524,288-byte boolean mask was most of a 3.3% gap; RoPE's
    per-row cos/sin, ``position_rows``, the rest).
    """
    if not run.grad_checkpointing:
        return 0
    masks = run.micro_batch * run.seq_len * run.seq_len
    if run.attn_implementation is Attention.EAGER or spec.family == "gemma2":
        return len(_mask_kinds(spec)) * masks * prec.w
    if run.packing in MASKED_PACKING and run.attn_implementation is Attention.SDPA:
        return masks  # bool
    return 0


def masks_freed_above_first_layer(spec, run: RunConfig, prec: Precisions) -> int:
    """Of ``checkpointed_masks``, those no longer alive in the first layer's backward: the kinds only
    layers above it use (Gemma 2: the full-attention mask; the first layer slides)."""
    kinds = _mask_kinds(spec)
    per_kind = checkpointed_masks(spec, run, prec) // len(kinds)
    return per_kind * (len(kinds) - 1)


def _mask_kinds(spec) -> list:
    types = list(getattr(spec.hf_config, "layer_types", None) or ["full_attention"])[: spec.num_layers]
    return sorted(set(types), key=types.index) or ["full_attention"]


@dataclass(frozen=True)
class LogitsTerms:
    forward: int
    """At the end of forward: the logits the model returns + log_softmax's saved fp32 output."""
    backward: int
    """At the start of backward: the above + the fp32 gradient of log_softmax's output and of the logits."""
    retained: int = 0
    """After the loss' backward, still referenced by the caller (0: ``memfit train`` keeps only ``.loss``)."""


def logits_terms(spec, run: RunConfig, prec: Precisions, device: str = "cuda") -> LogitsTerms:
    """Bytes of the logits and loss, ``N = B * T * V`` elements.

    Forward (inside transformers' ``ForCausalLMLoss``): the head's logits (c bytes) and
    ``log_softmax``'s saved fp32 output (4); when the logits are not fp32, ``logits.float()`` adds an
    fp32 copy (4) while the loss runs, and Accelerate's ``convert_outputs_to_fp32`` another after it:
    8 N bytes in fp32, 10 N otherwise. The caller keeps only ``.loss``, so the logits die with the output.
    Backward start: ``nll_loss`` backward makes the fp32 gradient of log_softmax's output and
    ``log_softmax`` backward the fp32 gradient of the logits while its saved output is alive: 12 N bytes
    in every regime (the cast of that gradient to c comes after the first two are freed).
    Gemma-2's final soft-capping (``tanh(logits / cap) * cap``) keeps ``tanh``'s output (c) for backward
    too: + c N in both.
    Checked against the exact tracer to the byte (transformers 5.24, torch 2.13).
    """
    if str(run.loss) == "trl":  # TRL's SFTTrainer: its fused LM head (memory/trl_head.py)
        forward, backward = trl_logits_terms(spec, run, prec, device)
        return LogitsTerms(forward=forward, backward=backward)
    if str(run.loss) != "standard":
        return chunked_logits_terms(spec, run, prec)
    if str(run.method) != "sft":  # the preference loss reads the logits itself (memory/preference_terms.py)
        forward, backward = preference_logits_terms(spec, run, prec)
        return LogitsTerms(forward=forward, backward=backward)
    n = run.micro_batch * run.seq_len * spec.vocab_size
    forward = n * (FP32 + FP32) if prec.c == FP32 else n * (prec.c + FP32 + FP32)
    cap = prec.c * n if spec.final_logit_softcapping else 0
    return LogitsTerms(forward=forward + cap, backward=3 * FP32 * n + cap)


def chunked_logits_terms(spec, run: RunConfig, prec: Precisions) -> LogitsTerms:
    """Bytes of the head + loss with ``--loss chunked`` (``memfit.spec.losses``): one chunk of ``n`` tokens at a time.

    ``N = B * T`` tokens, ``n`` = ``chunk_tokens`` (Liger's rule), ``Vn = n * V`` elements of one chunk's logits.
    Forward, inside the function: the per-token log-sum-exp (fp32, 4 N, kept for backward), the int64
    clamped targets and bool mask (9 N, freed at the end), and one chunk: its fp32 logits and
    ``exp(z - max)`` (8 Vn; under autocast the c-byte logits die as their fp32 copy is made: c + 4 <= 8),
    + 4 Vn for Gemma 2's soft-capping (``tanh`` output and the capped logits alive together).
    Backward, inside the function: log-sum-exp and targets as above, the gradient buffers of the hidden
    states (``w * N * H``) and, when the head is trained, of the head's weight (``w * V * H``; it becomes
    the head's ``.grad``), and one chunk: fp32 logits turned into the logits' gradient in place (4 Vn;
    + 4 Vn of ``tanh`` with soft-capping), its c copy under autocast (c Vn, alive with the fp32 one), the
    chunk's input-gradient product (c n H) and input cast (c n H when w != c), and under autocast with a
    trained head the chunk's (V, H) weight-gradient product in c before it is added to the fp32 buffer.
    Exact on the tracer (every tensor is explicit); what CUDA kernels allocate inside matmuls is not counted.
    """
    from memfit.spec.losses import chunk_tokens  # see the note at the top of this module

    tokens = run.micro_batch * run.seq_len
    n = chunk_tokens(tokens, spec.vocab_size, spec.hidden_size)
    vn = n * spec.vocab_size
    cap = bool(spec.final_logit_softcapping)
    vh = spec.vocab_size * spec.hidden_size
    trained_head = not run.is_lora()
    forward = 4 * tokens + 9 * tokens + (12 if cap else 8) * vn
    chunk_back = max(8 if cap else 4, 4 + (prec.c if prec.c != FP32 else 0)) * vn
    chunk_back += prec.c * n * spec.hidden_size * (2 if prec.w != prec.c else 1)
    if trained_head and prec.c != prec.w:
        chunk_back += prec.c * vh
    buffers = prec.w * tokens * spec.hidden_size + (prec.w * vh if trained_head else 0)
    backward = 4 * tokens + 9 * tokens + buffers + chunk_back
    return LogitsTerms(forward=int(forward), backward=int(backward))
