"""Bytes autograd saves for backward, per decoder layer, counted op by op for transformers 5's code.

Each family's recipe below lists the tensors its decoder layer keeps alive between forward and
backward, in bytes per token (``BT = micro_batch * seq_len`` tokens), plus the attention terms that
grow with the sequence. They were read off transformers' modeling code and checked tensor by tensor
with ``torch.autograd.graph.saved_tensors_hooks`` on 1-layer models (fp32, AMP bf16, pure bf16, LoRA);
``tests/test_estimate_accuracy.py`` holds the sum to the exact tracer. Symbols: H hidden, I intermediate,
Q = heads x head_dim, K = kv_heads x head_dim, n = heads, c = compute-dtype bytes, w = weight/stream bytes.

Rules that hold for every family (source: ``torch/csrc/autograd`` derivative formulas):
- ``linear`` saves its input only when its weight needs a gradient (full fine-tune, or a LoRA ``lora_A``),
  and its weight only when its input needs one (always, for decoder layers).
- Under autocast every ``linear`` casts its own fp32 input to the compute dtype; two projections of one
  hidden state (q and k) therefore save two half copies, not one.
- ``mul`` saves each operand the other's gradient needs; element-wise activations save their input.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.config import Attention, Quantize, RunConfig

FP32 = 4


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
            # QLoRA: non-quantized weights and compute in bf16 (bnb_4bit_compute_dtype).
            return cls(w=2, c=2, amp=False)
        w = 2 if str(run.dtype) in ("bf16", "fp16") else 4
        c = 2 if str(run.mixed_precision) in ("bf16", "fp16") else w
        return cls(w=w, c=c, amp=c != w)


@dataclass(frozen=True)
class LayerActivations:
    saved: int
    """Bytes one decoder layer keeps for backward (with checkpointing: its input only)."""
    backward_transient: int
    """Extra bytes while one layer runs backward: recomputed activations (checkpointing) + input grads."""


class _Ctx:
    """The numbers a recipe needs, computed once."""

    def __init__(self, spec, run: RunConfig, prec: Precisions, device: str):
        self.spec, self.run, self.prec, self.device = spec, run, prec, device
        self.bt = run.micro_batch * run.seq_len
        self.lora = set()
        if run.is_lora():
            self.lora = {lin.name for lin in spec.lora_linears(run.lora_targets)}

    def linear_inputs(self, dim: int, names: tuple[str, ...], src: int) -> int:
        """Bytes per token saved as the input of the projections ``names`` reading one tensor of ``src`` bytes.

        Full fine-tune: autocast casts the fp32 input once per projection (each keeps its copy); without a
        cast all share the one tensor. LoRA: only adapted projections save it (``lora_A``); PEFT casts a
        bf16 input to the fp32 adapter dtype once per projection (``_cast_input_dtype``), autocast casts an
        fp32 input to ``c`` once per projection; ``lora_A``'s r-wide output is saved by ``lora_B``.
        """
        p, run = self.prec, self.run
        if not run.is_lora():
            if p.amp and src != p.c:
                return len(names) * p.c * dim
            return src * dim
        adapted = [n for n in names if n in self.lora]
        if not adapted:
            return 0
        if p.amp:
            per_input = p.c * dim if src != p.c else 0
            shared = 0 if src != p.c else p.c * dim
            mid = p.c * run.lora_r
        elif src != p.adapter:
            per_input, shared, mid = p.adapter * dim, 0, p.adapter * run.lora_r
        else:
            per_input, shared, mid = 0, src * dim, p.adapter * run.lora_r
        dropout = 0
        if run.lora_dropout > 0:
            # nn.Dropout on the adapter input: the dropped copy (saved by lora_A instead) and the mask
            # (bool on CUDA's fused kernel, input dtype on CPU).
            mask = 1 if self.device == "cuda" else (p.c if p.amp else p.adapter)
            dropout = len(adapted) * mask * dim
        return len(adapted) * (per_input + mid) + shared + dropout

    def mlp_down_input(self, dim: int, name: str, src: int) -> int:
        return self.linear_inputs(dim, (name,), src)


def _rms_norm_llama(w: int, hidden: int) -> int:
    """LlamaRMSNorm: ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``.

    fp32 stream: saves x (the residual, counted as the layer input, not here), rsqrt (1 fp32/token) and
    the normalised h (fp32). bf16 stream: saves the fp32 copy of x, rsqrt and h cast back to bf16.
    """
    if w == FP32:
        return FP32 + FP32 * hidden
    return FP32 * hidden + FP32 + w * hidden


def _attention_core(ctx: _Ctx, kv_saved_as_q: bool = False) -> int:
    """Bytes per token saved by SDPA (flash / mem-efficient on CUDA, flash-for-CPU on CPU), no mask.

    Saves q and k after RoPE, v, the output (also the input ``o_proj`` saves) and the log-sum-exp
    (fp32, one per head and token). With GQA and no mask transformers passes ``enable_gqa=True``, so k and v
    stay kv-head sized. Eager attention adds the (B, n, T, T) score matrices, see ``_eager_scores``.
    """
    s, p = ctx.spec, ctx.prec
    k = s.q_dim if kv_saved_as_q else s.kv_dim
    return p.c * (s.q_dim + 2 * k + s.q_dim) + FP32 * s.num_heads


def _eager_scores(ctx: _Ctx) -> int:
    """Eager attention: bytes per token of the (B, n, T, T) matrices kept for backward.

    ``softmax(scores, dtype=fp32).to(c)``: softmax saves its fp32 output; the matmul with v saves the
    c-dtype probabilities (the same tensor when c is fp32). Per token: n * T elements of each.
    """
    s, p = ctx.spec, ctx.prec
    per = s.num_heads * ctx.run.seq_len
    return per * (FP32 + (p.c if p.c != FP32 else 0))


def llama_layer(ctx: _Ctx) -> int:
    """Llama / Mistral / Qwen2 decoder layer, bytes per token saved for backward.

    x (w) + norm1 + q,k,v inputs + attention core + x2 (w) + norm2 + gate,up inputs + 4 I-wide tensors
    (gate out, act out, up out, their product = down's input) in c.
    """
    s, p = ctx.spec, ctx.prec
    h, i = s.hidden_size, s.intermediate_size
    norm_out = p.w  # weight(w) * h(w)
    full = not ctx.run.is_lora()
    total = (p.w * h if p.w == FP32 else 0) * 2  # x and x2, saved by the norms' pow (fp32 stream only)
    total += 2 * _rms_norm_llama(p.w, h)
    total += ctx.linear_inputs(h, ("q_proj", "k_proj", "v_proj"), norm_out)
    kv_as_q = ctx.run.attn_implementation is Attention.EAGER and s.num_kv_heads != s.num_heads
    total += _attention_core(ctx, kv_as_q)
    # o_proj input is SDPA's output, already saved (and already in c): nothing new.
    total += ctx.linear_inputs(h, ("gate_proj", "up_proj"), norm_out)
    total += 3 * p.c * i  # gate out (act input), act out, up out
    down = ctx.linear_inputs(i, ("down_proj",), p.c)
    total += down if (full or "down_proj" in ctx.lora) else 0
    return total


RECIPES = {"llama": llama_layer}


def layer_activations(spec, run: RunConfig, prec: Precisions, device: str) -> LayerActivations:
    """Saved bytes of one decoder layer and the transient of its backward.

    Gradient checkpointing (non-reentrant, transformers' default): a layer keeps only its input
    (``w * H`` per token); in backward one layer at a time is recomputed (its full saved set) while the
    gradient of its input and output (2 x ``w * H``) exist.
    """
    ctx = _Ctx(spec, run, prec, device)
    recipe = RECIPES.get(spec.family, llama_layer)
    per_token = recipe(ctx)
    full = per_token * ctx.bt
    if run.attn_implementation is Attention.EAGER:
        full += _eager_scores(ctx) * ctx.bt
    grads = 2 * prec.w * spec.hidden_size * ctx.bt
    if run.grad_checkpointing:
        return LayerActivations(saved=prec.w * spec.hidden_size * ctx.bt, backward_transient=full + grads)
    return LayerActivations(saved=full, backward_transient=grads)


def outside_layer_activations(spec, run: RunConfig, prec: Precisions, device: str) -> int:
    """Saved tensors outside the decoder layers: input ids, RoPE cos/sin, the final norm and the head input.

    input_ids (int64, saved by the embedding backward), cos/sin (fp32, T x head_dim each, shared by all
    layers), the final norm (as a layer norm above, including its input), the head's input (cast per
    autocast), and the shifted int64 targets saved by the loss.
    """
    ctx = _Ctx(spec, run, prec, device)
    bt, h = ctx.bt, spec.hidden_size
    total = 8 * bt + 8 * bt  # input ids + loss targets
    total += 2 * FP32 * run.seq_len * spec.head_dim
    total += (prec.w * h if prec.w == FP32 else 0) * bt + _rms_norm_llama(prec.w, h) * bt
    if run.is_lora():
        total += 0  # the frozen head keeps only its weight
    elif prec.amp:
        total += prec.c * h * bt
    else:
        total += prec.w * h * bt
    return int(total)


@dataclass(frozen=True)
class LogitsTerms:
    forward: int
    """At the end of forward: the logits the model returns + log_softmax's saved fp32 output."""
    backward: int
    """At the start of backward: the above + the fp32 gradient of log_softmax's output and of the logits."""
    retained: int = 0
    """After the loss' backward, still referenced by the caller (0: ``memfit train`` keeps only ``.loss``)."""


def logits_terms(spec, run: RunConfig, prec: Precisions) -> LogitsTerms:
    """Bytes of the logits and loss, ``N = B * T * V`` elements.

    Forward (inside transformers' ``ForCausalLMLoss``): the head's logits (c bytes) and
    ``log_softmax``'s saved fp32 output (4); when the logits are not fp32, ``logits.float()`` adds an
    fp32 copy (4) while the loss runs, and Accelerate's ``convert_outputs_to_fp32`` another after it:
    8 N bytes in fp32, 10 N otherwise. The caller keeps only ``.loss``, so the logits die with the output.
    Backward start: ``nll_loss`` backward makes the fp32 gradient of log_softmax's output and
    ``log_softmax`` backward the fp32 gradient of the logits while its saved output is alive: 12 N bytes
    in every regime (the cast of that gradient to c comes after the first two are freed).
    Checked against the exact tracer to the byte (transformers 5.24, torch 2.13).
    """
    n = run.micro_batch * run.seq_len * spec.vocab_size
    forward = n * (FP32 + FP32) if prec.c == FP32 else n * (prec.c + FP32 + FP32)
    return LogitsTerms(forward=forward, backward=3 * FP32 * n)
