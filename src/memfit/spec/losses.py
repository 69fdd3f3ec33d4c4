"""The LM head + cross-entropy implementations, one table read by estimate, trace, plan and train.

``standard`` is transformers' path: the head writes the full (B, T, V) logits, ``ForCausalLMLoss``
upcasts them to fp32 and ``log_softmax`` keeps another fp32 copy, and backward makes two more; at
Llama 3's 128,256-token vocabulary that is ~10 bytes x B x T x V, often the step's peak.

``chunked`` (pure PyTorch, any device) runs the head and the loss over chunks of tokens inside one
``torch.autograd.Function``: forward keeps only each token's log-sum-exp (fp32) and the head's input;
backward recomputes one chunk's logits at a time, turns them into the gradient of the logits
(``softmax - one_hot``), and accumulates the gradients of the hidden states and of the head's weight into
one buffer each. At most one chunk's logits exist at any time. The cost is one extra head matmul
(the recompute): ``2 * tokens * H * V`` FLOPs per micro-batch. The design follows Liger kernel's fused
linear cross-entropy (chunk size) and torchtune's chunked CE (loss per chunk), written from first principles.

``trl`` is TRL's ``SFTTrainer`` (its fused LM head, ``trl.trainer.utils.add_fused_lm_head``): estimate and
plan price it (``memory.trl_head``) for ``--from``/``--emit trl`` and memfit's Trainer callback; memfit train
does not run it.

``liger`` / ``cce`` call Liger kernel's fused linear cross-entropy or Apple's Cut Cross-Entropy when
installed on CUDA (``pip install memfit[liger]`` / ``memfit[cce]``); elsewhere they are refused.

The loss is the sum of the per-token cross-entropies divided by ``num_items`` (the step's target tokens
over all micro-batches and ranks), exactly what ``ForCausalLMLoss(..., num_items_in_batch=N)`` returns,
so the exact accumulation of ``training/step.py`` is unchanged.
"""

# Inside functions: liger-kernel and cut-cross-entropy, optional extras (--loss liger|cce).
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import inspect
import math
from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.settings.config import Loss, RunConfig
from memfit.spec.batch import model_inputs  # a packed batch goes with its position ids, not its mask

IGNORE_INDEX = -100

#: Fewest tokens per chunk: one chunk of a 256K vocabulary is then >= 128 MB of fp32 logits, and the
#: Python loop's per-chunk cost stays small next to the chunk's matmul.
MIN_CHUNK_TOKENS = 128


@dataclass(frozen=True)
class LossImpl:
    """One row of the table: what the implementation needs and what it costs."""

    name: Loss
    needs_cuda: bool
    package: str | None
    """Python module that must be importable (an optional extra), or None."""
    materialises_logits: bool
    """Whether the full (B, T, V) logits exist (standard) or only a chunk of them."""
    extra_head_matmuls: float
    """Head matmuls (``2 * tokens * H * V`` FLOPs each) on top of the standard 3 (forward + 2 backward)."""


LOSSES: dict[Loss, LossImpl] = {
    Loss.STANDARD: LossImpl(Loss.STANDARD, False, None, True, 0.0),
    Loss.CHUNKED: LossImpl(Loss.CHUNKED, False, None, False, 1.0),
    # Liger computes the gradients in forward (no recompute); CCE recomputes like chunked.
    Loss.LIGER: LossImpl(Loss.LIGER, True, "liger_kernel", False, 0.0),
    Loss.CCE: LossImpl(Loss.CCE, True, "cut_cross_entropy", False, 1.0),
    # TRL's SFTTrainer (its fused LM head, ``memory.trl_head``): recomputes each tile in backward, like chunked.
    Loss.TRL: LossImpl(Loss.TRL, False, "trl", False, 1.0),
}


def loss_impl(run: RunConfig) -> LossImpl:
    return LOSSES[run.loss]


