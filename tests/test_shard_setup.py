"""Ranks > 0 of a CPU FSDP run never hold the whole model: they build it on the meta device and receive
their shards from rank 0 (Accelerate's ``cpu_ram_efficient_loading``, ``training.sharding.shard_model``).
Runs ``bench/shard_setup_memory.py`` on 2 CPU processes: the case ``shard-setup`` of the suite's shared launch
(``tests/_gloo_cases.py``)."""

from __future__ import annotations

import pytest

from _launch_helpers import last_json_line


@pytest.mark.launch_cases("shard-setup")
def test_rank_one_builds_no_full_model_and_gets_the_single_process_weights(gloo_runs):
    proc = gloo_runs["shard-setup"]  # bench/shard_setup_memory.py --model tiny
    assert proc.returncode == 0, proc.failure()
    got = last_json_line(proc.stdout)
    # the same weights as one process builds with the same seed: broadcast from rank 0, bit for bit
    assert got["max_abs_diff_vs_single_process"] == 0.0
    full, shard = got["full_model_bytes"], got["rank0_shard_bytes"]
    rank0, rank1 = got["setup_peak_bytes_per_rank"]
    # tiny: full 25,969,664 B, shard 12,984,832 B. Rank 1 peaks at its shard + the tensor being broadcast
    # (the largest, 786,432 B: measured 13,966,672 B), where building the whole model cost 39,936,336 B.
    assert shard < rank1 < shard + full // 8
    assert rank0 >= full + shard  # rank 0 still builds the whole model, then shards it
