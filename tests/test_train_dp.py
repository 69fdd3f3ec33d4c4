"""Data parallel on 2 CPU processes (gloo): the same weights as 1 process with the same effective batch,
the last partial step included, and a resume on a different number of processes.

The one test here that launches processes (~30-60 s on 2 shared cores).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from _launch_helpers import gloo_launch
from _train_helpers import max_diff, metrics, tiny_config, write_qa
from memfit.training.loop import run_training


def test_two_processes_match_one_and_resume_on_one(tmp_path):
    # 22 samples, effective batch 4: 6 steps per epoch, the 6th holds 2 samples (on 2 ranks x 2
    # micro-batches of 1 that is rank 0 with both samples and rank 1 with dummy rows).
    data = write_qa(tmp_path, n=22)
    common = dict(data=data, max_steps=6, optimizer_lr=1e-2, warmup_steps=2)
    one = tiny_config(tmp_path / "one", run={"optimizer": "adamw"}, **common)
    single = run_training(one, show=False)

    two = tiny_config(tmp_path / "two", save_every=3, **common)
    args = ["--model", two.model, "--tokenizer", "byte", "--data", data, "--seq-len", "64", "--micro-batch", "1",
            "--grad-accum", "2", "--max-steps", "6", "--save-every", "3", "--lr", "0.01", "--warmup-steps", "2",
            "--optimizer", "adamw", "--packing", "none", "--eval-every", "0", "--eval-fraction", "0", "--samples", "0",
            "--log-every", "1", "--max-grad-norm", "0", "--output", two.output]
    proc = gloo_launch("-m", "memfit", "train", *args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    from transformers import AutoModelForCausalLM

    ddp = AutoModelForCausalLM.from_pretrained(two.output)
    assert max_diff(single.model, ddp) < 1e-6
    logged_two = metrics(two.output)
    assert [m["sequences"] for m in logged_two] == [4, 8, 12, 16, 20, 22]  # every sample once, none dropped
    assert [m["loss"] for m in logged_two] == __import__("pytest").approx(
        [m["loss"] for m in metrics(one.output)], abs=1e-6)

    # Resume the 2-process run's step-3 checkpoint on 1 process with another split (4 x 1).
    shutil.rmtree(Path(two.output) / "checkpoints" / "step-6")
    resumed_cfg = tiny_config(tmp_path / "two", resume=True, run={"optimizer": "adamw"}, **common)
    resumed = run_training(resumed_cfg, show=False)
    assert resumed.summary.sequences == 22
    assert max_diff(single.model, resumed.model) < 1e-6
