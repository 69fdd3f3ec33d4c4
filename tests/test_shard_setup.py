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


@pytest.mark.launch_cases("shard-setup")
def test_loading_and_wrapping_phases_are_rank_zeros_measured_peaks(gloo_runs):
    """memory.phases on a CPU, where the host is the device: rank 0 loads the whole model (25,969,920 B measured
    and predicted: parameters and buffers) and holds it beside its shards while Accelerate distributes them
    (38,954,832 B measured, 38,954,880 B predicted). Within 0.5%: the difference is the rotary buffer's
    temporaries; the formula's smallest error, a missing shard of the smallest tensor, is larger, and leaving out
    the full model (the GPU's formula, where it stays in host memory) is -65%."""
    proc = gloo_runs["shard-setup"]
    assert proc.returncode == 0, proc.failure()
    got = last_json_line(proc.stdout)
    predicted = got["predicted_phases"]
    for phase, measured in (("loading", got["loading_peak_bytes_per_rank"]),
                            ("wrapping", got["setup_peak_bytes_per_rank"])):
        assert max(measured) == measured[0]  # rank 0's is the phase's peak
        error = (predicted[phase] - measured[0]) / measured[0]
        assert abs(error) <= 0.005, (phase, predicted[phase], measured[0])
