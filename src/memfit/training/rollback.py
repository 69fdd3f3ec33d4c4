"""Undo a training step that ran out of memory, so that redoing it applies its update exactly once.

What a step changes, and when an out-of-memory error can leave it half done:

- **forward, backward, clipping** change only gradients (clipping scales them in place; fp16's loss
  scaler unscales them in place and marks the optimizer "unscaled"). Parameters, optimizer state and
  the learning-rate schedule are untouched, so undoing is: drop the gradients, reset the scaler's
  per-optimizer bookkeeping and Accelerate's micro-batch counter (``undo_step``).
- **the optimizer step** mutates before it allocates. torch's foreach AdamW (``_multi_tensor_adam``)
  adds 1 to every step count, decays every parameter and updates both moments in place, and only then
  allocates ``_foreach_sqrt(exp_avg_sq)``, one temporary per parameter of the group: the allocation
  that runs out. The single-tensor path, Adafactor and bitsandbytes loop over parameters, updating
  some before allocating for the next. None of these updates can be inverted exactly in floating
  point, so ``OptimizerSnapshot`` copies what the step mutates (the trainable parameters and their
  state tensors, and which parameters had state at all) just before ``optimizer.step()`` and puts it
  back if the step raises.

**Cost of the snapshot** (paid every step, since an OOM cannot be foreseen): host memory for one
copy of the trainable parameters and their optimizer state (fp32 AdamW: 4 + 8 = 12 bytes per
trainable parameter; LoRA: the adapters only), allocated once and reused, pinned on CUDA so the
device-to-host copy is asynchronous. The copy is queued on the current stream before the optimizer's
kernels (so they cannot run before it has read the old values) and does not stall the host; it
costs the transfer time on the device timeline, about 12 B x trainable params / PCIe bandwidth
(~0.5 s per billion trainable parameters at 25 GB/s; on CPU a memcpy at memory bandwidth). The copy
goes to the host rather than the device because an OOM in the optimizer step means device memory
is already the scarce resource. If the host cannot hold the snapshot, the step runs without one
and an OOM inside it stops the run (one sentence) instead of redoing it wrongly.

**Only where a step can half apply** (``snapshot_needed``, from the optimizer table's ``rollback``,
justified there against torch's code): fused AdamW steps in place once its state exists, and plain
SGD never allocates inside its step, so they are copied only on the step that creates the state
(fused AdamW's first) or never, and the buffers are released: no host memory for the rest of the run.
``memory/snapshot.py`` prices the same rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import release_memory
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from memfit.settings.config import Optimizer
from memfit.spec.optimizers import inner_optimizer, row
from memfit.training.oom import is_oom


@dataclass
class _Saved:
    """One parameter's pre-step values: its data and its state (tensors copied to host buffers)."""

    had_state: bool
    data: torch.Tensor
    state: dict[str, Any]
    """State key -> host copy (tensors) or the value itself (Python numbers)."""
    devices: dict[str, tuple[torch.device, torch.dtype]] = field(default_factory=dict)


