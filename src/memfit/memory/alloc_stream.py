"""The allocation stream of a traced step, and what the caching allocator makes of it.

``--exact`` runs the model's code on fake tensors (``memory/trace.py``). ``stream_recorder`` is a dispatch
mode beside torch's MemTracker that writes down, in order, every storage an operator creates (its bytes)
and, through a weak reference's callback, the moment Python drops its last reference to it: the
``cudaMalloc``-free order a real run hands torch's caching allocator. ``predicted_reserved`` replays it
through ``memory/allocator.py`` under the ``PYTORCH_ALLOC_CONF`` of this process.

What the stream holds, in order: the weights and buffers (each storage its own allocation, in the model's
order: how ``from_pretrained`` leaves them, loading transients aside), cuBLAS's workspaces (``WORKSPACES``,
allocated by torch through the caching allocator at the first matmul and kept), then the untracked first
step (creating the optimizer state), a peak reset (``torch.cuda.reset_peak_memory_stats``: the allocated
peak is the reported step's; reserved memory is never given back without ``empty_cache``, so its peak spans
both steps), and the reported second step. One stream (0): a single-process step runs on the default stream.

Known error: a steady state is assumed after two steps (a third would start from the second's cached
blocks; the trace runs two); allocations inside CUDA kernels that the CPU trace does not run (attention
backends' workspaces, cuBLASLt's) and resized storages (FSDP, not traced) are missing; each storage is
taken at its CPU size (identical to CUDA's for dense tensors).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from memfit.memory.allocator import AllocatorStats, CachingAllocator
from memfit.memory.allocator_config import AllocatorSettings, settings_from_env
from memfit.memory.device_terms import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES_PER_STEP

#: The cuBLAS workspace events, never freed: the forward's (the Python thread's handle) and the backward's
#: (autograd's device thread has its own handle: ``memory/device_terms.py``). The backward's is allocated at the
#: first step's first backward matmul; placed here before the first step, as its block is held from then on either
#: way (where it lands in the untracked first step changes only that step's splits).
WORKSPACES = tuple(("alloc", f"cublas-workspace-{i}", CUBLAS_WORKSPACE_BYTES, 0)
                   for i in range(CUBLAS_WORKSPACES_PER_STEP))


def stream_recorder(mode_base, storages_of, leaves):
    """A ``TorchDispatchMode`` (``mode_base``, from ``memory/trace.py``'s door) recording allocations and
    frees of storages while ``recording`` is set; ``storages_of(tensor)`` gives a tensor's untyped storages,
    ``leaves(output)`` the tensors of an operator's output (torch's pytree, through the same door)."""

    class StreamRecorder(mode_base):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[tuple] = []
            self.recording = False
            self._known: dict[int, weakref.ref] = {}
            self._keys = itertools.count()

        def _freed(self, key: int, storage_id: int) -> None:
            self._known.pop(storage_id, None)
            if self.recording:
                self.events.append(("free", key))

        def adopt(self, storage) -> None:
            """Record ``storage`` as allocated now (if not seen yet)."""
            sid = id(storage)
            ref = self._known.get(sid)
            if ref is not None and ref() is storage:
                return
            key = next(self._keys)
            self._known[sid] = weakref.ref(storage, lambda _r, key=key, sid=sid: self._freed(key, sid))
            if self.recording:
                self.events.append(("alloc", key, int(storage.nbytes()), 0))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.recording:
                for t in leaves(out):
                    if isinstance(t, torch.Tensor):
                        for st in storages_of(t):
                            self.adopt(st)
            return out

    return StreamRecorder()


@dataclass(frozen=True)
class Replay:
    """What replaying a stream through ``CachingAllocator`` predicts (``replay``)."""

    stats: AllocatorStats
    settings: AllocatorSettings

    @property
    def fragmentation_share(self) -> float:
        """Share of the reserved peak that no block handed out covers at the allocated peak:
        ``(max_memory_reserved - max_memory_allocated) / max_memory_reserved``."""
        s = self.stats
        return (s.peak_reserved - s.peak_allocated) / s.peak_reserved if s.peak_reserved else 0.0


def replay(events, settings: AllocatorSettings | None = None, capacity: int | None = None) -> Replay:
    """Run ``events`` through a fresh ``CachingAllocator``.

    Each event is ``("alloc", key, nbytes, stream)``, ``("free", key)``, ``("empty_cache",)`` or
    ``("reset_peaks",)`` (``torch.cuda.reset_peak_memory_stats``); zero-byte allocations take no block, as in
    torch (``CUDACachingAllocator::allocate`` calls ``malloc`` only for a size above 0). A free of a key never
    allocated (or of size 0) is ignored. Raises ``AllocatorOutOfMemory`` where torch would.
    """
    allocator = CachingAllocator(settings, capacity)
    live: dict = {}
    for event in events:
        kind = event[0]
        if kind == "alloc":
            if event[2] > 0:
                live[event[1]] = allocator.malloc(event[2], event[3])
        elif kind == "free":
            block = live.pop(event[1], None)
            if block is not None:
                allocator.free(block)
        elif kind == "empty_cache":
            allocator.empty_cache()
        elif kind == "reset_peaks":
            allocator.reset_peaks()
        else:
            raise ValueError(f"unknown allocator event {kind!r}")
    return Replay(allocator.stats(), allocator.settings)


def predicted_reserved(events, settings: AllocatorSettings | None = None) -> Replay | None:
    """The replay of ``events`` under ``settings`` (default: this process' ``PYTORCH_ALLOC_CONF``); None for
    a backend memfit does not model (``cudaMallocAsync``)."""
    settings = settings_from_env() if settings is None else settings
    return replay(events, settings) if settings.modelled else None
