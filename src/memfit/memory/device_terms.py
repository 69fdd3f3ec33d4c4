"""Bytes a CUDA device holds that no tensor does: the CUDA context, cuBLAS's workspace and the caching
allocator's overhead (``cuda_other``; ``memory/fragmentation.py``). The analytic estimate and the exact trace both add these same
documented constants, so that the two differ only in tensor bytes.
"""

# Inside a function: memory.allocator_config, read only for a CUDA breakdown's reserved memory.
from __future__ import annotations

from memfit.memory import fragmentation
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


def cuda_other(tensor_peak: int, optimizer: int = 0, logits: int = 0) -> int:
    """CUDA context + cuBLAS workspace + the caching allocator's overhead over what tensors hold, for a step whose
    tensors peak at ``tensor_peak`` with ``optimizer`` bytes of optimizer state and ``logits`` bytes of logits
    (``memory.fragmentation.overhead``, fitted to allocator replays)."""
    return int(CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + fragmentation.overhead(tensor_peak, optimizer, logits))


def reserved_from_tensors(tensor_peak: int, optimizer: int = 0, logits: int = 0) -> int:
    """Predicted ``max_memory_reserved`` of a phase whose tensors peak at ``tensor_peak`` (no replay), ``optimizer``
    and ``logits`` bytes of it optimizer state and logits: the tensors, cuBLAS's workspace and the allocator's
    fitted overhead (``memory.fragmentation``)."""
    return int(tensor_peak + CUBLAS_WORKSPACE_BYTES + fragmentation.overhead(tensor_peak, optimizer, logits))


def with_fitted_reserved(breakdown) -> None:
    """Give an analytic CUDA ``breakdown`` its ``other`` term and its predicted reserved memory from the fitted
    allocator overhead (``breakdown.other`` must still be 0: its peak is the tensor peak)."""
    from memfit.memory.allocator_config import settings_from_env

    tensors = breakdown.peak_bytes
    breakdown.other = cuda_other(tensors, breakdown.optimizer, breakdown.logits)
    breakdown.reserved = reserved_from_tensors(tensors, breakdown.optimizer, breakdown.logits)
    breakdown.reserved_allocated = tensors + CUBLAS_WORKSPACE_BYTES
    breakdown.allocator_settings = f"{settings_from_env().describe()}; fitted term under torch's defaults"


def device_bytes(breakdown) -> int:
    """Bytes the device must hold for a step's peak: what fit decisions compare with a budget.

    With the caching allocator's replay (``MemoryBreakdown.reserved``, ``--exact`` on a CUDA target): the CUDA
    context + the predicted reserved peak (``max_memory_reserved``: tensors, block rounding, cached blocks,
    cuBLAS's workspace), or the breakdown's peak where that is larger (a run may OOM on either). Without it
    (the analytic estimate): the breakdown's peak, whose ``other`` is ``cuda_other`` (context + workspace +
    the fitted allocator overhead, ``memory/fragmentation.py``, with its spread). Not yet checked on a GPU
    (``bench/gpu_allocator_check.py``).
    """
    if breakdown.reserved:
        return int(max(breakdown.peak_bytes, CUDA_CONTEXT_BYTES + breakdown.reserved))
    return int(breakdown.peak_bytes)
