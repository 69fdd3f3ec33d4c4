"""Memory measured on the device a run uses, as a ``MemoryBreakdown(method="measured")``.

- CUDA: ``torch.cuda.max_memory_allocated`` (bytes tensors held at the peak) and
  ``max_memory_reserved`` (what the caching allocator took from the driver). The breakdown's
  ``other`` is reserved minus allocated (allocator slack); the CUDA context (~300-600 MiB) is in
  neither and is not counted.
- CPU: the tensor peak of one representative training step (the second this process runs, when
  the optimizer state exists), counted on the real tensors by ``StepPeak``: every storage live when
  the step starts (weights, buffers, optimizer state, the micro-batches) plus every storage an
  operator creates during the step, minus each one when it is freed; the maximum is the tensor peak,
  the quantity the estimate predicts (tensors vs tensors). Only that one step runs under the counter
  (a Python call per operator; the other steps run at full speed). It sees every tensor created by a
  torch operator, including autograd's and the optimizer's; it does not see memory torch's kernels
  take outside tensors (oneDNN scratch buffers) or allocator overhead.
  Next to it, on its own line: the process's peak resident set size (``resource.getrusage``, KiB on
  Linux, bytes on macOS), which also holds the Python interpreter, the imported libraries and the
  torch runtime (typically 300-600 MiB before any tensor exists).

Weights, gradients and optimizer state are counted exactly from the live tensors; what the peak
holds beyond them (activations, logits, temporaries) cannot be told apart from allocator statistics,
so it is reported as ``activations`` with a note saying so.
"""

# Inside a function, in a try: torch._inductor.codecache, a private module (a torch without it: nothing to wrap).
from __future__ import annotations

import contextlib
import functools
import resource
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import psutil  # an Accelerate dependency
import torch
from torch.utils.weak import WeakIdKeyDictionary

from memfit.integrations.quant_support import quant_state_tensors
from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.trace import dispatch_mode_base


@dataclass
class PeakMemory:
    """Peak figures of one process (bytes; 0 where the device has no such figure)."""

    device: str
    cuda_max_allocated: int = 0
    cuda_max_reserved: int = 0
    cpu_peak_rss: int = 0
    cpu_tensor_peak: int = 0
    """CPU: tensor peak of the measured step (``StepPeak``); 0 when not measured."""
    cpu_tensor_peak_step: int = 0
    """Which step of the run that was (1-based)."""
    cpu_tensor_peak_rows: tuple[int, int] | None = None
    """(rows, tokens) of that step's largest micro-batch: rows are padded to the micro-batch's longest, not to
    ``--seq-len``, so a step of short documents holds less than the full-length step the plan is sized for;
    the summary compares the measurement with the prediction at this shape too (``StepPeak.rows``)."""

    @property
    def peak_bytes(self) -> int:
        """The number compared with the prediction: CUDA max allocated, or the CPU tensor peak (0: none)."""
        return self.cuda_max_allocated if self.device == "cuda" else self.cpu_tensor_peak

    @property
    def compared(self) -> str:
        """What ``peak_bytes`` is, in words (``run.json``'s ``compared``)."""
        if self.device == "cuda":
            return "CUDA max allocated vs predicted peak (both tensor bytes)"
        if self.cpu_tensor_peak:
            return (f"CPU tensor peak of step {self.cpu_tensor_peak_step} (live tensors, counted) vs predicted "
                    "peak (tensors); cpu_peak_rss is the whole process")
        return "nothing measured on tensors (cpu_peak_rss is the whole process, not comparable)"

    def to_dict(self) -> dict[str, int | str]:
        return {
            "device": self.device,
            "cuda_max_allocated": self.cuda_max_allocated,
            "cuda_max_reserved": self.cuda_max_reserved,
            "cpu_peak_rss": self.cpu_peak_rss,
            "cpu_tensor_peak": self.cpu_tensor_peak,
            "cpu_tensor_peak_step": self.cpu_tensor_peak_step,
            "cpu_tensor_peak_rows": list(self.cpu_tensor_peak_rows) if self.cpu_tensor_peak_rows else None,
            "peak_bytes": self.peak_bytes,
        }


def cpu_peak_rss() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak(device_type: str) -> None:
    """Start a fresh CUDA peak (CPU peak RSS cannot be reset: it covers the whole process)."""
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def in_use(device_type: str) -> int:
    """Bytes in use now: CUDA memory allocated, or the process's current RSS on CPU."""
    if device_type == "cuda":
        return int(torch.cuda.memory_allocated())
    return int(psutil.Process().memory_info().rss)


