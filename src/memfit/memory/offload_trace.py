"""``--offload activations`` in the exact trace: torch's ``save_on_cpu`` played on fake CPU tensors.

``memfit train`` runs forward under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
(``training/step.py``). Its two hooks, as torch 2.x writes them:

- pack: every tensor autograd saves for backward (activations, and also parameters and autocast weight
  copies: a saved tensor is a saved tensor) is copied into a new *contiguous* pinned host tensor
  (``torch.empty(tensor.size()) + copy_``). Autograd keeps only that host copy, so the device tensor is
  released as soon as nothing else (the next layer's input, a Python variable, a parameter) holds it;
- unpack: each use in backward copies the host tensor back (``packed.to(device)``): a new contiguous
  device tensor, alive while that node's backward runs.

The exact trace runs on the CPU, where a host copy would be counted like device memory. So the trace
installs the same kind of hooks with what they do to the *device*: pack keeps only the saved tensor's
size and dtype (the host copy lives in host RAM, which the device peak does not include), unpack allocates
a new contiguous tensor of that size and dtype (the copy back, counted while backward uses it). Values do
not matter on fake tensors. Non-reentrant gradient checkpointing installs its own hooks inside each
checkpointed layer, which take precedence there, exactly as they do over ``save_on_cpu`` in training.

Known error: none in bytes beyond what the trace already has; the time of the copies is not modelled here
(``planning/cost.py`` prices them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def saved_tensors_off_device() -> Iterator[None]:
    """Forward's saved tensors leave the (traced) device and come back, one use at a time, in backward."""

    def pack(tensor: torch.Tensor):
        return tuple(tensor.size()), tensor.dtype  # the host copy: not device memory

    def unpack(packed) -> torch.Tensor:
        size, dtype = packed
        return torch.empty(size, dtype=dtype)  # (..) the copy back to the device, contiguous like save_on_cpu's

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
