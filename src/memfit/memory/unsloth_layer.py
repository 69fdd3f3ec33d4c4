"""What an Unsloth LoRA/QLoRA step holds on a Llama-family model, read off Unsloth's own source.

Unsloth (``memfit.settings.stack``: trainer ``unsloth``) replaces transformers' Llama layer by its own code
and autograd functions, so memfit's transformers recipe (``memory.activations``) does not describe it. The
terms here are what Unsloth's source saves and allocates, read at the commits of the release of December 2024
(the month of Unsloth's long-context table that ``bench/published_runs.yaml`` cites):

- unslothai/unsloth 6dd9d4e (2024-12-10): ``unsloth/models/llama.py``, ``unsloth/models/_utils.py``,
  ``unsloth/kernels/{fast_lora,swiglu,rms_layernorm,rope_embedding,cross_entropy_loss,utils}.py``;
- unslothai/unsloth-zoo b09a943 (2024-12-09): ``unsloth_zoo/gradient_checkpointing.py``, ``loss_utils.py``;
- apple/ml-cross-entropy 1f3ebdb (2024-12-09): ``cut_cross_entropy/{cce,cce_backward,utils}.py``;
- flash-attention 2's ``mha_bwd`` (``csrc/flash_attn/flash_api.cpp``) for attention's backward buffers.

Symbols (bytes per token unless said): H hidden, I intermediate, Q = heads x head_dim, K = kv_heads x
head_dim, n heads, r the LoRA rank, c = 2 (Unsloth computes in the model's bf16/fp16: ``matmul_lora`` casts
the fp32 adapters to the input's dtype, ``A.to(dtype)``), N = micro_batch x seq_len tokens.

Where Unsloth's kernels run (``applies``): ``FastLlamaModel.patch_peft_model`` swaps in ``LoRA_QKV``, ``LoRA_W`` and
``LoRA_MLP`` only with ``lora_dropout == 0``, no bias, and q, k, v (o; gate, up, down) all adapted
(llama.py L2337-2397); the model computes in its own half dtype (llama.py L611-613 ``inputs_embeds.to(torch_dtype)``),
with fp32 adapters (``_utils.py`` L521-527 ``prepare_model_for_kbit_training``: "Also must be in float32!").
Elsewhere memfit prices transformers' layer and says so (``notes``).

Not priced here: the no-grad forward of a checkpointed layer (below its recompute's backward, which runs the same
forward with grad and more); xformers' attention, which Unsloth runs when flash-attn is not installed (llama.py
L393-413: k and v expanded to every head, 2 c (Q - K) more; said by the stack's ``unpriced``); models Unsloth
patches through other files (Mistral, Qwen2: ``mistral.py``, ``qwen2.py``, not read), priced as transformers' layers
and said by ``notes``. Host memory is reported (``host_bytes``), never counted on the device. Not checked on a GPU
(this machine has no CUDA; Unsloth cannot run here).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory.activations import LayerActivations, LogitsTerms, Precisions
from memfit.settings.config import Loss, Offload, Packing, Quantize, RunConfig
from memfit.settings.stack import Stack

FP32 = 4
INT64 = 8
ROPE_FIRST_ROWS = 4 * 8192
"""Rows of each rotary cache Unsloth builds at start (llama.py L1241 ``min(4 * 8192, max_position_embeddings)``)."""
ROPE_STEP_ROWS = 8192
"""A longer sequence grows the cache to the next multiple of 8,192 rows (llama.py L1309-1313)."""
KERNEL_TARGETS = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
"""The projections Unsloth's LoRA kernels need adapted (llama.py L2343-2397)."""


def applies(spec, run: RunConfig, prec: Precisions, stack: Stack) -> bool:
    """Whether Unsloth's kernels run this step and this module prices it: a Llama model (``FastLlamaModel``: its
    decoder layer is ``LlamaDecoderLayer_fast_forward``) with a bias-free SwiGLU MLP, LoRA with no dropout on all seven
    projections, a half-precision model (none or 4-bit base: ``fast_dequantize`` returns an unquantized weight as
    is, utils.py L120), and Unsloth's gradient checkpointing ("unsloth": each layer's input offloaded to the host,
    ``--offload activations``; ``True``: kept on the device)."""
    if not stack.traits.unsloth_kernels or not run.is_lora() or not run.grad_checkpointing:
        return False
    adapted = {lin.name for lin in spec.lora_linears(run.lora.targets)}
    biased = any(lin.bias for lin in spec.linears if lin.name in KERNEL_TARGETS)
    return (spec.model_type == "llama" and spec.gated_mlp and spec.hidden_act == "silu" and not biased
            and KERNEL_TARGETS <= adapted and run.lora.dropout == 0 and prec.w == 2 == prec.c
            and run.quantize in (Quantize.NONE, Quantize.Q4) and run.offload in (Offload.NONE, Offload.ACTIVATIONS))


