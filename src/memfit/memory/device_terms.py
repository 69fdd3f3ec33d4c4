"""Bytes a CUDA device holds that no tensor does: the CUDA context, cuBLAS's workspace and the caching
allocator's reserve (``cuda_other``). The analytic estimate and the exact trace both add these same
documented constants, so that the two differ only in tensor bytes.
"""

from __future__ import annotations

from memfit.units import MiB

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


def cuda_other(allocated_peak: int) -> int:
    """CUDA context + cuBLAS workspace + the caching allocator's reserve over what tensors hold."""
    return int(CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + ALLOCATOR_RESERVE_FRACTION * allocated_peak)


def device_bytes(breakdown) -> int:
    """Bytes the device must hold for a step's peak: what fit decisions compare with a budget.

    With the caching allocator's replay (``MemoryBreakdown.reserved``, ``--exact`` on a CUDA target): the CUDA
    context + the predicted reserved peak (``max_memory_reserved``: tensors, block rounding, cached blocks,
    cuBLAS's workspace), or the breakdown's peak where that is larger (a run may OOM on either). Without it
    (the analytic estimate): the breakdown's peak, whose ``other`` is ``cuda_other`` (context + workspace +
    ``ALLOCATOR_RESERVE_FRACTION`` of the tensors). Known error: replays of llama-2-7b LoRA (seq 512) and
    qwen2.5-0.5b AMP bf16 left 2-13% of the reserved peak unused (more than the 5% fraction for the
    latter without ``expandable_segments``); not yet checked on a GPU (``bench/gpu_allocator_check.py``).
    """
    if breakdown.reserved:
        return int(max(breakdown.peak_bytes, CUDA_CONTEXT_BYTES + breakdown.reserved))
    return int(breakdown.peak_bytes)
