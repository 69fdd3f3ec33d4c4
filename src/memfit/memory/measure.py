"""Memory measured on the device a run uses, as a ``MemoryBreakdown(method="measured")``.

- CUDA: ``torch.cuda.max_memory_allocated`` (bytes tensors held at the peak) and
  ``max_memory_reserved`` (what the caching allocator took from the driver). The breakdown's
  ``other`` is reserved minus allocated (allocator slack); the CUDA context (~300-600 MiB) is in
  neither and is not counted.
- CPU: the process's peak resident set size (``resource.getrusage``, kilobytes on Linux, bytes on
  macOS). It includes the Python interpreter, the imported libraries and the torch runtime
  (typically 300-600 MiB before any tensor exists), so it is larger than any tensor estimate; that
  remainder is reported as ``other``.

Weights, gradients and optimizer state are counted exactly from the live tensors; what the peak
holds beyond them (activations, logits, temporaries) cannot be told apart from allocator statistics,
so it is reported as ``activations`` with a note saying so.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

from memfit.memory.breakdown import MemoryBreakdown


@dataclass
class PeakMemory:
    """Peak figures of one process (bytes; 0 where the device has no such figure)."""

    device: str
    cuda_max_allocated: int = 0
    cuda_max_reserved: int = 0
    cpu_peak_rss: int = 0

    @property
    def peak_bytes(self) -> int:
        """The number compared with the prediction: CUDA max allocated, or CPU peak RSS."""
        return self.cuda_max_allocated if self.device == "cuda" else self.cpu_peak_rss

    def to_dict(self) -> dict[str, int | str]:
        return {
            "device": self.device,
            "cuda_max_allocated": self.cuda_max_allocated,
            "cuda_max_reserved": self.cuda_max_reserved,
            "cpu_peak_rss": self.cpu_peak_rss,
            "peak_bytes": self.peak_bytes,
        }


def cpu_peak_rss() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak(device_type: str) -> None:
    """Start a fresh CUDA peak (CPU peak RSS cannot be reset: it covers the whole process)."""
    if device_type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def in_use(device_type: str) -> int:
    """Bytes in use now: CUDA memory allocated, or the process's current RSS on CPU."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.memory_allocated())
    import psutil  # an Accelerate dependency

    return int(psutil.Process().memory_info().rss)


def peak(device_type: str) -> PeakMemory:
    out = PeakMemory(device=device_type, cpu_peak_rss=cpu_peak_rss())
    if device_type == "cuda":
        import torch

        out.cuda_max_allocated = int(torch.cuda.max_memory_allocated())
        out.cuda_max_reserved = int(torch.cuda.max_memory_reserved())
    return out


def _tensor_bytes(tensors) -> int:
    """Bytes this process holds: a sharded (DTensor) parameter counts its local shard only."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return int(sum(t.numel() * t.element_size() for t in local))


def state_bytes(model, optimizer) -> tuple[int, int, int]:
    """(weights incl. buffers, gradients, optimizer state) bytes held by live tensors now."""
    import torch

    weights = _tensor_bytes(p for p in model.parameters()) + _tensor_bytes(model.buffers())
    grads = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    opt_state = getattr(optimizer, "optimizer", optimizer).state  # unwrap Accelerate's wrapper
    moments = _tensor_bytes(v for s in opt_state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return weights, grads, moments


def measured_breakdown(peak_mem: PeakMemory, model, optimizer, *, trainable_params: int) -> MemoryBreakdown:
    """The measured peak split into what live tensors explain and the rest.

    Gradients are counted as the trainable parameters' size (they are freed by ``zero_grad`` between
    steps but held at the peak of backward and the optimizer step).
    """
    weights, _, moments = state_bytes(model, optimizer)
    grads = _tensor_bytes(p for p in model.parameters() if p.requires_grad)
    states = weights + grads + moments
    notes = []
    if peak_mem.device == "cuda":
        rest = max(peak_mem.cuda_max_allocated - states, 0)
        other = max(peak_mem.cuda_max_reserved - peak_mem.cuda_max_allocated, 0)
        notes.append("activations = CUDA max allocated minus weights, gradients and optimizer state "
                     "(activations, logits and temporaries together).")
        notes.append("other = max reserved minus max allocated (allocator slack); the CUDA context is not counted.")
    else:
        rest = 0
        other = max(peak_mem.cpu_peak_rss - states, 0)
        notes.append("CPU: peak RSS of the process; other = RSS minus model states, which includes the "
                     "Python and torch runtime as well as activations.")
    return MemoryBreakdown(weights=weights, gradients=grads, optimizer=moments, activations=rest, other=other,
                           method="measured", params=sum(p.numel() for p in model.parameters()),
                           trainable_params=trainable_params, notes=notes)