def recomputed_saved(spec, run: RunConfig, prec: Precisions) -> int:
    """Bytes per token one recomputed layer saves for its backward, beside its input (the checkpoint itself).

    ``LlamaDecoderLayer_fast_forward`` (llama.py L490-510) in order:
    - ``fast_rms_layernorm``: ``Fast_RMS_Layernorm.forward`` saves ``X`` (the layer's input: no new bytes), the
      weight and ``r``, one fp32 per row (rms_layernorm.py L148-165): 4; its output ``Y`` (c H) is new;
    - ``LoRA_QKV.forward`` saves ``X`` (that output, c H) and the adapters (fast_lora.py L249); its Q, K, V (c (Q +
      2K)) are rotated in place by ``Fast_RoPE_Embedding`` (rope_embedding.py L83-114: a view of Q, written by the
      kernel, nothing saved but the cache) and kept by ``flash_attn_func`` (llama.py L419) with its output (c Q)
      and fp32 log-sum-exp (4 n); ``LoRA_W`` (o_proj) saves that output (the same tensor, fast_lora.py L371);
    - the residual sum (c H), saved by the second norm as its ``X``, with its ``r`` (4);
    - the second norm's output (c H), saved by ``LoRA_MLP`` as ``X`` with ``e = X @ G`` and ``g = X @ U`` (2 c I,
      fast_lora.py L86-87); ``h = swiglu(e, g)`` (swiglu.py L44) dies once the down projection has run.

    With restarting position ids (``--packing documents``) the attention takes ``inplace_rope_embedding`` instead
    (llama.py L381-383): ``Slow_RoPE_Embedding`` gathers ``cos[position_ids]`` and ``sin[position_ids]`` for Q and
    again for K and saves them (rope_embedding.py L158-174): 4 c head_dim more.
    """
    c, h = prec.c, spec.hidden_size
    gathered_rope = 4 * c * spec.head_dim if run.packing is Packing.DOCUMENTS else 0
    return (FP32 + c * h + c * (2 * spec.q_dim + 2 * spec.kv_dim) + FP32 * spec.num_heads
            + c * h + FP32 + c * h + 2 * c * spec.intermediate_size + gathered_rope)


def mlp_backward_moment(spec, run: RunConfig, prec: Precisions) -> int:
    """Bytes beside a recomputed layer's saved set (``recomputed_saved``) and its input while ``LoRA_MLP.backward``
    computes the down projection's input gradient, the layer's backward peak.

    - the layer output's gradient ``dY`` (c H): ``Unsloth_Offloaded_Gradient_Checkpointer.backward`` holds it
      while it runs ``torch.autograd.backward(output, dY)`` (unsloth-zoo gradient_checkpointing.py L165-172),
      with the recomputed ``output`` (c H, the residual sum the decoder layer returns);
    - ``DW = matmul_lora(dY, downW.t(), ...)`` (fast_lora.py L111): ``torch.matmul`` writes a new N x I tensor (c
      I), then ``out += (X @ A) @ (s * B)`` (utils.py L412-418) adds a second N x I product (c I, with its N x r
      factor: c r) before it is summed in place; the dequantized down weight (``fast_dequantize``: I x H in the
      compute dtype, utils.py L143-144) is deleted before that product exists (L413), so the larger of the two.

    After it, ``swiglu_DWf_DW_dfg_kernel`` writes h, df and de into DW, e and g in place (swiglu.py L87-89) and the
    input gradient goes into ``X``'s storage (``torch.matmul(..., out = X)``, fast_lora.py L136): nothing wider.
    """
    c, h, i = prec.c, spec.hidden_size, spec.intermediate_size
    tokens = run.micro_batch * run.seq_len
    dequantized = c * i * h if run.quantize is Quantize.Q4 else 0
    return tokens * (2 * c * h + c * i) + max(tokens * (c * i + c * run.lora.r), dequantized)