def peak(device_type: str, step_peak: StepPeak | None = None) -> PeakMemory:
    out = PeakMemory(device=device_type, cpu_peak_rss=cpu_peak_rss())
    if step_peak is not None and step_peak.peak_bytes:
        out.cpu_tensor_peak, out.cpu_tensor_peak_step = step_peak.peak_bytes, step_peak.measured_step
        out.cpu_tensor_peak_rows = step_peak.rows
    if device_type == "cuda":
        out.cuda_max_allocated = int(torch.cuda.max_memory_allocated())
        out.cuda_max_reserved = int(torch.cuda.max_memory_reserved())
    return out


def _tensor_bytes(tensors) -> int:
    """Bytes this process holds: a sharded (DTensor) parameter counts its local shard only."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return int(sum(t.numel() * t.element_size() for t in local))


def state_bytes(model, optimizer) -> tuple[int, int, int]:
    """(weights incl. buffers, gradients, optimizer state) bytes held by live tensors now."""

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
    elif peak_mem.cpu_tensor_peak:
        rest = max(peak_mem.cpu_tensor_peak - states, 0)
        other = 0
        notes.append(f"CPU: tensor peak of step {peak_mem.cpu_tensor_peak_step}, counted on live tensors; "
                     "activations = that peak minus weights, gradients and optimizer state.")
        notes.append(f"The process' peak RSS ({peak_mem.cpu_peak_rss:,} B) also holds the Python/torch runtime; "
                     "it is not part of this breakdown.")
    else:
        rest = 0
        other = max(peak_mem.cpu_peak_rss - states, 0)
        notes.append("CPU: peak RSS of the process; other = RSS minus model states, which includes the "
                     "Python and torch runtime as well as activations.")
    return MemoryBreakdown(weights=weights, gradients=grads, optimizer=moments, activations=rest, other=other,
                           method="measured", params=sum(p.numel() for p in model.parameters()),
                           trainable_params=trainable_params, notes=notes)


# ------------------------------------------------------------------------------------------------
# CPU: the tensor peak of one real training step
# ------------------------------------------------------------------------------------------------
def _tensors(obj) -> Iterator:
    """The tensors in an operator's output (a tensor, or tuples/lists/dicts of them)."""

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _LiveBytes:
    """Bytes of distinct live storages: added when first seen, removed by a weakref callback when freed,
    and adjusted when a storage is resized in place.

    torch keeps one Python object per storage alive as long as the storage (PyObject preservation),
    so a weak reference to ``tensor.untyped_storage()`` dies exactly when the memory is released; views
    share their base's storage and are counted once. The same technique as torch's MemTracker, and like
    it the counter also follows ``UntypedStorage.resize_`` (``resized``; no dispatch mode sees it): FSDP2
    frees a unit's gathered parameters by resizing their storages to 0 and gathers them again by resizing
    them back (``_fsdp_param.free_storage``/``alloc_storage``), so a counter that only watched storages die
    would hold every layer's gathered parameters from their first use on (measured on the tiny preset,
    FSDP on 2 ranks: an evaluation counted +25 MB, all 8 layers gathered, against 2 layers really).
    """

    def __init__(self) -> None:
        self.seen = WeakIdKeyDictionary()  # storage -> (its counted bytes in a 1-list, weakref)
        self.current = 0
        self.peak = 0

    def add(self, tensor) -> None:
        if hasattr(tensor, "to_local"):  # a sharded (DTensor) parameter: this rank holds its local shard
            tensor = tensor.to_local()
        if tensor.device.type == "meta":
            return
        self._track(tensor.untyped_storage())

    def _track(self, storage) -> None:
        if storage in self.seen:
            return
        counted = [storage.nbytes()]
        self.seen[storage] = (counted, weakref.ref(storage, lambda _ref, c=counted: self._freed(c)))
        self._grow(counted[0])

    def resized(self, storage) -> None:
        """After ``storage.resize_``: count its new size (a storage not seen before is counted from now)."""
        if storage.device.type == "meta":
            return
        entry = self.seen.get(storage)
        if entry is None:
            self._track(storage)
            return
        counted = entry[0]
        delta, counted[0] = storage.nbytes() - counted[0], storage.nbytes()
        self._grow(delta)

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _freed(self, counted: list[int]) -> None:
        self.current -= counted[0]


