"""The caching allocator model (memory/allocator.py) on hand-worked sequences.

Every expected number is derived in the comments from ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch
at 001074d2): ``round_size`` (512 B steps), ``get_pool`` (<= 1 MiB small), ``get_allocation_size`` (2 MiB small
segment; 20 MiB for 1-10 MiB; else rounded to 2 MiB), ``get_free_block`` (best fit; oversize rules),
``should_split`` (small pool/expandable: rest >= 512 B; large: request < max_split and rest > 1 MiB),
``free_block``/``try_merge_blocks`` and ``release_cached_blocks`` (whole segments only).
"""

from __future__ import annotations

import pytest

from memfit.errors import UserError
from memfit.memory.alloc_stream import replay
from memfit.memory.allocator import AllocatorOutOfMemory, CachingAllocator
from memfit.memory.allocator_config import parse_alloc_conf, settings_from_env

KiB, MiB = 2**10, 2**20


def _alloc(*sizes, stream=0):
    return [("alloc", i, size, stream) for i, size in enumerate(sizes)]


def test_small_requests_round_to_512_bytes_and_share_2_mib_segments():
    # 1 B and 513 B round to 512 and 1024 (round_size); both <= 1 MiB: small pool, one 2 MiB segment.
    r = replay(_alloc(1, 513)).stats
    assert (r.peak_allocated, r.peak_requested, r.peak_reserved, r.segments) == (1536, 514, 2 * MiB, 1)
    # 4,096 x 512 B fill one 2 MiB segment exactly (the last split leaves 0 B: no split); one more needs a second.
    assert replay(_alloc(*[512] * 4096)).stats.peak_reserved == 2 * MiB
    assert replay(_alloc(*[512] * 4097)).stats.peak_reserved == 4 * MiB
    # 1 MiB is still small: two fit one 2 MiB segment; 1 MiB + 1 B rounds to 1 MiB + 512: large pool, 20 MiB.
    assert replay(_alloc(MiB, MiB)).stats.peak_reserved == 2 * MiB
    assert replay(_alloc(MiB + 1)).stats.peak_reserved == 20 * MiB


