"""A model of PyTorch's CUDA caching allocator: what ``torch.cuda.max_memory_reserved`` will show.

A run dies when the caching allocator cannot find or ``cudaMalloc`` a block, not when tensors outgrow the
device: what it keeps reserved (``memory_reserved``, and nvidia-smi on top of the CUDA context) exceeds
what tensors hold (``memory_allocated``) by rounding, 2 MiB / 20 MiB segments and blocks that are free but
too small or split. ``CachingAllocator`` replays an allocation/free stream (``memory/alloc_stream.py``
records one from ``--exact``'s trace) through the rules of ``DeviceCachingAllocator`` in
``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch at 001074d2; functions named below):

- ``round_size``: requests round up to 512 B (``kMinBlockSize``), or with ``roundup_power2_divisions`` to
  the next of N equal steps between two powers of 2 (``roundup_power2_next_division``) when the size is
  above 512 x N;
- ``get_pool``: rounded sizes <= 1 MiB (``kSmallSize``) go to the small pool, larger ones to the large;
- ``get_allocation_size``: a new segment is 2 MiB (``kSmallBuffer``) for the small pool, 20 MiB
  (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``), else the request rounded up to 2 MiB;
- ``get_free_block``: the smallest cached block of the same stream and pool that is large enough (best
  fit, ties to the lower address); an oversize block (>= ``max_split_size``) is not handed out for a
  smaller request, and for an oversize request only if at most ``max_non_split_rounding`` larger;
- ``should_split`` / ``alloc_found_block``: the rest of a block is split off and cached when it is >= 512 B
  (small pool, or expandable segments), else when the request is under ``max_split_size`` and the rest is
  more than 1 MiB; otherwise the whole block is handed out (and counted as allocated);
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its segment;
- ``malloc``: no cached block -> ``garbage_collect_cached_blocks`` (with a capacity and
  ``garbage_collection_threshold``), ``alloc_block``; if that fails, ``release_available_cached_blocks``
  (oversize blocks, only when ``max_split_size`` is set) and retry, then ``release_cached_blocks`` (every
  cached block that is a whole segment, as ``torch.cuda.empty_cache`` does) and retry, else out of memory;
- expandable segments (``try_allocate_expandable_block``, ``find_expandable_block``, ``map_block``,
  ``unmap_block``): one growing segment per stream and pool, mapped in 2 MiB (small) / 20 MiB (large)
  pages at the lowest free address; ``empty_cache`` unmaps the whole free pages.

Known error: addresses are the model's own (segments in creation order), so between cached blocks of equal
size the one chosen may differ from a real run; events of other streams (``record_stream``), CUDA graphs'
private pools and ``set_per_process_memory_fraction`` beyond ``capacity`` are not modelled. A replay is as
good as its stream: see ``memory/alloc_stream.py`` for what the trace's stream leaves out.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from memfit.memory.allocator_config import LARGE_BUFFER, AllocatorSettings
from memfit.units import MiB

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small-pool segment (and an expandable small-pool page)
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: requests below it get a LARGE_BUFFER segment
ROUND_LARGE = 2 * MiB  # kRoundLarge

#: Address space of one expandable segment when no capacity is given (torch reserves 1 1/8 x the device).
_UNBOUNDED_SPACE = 1 << 46


class AllocatorOutOfMemory(Exception):
    """The model's ``malloc`` found no block and could not reserve one within ``capacity``."""


