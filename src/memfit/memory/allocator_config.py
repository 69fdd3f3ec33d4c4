"""The CUDA caching allocator's settings, read from ``PYTORCH_ALLOC_CONF`` as torch reads them.

torch reads ``PYTORCH_ALLOC_CONF`` (``PYTORCH_CUDA_ALLOC_CONF``, its older name, when the new one is
unset) once, at the first CUDA allocation. The parser here follows torch's
``c10::CachingAllocator::AllocatorConfig::parseArgs`` and ``lexArgs`` (``c10/core/AllocatorConfig.cpp``,
pytorch/pytorch at 065861fb; ``c10/cuda/CUDAAllocatorConfig.cpp`` at 01f9ef32 adds the CUDA-only keys):

- the text is cut into tokens at ``,`` ``:`` ``[`` ``]`` (each one a token too); spaces are dropped;
- ``max_split_size_mb:N`` (N >= 20, the 20 MiB ``kLargeBuffer``: ``parseMaxSplitSize``): blocks of N MiB
  or more are never split; unset = no limit;
- ``max_non_split_rounding_mb:N`` (N >= 20; default 20 MiB): how much larger than the request an
  oversize block handed out may be (``parseMaxNonSplitRoundingSize``);
- ``roundup_power2_divisions:N`` (a power of 2, every size class) or ``[256:1,512:2,>:4]`` (size classes
  in MiB, powers of 2, ``>`` for all those above the last one named; ``parseRoundUpPower2Divisions``):
  16 size classes of sizes from 1 MiB (index 0) to 32 GiB and above (index 15);
- ``garbage_collection_threshold:F`` (0 < F < 1; ``parseGarbageCollectionThreshold``);
- ``expandable_segments:True|False``; ``backend:native|cudaMallocAsync``; ``release_lock_on_cudamalloc``
  and the ``pinned_*`` keys are accepted and change nothing here (locking, host memory).

Any other key, or a value torch refuses, is refused the same way, as a ``UserError`` (torch raises at the
first CUDA allocation, after the model has been loaded).

Known error: ``backend:cudaMallocAsync`` hands allocation to CUDA's own pool, which memfit does not model
(``AllocatorSettings.modelled`` is False); torch of other versions may accept keys this parser refuses.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from memfit.errors import UserError
from memfit.units import MiB

#: ``kLargeBuffer`` (``CUDACachingAllocator.cpp``): 20 MiB, the segment of a 1-10 MiB request and the least
#: ``max_split_size_mb`` and ``max_non_split_rounding_mb`` torch accepts.
LARGE_BUFFER = 20 * MiB

#: ``kRoundUpPowerOfTwoIntervals``: size classes of ``roundup_power2_divisions``, 1 MiB (index 0) to 64 GiB.
ROUNDUP_INTERVALS = 16

#: The environment variables torch reads, first found wins (the second is the deprecated name).
ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

_IGNORED_BOOL_KEYS = ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                      "pinned_use_hip_host_register", "pinned_use_background_threads")
_IGNORED_COUNT_KEYS = ("pinned_num_register_threads", "pinned_reserve_segment_size_mb")


@dataclass(frozen=True)
class AllocatorSettings:
    """The settings of torch's CUDA caching allocator that decide how much it reserves."""

    max_split_size: int | None = None
    """Bytes: blocks this large or larger are never split (``max_split_size_mb``); None = no limit (default)."""
    max_non_split_rounding: int = LARGE_BUFFER
    """Bytes an oversize cached block may exceed a request by and still be handed out for it."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Divisions per power-of-2 interval for each size class (0 or 1: plain 512-byte rounding)."""
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    """Fraction of the allowed memory above which cached unused blocks are released (0: never)."""
    backend: str = "native"
    source: str = ""
    """Where the settings came from: ``PYTORCH_ALLOC_CONF=...``, or empty for torch's defaults."""

    @property
    def modelled(self) -> bool:
        """False for ``backend:cudaMallocAsync`` (CUDA's stream-ordered pool, not torch's caching allocator)."""
        return self.backend == "native"

    def divisions(self, size: int) -> int:
        """``AllocatorConfig::roundup_power2_divisions(size)``: the divisions of ``size``'s size class."""
        index = size.bit_length() - 1 - 20  # log2(size) - log2(1 MiB)
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]

    def describe(self) -> str:
        """One line naming every setting, e.g. ``PYTORCH_ALLOC_CONF unset (torch's defaults: ...)``."""
        split = "none" if self.max_split_size is None else f"{self.max_split_size // MiB} MiB"
        divisions = sorted(set(self.roundup_power2_divisions))
        rounding = "off" if divisions in ([0], [1], [0, 1]) else ",".join(map(str, self.roundup_power2_divisions))
        values = (f"backend {self.backend}, expandable_segments {self.expandable_segments}, max_split_size {split}, "
                  f"roundup_power2_divisions {rounding}, garbage_collection_threshold "
                  f"{self.garbage_collection_threshold:g}")
        return f"{self.source} ({values})" if self.source else f"PYTORCH_ALLOC_CONF unset (torch's defaults: {values})"