def check_loss_runnable(run: RunConfig, cuda: bool) -> None:
    """Refuse, in one sentence, a loss this machine cannot run (Liger/CCE without CUDA or the package)."""
    impl = loss_impl(run)
    if impl.name is Loss.TRL:
        raise UserError("--loss trl prices TRL's SFTTrainer (estimate, plan --emit trl), which memfit train does not "
                        "run; use --loss chunked.")
    if impl.needs_cuda and not cuda:
        raise UserError(f"--loss {impl.name} needs a CUDA GPU (Triton kernels); use --loss chunked on this machine.")
    if impl.package and importlib.util.find_spec(impl.package) is None:
        raise UserError(f"--loss {impl.name} needs the optional package {impl.package} "
                        f"(pip install 'memfit[{impl.name}]'); or use --loss chunked.")


#: Set by ``one_chunk_per_micro_batch`` (the derivation of a recipe), read by ``chunk_tokens``.
_ONE_CHUNK = contextvars.ContextVar("memfit_one_chunk", default=False)


@contextlib.contextmanager
def one_chunk_per_micro_batch():
    """Within this context ``chunk_tokens`` is the whole micro-batch: one chunk at every size.

    For ``memory/derive.py``: its five traces must run the same operators, and the number of chunks grows
    with the tokens; with one chunk each chunk-sized tensor is ``tokens x V`` and the derived estimate
    scales those (the ``logits`` category) to the run's chunk (``DerivedRecipe.at``).
    """
    token = _ONE_CHUNK.set(True)
    try:
        yield
    finally:
        _ONE_CHUNK.reset(token)


def chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: Liger's rule, so one chunk's logits hold about as many elements as the hidden states.

    ``2 ** ceil(log2(ceil(tokens / ceil(V / H))))``, capped at ``tokens``: with V = 128,256 and H = 4,096
    (Llama 3 8B) one chunk is 1/32 of the micro-batch's tokens. Source: Liger kernel's
    ``fused_linear_cross_entropy_forward`` (``inc_factor = ceil(V / H)``). At least ``MIN_CHUNK_TOKENS``
    (memfit's floor, not Liger's): small micro-batches would otherwise loop over one-token chunks.
    ``tokens`` inside ``one_chunk_per_micro_batch``.
    """
    if _ONE_CHUNK.get():
        return tokens
    per = max(1, math.ceil(tokens / max(1, math.ceil(vocab / hidden))))
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, 2 ** math.ceil(math.log2(per)))))


# ------------------------------------------------------------------------------------------------
# the chunked function
# ------------------------------------------------------------------------------------------------
def _chunk_logits(torch, h, weight_c, bias, cdtype, softcap):
    """fp32 logits of one chunk (and tanh of the capped logits, for backward); matmul in ``cdtype``."""
    z = torch.nn.functional.linear(h.to(cdtype), weight_c, None if bias is None else bias.to(cdtype))  # (n, V) c
    z = z.float() if z.dtype != torch.float32 else z  # (n, V) fp32, as ForCausalLMLoss' logits.float()
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)  # Gemma 2's final_logit_softcapping: cap * tanh(z / cap)
    return t * softcap, t


def _logsumexp(z):
    """``log(sum(exp(z)))`` per row with its one (n, V) fp32 temporary explicit (``torch.logsumexp`` makes
    the same inside its kernel, where neither the tracer nor the CPU tracker can see it)."""
    top = z.amax(dim=-1, keepdim=True)  # (n, 1)
    return (z - top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))  # (n,)


def _make_function():
    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        """``sum_i CE(h_i W^T + b, y_i) / num_items`` over chunks; logits recomputed per chunk in backward."""

        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, inv_n, softcap, chunk, cdtype):
            # hidden (N, H), weight (V, H), targets (N,) with IGNORE_INDEX; autocast off: casts are explicit.
            with torch.autocast(hidden.device.type, enabled=False):
                weight_c = weight.to(cdtype)  # the head's half copy under autocast (same tensor otherwise)
                valid = targets != IGNORE_INDEX
                safe = targets.clamp(min=0)
                lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
                total = torch.zeros((), dtype=torch.float32, device=hidden.device)
                for s in range(0, hidden.shape[0], chunk):
                    z, _t = _chunk_logits(torch, hidden[s:s + chunk], weight_c, bias, cdtype, softcap)
                    lse[s:s + chunk] = _logsumexp(z)
                    picked = z.gather(1, safe[s:s + chunk, None]).squeeze(1)
                    total += ((lse[s:s + chunk] - picked) * valid[s:s + chunk]).sum()
                    del z, _t, picked
            ctx.save_for_backward(hidden, weight, weight_c if weight_c is not weight else None, bias, targets, lse)
            ctx.inv_n, ctx.softcap, ctx.chunk, ctx.cdtype = inv_n, softcap, chunk, cdtype
            return total * inv_n

        @staticmethod
        def backward(ctx, grad_out):
            hidden, weight, weight_c, bias, targets, lse = ctx.saved_tensors
            weight_c = weight if weight_c is None else weight_c
            need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
            cdtype, softcap, chunk = ctx.cdtype, ctx.softcap, ctx.chunk
            with torch.autocast(hidden.device.type, enabled=False):
                scale = (grad_out.float() * ctx.inv_n)
                valid = targets != IGNORE_INDEX
                safe = targets.clamp(min=0)
                grad_h = torch.empty_like(hidden) if need_h else None  # (N, H)
                grad_w = torch.zeros_like(weight) if need_w else None  # (V, H): the head's gradient
                grad_b = torch.zeros_like(bias) if need_b else None
                for s in range(0, hidden.shape[0], chunk):
                    h = hidden[s:s + chunk]
                    z, t = _chunk_logits(torch, h, weight_c, bias, cdtype, softcap)
                    g = z.sub_(lse[s:s + chunk, None]).exp_()  # softmax, in place: (n, V) fp32
                    rows = torch.arange(g.shape[0], device=g.device)
                    g[rows, safe[s:s + chunk]] -= 1.0  # softmax - one_hot
                    g.mul_((valid[s:s + chunk] * scale)[:, None])
                    if t is not None:
                        g.mul_(t.mul_(t).neg_().add_(1.0))  # d(cap tanh(z/cap))/dz = 1 - tanh^2
                    del t
                    g = g.to(cdtype)  # the logits' gradient in the head's dtype, as autocast's backward makes it
                    if need_h:
                        grad_h[s:s + chunk] = g @ weight_c
                    if need_w:
                        _accumulate(grad_w, g.t(), h.to(cdtype))
                    if need_b:
                        grad_b += g.sum(0).to(grad_b.dtype)
                    del g, z
            return grad_h, grad_w, grad_b, None, None, None, None, None

    return ChunkedLinearCrossEntropy


def _accumulate(out, a, b) -> None:
    """``out += a @ b`` in place when dtypes agree; else through one (V, H) product in ``a``'s dtype."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out += a @ b