def attention_backward_moment(spec, run: RunConfig, prec: Precisions) -> int:
    """Bytes beside a recomputed layer's saved set and its input while flash-attention 2 runs its backward.

    The MLP's saved tensors are gone by then (``e``, ``g``, the second norm's ``X`` and output, its ``r``: 2 c I +
    2 c H + 4 per token, freed as their nodes finish). Alive: ``dY`` and the recomputed output (2 c H, as in
    ``mlp_backward_moment``), the residual sum's gradient (c H: autograd adds ``dY`` and the second norm's input
    gradient into a new tensor, ``dY`` being still held), the attention output's gradient from ``LoRA_W.backward``
    (c Q), and ``mha_bwd``'s buffers: dq, dk, dv (c (Q + 2 K)), the fp32 ``dq_accum`` (4 Q) and ``softmax_d``
    (4 n), and with grouped-query attention ``dk_expanded``/``dv_expanded`` at every head (2 c Q). Ignores the
    rounding of the sequence up to 128 rows in ``dq_accum`` and ``softmax_d``. Negative: below the MLP's."""
    c, h, i, q, k = prec.c, spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    expanded = 2 * c * q if k != q else 0
    alive = 3 * c * h + c * q + c * (q + 2 * k) + FP32 * q + FP32 * spec.num_heads + expanded
    freed = 2 * c * i + 2 * c * h + FP32
    return run.micro_batch * run.seq_len * (alive - freed)


def layer(spec, run: RunConfig, prec: Precisions) -> LayerActivations:
    """One decoder layer under Unsloth's checkpointing (``use_gradient_checkpointing``: ``patch_peft_model`` passes it
    to ``prepare_model_for_kbit_training``, llama.py L2274, which marks the model for offloading when it is
    "unsloth", ``_utils.py`` L536-543; llama.py L716-721, L799-811): it keeps its input only (c H per token:
    ``ctx.save_for_backward`` of the host copy, gradient_checkpointing.py L154-157, or torch's reentrant checkpoint's
    input, llama.py L820-828),
    and its backward recomputes it: the recomputed saved set + the larger of its two backward moments. The input
    copied back to the device (``--offload activations``) is added by ``memory.estimate.offloaded_activations``."""
    tokens = run.micro_batch * run.seq_len
    saved = prec.c * spec.hidden_size * tokens
    moment = max(mlp_backward_moment(spec, run, prec), attention_backward_moment(spec, run, prec))
    transient = recomputed_saved(spec, run, prec) * tokens + moment
    return LayerActivations(saved=saved, backward_transient=transient, all_layers=saved * spec.num_layers)


