"""Which samples each optimizer step sees, whatever the micro-batch split or the number of processes.

The contract (issue 6, and what makes resume and the out-of-memory fallback exact):

- Epoch ``e`` visits the ``N`` training samples in the order ``randperm(N, seed + e)``.
- Optimizer step covers the next ``E`` samples of that order (``E`` = effective batch =
  ``micro_batch x grad_accum x num_processes``); the last step of an epoch takes the remainder, so
  nothing is dropped or repeated.
- The position in the data is the number of samples consumed (``samples``), not a batch index, so a
  run resumed with another split, another process count or after a fallback continues at the right
  sample.

Worked example: N=10, E=4, P=2 processes, k=2 micro-batches of m=1. Step 0 takes samples
``perm[0:4]`` and splits them into P*k=4 slots: rank 0 gets slots 0,1, rank 1 gets slots 2,3.
Step 2 takes ``perm[8:10]``: slots 0 and 1 hold one sample each, slots 2 and 3 are empty and get a
*dummy row* (one pad token, no target), so every rank still runs k forward/backward passes (DDP
needs every rank in every all-reduce) and the dummy adds exactly zero loss and zero gradient.

The batch sampler yields the slots in the order Accelerate's ``BatchSamplerShard`` deals them out
(batch ``i`` goes to rank ``i % P``), so ``accelerator.prepare(dataloader)`` places them correctly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

DUMMY = -1
"""Slot marker for an empty place in a partial step (becomes a pad-only row with no target)."""


@dataclass(frozen=True)
class StepSchedule:
    """The order samples are visited in, epoch after epoch."""

    num_samples: int
    effective_batch: int
    seed: int = 0

    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.effective_batch)  # ceil

    def order(self, epoch: int) -> list[int]:
        return _permutation(self.num_samples, self.seed + epoch).tolist()

    def step_samples(self, samples_done: int) -> list[int]:
        """Sample indices of the optimizer step that starts after ``samples_done`` samples."""
        epoch, pos = divmod(samples_done, self.num_samples)
        return _permutation(self.num_samples, self.seed + epoch)[pos : min(pos + self.effective_batch,
                                                                              self.num_samples)].tolist()


@functools.lru_cache(maxsize=2)
def _permutation(num_samples: int, seed: int) -> torch.Tensor:
    """``randperm(num_samples)`` seeded with ``seed``, kept (an epoch's steps read slices of it): drawn once
    an epoch, 8 bytes a sample as a tensor rather than a list of millions of Python ints every step."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_samples, generator=gen)


def split_step(samples: list[int], micro_batch: int, grad_accum: int, num_processes: int) -> list[list[int]]:
    """Deal one step's samples into ``grad_accum x num_processes`` micro-batches, in Accelerate's order.

    Slot ``c = rank * grad_accum + j`` (micro-batch ``j`` of ``rank``) holds ``samples[c*m:(c+1)*m]``;
    the returned list is ordered ``j``-major (``[j0r0, j0r1, j1r0, ...]``) so that ``BatchSamplerShard``
    (batch ``i`` to rank ``i % P``) gives rank ``r`` its slots in order.
    """
    out = []
    for j in range(grad_accum):
        for rank in range(num_processes):
            c = rank * grad_accum + j
            chunk = samples[c * micro_batch : (c + 1) * micro_batch]
            out.append(chunk if chunk else [DUMMY])
    return out


class StepBatchSampler:
    """Batch sampler over ``num_steps`` optimizer steps starting after ``start_samples`` samples.

    Deliberately has no ``batch_size`` attribute: Accelerate then treats batches as variable-length
    lists and, since we always yield a multiple of ``num_processes`` batches, never pads or loops
    back to the start (see ``accelerate.data_loader.BatchSamplerShard._iter_with_no_split``).
    """

    def __init__(self, schedule: StepSchedule, *, start_samples: int, num_steps: int, micro_batch: int,
                 grad_accum: int, num_processes: int) -> None:
        self.schedule = schedule
        self.start_samples = start_samples
        self.num_steps = num_steps
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.num_processes = num_processes

    def __len__(self) -> int:
        return self.num_steps * self.grad_accum * self.num_processes

    def __iter__(self) -> Iterator[list[int]]:
        done = self.start_samples
        for _ in range(self.num_steps):
            samples = self.schedule.step_samples(done)
            done += len(samples)
            yield from split_step(samples, self.micro_batch, self.grad_accum, self.num_processes)


class RowsWithDummy(torch.utils.data.Dataset):
    """The tokenized rows, plus the dummy row at index ``DUMMY``: one pad token that is attended to
    (so attention is never fully masked, which gives NaN in SDPA) and has no target."""

    def __init__(self, rows: list[dict], pad_id: int) -> None:
        self.rows = rows
        self.dummy = {"input_ids": [pad_id], "labels": [-100]}
        if rows and "ref_logps" in rows[0]:  # --precompute-reference: a batch of dummy rows only reads no reference
            self.dummy["ref_logps"] = (0.0, 0.0)  # its pair carries no target, so these are never used

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.dummy if index == DUMMY else self.rows[index]
