"""Data parallel on 2 CPU processes (gloo): the same weights as 1 process with the same effective batch,
the last partial step included, and a resume on a different number of processes.

The 2-process run is the case ``dp`` of the suite's shared launch (``tests/_gloo_cases.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _train_helpers import max_diff, metrics, tiny_config
from memfit.training.loop import run_training


@pytest.mark.launch_cases("dp")
def test_two_processes_match_one_and_resume_on_one(tmp_path, gloo_runs):
    # 22 samples, effective batch 4: 6 steps per epoch, the 6th holds 2 samples (on 2 ranks x 2
    # micro-batches of 1 that is rank 0 with both samples and rank 1 with dummy rows).
    # The launch: --micro-batch 1 --grad-accum 2 --max-steps 6 --save-every 3 --lr 0.01 --warmup-steps 2
    # --optimizer adamw --packing none --max-grad-norm 0 (_gloo_cases.TRAIN_ARGS).
    proc = gloo_runs["dp"]
    assert proc.returncode == 0, proc.failure()
    data, root = proc.paths["data"], Path(proc.paths["output"]).parents[1]
    common = dict(data=data, max_steps=6, lr=1e-2, warmup_steps=2)
    one = tiny_config(tmp_path / "one", run={"optimizer": "adamw"}, **common)
    single = run_training(one, show=False)
    two = tiny_config(root / "two", save_every=3, **common)
    assert two.folder.output == proc.paths["output"] and two.source.model == proc.paths["model"]

    from transformers import AutoModelForCausalLM

    ddp = AutoModelForCausalLM.from_pretrained(two.folder.output)
    assert max_diff(single.model, ddp) < 1e-6
    logged_two = metrics(two.folder.output)
    assert [m["sequences"] for m in logged_two] == [4, 8, 12, 16, 20, 22]  # every sample once, none dropped
    assert [m["loss"] for m in logged_two] == pytest.approx([m["loss"] for m in metrics(one.folder.output)], abs=1e-6)

    # Resume the 2-process run's step-3 checkpoint on 1 process with another split (4 x 1).
    shutil.rmtree(Path(two.folder.output) / "checkpoints" / "step-6")
    resumed_cfg = tiny_config(root / "two", resume=True, run={"optimizer": "adamw"}, **common)
    resumed = run_training(resumed_cfg, show=False)
    assert resumed.summary.sequences == 22
    assert max_diff(single.model, resumed.model) < 1e-6