def rope_cache_bytes(spec, run: RunConfig, prec: Precisions) -> int:
    """Unsloth's rotary caches: ``patch_llama_rope_scaling`` gives every attention module its own rotary embedding
    (``_utils.py`` L893-919, in ``LlamaAttention.__init__``), each holding ``cos_cached`` and ``sin_cached`` of
    (rows, head_dim); built for 32,768 rows or the model's positions if fewer (llama.py L1241-1251), regrown in the input's dtype to the next multiple
    of 8,192 rows a longer sequence needs (``extend_rope_embedding``, L1309-1313, called by every layer, L373).
    Persistent: charged with the weights. Known error: the first cache is built in torch's default dtype, charged in
    the model's (transformers builds a model under its ``torch_dtype``); were it fp32 it would be twice as large."""
    rows = min(ROPE_FIRST_ROWS, spec.max_position_embeddings)
    if run.seq_len > rows:  # extend_rope_embedding: only a longer sequence regrows it
        rows = -(-run.seq_len // ROPE_STEP_ROWS) * ROPE_STEP_ROWS
    return spec.num_layers * 2 * rows * spec.head_dim * prec.c


def host_bytes(spec, run: RunConfig, prec: Precisions) -> int:
    """Host memory of Unsloth's offloaded checkpoints: every layer's input copied to the host in forward
    (``hidden_states.to("cpu", non_blocking = True)``, gradient_checkpointing.py L154), c H per token and layer."""
    if run.offload is not Offload.ACTIVATIONS:
        return 0
    return spec.num_layers * run.micro_batch * run.seq_len * spec.hidden_size * prec.c


def loss_terms(spec, run: RunConfig, prec: Precisions) -> LogitsTerms:
    """The head and loss of an Unsloth step (``CausalLM_fast_forward``, llama.py L985-1054).

    ``--loss cce``: Apple's Cut Cross-Entropy when installed (llama.py L996-1003, ``fused_linear_cross_entropy``:
    ``linear_cross_entropy(..., shift = True)``); no logits exist. Forward: ``_build_flat_valids`` (utils.py
    L22-43) takes ``nonzero`` of the shifted targets (int64, two indices a token: 16) and an int32 copy (8) before
    their int64 sum (8), the valid rows kept; then the fp32 log-sum-exp (4) and the negated dot product (4) and
    the vocabulary's fp32 logit average (4 V) (cce.py L46-77). Backward (cce_backward.py L265-295): the saved valids,
    log-sum-exp and average (12 N + 4 V) and the vocabulary order (int32, 4 V); ``de = torch.zeros_like(e)`` (c H
    per token) and ``dc = torch.zeros_like(c)``, a V x H gradient of the head allocated although the head is
    frozen (c V H), and their locks (int32: ~4 per token, ~4 V).

    ``--loss standard``: ``Fast_CrossEntropyLoss`` on the head's logits in the model's dtype (llama.py L1018-1023:
    c V per token) saves them and computes their gradient in place (cross_entropy_loss.py L330, L352-365), with an
    fp32 loss per row and a log-sum-exp per 65,536-word chunk (L279-325; charged throughout, an upper bound by 8
    bytes a token where one log-sum-exp is left); Accelerate's ``convert_outputs_to_fp32``
    (the Trainer's bf16 mixed precision) copies the returned logits to fp32 (4 V) until the loss is read; backward:
    the logits become their gradient in place and the frozen head gives the hidden states' (c H).
    """
    tokens, vocab, c = run.micro_batch * run.seq_len, spec.vocab_size, prec.c
    if run.loss is Loss.CCE:
        forward = max(24 * tokens, 16 * tokens + 4 * vocab)
        backward = 16 * tokens + 12 * vocab + c * spec.hidden_size * (tokens + vocab)
        return LogitsTerms(forward=forward, backward=backward)
    chunks = -(-vocab // 65536)
    stats = FP32 * tokens * (1 + chunks)
    return LogitsTerms(forward=(c + FP32) * tokens * vocab + stats,
                       backward=c * tokens * vocab + c * tokens * spec.hidden_size + stats)


def head_side(spec, run: RunConfig, prec: Precisions) -> int:
    """Saved tensors outside the layers that the loss' and final norm's backward free before any layer's backward:
    the final ``fast_rms_layernorm`` (llama.py L858) saves its input (the last layer's output, c H) and ``r`` (4);
    Cut Cross-Entropy saves the head's input, that norm's output (``ctx.save_for_backward(e, ...)``, cce.py L77),
    c H (the standard loss saves the logits instead: ``loss_terms``)."""
    tokens, c, h = run.micro_batch * run.seq_len, prec.c, spec.hidden_size
    kept_by_loss = c * h if run.loss is Loss.CCE else 0
    return tokens * (c * h + FP32 + kept_by_loss)


def outside(spec, run: RunConfig, prec: Precisions) -> int:
    """Every tensor saved outside the layers: ``head_side`` and the labels (int64, which the Trainer's batch holds
    through backward). No attention mask: Unsloth drops it in training (llama.py L669-671), whatever the padding."""
    return head_side(spec, run, prec) + INT64 * run.micro_batch * run.seq_len


@dataclass(frozen=True)
class UnslothTerms:
    """The terms of an Unsloth step that replace memfit's transformers recipe (``terms``)."""

    acts: LayerActivations
    outside: int
    head_side: int
    logits: LogitsTerms
    buffers: int
    """Unsloth's rotary caches (``rope_cache_bytes``), resident like the weights."""
    host: int
    """Host bytes of the offloaded checkpoints (``host_bytes``), not on the device."""


def terms(spec, run: RunConfig, prec: Precisions, stack: Stack) -> UnslothTerms | None:
    """Unsloth's terms for this step, or None where its kernels do not run (``applies``) or the loss is neither
    Cut Cross-Entropy nor the standard one (memfit's pricing then, said by ``notes``)."""
    if not applies(spec, run, prec, stack) or run.loss not in (Loss.CCE, Loss.STANDARD) or str(run.method) != "sft":
        return None
    return UnslothTerms(acts=layer(spec, run, prec), outside=outside(spec, run, prec),
                        head_side=head_side(spec, run, prec), logits=loss_terms(spec, run, prec),
                        buffers=rope_cache_bytes(spec, run, prec), host=host_bytes(spec, run, prec))


def notes(spec, run: RunConfig, prec: Precisions, stack: Stack) -> list[str]:
    """What an estimate says about Unsloth's terms: where they priced the step, or why memfit's recipe did."""
    if not stack.traits.unsloth_kernels:
        return []
    priced = terms(spec, run, prec, stack)
    if priced is None:
        return ["Unsloth's kernels are priced (memory/unsloth_layer.py) only for LoRA without dropout on q, k, v, o, "
                "gate, up and down of a bias-free Llama model in bf16/fp16, with gradient checkpointing and "
                "standard or cce loss for SFT; this run is priced as transformers' layers, an upper bound."]
    out = ["Unsloth's layer (LoRA_QKV, LoRA_W, LoRA_MLP, its RMSNorm and in-place RoPE), flash-attention 2 and its "
           "loss are priced from Unsloth's source (memory/unsloth_layer.py); not checked on a GPU."]
    if priced.host:
        out.append(f"Unsloth's offloaded checkpoints hold {priced.host / 2**30:.2f} GiB of host memory "
                   "(not counted on the device).")
    return out
