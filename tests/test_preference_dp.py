"""Preference methods on 2 CPU processes (gloo): DPO under DDP (a frozen reference copy, or the reference
precomputed, each rank its share) and ORPO under FSDP2 train the same weights as 1 process with the same
effective batch (pairs normalised over ranks, the partial last step included); the DDP run and the FSDP2
run's full-state checkpoint resume on 1 process (cases of ``tests/_gloo_cases.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _train_helpers import max_diff, metrics, tiny_config
from memfit.training.loop import run_training


def _single(tmp_path, data: str, method: str, **run):
    common = dict(data=data, max_steps=6, lr=1e-2, warmup_steps=2)
    one = tiny_config(tmp_path / "one", run={"optimizer": "adamw", "micro_batch": 1, "grad_accum": 4,
                                             "method": method, **run}, **common)
    return one, run_training(one, show=False), common


@pytest.mark.launch_cases("dpo-ddp")
def test_dpo_two_processes_match_one_and_resume(tmp_path, gloo_runs):
    from transformers import AutoModelForCausalLM

    proc = gloo_runs["dpo-ddp"]
    assert proc.returncode == 0, proc.failure()
    one, single, common = _single(tmp_path, proc.paths["data"], "dpo")
    two_out = Path(proc.paths["output"])
    assert max_diff(single.model, AutoModelForCausalLM.from_pretrained(two_out)) < 1e-5
    logged = metrics(two_out)
    assert [m["sequences"] for m in logged] == [4, 8, 12, 16, 20, 22]
    assert [m["reward_margin"] for m in logged] == pytest.approx([m["reward_margin"] for m in metrics(one.folder.output)],
                                                                 abs=1e-5)
    shutil.rmtree(two_out / "checkpoints" / "step-6")
    resumed = tiny_config(two_out.parent, resume=True, run={"optimizer": "adamw", "method": "dpo"}, **common)
    assert max_diff(single.model, run_training(resumed, show=False).model) < 1e-5


@pytest.mark.launch_cases("orpo-fsdp")
def test_orpo_fsdp_matches_one_process(tmp_path, gloo_runs):
    from transformers import AutoModelForCausalLM

    proc = gloo_runs["orpo-fsdp"]
    assert proc.returncode == 0, proc.failure()
    _one, single, common = _single(tmp_path, proc.paths["data"], "orpo")
    two_out = Path(proc.paths["output"])
    assert max_diff(single.model, AutoModelForCausalLM.from_pretrained(two_out)) < 1e-5
    # the FSDP2 run's full-state checkpoint at step 3 (the launch: --state-dict full --save-every 3), on 1 process
    shutil.rmtree(two_out / "checkpoints" / "step-6")
    resumed = tiny_config(two_out.parent, resume=True, run={"optimizer": "adamw", "method": "orpo",
                                                             "sharding": "ddp"}, **common)
    result = run_training(resumed, show=False)
    assert result.summary.resumes[-1]["step"] == 3 and result.summary.sequences == 22
    assert max_diff(single.model, result.model) < 1e-5


@pytest.mark.launch_cases("dpo-precompute")
def test_dpo_precomputed_reference_on_two_processes_matches_one(tmp_path, gloo_runs):
    """Each rank computed half the pairs' reference log-probabilities and gathered the other half: the same
    weights as 1 process computing them all (a pair with a wrong or missing reference would train others)."""
    from transformers import AutoModelForCausalLM

    proc = gloo_runs["dpo-precompute"]
    assert proc.returncode == 0, proc.failure()
    _one, single, _ = _single(tmp_path, proc.paths["data"], "dpo", precompute_reference=True)
    assert max_diff(single.model, AutoModelForCausalLM.from_pretrained(proc.paths["output"])) < 1e-5


@pytest.mark.launch_cases("dpo-fsdp")
def test_dpo_with_a_reference_copy_under_fsdp_matches_one_process(tmp_path, gloo_runs):
    """Rank 1 of CPU FSDP2 builds its model empty; its frozen reference copy receives rank 0's weights (it
    crashed on meta tensors before)."""
    from transformers import AutoModelForCausalLM

    proc = gloo_runs["dpo-fsdp"]
    assert proc.returncode == 0, proc.failure()
    _one, single, _ = _single(tmp_path, proc.paths["data"], "dpo")
    assert max_diff(single.model, AutoModelForCausalLM.from_pretrained(proc.paths["output"])) < 1e-5


@pytest.mark.slow  # two launches of its own (~1-2 min on 2 cores), as SFT's test_train_fsdp sharded resume
def test_dpo_sharded_checkpoint_resumes_on_two_processes(tmp_path):
    """DPO under FSDP2 saves a sharded (DCP) checkpoint at step 3; with step 6's removed, the run resumes on
    2 processes from step 3 and ends with the weights of one uninterrupted process."""
    from transformers import AutoModelForCausalLM

    from _gloo_cases import TRAIN_ARGS
    from _launch_helpers import gloo_launch
    from _train_helpers import write_pairs

    data = write_pairs(tmp_path / "pairs.jsonl", n=22)
    two = tiny_config(tmp_path / "two", data=data)
    args = ["train", "--model", two.source.model, "--data", data, *TRAIN_ARGS, "--method", "dpo", "--sharding", "fsdp",
            "--save-every", "3", "--output", two.folder.output]
    first = gloo_launch("-m", "memfit", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (Path(two.folder.output) / "checkpoints" / "step-3").is_dir()
    shutil.rmtree(Path(two.folder.output) / "checkpoints" / "step-6")
    resumed = gloo_launch("-m", "memfit", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    _one, single, _ = _single(tmp_path, data, "dpo")
    assert max_diff(single.model, AutoModelForCausalLM.from_pretrained(two.folder.output)) < 1e-5
    assert [m["sequences"] for m in metrics(two.folder.output) if "sequences" in m][-1] == 22
