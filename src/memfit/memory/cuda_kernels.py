"""CUDA's kernels, as far as memory goes, for an exact trace whose target is CUDA.

The trace runs CPU kernels on fake tensors (a CPU-only torch cannot fake CUDA: DESIGN.md). Where a CUDA
kernel saves different tensors for backward than the CPU kernel the same call runs here, ``cuda_kernels``
(patched into ``torch.nn.functional`` while the trace runs with ``device="cuda"``) replaces the call by a
stand-in that allocates and saves what the CUDA kernel does, from the kernels' documented saved tensors:

- ``scaled_dot_product_attention``: CUDA runs flash attention (fp16/bf16, no mask, head_dim <= 256) or the
  memory-efficient kernel (fp32, or with a mask), with or without dropout. Both save q, k, v, the output
  (allocated (B, T, n, d) and returned transposed, so the ``transpose(1, 2).reshape`` after it is a view)
  and the fp32 log-sum-exp, (B, n, T) for flash, rows padded to a multiple of 32 for the memory-efficient
  kernel; with dropout the Philox seed and offset (the mask is regenerated in backward, never stored); the
  memory-efficient kernel also saves the additive mask (a boolean mask converted to the query dtype, its last
  dimension padded to a multiple of 16). No T x T probabilities. The CPU runs flash-for-CPU without dropout
  (the same saved set, log-sum-exp unpadded) but its math path with dropout: three (B, n, T, T) fp32 matrices
  per layer. Sources: torch ``tools/autograd/derivatives.yaml`` (``_scaled_dot_product_flash_attention``,
  ``_scaled_dot_product_efficient_attention``: what backward reads), ``aten/src/ATen/native/transformers/
  cuda/sdp_utils.cpp`` (backend choice: ``can_use_flash_attention``, ``can_use_mem_efficient_attention``),
  ``attention.cpp`` (``convert_boolean_attn_mask``, the mask's padding to 16) and the meta registrations of
  both ops (output layout, log-sum-exp shapes).
- ``nn.functional.dropout`` in training: CUDA's fused ``native_dropout`` saves a bool mask (1 byte an
  element); the CPU's ``dropout`` multiplies by a noise tensor in the input dtype and saves that. The stand-in
  calls ``torch.native_dropout``, whose CPU kernel also returns and saves a bool mask.

The attention stand-in only allocates (its outputs hold no values): it is for fake tensors, where nothing
has values. Known error: the kernels' backward workspaces (flash's fp32 ``dq_accum`` and ``softmax_d``,
GQA's expanded dk/dv before their sum) are not allocated, nor is cuDNN attention (preferred over flash on
some Hopper/Blackwell builds; it saves the same output + fp32 statistics) told apart. Every item is listed
in docs/exact.md ("What only a GPU can check") and checked by bench/gpu_memory_check.py.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import torch

#: Rows of the memory-efficient kernel's log-sum-exp are padded to a multiple of this
#: (``_scaled_dot_product_efficient_attention``'s meta registration: ``ceil_div(T, 32) * 32``).
EFFICIENT_LSE_ROWS = 32
#: The memory-efficient kernel's additive mask has its last dimension padded to a multiple of this
#: (``attention.cpp``'s ``preprocess_mask``: ``mem_eff_alignment``).
EFFICIENT_MASK_ALIGN = 16
#: Flash attention's largest head dimension (``check_head_dim_size_flash``).
FLASH_MAX_HEAD_DIM = 256


def sdpa_backend(dtype_bytes: int, has_mask: bool, head_dim: int) -> str:
    """The SDPA kernel CUDA (sm80 and later) runs for a training step: ``"flash"`` or ``"efficient"``.

    Flash needs fp16/bf16 inputs, no attention mask and head_dim <= 256; otherwise the memory-efficient
    kernel runs (fp32, masks and dropout included). Both take GQA's unrepeated k/v. The math path (T x T
    saved) is left to older GPUs (sm < 80 with bf16), which memfit does not model.
    """
    if dtype_bytes == 2 and not has_mask and head_dim <= FLASH_MAX_HEAD_DIM:
        return "flash"
    return "efficient"


def _sdpa_function():
    class CudaSdpa(torch.autograd.Function):
        """Allocation-only stand-in for CUDA's flash / memory-efficient SDPA (module docstring)."""

        @staticmethod
        def forward(ctx, q, k, v, mask, backend: str, dropout: bool):
            b, n, t, _ = q.shape
            out = q.new_empty((b, t, n, v.shape[-1])).transpose(1, 2)  # (B, n, T, d), stored (B, T, n, d)
            rows = t if backend == "flash" else -(-t // EFFICIENT_LSE_ROWS) * EFFICIENT_LSE_ROWS
            lse = q.new_empty((b, n, rows), dtype=torch.float32)
            saved = [q, k, v, out, lse]
            if dropout:
                saved.append(q.new_empty((2,), dtype=torch.int64))  # Philox seed and offset
            if mask is not None and backend == "efficient":
                saved.append(_additive_mask(mask, q.dtype))
            ctx.save_for_backward(*saved)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors[:3]
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None

    return CudaSdpa


def _additive_mask(mask, dtype):
    """The mask the memory-efficient kernel keeps: additive in the query dtype, last dim padded to 16."""

    shape = list(mask.shape)
    pad = -shape[-1] % EFFICIENT_MASK_ALIGN
    if mask.dtype != torch.bool and not pad:
        return mask
    full = mask.new_empty((*shape[:-1], shape[-1] + pad), dtype=dtype if mask.dtype == torch.bool else mask.dtype)
    return full[..., : shape[-1]]


class Substitutions(Counter):
    """How many calls of each kind the trace ran as CUDA would (``notes()`` words them)."""

    def new_step(self) -> None:
        """Forget the calls counted so far (the loss' substitution is per run, not per call)."""
        for key in [k for k in self if not k.startswith("loss:")]:
            del self[key]

    def notes(self) -> list[str]:
        out = []
        for key, count in sorted(self.items()):
            kind, _, detail = key.partition(":")
            if kind == "sdpa":
                out.append(f"CUDA kernel substituted: {count} SDPA call(s) priced as CUDA's {detail} (saved: q, "
                           "k, v, output, fp32 log-sum-exp; no T x T probabilities), not the CPU's kernel.")
            elif kind == "dropout":
                out.append(f"CUDA kernel substituted: {count} dropout call(s) priced as CUDA's fused "
                           "native_dropout (a bool mask saved), not the CPU's mask in the input dtype.")
            else:
                out.append(f"CUDA kernel substituted: {detail}.")
        return out


@contextlib.contextmanager
def cuda_kernels(enabled: bool, substituted: Substitutions):
    """Within this context (when ``enabled``) SDPA and dropout calls run as CUDA runs them, counted in
    ``substituted``; a no-op for a CPU target.

    ``torch.nn.functional``'s two functions are patched (transformers and ``nn.Dropout`` look them up at
    call time), not intercepted by a ``TorchFunctionMode``: a mode is switched off inside its own handler,
    and ``Tensor.backward`` goes through it, so checkpointing's recompute in backward would run the CPU's
    kernels and find other saved tensors than its forward did.
    """
    if not enabled:
        yield
        return

    functional = torch.nn.functional
    dropout = functional.dropout
    function = _sdpa_function()
    with mock.patch.object(functional, "scaled_dot_product_attention",
                           lambda *a, **k: _attention(function, substituted, *a, **k)), \
            mock.patch.object(functional, "dropout", lambda *a, **k: _dropout(dropout, substituted, *a, **k)):
        yield


def _attention(function, substituted: Substitutions, query, key, value, attn_mask=None, dropout_p=0.0,
               is_causal=False, scale=None, enable_gqa=False):
    """SDPA as CUDA runs it: autocast's cast of fp32 inputs (SDPA is on CUDA autocast's half list), then the
    backend's saved set."""

    if torch.is_autocast_enabled("cpu") and query.dtype == torch.float32:
        half = torch.get_autocast_dtype("cpu")
        query, key, value = (x.to(half) for x in (query, key, value))
    backend = sdpa_backend(query.element_size(), attn_mask is not None, query.shape[-1])
    name = {"flash": "flash attention", "efficient": "memory-efficient attention"}[backend]
    substituted[f"sdpa:{name}{' with dropout' if dropout_p > 0 else ''}"] += 1
    with torch.autocast("cpu", enabled=False):
        return function.apply(query, key, value, attn_mask, backend, dropout_p > 0)


def _dropout(func, substituted: Substitutions, input, p=0.5, training=True, inplace=False):
    """``F.dropout`` in training as CUDA's fused kernel: ``native_dropout`` (bool mask saved)."""

    if not training or p <= 0 or inplace:
        return func(input, p, training, inplace)
    substituted["dropout:"] += 1
    return torch.native_dropout(input, p, True)[0]