class _Segment:
    """An expandable segment: a range of address space whose pages are mapped as needed."""

    def __init__(self, base: int, size: int, page: int) -> None:
        self.base, self.size, self.page = base, size, page

    def map_range(self, ptr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::map``: the whole pages covering ``[ptr, ptr + size)``."""
        begin = (ptr - self.base) // self.page
        end = -(-(ptr + size - self.base) // self.page)
        return self.base + begin * self.page, (end - begin) * self.page

    def unmap_range(self, ptr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::unmap``: the pages lying wholly inside ``[ptr, ptr + size)``."""
        begin = -(-(ptr - self.base) // self.page)
        end = (ptr + size - self.base) // self.page
        return (self.base + begin * self.page, (end - begin) * self.page) if end > begin else (ptr, 0)


class _Block:
    __slots__ = ("ptr", "size", "stream", "pool", "allocated", "prev", "next", "segment", "mapped", "requested",
                 "gc_base")

    def __init__(self, ptr: int, size: int, stream: int, pool: _Pool, segment: _Segment | None = None,
                 mapped: bool = True) -> None:
        self.ptr, self.size, self.stream, self.pool = ptr, size, stream, pool
        self.allocated, self.prev, self.next = False, None, None
        self.segment, self.mapped, self.requested, self.gc_base = segment, mapped, 0, 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class _Pool:
    """``BlockPool``: cached free blocks by (stream, size, address), unmapped ones by (stream, address)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], _Block] = {}
        self.unmapped: dict[tuple[int, int], _Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, block: _Block) -> None:
        key = (block.stream, block.size, block.ptr)
        bisect.insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.gc_calls

    def remove(self, block: _Block) -> None:
        key = (block.stream, block.size, block.ptr)
        del self.blocks[key]
        del self.keys[bisect.bisect_left(self.keys, key)]

    def lower_bound(self, stream: int, size: int) -> int:
        return bisect.bisect_left(self.keys, (stream, size, -1))


@dataclass(frozen=True)
class AllocatorStats:
    """The counters of ``torch.cuda.memory_stats`` the replay reports (bytes)."""

    allocated: int
    reserved: int
    peak_allocated: int
    """``max_memory_allocated``: the blocks handed out, rounded, at their most since the last peak reset."""
    peak_reserved: int
    """``max_memory_reserved``: segments held, at their most since the last peak reset."""
    peak_requested: int
    """The bytes tensors asked for, at their most (what memfit's tensor peak counts)."""
    segments: int
    alloc_retries: int
    """Times ``malloc`` freed cached segments and tried again (``num_alloc_retries``)."""


class CachingAllocator:
    """One device's caching allocator (module docstring), with an optional ``capacity`` in bytes: the most it
    may reserve (the device's free memory, or ``set_per_process_memory_fraction``'s allowed maximum)."""

    def __init__(self, settings: AllocatorSettings | None = None, capacity: int | None = None) -> None:
        self.settings = settings or AllocatorSettings()
        self.capacity = capacity
        self.small, self.large = _Pool(True), _Pool(False)
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = 0
        self.retries = 0
        self.segments = 0  # cudaMalloc'd segments and expandable segments alive
        self._addresses = itertools.count(1 << 40, 1 << 40)  # a fresh, aligned range per segment

    # ---- sizes ------------------------------------------------------------------------------------
    def round_size(self, size: int) -> int:
        """``round_size`` (and ``roundup_power2_next_division``)."""
        if size < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.settings.divisions(size)
        if divisions > 1 and size > MIN_BLOCK * divisions:
            if size & (size - 1) == 0:
                return size
            floor = 1 << (size.bit_length() - 1)
            step = floor >> (divisions.bit_length() - 1)
            if step == 0:
                return floor << 1
            rounded = size & ~(step - 1)
            return size if rounded == size else rounded + step
        return -(-size // MIN_BLOCK) * MIN_BLOCK

    @staticmethod
    def allocation_size(size: int) -> int:
        """``get_allocation_size``: the segment a rounded request gets when no cached block fits."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    @property
    def _max_split(self) -> int:
        return self.settings.max_split_size if self.settings.max_split_size is not None else 1 << 62

    # ---- the public calls ---------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        """``DeviceCachingAllocator::malloc``; raises ``AllocatorOutOfMemory`` where torch raises its OOM."""
        size = self.round_size(nbytes)
        pool = self.small if size <= SMALL_SIZE else self.large
        block = self._free_block_for(pool, size, stream)
        if block is None:
            if self.capacity is not None and self.settings.garbage_collection_threshold > 0:
                self._garbage_collect()
            block = (self._alloc_block(pool, size, stream)
                     or (self._release_available(pool, size, stream) and self._alloc_block(pool, size, stream))
                     or (self._release_cached() and self._alloc_block(pool, size, stream, retry=True)))
        if block is None:
            raise AllocatorOutOfMemory(f"tried to allocate {self.allocation_size(size)} B with {self.reserved} B "
                                       f"reserved of {self.capacity} B")
        return self._hand_out(block, size, nbytes)

    def free(self, block: _Block) -> None:
        """``free`` then ``free_block``: back to its pool, merged with free neighbours."""
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour)
        block.pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache`` (``emptyCache`` -> ``release_cached_blocks``)."""
        self._release_cached()

    def reset_peaks(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: peaks restart from the current values."""
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.allocated, self.reserved, self.peak_allocated, self.peak_reserved,
                              self.peak_requested, self.segments, self.retries)

    # ---- finding and splitting ----------------------------------------------------------------------
    def _free_block_for(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``get_free_block``: best fit in ``pool`` under the oversize rules (module docstring)."""
        if self.capacity is not None and self.settings.garbage_collection_threshold > 0:
            pool.gc_calls += 1
        i = pool.lower_bound(stream, size)
        if i == len(pool.keys) or pool.keys[i][0] != stream:
            return None
        block = pool.blocks[pool.keys[i]]
        if block.segment is not None:
            if self.settings.expandable_segments:
                i = self._expandable_best(pool, i, stream)
            else:  # expandable segments switched off since: only ordinary blocks
                i += 1
                while i < len(pool.keys) and pool.keys[i][0] == stream and pool.blocks[pool.keys[i]].segment:
                    i += 1
                if i == len(pool.keys) or pool.keys[i][0] != stream:
                    return None
            block = pool.blocks[pool.keys[i]]
        max_split = self._max_split
        if size < max_split <= block.size:
            return None
        if size >= max_split and block.size >= size + self.settings.max_non_split_rounding:
            return None
        pool.remove(block)
        return block

    @staticmethod
    def _expandable_best(pool: _Pool, i: int, stream: int) -> int:
        """A free block at the mapped end of an expandable segment counts as the size it can grow to."""
        def grows_to(b: _Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        while (pool.blocks[pool.keys[i]].segment is not None and i + 1 < len(pool.keys)
               and pool.keys[i + 1][0] == stream
               and grows_to(pool.blocks[pool.keys[i + 1]]) < grows_to(pool.blocks[pool.keys[i]])):
            i += 1
        return i

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.settings.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self._max_split and remaining > SMALL_SIZE

    def _hand_out(self, block: _Block, size: int, requested: int) -> _Block:
        """``alloc_found_block``: split off the rest when ``should_split``, count the block as allocated."""
        if self._should_split(block, size):
            rest = block
            block = _Block(rest.ptr, size, rest.stream, rest.pool, rest.segment)
            block.splice(rest.prev, rest)
            rest.ptr += size
            rest.size -= size
            rest.pool.insert(rest)
        block.allocated, block.requested = True, requested
        self.allocated += block.size
        self.requested += requested
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return block

    def _merge(self, dst: _Block, src: _Block | None) -> int:
        """``try_merge_blocks``: absorb the free neighbour ``src`` (same mapping state) into ``dst``."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            src.pool.remove(src)
        else:
            del src.pool.unmapped[(src.stream, src.ptr)]
        dst.size += src.size
        return src.size

    # ---- reserving and releasing segments ---------------------------------------------------------------
    def _reserve(self, nbytes: int) -> bool:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return True

    def _alloc_block(self, pool: _Pool, size: int, stream: int, retry: bool = False) -> _Block | None:
        """``alloc_block``: a new segment (``cudaMalloc``), or more pages of an expandable one."""
        self.retries += retry
        if self.settings.expandable_segments:
            return self._alloc_expandable(pool, size, stream)
        segment = self.allocation_size(size)
        if not self._reserve(segment):
            return None
        self.segments += 1
        return _Block(next(self._addresses), segment, stream, pool)

    def _release(self, block: _Block) -> None:
        """``release_block``: ``cudaFree`` a cached block that is a whole segment."""
        block.pool.remove(block)
        self.reserved -= block.size
        self.segments -= 1

    def _release_available(self, pool: _Pool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached blocks, one large enough or the largest
        ones until enough is freed (only when ``max_split_size`` is set)."""
        if self.settings.max_split_size is None:
            return False
        max_split = self._max_split
        wanted = max(size, max_split)
        i = pool.lower_bound(stream, wanted)
        if i < len(pool.keys) and pool.keys[i][0] == stream:
            self._release(pool.blocks[pool.keys[i]])
            return True
        released = 0
        for key in reversed(pool.keys[:i]):
            block = pool.blocks[key]
            if released >= wanted or key[0] != stream or block.size < max_split:
                break
            if not block.is_split() and block.segment is None:
                released += block.size
                self._release(block)
        return released >= wanted

    def _release_cached(self) -> bool:
        """``release_cached_blocks`` -> ``release_blocks``: every cached block that is a whole segment, large
        pool then small; free pages of expandable segments unmapped, a segment left empty released."""
        for pool in (self.large, self.small):
            expandable = []
            for key in list(pool.keys):
                block = pool.blocks[key]
                if block.segment is not None:
                    expandable.append(block)
                elif not block.is_split():
                    self._release(block)
            for block in expandable:
                self._unmap(block)
                if not block.is_split() and not block.mapped:  # release_expandable_segment
                    del pool.unmapped[(block.stream, block.ptr)]
                    self.segments -= 1
        return True

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above ``threshold x capacity`` reserved, release whole cached
        large-pool segments not reused for longer than the average, until the excess is freed."""
        threshold = int(self.settings.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        ages = {id(b): pool.gc_calls - b.gc_base for b in pool.blocks.values() if not b.is_split()}
        while reclaimed < target and ages:
            average = sum(ages.values()) / len(ages)
            freed = False
            for key in list(pool.keys):
                block = pool.blocks[key]
                if id(block) in ages and ages[id(block)] >= average:
                    reclaimed += block.size
                    del ages[id(block)]
                    self._release(block)
                    freed = True
            if not freed:
                break

    # ---- expandable segments ----------------------------------------------------------------------------
    def _alloc_expandable(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages from the lowest free address that fits ``size``."""
        candidate = self._expandable_candidate(pool, size, stream)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            grown = candidate.next
            if not self._map(grown, min(size - candidate.size, grown.size)):
                return None
            candidate = grown
        pool.remove(candidate)
        return candidate

    def _expandable_candidate(self, pool: _Pool, size: int, stream: int) -> _Block:
        """``find_expandable_block``: an unmapped range (with the free block before it) of at least ``size``
        bytes, else a new segment."""
        def room(b: _Block | None) -> bool:
            total = 0
            while total < size and b is not None and not b.allocated:
                total += b.size
                b = b.next
            return total >= size

        for key in sorted(k for k in pool.unmapped if k[0] == stream):
            c = pool.unmapped[key]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if room(c):
                return c
        space = _UNBOUNDED_SPACE if self.capacity is None else self.capacity + self.capacity // 8
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        segment = _Segment(next(self._addresses), -(-space // page) * page, page)
        candidate = _Block(segment.base, segment.size, stream, pool, segment, mapped=False)
        self.segments += 1
        pool.unmapped[(stream, candidate.ptr)] = candidate
        return candidate

    def _map(self, block: _Block, size: int) -> bool:
        """``map_block``: back the start of unmapped ``block`` with whole pages; merge with free neighbours."""
        ptr, mapped = block.segment.map_range(block.ptr, size)
        if not self._reserve(mapped):
            return False
        pool = block.pool
        del pool.unmapped[(block.stream, block.ptr)]
        block.mapped = True
        if mapped < block.size:
            rest = _Block(ptr + mapped, block.size - mapped, block.stream, pool, block.segment, mapped=False)
            rest.splice(block, block.next)
            pool.unmapped[(rest.stream, rest.ptr)] = rest
            block.size = mapped
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.insert(block)
        return True

    def _unmap(self, block: _Block) -> None:
        """``unmap_block``: give back the whole pages of a free expandable block; partial pages stay cached."""
        ptr, size = block.segment.unmap_range(block.ptr, block.size)
        if size == 0:
            return
        pool = block.pool
        pool.remove(block)
        before, after = ptr - block.ptr, block.size - (ptr - block.ptr) - size
        if before > 0:
            head = _Block(block.ptr, before, block.stream, pool, block.segment)
            head.splice(block.prev, block)
            pool.insert(head)
        if after > 0:
            tail = _Block(ptr + size, after, block.stream, pool, block.segment)
            tail.splice(block, block.next)
            pool.insert(tail)
        block.ptr, block.size, block.mapped = ptr, size, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.unmapped[(block.stream, block.ptr)] = block
        self.reserved -= size