_FUNCTION = None


def chunked_linear_cross_entropy(hidden, weight, bias, labels, num_items, *, softcap=None, chunk=None):
    """Causal-LM loss ``sum CE / num_items`` from the final hidden states, never building (B, T, V).

    Args:
        hidden: (B, T, H) final hidden states (the head's input).
        weight: (V, H) head weight (tied embeddings: the embedding matrix); bias: (V,) or None.
        labels: (B, T) unshifted labels with -100 for ignored positions (shifted here, as transformers does).
        num_items: target tokens of the whole optimizer step (tensor or int).
        softcap: Gemma 2's ``final_logit_softcapping`` (applied per chunk), or None.
        chunk: tokens per chunk; default ``chunk_tokens``.
    """

    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _make_function()
    b, t, h = hidden.shape
    # Shift as ForCausalLMLoss does: position i predicts label i+1; the last position predicts nothing.
    targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)  # (B*T,)
    flat = hidden.reshape(b * t, h)  # (N, H)
    device = hidden.device.type
    cdtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else flat.dtype
    inv_n = 1.0 / float(num_items)
    chunk = chunk or chunk_tokens(b * t, weight.shape[0], h)
    return _FUNCTION.apply(flat, weight, bias, targets, inv_n, softcap, int(chunk), cdtype)