class OptimizerSnapshot:
    """Copies of what ``optimizer.step()`` mutates, taken before it runs; ``restore`` puts them back.

    Host buffers are allocated on the first ``take`` and reused while shapes and dtypes stay the same.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._saved: dict[int, _Saved] = {}
        self._groups: list[dict[str, Any]] = []
        self.available = True
        """False when the host had no room for the copy: an OOM in this step cannot be undone."""

    @contextmanager
    def guard(self, optimizer) -> Iterator[None]:
        """Run ``optimizer.step()`` inside: on any exception the optimizer is as it was, then it re-raises."""
        self.take(optimizer)
        try:
            yield
        except BaseException:
            if self.available:
                self.restore(optimizer)
            raise

    def take(self, optimizer) -> None:
        """Copy the parameters that have gradients (the ones the step updates) and their state; nothing
        (and the buffers released) when this step cannot half apply (``snapshot_needed``)."""
        opt = inner_optimizer(optimizer)
        self._saved.clear()
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        if not snapshot_needed(opt):
            self._buffers.clear()
            self.available = True  # an OOM cannot leave this step half applied: redoing it is exact
            return
        try:
            for index, p in enumerate(q for g in opt.param_groups for q in g["params"]):
                if p.grad is None:
                    continue  # not updated by this step (frozen, or no gradient reached it)
                state = opt.state.get(p) or {}  # .get: the state defaultdict must not grow here
                saved = _Saved(had_state=bool(state), data=self._copy((index, "<param>"), _local(p.detach())), state={})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        saved.state[key] = self._copy((index, key), _local(value.detach()))
                        saved.devices[key] = (value.device, value.dtype)
                    else:
                        saved.state[key] = value
                self._saved[id(p)] = saved
            self.available = True
        except (RuntimeError, MemoryError) as err:
            if not is_oom(err):
                raise
            self._buffers.clear()  # the host cannot hold the copy: run the step without one
            self._saved.clear()
            self.available = False

    def restore(self, optimizer) -> None:
        """Put back every parameter and state tensor the failed step touched; drop state it created."""
        opt = inner_optimizer(optimizer)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies into the host buffers have landed
        for group, saved_group in zip(opt.param_groups, self._groups, strict=True):
            group.update(saved_group)
        for p in (q for g in opt.param_groups for q in g["params"]):
            saved = self._saved.get(id(p))
            if saved is None:
                continue
            with torch.no_grad():
                _local(p).copy_(saved.data)
            if not saved.had_state:
                opt.state.pop(p, None)  # the failed step initialised it: a fresh step will again
                continue
            state = opt.state[p]
            for key in [k for k in state if k not in saved.state]:
                del state[key]
            for key, value in saved.state.items():
                state[key] = self._put_back(state.get(key), value, *saved.devices.get(key, (None, None)))

    def _copy(self, key: tuple[int, str], tensor: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
            self._buffers[key] = buf
        buf.copy_(tensor, non_blocking=tensor.is_cuda)
        return buf

    @staticmethod
    def _put_back(current, value, device, dtype):
        if not isinstance(value, torch.Tensor):
            return value
        target = _local(current) if isinstance(current, torch.Tensor) else None
        if target is not None and target.shape == value.shape and target.dtype == dtype and target.device == device:
            with torch.no_grad():
                target.copy_(value)  # in place: no new device memory while memory is tight
            return current
        return value.to(device=device, dtype=dtype, copy=True)

    def buffers(self) -> list[torch.Tensor]:
        """The host buffers held between steps (what the snapshot costs in memory)."""
        return list(self._buffers.values())


def rollback_kind(opt) -> str:
    """The optimizer table's ``rollback`` for the live torch optimizer ``opt``: fused AdamW's row when every
    group is fused (``oom.use_fused_adamw`` may switch a run to it), SGD's when no group has momentum or
    weight decay (then nothing is allocated inside its step); ``"every-step"`` for anything else."""

    groups = opt.param_groups
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and groups and all(g.get("fused") for g in groups):
        return row(Optimizer.ADAMW_FUSED).rollback
    if type(opt) is torch.optim.SGD and all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in groups):
        return row(Optimizer.SGD).rollback
    return "every-step"


def snapshot_needed(opt) -> bool:
    """Whether an out-of-memory error inside ``opt.step()``, about to run, could leave it half applied."""
    kind = rollback_kind(opt)
    if kind == "never":
        return False
    if kind == "first-step":  # a parameter the step updates has no state yet: the step creates it
        return any(p.grad is not None and not opt.state.get(p) for g in opt.param_groups for p in g["params"])
    return True


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 ``DTensor`` (the storage the optimizer updates), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass
class RngState:
    """torch's random generators at the start of a step: a redo draws the same dropout masks."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RngState:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def undo_step(accelerator, model, optimizer) -> None:
    """Forget a failed step's gradients and bookkeeping (the optimizer state is ``OptimizerSnapshot``'s job).

    Accelerate's micro-batch counter restarts (the step restarts), and fp16's loss scaler forgets that
    it unscaled this optimizer (else the redo's ``unscale_`` raises) and Accelerate's ``step`` patch
    around it is undone; the scale itself only changes in ``update()``, after a successful step.
    """

    opt = inner_optimizer(optimizer)
    opt.zero_grad(set_to_none=True)
    accelerator.unwrap_model(model).zero_grad(set_to_none=True)
    accelerator.step = 0
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        scaler._per_optimizer_states.clear()  # private: GradScaler.update() does the same after a step
        scaler._per_optimizer_states.default_factory = _refresh_per_optimizer_state
    original = getattr(optimizer, "_optimizer_original_step_method", None)
    if original is not None:  # AcceleratedOptimizer.step swaps in a patched step for the scaler's call
        opt.step = original
        optimizer._accelerate_step_called = False
    release_memory()  # gc.collect() and the device cache emptied, as Accelerate does between tries