def settings_from_env(environ: dict[str, str] | None = None) -> AllocatorSettings:
    """The settings a torch process started with ``environ`` (default ``os.environ``) would use."""
    environ = os.environ if environ is None else environ
    for name in ENV_NAMES:
        text = environ.get(name)
        if text is not None:
            return parse_alloc_conf(text, source=f"{name}={text}")
    return AllocatorSettings()


def _tokens(text: str) -> list[str]:
    """``AllocatorConfig::lexArgs``: separators are tokens of their own; spaces vanish."""
    return [t for t in re.split(r"([,:\[\]])", text.replace(" ", "")) if t]


class _Tokens:
    def __init__(self, text: str) -> None:
        self.items, self.i, self.text = _tokens(text), 0, text

    def fail(self, why: str) -> UserError:
        return UserError(f"PYTORCH_ALLOC_CONF={self.text!r} is refused by torch: {why}.")

    def take(self, expected: str | None = None) -> str:
        if self.i >= len(self.items) or (expected is not None and self.items[self.i] != expected):
            raise self.fail(f"expected {expected!r}" if expected else "a value is missing")
        self.i += 1
        return self.items[self.i - 1]

    def peek(self) -> str | None:
        return self.items[self.i] if self.i < len(self.items) else None

    def number(self, kind=int):
        raw = self.take()
        try:
            return kind(raw)
        except ValueError:
            raise self.fail(f"{raw!r} is not a number") from None

    def boolean(self, key: str) -> bool:
        value = self.take()
        if value not in ("True", "False"):
            raise self.fail(f"{key} takes True or False, not {value!r}")
        return value == "True"


def _power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _split_mb(tokens: _Tokens, key: str) -> int:
    value = tokens.number()
    if value < LARGE_BUFFER // MiB:
        raise tokens.fail(f"{key} must be >= {LARGE_BUFFER // MiB}")
    return value * MiB


def _divisions(tokens: _Tokens) -> tuple[int, ...]:
    """``parseRoundUpPower2Divisions``: one number for every size class, or a ``[MiB:divisions,...]`` list."""
    if tokens.peek() != "[":
        value = tokens.number()
        if not _power_of_2(value):
            raise tokens.fail("roundup_power2_divisions must be a power of 2")
        return (value,) * ROUNDUP_INTERVALS
    out = [0] * ROUNDUP_INTERVALS
    tokens.take("[")
    first, last = True, 0
    while tokens.peek() not in ("]", None):
        interval = tokens.take()
        tokens.take(":")
        value = tokens.number()
        if value and not _power_of_2(value):
            raise tokens.fail("each division must be a power of 2, or 0")
        if interval == ">":
            out[last:] = [value] * (ROUNDUP_INTERVALS - last)
        else:
            try:
                mib = int(interval)
            except ValueError:
                raise tokens.fail(f"{interval!r} is not a size in MiB") from None
            if not _power_of_2(mib):
                raise tokens.fail("each interval must be a power of 2 (MiB)")
            index = min(mib.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                out[:index] = [value] * index
                first = False
            out[index], last = value, index
        if tokens.peek() != "]":
            tokens.take(",")
    tokens.take("]")
    return tuple(out)


def parse_alloc_conf(text: str, source: str = "") -> AllocatorSettings:
    """``AllocatorConfig::parseArgs`` over ``text`` (module docstring); ``UserError`` where torch raises."""
    tokens, values = _Tokens(text), {}
    while tokens.peek() is not None:
        key = tokens.take()
        tokens.take(":")
        if key == "max_split_size_mb":
            values["max_split_size"] = _split_mb(tokens, key)
        elif key == "max_non_split_rounding_mb":
            values["max_non_split_rounding"] = _split_mb(tokens, key)
        elif key == "garbage_collection_threshold":
            threshold = tokens.number(float)
            if not 0.0 < threshold < 1.0:
                raise tokens.fail("garbage_collection_threshold must lie in (0.0, 1.0)")
            values["garbage_collection_threshold"] = threshold
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"] = _divisions(tokens)
        elif key == "expandable_segments":
            values["expandable_segments"] = tokens.boolean(key)
        elif key == "backend":
            backend = tokens.take()
            if backend not in ("native", "cudaMallocAsync"):
                raise tokens.fail(f"backend is native or cudaMallocAsync, not {backend!r}")
            values["backend"] = backend
        elif key in _IGNORED_BOOL_KEYS:
            tokens.boolean(key)
        elif key in _IGNORED_COUNT_KEYS:
            tokens.number()
        else:
            raise tokens.fail(f"unrecognized option {key!r}")
        if tokens.peek() is not None:
            tokens.take(",")
    return AllocatorSettings(**values, source=source or f"PYTORCH_ALLOC_CONF={text}")