# ------------------------------------------------------------------------------------------------
# getting the hidden states out of the model (through DDP, PEFT and autocast wrappers)
# ------------------------------------------------------------------------------------------------
def _inner(model):
    """The transformers model under DDP / Accelerate / PEFT wrappers."""
    net = model
    while hasattr(net, "module") and not hasattr(net, "get_output_embeddings"):
        net = net.module  # DDP
    net = getattr(net, "_orig_mod", net)
    return net.get_base_model() if hasattr(net, "get_base_model") else net


def head_of(model):
    """``(weight, bias, softcap)`` of the model's output head; refuses a head LoRA adapts."""

    net = _inner(model)
    head = net.get_output_embeddings()
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        raise UserError("--loss chunked cannot run with LoRA on the output head; drop lm_head from --lora-targets.")
    if not isinstance(head, torch.nn.Linear):
        raise UserError(f"--loss chunked needs a linear output head; this model's is {type(head).__name__}.")
    softcap = getattr(net.config, "final_logit_softcapping", None)
    return head.weight, head.bias, softcap


def check_model_supports(model) -> None:
    """Refuse, in one sentence, a model whose forward cannot skip its logits (no ``logits_to_keep``)."""

    net = _inner(model)
    if "logits_to_keep" not in inspect.signature(net.forward).parameters:
        raise UserError(f"--loss chunked needs a model whose forward takes logits_to_keep; "
                        f"{type(net).__name__} does not (use --loss standard).")
    head_of(model)


def final_hidden_states(model, batch: dict):
    """(B, T, H) final hidden states of one forward through all the model's wrappers, with no logits.

    The model is called as the standard path calls it (DDP's gradient sync, Accelerate's autocast,
    PEFT) but with ``logits_to_keep`` an empty index, so its head projects no position (logits
    (B, 0, V)); a forward hook on the decoder body catches its output (after the final norm). The body
    is transformers' ``get_decoder()``: the module whose output the head projects, which is not always
    ``base_model`` (OPT's and the BART family's causal LMs call ``model.decoder`` directly, so a hook on
    ``base_model`` never fired: ``KeyError: 'h'``).
    """

    net = _inner(model)
    body = net.get_decoder() if callable(getattr(net, "get_decoder", None)) else None
    body = body if body is not None else net.base_model
    caught = {}

    def hook(_module, _args, output):
        caught["h"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = body.register_forward_hook(hook)
    try:
        nothing = torch.empty(0, dtype=torch.long, device=batch["input_ids"].device)
        inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
        model(**inputs, logits_to_keep=nothing, use_cache=False)
    finally:
        handle.remove()
    return caught.pop("h")


def chunked_micro_loss(model, batch: dict, num_items, autocast=contextlib.nullcontext, loss: Loss = Loss.CHUNKED):
    """``S_i / N`` of one micro-batch with a loss that never builds the full logits.

    ``autocast``: the caller's autocast context (``accelerator.autocast``), under which the standard
    path's head ran (Accelerate wraps only ``model.forward``, and the head now runs outside it).
    """
    hidden = final_hidden_states(model, batch)  # (B, T, H)
    weight, bias, softcap = head_of(model)
    with (autocast or contextlib.nullcontext)():
        if loss is Loss.CHUNKED:
            return chunked_linear_cross_entropy(hidden, weight, bias, batch["labels"], num_items, softcap=softcap)
        return _fused_kernel_loss(loss, hidden, weight, bias, batch["labels"], num_items, softcap)


def _fused_kernel_loss(loss: Loss, hidden, weight, bias, labels, num_items, softcap):
    """Liger's fused linear CE or Cut Cross-Entropy (CUDA), summed then divided by ``num_items``.

    Not exercised by the CPU tests (both need Triton on CUDA); ``check_loss_runnable`` refuses them elsewhere.
    """

    targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)  # (B*T,)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    if loss is Loss.LIGER:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap)
        total = fn(weight, flat, targets, bias)
    else:
        from cut_cross_entropy import linear_cross_entropy

        total = linear_cross_entropy(flat, weight, targets, bias=bias, ignore_index=IGNORE_INDEX, softcap=softcap,
                                     reduction="sum")
    return total.float() / float(num_items)