def test_mid_size_requests_split_a_20_mib_segment_until_the_rest_is_1_mib_or_less():
    # 6 MiB (1-10 MiB): a 20 MiB segment, split (rest 14 MiB > 1 MiB); the next two come out of the rest
    # (14 -> 8 -> 2 MiB, each rest > 1 MiB so split again): three requests, one segment.
    three = replay(_alloc(6 * MiB, 6 * MiB, 6 * MiB)).stats
    assert (three.peak_reserved, three.peak_allocated, three.segments) == (20 * MiB, 18 * MiB, 1)
    # A fourth finds only the 2 MiB rest: a second 20 MiB segment.
    assert replay(_alloc(*[6 * MiB] * 4)).stats.peak_reserved == 40 * MiB
    # 9.5 MiB from the 20 MiB segment leaves 10.5 MiB, split; a second 9.5 MiB fits it (rest 1 MiB, not split:
    # the whole 10.5 MiB block is handed out and counted as allocated).
    two = replay(_alloc(19 * MiB // 2, 19 * MiB // 2)).stats
    assert (two.peak_reserved, two.peak_allocated) == (20 * MiB, 20 * MiB)


def test_large_requests_get_their_own_segment_rounded_to_2_mib():
    # 11 MiB >= 10 MiB: segment = 12 MiB; the 1 MiB rest is not > 1 MiB, so the whole 12 MiB is allocated.
    eleven = replay(_alloc(11 * MiB)).stats
    assert (eleven.peak_reserved, eleven.peak_allocated, eleven.peak_requested) == (12 * MiB, 12 * MiB, 11 * MiB)
    # 10 MiB + 1 B -> 10 MiB + 512 (round_size) -> a 12 MiB segment; rest 2 MiB - 512 > 1 MiB: split off.
    ten = replay(_alloc(10 * MiB + 1)).stats
    assert (ten.peak_reserved, ten.peak_allocated) == (12 * MiB, 10 * MiB + 512)


def test_best_fit_and_splitting_reuse_a_freed_block():
    # 3 MiB takes a 20 MiB segment (rest 17 MiB); 12 MiB + 1 fits the 17 MiB rest (best fit, split: rest
    # ~5 MiB); the freed 3 MiB serves a 2 MiB request whole (rest 1 MiB not > 1 MiB): no new segment.
    events = [*_alloc(3 * MiB, 12 * MiB + 1), ("free", 0), ("alloc", 9, 2 * MiB, 0)]
    s = replay(events).stats
    assert (s.peak_reserved, s.allocated) == (20 * MiB, 3 * MiB + 12 * MiB + 512)


def test_a_free_block_merges_with_its_free_neighbours_and_empty_cache_releases_whole_segments():
    allocator = CachingAllocator()
    a, b = allocator.malloc(6 * MiB), allocator.malloc(6 * MiB)  # one 20 MiB segment: [a 6][b 6][rest 8]
    allocator.free(a)
    allocator.empty_cache()  # a is free but split (b still allocated): nothing is a whole segment
    assert allocator.reserved == 20 * MiB
    allocator.free(b)  # b merges with a before it and the 8 MiB rest after it: one free 20 MiB block
    allocator.empty_cache()
    assert (allocator.reserved, allocator.segments) == (0, 0)


def test_fragmentation_a_freed_hole_too_small_for_the_next_request_costs_a_new_segment():
    # [6][6][6][2 rest] in one 20 MiB segment; free the middle 6 MiB: two holes of 6 and 2 MiB, neither
    # adjacent to the other. 7 MiB fits neither: a second 20 MiB segment, though 8 MiB of the first is free.
    events = [*_alloc(6 * MiB, 6 * MiB, 6 * MiB), ("free", 1), ("alloc", 9, 7 * MiB, 0)]
    r = replay(events)
    assert r.stats.peak_reserved == 40 * MiB
    assert r.stats.peak_allocated == 19 * MiB  # 6 + 6 + 7 after the free (18 before it)
    assert r.fragmentation_share == pytest.approx((40 - 19) / 40)


def test_max_split_size_keeps_oversize_blocks_whole_and_reuses_them_only_within_20_mib():
    oversize = parse_alloc_conf("max_split_size_mb:40")
    events = [("alloc", 0, 50 * MiB, 0), ("free", 0), ("alloc", 1, 30 * MiB, 0)]
    # Default: the cached 50 MiB block serves 30 MiB and is split (rest 20 MiB > 1 MiB): 50 MiB reserved.
    assert replay(events).stats.peak_reserved == 50 * MiB
    # max_split 40 MiB: a request under it never gets a block of 40 MiB or more: a new 30 MiB segment.
    assert replay(events, oversize).stats.peak_reserved == 80 * MiB
    # An oversize request takes an oversize block less than 20 MiB larger, whole (not split): 45 -> the 50.
    near = replay([("alloc", 0, 50 * MiB, 0), ("free", 0), ("alloc", 1, 45 * MiB, 0)], oversize).stats
    assert (near.peak_reserved, near.allocated) == (50 * MiB, 50 * MiB)
    # ... but not one 20 MiB or more larger: 72 MiB against a cached 100 MiB block gets its own segment.
    far = replay([("alloc", 0, 100 * MiB, 0), ("free", 0), ("alloc", 1, 72 * MiB, 0)], oversize).stats
    assert far.peak_reserved == 172 * MiB


def test_roundup_power2_divisions_round_to_the_next_division_of_the_power_of_2_interval():
    allocator = CachingAllocator(parse_alloc_conf("roundup_power2_divisions:4"))
    # 1200 KiB lies in [1 MiB, 2 MiB): four steps of 256 KiB -> 1280 KiB (torch's own example, round_size).
    assert allocator.round_size(1200 * KiB) == 1280 * KiB
    assert allocator.round_size(2 * MiB) == 2 * MiB  # a power of 2 stays
    assert allocator.round_size(1500) == 1536  # not above 512 x 4 = 2048: plain 512 B rounding
    assert allocator.round_size(5 * MiB + 1) == 6 * MiB  # [4, 8) MiB in steps of 1 MiB (plain: 5 MiB + 512)
    assert CachingAllocator().round_size(1200 * KiB) == 1200 * KiB
    # The rounded size is what is allocated: 1280 KiB of a 20 MiB segment.
    assert replay(_alloc(1200 * KiB), allocator.settings).stats.peak_allocated == 1280 * KiB


def test_expandable_segments_grow_one_segment_in_20_mib_pages_and_give_them_back_on_empty_cache():
    expandable = parse_alloc_conf("expandable_segments:True")
    events = _alloc(3 * MiB, 30 * MiB)
    # Default: 20 MiB for the 3 MiB request, then a 30 MiB segment of its own: 50 MiB.
    assert replay(events).stats.peak_reserved == 50 * MiB
    # Expandable: 3 MiB maps one 20 MiB page (17 MiB rest, free); 30 MiB starts at that free rest and maps
    # one more page (17 + 20 = 37 MiB >= 30): 40 MiB reserved, 7 MiB left free at the end.
    s = replay(events, expandable).stats
    assert (s.peak_reserved, s.segments) == (40 * MiB, 1)
    # Everything freed merges into one 40 MiB block; empty_cache unmaps both pages and drops the segment.
    emptied = replay([*events, ("free", 0), ("free", 1), ("empty_cache",)], expandable).stats
    assert (emptied.reserved, emptied.segments) == (0, 0)
    # A page partly in use stays mapped: free only the 30 MiB (bytes 3-33 MiB): the whole page 20-40 MiB is
    # free and unmapped, page 0-20 MiB holds the 3 MiB block and stays.
    partial = replay([*events, ("free", 1), ("empty_cache",)], expandable).stats
    assert partial.reserved == 20 * MiB


def test_expandable_small_pool_maps_2_mib_pages_and_splits_down_to_512_bytes():
    s = replay(_alloc(*[MiB] * 3), parse_alloc_conf("expandable_segments:True")).stats
    assert (s.peak_reserved, s.segments) == (4 * MiB, 1)  # three 1 MiB blocks in two 2 MiB pages of one segment


def test_blocks_freed_on_one_stream_are_not_reused_on_another():
    events = [("alloc", 0, 6 * MiB, 1), ("free", 0), ("alloc", 1, 6 * MiB, 0)]
    assert replay(events).stats.peak_reserved == 40 * MiB
    assert replay([("alloc", 0, 6 * MiB, 0), ("free", 0), ("alloc", 1, 6 * MiB, 0)]).stats.peak_reserved == 20 * MiB


def test_an_oom_releases_cached_segments_and_retries_before_failing():
    # Capacity 40 MiB: a cached (freed) 30 MiB segment cannot serve 34 MiB, and 30 + 34 > 40; malloc
    # releases the cached segments (release_cached_blocks) and retries: 34 MiB reserved, one retry.
    events = [("alloc", 0, 30 * MiB, 0), ("free", 0), ("alloc", 1, 34 * MiB, 0)]
    s = replay(events, capacity=40 * MiB).stats
    assert (s.reserved, s.peak_reserved, s.alloc_retries) == (34 * MiB, 34 * MiB, 1)
    with pytest.raises(AllocatorOutOfMemory):  # 30 MiB still allocated: nothing to release
        replay([("alloc", 0, 30 * MiB, 0), ("alloc", 1, 12 * MiB, 0)], capacity=40 * MiB)


def test_with_max_split_size_an_oom_first_releases_just_enough_oversize_blocks():
    # max_split 40 MiB, capacity 150 MiB: 50 and 60 MiB oversize segments, freed and cached. A 100 MiB request
    # finds no block and 110 + 100 > 150; release_available_cached_blocks frees the largest oversize blocks
    # until >= 100 MiB are freed: 60 then 50 (110 MiB); then the 100 MiB segment fits. No full retry.
    settings = parse_alloc_conf("max_split_size_mb:40")
    events = [("alloc", 0, 50 * MiB, 0), ("alloc", 1, 60 * MiB, 0), ("free", 0), ("free", 1),
              ("alloc", 2, 100 * MiB, 0)]
    s = replay(events, settings, capacity=150 * MiB).stats
    assert (s.reserved, s.alloc_retries, s.segments) == (100 * MiB, 0, 1)


def test_garbage_collection_releases_old_cached_segments_above_the_threshold():
    # Capacity 100 MiB, threshold 0.5: two freed 30 MiB segments are cached (60 MiB > 50 MiB). A 40 MiB request
    # finds no block; gc releases the cached segments at least as old as the average (both), then reserves 40.
    events = [("alloc", 0, 30 * MiB, 0), ("alloc", 1, 30 * MiB, 0), ("free", 0), ("free", 1),
              ("alloc", 2, 40 * MiB, 0)]
    with_gc = replay(events, parse_alloc_conf("garbage_collection_threshold:0.5"), capacity=100 * MiB).stats
    without = replay(events, capacity=100 * MiB).stats
    assert (with_gc.reserved, without.reserved) == (40 * MiB, 100 * MiB)


def test_reset_peaks_restarts_allocated_peak_but_reserved_stays_held():
    events = [("alloc", 0, 30 * MiB, 0), ("free", 0), ("reset_peaks",), ("alloc", 1, 4 * MiB, 0)]
    s = replay(events).stats
    # the 4 MiB comes out of the cached 30 MiB segment (split); the reserved 30 MiB stays the peak
    assert (s.peak_allocated, s.peak_reserved) == (4 * MiB, 30 * MiB)


# ---------------------------------------------------------------------------------------------------------
# PYTORCH_ALLOC_CONF, parsed as torch parses it (c10/core/AllocatorConfig.cpp, parseArgs)
# ---------------------------------------------------------------------------------------------------------
def test_settings_parse_every_key_with_torchs_tokens():
    s = parse_alloc_conf(" expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6,"
                         "max_non_split_rounding_mb:64,release_lock_on_cudamalloc:True")
    assert (s.expandable_segments, s.max_split_size, s.garbage_collection_threshold, s.max_non_split_rounding) \
        == (True, 128 * MiB, 0.6, 64 * MiB)
    # [256:1,512:2,>:4]: index 8 (256 MiB) = 1 and every class below it too (the first entry fills down),
    # index 9 = 2, then ">" fills from the last index named (9) onwards with 4, overwriting 2 as torch does.
    listed = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert listed.roundup_power2_divisions == (1,) * 9 + (4,) * 7
    assert listed.divisions(300 * MiB) == 1 and listed.divisions(600 * MiB) == 4 and listed.divisions(100) == 1


@pytest.mark.parametrize("text", ["max_split_size_mb:10", "roundup_power2_divisions:3", "expandable_segments:yes",
                                  "colour:blue", "max_split_size_mb", "garbage_collection_threshold:1.5",
                                  "backend:fast"])
def test_settings_torch_refuses_are_refused_in_one_sentence(text):
    with pytest.raises(UserError, match="refused by torch"):
        parse_alloc_conf(text)


def test_settings_come_from_the_new_variable_first_then_the_old_name():
    assert settings_from_env({}).source == ""
    old = settings_from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert old.expandable_segments and old.source.startswith("PYTORCH_CUDA_ALLOC_CONF=")
    both = settings_from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                              "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert (both.expandable_segments, both.max_split_size) == (False, 64 * MiB)
    assert "expandable_segments False" in both.describe() and "max_split_size 64 MiB" in both.describe()
    assert not settings_from_env({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}).modelled


# ---------------------------------------------------------------------------------------------------------
# the stream --exact records (memory/alloc_stream.py) and its replay
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced_tiny():
    from transformers import LlamaConfig

    from memfit.memory.trace import trace
    from memfit.settings.config import RunConfig

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return trace(config, RunConfig.of(seq_len=32, micro_batch=2, grad_accum=2), device="cuda", timeline=True)


def test_the_recorded_stream_holds_every_byte_the_trace_counts(traced_tiny):
    from memfit.memory.alloc_stream import WORKSPACES

    breakdown, line = traced_tiny
    # After the peak reset, the bytes the stream's tensors asked for peak at the trace's tensor peak plus the
    # two cuBLAS workspaces (the forward thread's and autograd's device thread's: 2 x 32 MiB = 67,108,864 B), to
    # the byte: no allocation or free of the reported step is missing or late.
    r = replay(line.allocations)
    assert r.stats.peak_requested - 67_108_864 == breakdown.peak_bytes - breakdown.other
    assert ("reset_peaks",) in line.allocations and all(line.allocations.count(w) == 1 for w in WORKSPACES)
    # what estimate reports is that replay, under this process' settings (none set here)
    assert (breakdown.reserved, breakdown.reserved_allocated) == (r.stats.peak_reserved, r.stats.peak_allocated)
    # every tensor of this model is under 1 MiB (small pool, 2 MiB segments); each 32 MiB workspace is one
    # large segment of its own (>= 10 MiB: rounded to 2 MiB): reserved = 2 x 32 MiB + whole 2 MiB segments
    assert (breakdown.reserved - 64 * MiB) % (2 * MiB) == 0 and breakdown.reserved > 64 * MiB
    assert 0 < breakdown.fragmentation_share < 1
    assert breakdown.to_dict()["allocator"]["reserved_bytes"] == breakdown.reserved


def test_a_cpu_trace_records_no_stream_and_predicts_no_reserved_memory():
    from transformers import LlamaConfig

    from memfit.memory.trace import trace
    from memfit.settings.config import RunConfig

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    breakdown, line = trace(config, RunConfig.of(seq_len=16, micro_batch=1), device="cpu", timeline=True)
    assert (breakdown.reserved, line.allocations, breakdown.to_dict()["allocator"]) == (0, [], None)


def test_fit_decisions_take_the_predicted_reserved_peak_and_the_context_where_the_replay_gave_one():
    from memfit.memory.breakdown import MemoryBreakdown
    from memfit.memory.device_terms import CUDA_CONTEXT_BYTES, device_bytes

    analytic = MemoryBreakdown(weights=10 * MiB, other=600 * MiB)
    assert device_bytes(analytic) == 610 * MiB  # no replay: the peak, whose other holds context and reserve
    # a replay that reserved 300 MiB for 10 MiB of tensors (small segments, workspace): context + 300 MiB
    replayed = MemoryBreakdown(weights=10 * MiB, other=600 * MiB, reserved=300 * MiB, reserved_allocated=50 * MiB)
    assert device_bytes(replayed) == CUDA_CONTEXT_BYTES + 300 * MiB
    # never below the peak itself
    assert device_bytes(MemoryBreakdown(weights=10 * MiB, other=600 * MiB, reserved=20 * MiB)) == 610 * MiB