@contextlib.contextmanager
def _following_resizes(live: _LiveBytes) -> Iterator[None]:
    """Route ``torch.UntypedStorage.resize_`` through ``live.resized`` while the block runs (as torch's
    MemTracker does: the dispatch mode does not see storage resizes)."""

    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage, size):
        out = original(storage, size)
        live.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def _following_registrations(live: _LiveBytes) -> Iterator[None]:
    """Count every parameter or buffer a module registers while the block runs (torch's global registration hooks,
    ``torch.nn.modules.module.register_module_parameter_registration_hook``).

    A checkpoint's tensors reach a model without an operator: safetensors maps the file and builds each tensor over
    the mapping outside the dispatcher (``safe_open(..., backend="mmap").get_slice(k)[...]``, which transformers
    5.25's ``core_model_loading._materialize_copy`` L1464 calls; the ``.to(device, dtype)`` after it is a no-op when
    the dtype already matches), and ``set_param_for_module`` (L1614) ``setattr``s it as a ``Parameter``. The
    dispatch mode never sees such a storage; here it is counted from the moment it becomes part of the model (it
    was created just before: the known error is that moment). A storage already counted is not counted again.
    The hooks are process-wide but the dispatch mode is per thread, so only this thread's registrations count, as
    its operators do: a model another thread builds meanwhile (a web request's trace, a test beside this one) is
    not this block's work. transformers registers a loaded tensor on the thread that called ``from_pretrained``
    (``set_param_for_module`` L1996, after its thread pool materialized it).
    """
    from torch.nn.modules.module import register_module_buffer_registration_hook as on_buffer
    from torch.nn.modules.module import register_module_parameter_registration_hook as on_parameter

    owner = threading.get_ident()

    def registered(_module, _name, tensor):
        if tensor is not None and threading.get_ident() == owner:
            live.add(tensor)

    handles = [on_parameter(registered), on_buffer(registered)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _counting_mode(live: _LiveBytes, compiled: bool = False):
    """A ``TorchDispatchMode`` that adds every operator's outputs to ``live`` (None without the API).

    ``compiled``: the mode says it ignores compile internals; otherwise Dynamo, finding a dispatch mode on the
    stack, runs a compiled model eagerly (torch 2.13 ``convert_frame``), and an eager step would be counted.
    """

    base = dispatch_mode_base()
    if base is None:
        return None

    class _Counting(base):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return compiled

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in _tensors(out):
                live.add(tensor)
            return out

    return _Counting()


class StepPeak:
    """Counts the tensor peak of one representative step of a CPU run (``watch`` around every step).

    The third step this process runs is measured: the first creates the optimizer state and runs
    one-off work, and the rollback snapshot (``training/rollback.py``) copies that state for the first
    time in the second step's optimizer phase, so only from the third step on does a step start with
    everything it holds for the rest of the run (measured on the demo: step 2 counted 194.1 MiB, 49.5 MiB
    of snapshot short of the steady state). Shorter runs measure their last step. On CUDA nothing is
    counted (the allocator's ``max_memory_allocated`` is exact and free).
    """

    def __init__(self, device_type: str, steps_to_run: int, compiled: bool = False) -> None:
        self.enabled = device_type == "cpu" and steps_to_run > 0
        self.compiled = compiled
        """``--compile``: also count the buffers inductor's generated code allocates (``counted_compiled``)."""
        self.target = min(steps_to_run, 3) if steps_to_run > 0 else 1
        self.calls = 0
        self.peak_bytes = 0
        self.measured_step = 0
        self.rows: tuple[int, int] | None = None
        """(rows, tokens) of the measured step's largest micro-batch (``PeakMemory.cpu_tensor_peak_rows``)."""

    @contextlib.contextmanager
    def watch(self, step: int, model, optimizer, batches: list[dict], resident=()) -> Iterator[None]:
        """Around one training step (``step``: the 1-based number of the step about to run); ``resident``:
        other tensors alive when it starts (the rollback snapshot's host buffers: on CPU, device memory)."""
        self.calls += 1
        if not self.enabled or self.calls != self.target:
            yield
            return
        held = resident_tensors(model, optimizer, [*(b for batch in batches for b in batch.values()), *resident])
        with (counted_compiled if self.compiled else counted)(held) as live:
            yield
        self.peak_bytes, self.measured_step = live.peak, step
        self.rows = largest_rows(batches)


def largest_rows(batches: list[dict]) -> tuple[int, int] | None:
    """(rows, tokens) of the micro-batch with the most token slots: rows of ``input_ids`` (a preference batch's
    pairs: its rejected side, ``rejected_input_ids``, is as many rows), tokens the longest of its id tensors."""
    shapes = [(int(batch["input_ids"].shape[0]),
               max(int(v.shape[-1]) for k, v in batch.items() if k.endswith("input_ids")))
              for batch in batches if "input_ids" in batch]
    return max(shapes, key=lambda shape: shape[0] * shape[1]) if shapes else None


@contextlib.contextmanager
def counted(resident=(), compiled: bool = False) -> Iterator[_LiveBytes]:
    """Count the tensor peak of a block of real work (evaluation, a save, generation): ``resident`` (any
    tensors, nested in lists/tuples/dicts) counts as held at the start, plus every storage an operator
    creates inside or a module registers as a parameter or buffer (``_following_registrations``: a checkpoint's
    memory-mapped tensors), minus each one when it is freed. The yielded counter's ``.peak`` is the block's peak
    (0 where torch lacks the dispatch-mode API). The same counter as ``StepPeak`` (memfit's tracker on
    real tensors); like it, it does not see kernels' scratch memory or allocator overhead.
    """
    live = _LiveBytes()
    mode = _counting_mode(live, compiled)
    for tensor in _tensors(resident):
        live.add(tensor)
    if mode is None:
        yield live
        return
    with _following_resizes(live), _following_registrations(live), mode:
        yield live


@contextlib.contextmanager
def counted_compiled(resident=()) -> Iterator[_LiveBytes]:
    """``counted`` for compiled code (``--compile``), which also sees the buffers inductor allocates.

    The Python wrapper inductor generates for a compiled graph allocates its buffers with
    ``empty_strided_cpu`` (``torch._C._dynamo.guards._empty_strided_cpu``, bound into each generated module's
    globals when it is loaded), below the dispatcher: ``counted``'s dispatch mode never sees them. While the
    block runs, every loaded generated module (``torch._inductor.codecache.PyCodeCache.modules``) gets a
    wrapper in that name that adds the new buffer to the same counter; its frees are seen as for any storage.
    The step measured is the third, long after compilation, so every module is loaded by then.
    """
    with counted(resident, compiled=True) as live:
        patched = _wrap_inductor_allocations(live)
        try:
            yield live
        finally:
            for module, original in patched:
                module.empty_strided_cpu = original


def _wrap_inductor_allocations(live: _LiveBytes) -> list:
    """Wrap ``empty_strided_cpu`` in every loaded inductor module; return (module, original) to restore."""
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:
        return []
    patched = []
    for module in list(getattr(PyCodeCache, "modules", [])):
        original = getattr(module, "empty_strided_cpu", None)
        if original is None:
            continue

        def empty_strided_cpu(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            live.add(out)
            return out

        module.empty_strided_cpu = empty_strided_cpu
        patched.append((module, original))
    return patched


def resident_tensors(model, optimizer, extra=()) -> list:
    """What a training process holds between steps: parameters (and any gradients left), buffers, the
    quantization state of a bitsandbytes base, the optimizer's state tensors (a ZeRO optimizer's flat
    partitions and buffers), and ``extra`` (e.g. the rollback snapshot's host buffers)."""

    inner = getattr(optimizer, "optimizer", optimizer)
    out = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    # a ZeRO-3 parameter's own partition (a frozen one's lies outside the optimizer's flat groups: a LoRA base)
    out += [p.ds_tensor for p in model.parameters() if getattr(p, "ds_tensor", None) is not None]
    out += [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]

    out += quant_state_tensors(model)  # bitsandbytes' quantization state lives beside the packed weights
    if type(inner).__module__.startswith("deepspeed."):  # a ZeRO optimizer's flat partitions and buffers
        out += _zero_held(inner)
    return out + list(extra)


def _zero_held(optimizer) -> list:
    """Tensors a ZeRO optimizer holds between steps that are neither model parameters nor its optimizer
    state: the flat fp32 partitions its torch optimizer steps (``param_groups``) and, as attributes of the
    ZeRO optimizer and of its DeepSpeed-owned helpers (``IPGBucketZ3``, the parameter coordinator), its
    flat parameter and gradient buffers and reduce buckets. For ``StepPeak``: on CPU they are
    device memory.

    ``optimizer`` is the ZeRO optimizer itself or anything wrapping it (Accelerate's
    ``DeepSpeedOptimizerWrapper``). Its own attributes are walked, not only its inner torch optimizer's:
    ZeRO-3 keeps its bit16 partitions (``fp16_partitioned_groups_flat``), its fp32 master partitions
    (``fp32_partitioned_groups_flat``), its gradient partitions (``grad_partitions_flat_buffer``) and the
    reduce bucket there, 37.4 MiB per rank on the tiny preset over 2 ranks, which an earlier walk of the
    torch optimizer alone left out of the measured peak.
    """

    zero = optimizer
    while not type(zero).__module__.startswith("deepspeed.") and hasattr(zero, "optimizer"):
        zero = zero.optimizer  # Accelerate's wrapper -> the ZeRO optimizer
    inner = getattr(zero, "optimizer", zero)  # the torch optimizer stepping the flat partitions
    found: list = [p for g in getattr(inner, "param_groups", []) for p in g["params"]]

    def walk(value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth and isinstance(value, (list, tuple)):
            for item in value:
                walk(item, depth - 1)
        elif depth and isinstance(value, dict):
            for item in value.values():
                walk(item, depth - 1)
        elif depth and type(value).__module__.startswith("deepspeed.") and hasattr(value, "__dict__"):
            for item in vars(value).values():  # a DeepSpeed helper object (buckets, coordinator)
                walk(item, depth - 1)

    for value in vars(zero).values():
        walk(value, 3)
    return found
