"""Each item of docs/exact.md's "What only a GPU can check", checked on a real GPU (one function per item).

An item's check runs the CUDA kernel on real CUDA tensors and counts what it saves for backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once) or, where the item is a transient, its
``max_memory_allocated`` over what is live; then it computes memfit's figure for the same call (the exact
trace's stand-in from ``memfit.memory.cuda_kernels`` run on CPU tensors, or the documented formula) and
reports both. ``ITEMS`` maps each docs item's id to its check; tests/test_bench.py holds the two lists equal.
Without a GPU (``dry_run``) only memfit's side is computed: the code runs, nothing is measured.

Run by ``bench/gpu_memory_check.py`` (``kernel_items`` in its JSON) or alone::

    python bench/cuda_kernel_items.py            # on the GPU machine
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

B, N, T, D = 2, 8, 1000, 64  # T not a multiple of 32 or 16: the memory-efficient kernel's padding shows


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (the graph is kept until counted)."""
    import torch

    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr() or id(st)] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def _qkv(device: str, dtype, kv_heads: int = N):
    import torch

    q = torch.randn(B, N, T, D, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def _sdpa_item(dtype_name: str, dropout: float, mask: bool, gqa: bool = False):
    """Saved bytes of one SDPA call on CUDA vs memfit's stand-in (flash / memory-efficient)."""
    def check(cuda: bool) -> dict[str, Any]:
        import torch

        from memfit.memory.cuda_kernels import Substitutions, cuda_kernels

        dtype = getattr(torch, dtype_name)
        kv = N // 2 if gqa else N

        def call(device: str):
            q, k, v = _qkv(device, dtype, kv)
            m = torch.ones(B, 1, T, T, dtype=torch.bool, device=device).tril() if mask else None
            return lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=m, dropout_p=dropout, is_causal=not mask, enable_gqa=gqa)

        subs = Substitutions()
        with cuda_kernels(True, subs):
            predicted = saved_bytes(call("cpu"))
        row = {"predicted": predicted, "memfit_backend": next(iter(subs), "")}
        if cuda:
            row["measured"] = saved_bytes(call("cuda"))
        return row

    return check


def _dropout_item(cuda: bool) -> dict[str, Any]:
    """nn.Dropout's saved mask: CUDA's fused kernel keeps bool (1 B an element), as the stand-in does."""
    import torch

    from memfit.memory.cuda_kernels import Substitutions, cuda_kernels

    def call(device):
        x = torch.randn(B * T, 768, device=device, dtype=torch.bfloat16, requires_grad=True)
        return lambda: torch.nn.functional.dropout(x, 0.1, True)

    with cuda_kernels(True, Substitutions()):
        row = {"predicted": saved_bytes(call("cpu"))}
    if cuda:
        row["measured"] = saved_bytes(call("cuda"))
    return row


def _gelu_new_item(cuda: bool) -> dict[str, Any]:
    """GPT-2's ``gelu_new`` under autocast bf16: not substituted (CPU autocast runs ``pow``/``tanh`` in bf16,
    CUDA's in fp32 where its op list says so); the difference is reported, not corrected."""
    import torch
    from transformers.activations import NewGELUActivation

    def call(device):
        x = torch.randn(B * T, 3072, device=device, dtype=torch.bfloat16, requires_grad=True)
        return lambda: NewGELUActivation()(x)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        row = {"predicted": saved_bytes(call("cpu"))}
    if cuda:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            row["measured"] = saved_bytes(call("cuda"))
    return row


def _flash_backward_workspace(cuda: bool) -> dict[str, Any]:
    """Flash attention's backward workspace (fp32 ``dq_accum``, ``softmax_d``; GQA's expanded dk/dv): the
    stand-in allocates only dq, dk, dv. Measured: the backward's ``max_memory_allocated`` over what was live."""
    row: dict[str, Any] = {"predicted": 0, "note": "not modelled; measured is the workspace beyond dq, dk, dv"}
    if not cuda:
        return row
    import torch

    q, k, v = _qkv("cuda", torch.bfloat16, N // 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    live = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    torch.cuda.synchronize()
    grads = sum(t.grad.nbytes for t in (q, k, v))
    row["measured"] = torch.cuda.max_memory_allocated() - live - grads
    return row


def _fused_ce_item(cuda: bool) -> dict[str, Any]:
    """``--loss liger``: traced as ``--loss chunked`` for a CUDA target; Liger's peak, measured when installed."""
    import importlib.util

    row: dict[str, Any] = {"predicted": None, "note": "needs liger_kernel on the GPU machine"}
    if not cuda or importlib.util.find_spec("liger_kernel") is None:
        return row
    import torch
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    from memfit.spec.losses import chunked_linear_cross_entropy

    h, vocab, tokens = 2048, 128256, 4096

    def peak(fn) -> int:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(vocab, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = torch.randint(0, vocab, (tokens,), device="cuda")
        torch.cuda.synchronize()
        live = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(x, w, y).backward()
        return torch.cuda.max_memory_allocated() - live

    liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    row["measured"] = peak(lambda x, w, y: liger(w, x, y))
    row["predicted"] = peak(lambda x, w, y: chunked_linear_cross_entropy(x[None], w, None, y[None], tokens))
    row["note"] = "predicted: memfit's chunked loss on the same GPU (what the trace runs in Liger's place)"
    return row


#: docs/exact.md "What only a GPU can check": item id -> check(cuda: bool) -> {"predicted", "measured"?}.
ITEMS = {
    "sdpa-flash": _sdpa_item("bfloat16", 0.0, False),
    "sdpa-flash-dropout": _sdpa_item("bfloat16", 0.1, False),
    "sdpa-flash-gqa": _sdpa_item("bfloat16", 0.0, False, gqa=True),
    "sdpa-efficient-fp32": _sdpa_item("float32", 0.0, False),
    "sdpa-efficient-dropout": _sdpa_item("float32", 0.1, False),
    "sdpa-efficient-mask": _sdpa_item("bfloat16", 0.0, True),
    "dropout-mask": _dropout_item,
    "autocast-gelu-new": _gelu_new_item,
    "sdpa-backward-workspace": _flash_backward_workspace,
    "fused-cross-entropy": _fused_ce_item,
}


def run_all(cuda: bool) -> dict[str, dict[str, Any]]:
    """Every item's row; an item that fails reports its error (one broken kernel does not end the check)."""
    rows = {}
    for name, check in ITEMS.items():
        try:
            rows[name] = check(cuda)
        except Exception as err:  # noqa: BLE001 - a result, not the end of the check
            rows[name] = {"error": f"{type(err).__name__}: {err}"}
        measured, predicted = rows[name].get("measured"), rows[name].get("predicted")
        if measured and predicted is not None:
            rows[name]["error_pct"] = round((predicted - measured) / measured * 100, 2)
        with contextlib.suppress(Exception):
            import torch

            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import torch

    json.dump(run_all(torch.cuda.is_available()), sys.stdout, indent=1)
    print()
