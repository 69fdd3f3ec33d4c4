"""The caching allocator's overhead for the analytic estimate: predicted reserved memory without a replay.

``estimate --exact`` replays a step's allocation stream through ``memory/allocator.py`` (``memory/alloc_stream.py``)
and reads ``max_memory_reserved`` off it. The analytic estimate (microseconds; what ``plan`` prices every candidate
with) has no stream, so it adds a term fitted to those replays over the accuracy grid::

    reserved = T + W + overhead,   overhead = max(FRACTION x T, PER_OPTIMIZER x O + PER_LOGIT x L) + FLOOR

with ``T`` the step's tensor peak (``max_memory_allocated`` less cuBLAS's two workspaces ``W``, ``memory/device_terms.py``), ``O`` the optimizer
state on the device and ``L`` the logits (and their gradients) held at the peak. Two descriptions of the same
replays, the larger taken. ``FRACTION x T`` is what split and cached blocks cost a step in general (the median share
over the grid points whose tensors reach 1 GiB). But the share is not constant (3% of the tensor peak for
llama-2-7b LoRA, 40% for a checkpointed full bf16 llama-3.2-1b), and where it is large it follows what breaks the
allocator's cached blocks: the optimizer state is created at the end of the first step (``torch.optim`` makes it
lazily), into the blocks that step's activations and logits freed, splitting them, so the second step's large
requests find no block of their size and new segments are reserved; the logits are the step's largest requests
(vocabulary-wide, fp32 for the loss) and come last in forward, when the cached blocks are most split
(``PER_OPTIMIZER`` and ``PER_LOGIT``: least squares of the relative error over the same points). Weights loaded
before the step sit in segments of their own size and cost next to nothing. ``FLOOR`` is what the segment sizes
cost a small step (2 MiB small-pool and 20 MiB large-pool segments: a few of them, half-used; the median remainder
over the smaller points).

Source: ``bench/allocator_replays.py``'s table (bench/README.md, "allocator_replays.py"): small random configs
of five families (llama, qwen2, gpt2, gemma2, phi3) at 256 x 4 and 512 x 2 tokens in fp32, AMP and LoRA, and
presets from 135 M to 8 B parameters at 512-2,048 tokens in AMP, pure bf16, LoRA, QLoRA and checkpointed regimes,
all under torch's default allocator settings, 53 grid points (2026-12-06). ``PER_OPTIMIZER`` and ``PER_LOGIT`` are
fitted over the 23 points whose tensors reach 1 GiB. Known error (``SPREAD``): the reserved memory this term
predicts from the exact tensor peak lies within -12.3% .. +6.3% of the replay's over those 23 points, 6 of them
under (-13.6% .. +7.7% with each point left out of the fit in turn, median |error| 3.3%), -14.5% .. +6.3% over all
53 (median |error| 3.4%; the small random gpt2 and phi3 LoRA configs, a few MiB of tensors, are the low end). Either
description alone reads worse on the 23: ``FRACTION x T`` -21.8% .. +6.1% with 11 under (low on checkpointed steps
with large logits or optimizer state), the least-squares pair -12.3% .. +6.3% with 11 under. Against GPUs (the
published reserved figures of ``bench/published_check.py``) the tensor-peak share is what holds where the state and
the logits are small (torchtune's Llama 2 7B LoRA rows: within 1% with it, 8% low with the pair alone). On top
comes the analytic tensor peak's own error (``bench/estimate_accuracy.py``) and the replay's (``memory/alloc_stream.py``: steady shapes, two steps). Under
``expandable_segments`` the overhead is smaller (pages instead of segments): the term over-states it.
"""

from __future__ import annotations

from memfit.units import MiB

#: Overhead per byte of tensor peak (the median share over the replays with tensors >= 1 GiB).
FRACTION = 0.0956

#: Overhead per byte of optimizer state on the device (least squares over the replays with tensors >= 1 GiB).
PER_OPTIMIZER = 0.3134

#: Overhead per byte of logits (and their gradients) held at the step's peak (the same fit).
PER_LOGIT = 0.2671

#: Overhead of a small step (the median remainder over the replays with tensors < 1 GiB).
FLOOR = 7_966_477  # 7.6 MiB

#: (lowest, highest) of ``(predicted - replayed) / replayed`` reserved memory over the replays with tensors >= 1 GiB,
#: each left out of the fit in turn (-13.64% .. +7.72% measured, rounded outward to 0.1%).
SPREAD = (-0.137, 0.078)

#: The same over all 53 grid points, in the fit (-14.50% .. +6.31% measured, rounded outward to 0.1%).
SPREAD_ALL = (-0.145, 0.064)


def overhead(tensor_peak: int, optimizer: int = 0, logits: int = 0) -> int:
    """Bytes the caching allocator reserves beyond a step's tensor peak and cuBLAS's workspaces, for a step whose
    tensors peak at ``tensor_peak`` holding ``optimizer`` bytes of optimizer state on the device and ``logits`` bytes
    of logits there (module docstring)."""
    return int(max(FRACTION * tensor_peak, PER_OPTIMIZER * optimizer + PER_LOGIT * logits) + FLOOR)


def describe() -> str:
    """The term in words, for a note under an estimate."""
    return (f"allocator overhead the larger of {FRACTION:.1%} of the tensor peak and {PER_OPTIMIZER:.1%} of the "
            f"optimizer state + {PER_LOGIT:.1%} of the logits, + {FLOOR / MiB:.1f} MiB, fitted to caching-allocator replays (within {SPREAD[0]:+.1%} .. {SPREAD[1]:+.1%} "
            "of them for steps of 1 GiB or more; memory/fragmentation.py)")
