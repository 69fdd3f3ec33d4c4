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

#: One cuBLAS workspace: torch allocates it through the caching allocator (so ``max_memory_allocated`` counts it,
#: though no tensor holds it) at a handle's first matmul on a stream and keeps it
#: (``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``setWorkspaceForHandle``, the map keyed by (handle, stream);
#: ``parseChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG``'s default, 4096 KiB x 8 = 32 MiB on Hopper and
#: 4096 KiB x 2 + 16 KiB x 8 = 8.1 MiB on earlier GPUs). memfit does not know the GPU an estimate is for, so it
#: prices Hopper's: over by 24 MiB a workspace elsewhere, the safe side.
CUBLAS_WORKSPACE_BYTES = 32 * MiB

#: Workspaces a training step holds: cuBLAS handles are per thread (``getCurrentCUDABlasHandle``'s
#: ``thread_local`` PoolWindow), and autograd runs a CUDA backward on its own device thread
#: (``torch/csrc/autograd/engine.cpp`` ``start_device_threads``), so the forward's matmuls (the Python thread) and
#: the backward's (the device thread) each get a workspace on the default stream. cuBLASLt's 1 MiB workspace per
#: handle and stream (``CUBLASLT_WORKSPACE_SIZE``; used for a matmul with a bias) is left out.
CUBLAS_WORKSPACES_PER_STEP = 2

#: What the step's cuBLAS workspaces hold in all.
CUBLAS_STEP_BYTES = CUBLAS_WORKSPACES_PER_STEP * CUBLAS_WORKSPACE_BYTES


def cuda_other(tensor_peak: int, optimizer: int = 0, logits: int = 0) -> int:
    """CUDA context + the step's cuBLAS workspaces + the caching allocator's overhead over what tensors hold, for a step whose
    tensors peak at ``tensor_peak`` with ``optimizer`` bytes of optimizer state and ``logits`` bytes of logits
    (``memory.fragmentation.overhead``, fitted to allocator replays)."""
    return int(CUDA_CONTEXT_BYTES + CUBLAS_STEP_BYTES + fragmentation.overhead(tensor_peak, optimizer, logits))


def reserved_from_tensors(tensor_peak: int, optimizer: int = 0, logits: int = 0) -> int:
    """Predicted ``max_memory_reserved`` of a phase whose tensors peak at ``tensor_peak`` (no replay), ``optimizer``
    and ``logits`` bytes of it optimizer state and logits: the tensors, the step's cuBLAS workspaces and the allocator's
    fitted overhead (``memory.fragmentation``)."""
    return int(tensor_peak + CUBLAS_STEP_BYTES + fragmentation.overhead(tensor_peak, optimizer, logits))


def with_fitted_reserved(breakdown) -> None:
    """Give an analytic CUDA ``breakdown`` its ``other`` term and its predicted reserved memory from the fitted
    allocator overhead (``breakdown.other`` must still be 0: its peak is the tensor peak)."""
    from memfit.memory.allocator_config import settings_from_env

    tensors = breakdown.peak_bytes
    breakdown.other = cuda_other(tensors, breakdown.optimizer, breakdown.logits)
    breakdown.reserved = reserved_from_tensors(tensors, breakdown.optimizer, breakdown.logits)
    breakdown.reserved_allocated = tensors + CUBLAS_STEP_BYTES
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
