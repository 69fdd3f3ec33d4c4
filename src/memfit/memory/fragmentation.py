"""The caching allocator's overhead for the analytic estimate: predicted reserved memory without a replay.

``estimate --exact`` replays a step's allocation stream through ``memory/allocator.py`` (``memory/alloc_stream.py``)
and reads ``max_memory_reserved`` off it. The analytic estimate (microseconds; what ``plan`` prices every candidate
with) has no stream, so it adds a term fitted to those replays over the accuracy grid::

    reserved = T + W + overhead(T),   overhead(T) = FRACTION x T + FLOOR

with ``T`` the step's tensor peak (``max_memory_allocated`` less cuBLAS's workspace ``W``). ``FRACTION`` is what
split and cached blocks cost once tensors dwarf the allocator's segments (the median share over the grid points
whose tensors reach 1 GiB); ``FLOOR`` is what the segment sizes cost a small step (2 MiB small-pool and 20 MiB
large-pool segments: a few of them, half-used; the median remainder over the smaller points).

Source: ``bench/allocator_replays.py``'s table (bench/README.md, "allocator_replays.py"): small random configs
of five families (llama, qwen2, gpt2, gemma2, phi3) at 256 x 4 and 512 x 2 tokens in fp32, AMP and LoRA, and
presets from 135 M to 7 B parameters at 512-2,048 tokens in AMP, pure bf16, LoRA and checkpointed regimes, all
under torch's default allocator settings, 43 grid points (2026-12-06). Known error (``SPREAD``): the reserved memory
this term predicts from the exact tensor peak lies within -12.4% .. +5.6% of the replay's over the 13 points with
tensors >= 1 GiB (median |error| 3.7% over all 43; -13.8% .. +6.7% with the small configs, ``SPREAD_ALL``). The overhead
share varies with the step's shape, 3% (llama-2-7b LoRA) to 25% (qwen2.5-0.5b AMP, checkpointed, 2,048 tokens: its
large-vocabulary logits leave big cached blocks), which one fraction cannot follow. On top comes the analytic tensor peak's own error
(``bench/estimate_accuracy.py``) and the replay's (``memory/alloc_stream.py``: steady shapes, two steps). Under
``expandable_segments`` the overhead is smaller (pages instead of segments): the term over-states it.
"""

from __future__ import annotations

from memfit.units import MiB

#: Overhead per byte of tensor peak (median over the replays with tensors >= 1 GiB).
FRACTION = 0.0906

#: Overhead of a small step (the median remainder over the replays with tensors < 1 GiB).
FLOOR = 8_895_976  # 8.5 MiB

#: (lowest, highest) of ``(predicted - replayed) / replayed`` reserved memory over the replays with tensors >= 1 GiB
#: (-12.40% .. +5.63% measured, rounded outward to 0.1%).
SPREAD = (-0.125, 0.057)

#: The same over all 43 grid points, the small random configs included (-13.80% .. +6.75%).
SPREAD_ALL = (-0.139, 0.068)


def overhead(tensor_peak: int) -> int:
    """Bytes the caching allocator reserves beyond a step's tensor peak and cuBLAS's workspace (module docstring)."""
    return int(FRACTION * tensor_peak + FLOOR)


def describe() -> str:
    """The term in words, for a note under an estimate."""
    return (f"allocator overhead {FRACTION:.1%} of the tensor peak + {FLOOR / MiB:.1f} MiB, fitted to caching-allocator "
            f"replays (within {SPREAD[0]:+.1%} .. {SPREAD[1]:+.1%} of them for steps of 1 GiB or more; "
            "memory/fragmentation.py)")
