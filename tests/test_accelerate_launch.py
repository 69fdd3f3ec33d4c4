"""``accelerate launch --config_file`` itself, on 2 CPU processes (issue 13: "accelerate launch with an
Accelerate config file, and torchrun, both work").

The other multi-process tests start torchrun with the variables ``accelerate launch`` would export; these
run Accelerate's own launcher on a config file: the FSDP one ``memfit plan --accelerate-config`` writes, and
a DeepSpeed ZeRO-2 one as a user writes it (``deepspeed_config: {zero_stage: 2, ...}``). Both train the same
3 steps of the tiny Llama, so their losses agree (FSDP2 and DeepSpeed sum the same gradients). Found by the
DeepSpeed launch: Accelerate refused memfit's DeepSpeed config beside the config file's fields with a
ValueError traceback (``deepspeed_engine.plugin``). ~40 s per launch on 2 shared cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _launch_helpers import free_port
from _train_helpers import metrics, write_model, write_qa

TRAIN = ["--seq-len", "64", "--micro-batch", "2", "--grad-accum", "1", "--num-processes", "2",
         "--mixed-precision", "no", "--dtype", "fp32", "--lora-r", "0", "--optimizer", "adamw",
         "--tokenizer", "byte", "--max-steps", "3", "--lr", "0.01", "--warmup-steps", "0", "--eval-every", "0",
         "--eval-fraction", "0", "--samples", "0", "--max-grad-norm", "0", "--log-every", "1"]

DEEPSPEED_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
mixed_precision: 'no'
num_machines: 1
machine_rank: 0
num_processes: 2
use_cpu: false
deepspeed_config:
  zero_stage: 2
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
"""


def _accelerate_launch(config: Path, *train_args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)  # only what the config file says
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--main_process_port", str(free_port()), "-m", "memfit", "train", *train_args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    model, data = write_model(root), write_qa(root, n=22)
    config = root / "fsdp.yaml"
    from click.testing import CliRunner

    from memfit.cli import cli

    # in-process: the file plan writes is the point (accelerate launch, below, is the real subprocess)
    plan = CliRunner().invoke(cli, ["plan", model, "--budget", "2GiB", "--num-processes", "2", "--seq-len", "64",
                                    "--batch", "4", "--sharding", "fsdp", "--full", "--accelerate-config", str(config)])
    assert plan.exit_code == 0 and config.exists(), plan.output
    proc = _accelerate_launch(config, "--model", model, "--data", data, *TRAIN, "--sharding", "fsdp",
                              "--output", str(root / "fsdp"))
    return root, model, data, proc


@pytest.mark.heavy
def test_the_fsdp_config_plan_writes_launches_a_sharded_run(fsdp_run):
    root, _, _, proc = fsdp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp over 2 processes" in " ".join(proc.stderr.split())  # the preamble (stderr), wrapped at 80 columns
    losses = [m["loss"] for m in metrics(root / "fsdp") if "loss" in m]
    assert len(losses) == 3


@pytest.mark.heavy
def test_a_deepspeed_config_file_launches_zero2_with_the_same_losses(fsdp_run, tmp_path):
    pytest.importorskip("deepspeed")  # the optional extra; .ci/run installs it
    root, model, data, fsdp = fsdp_run
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    config = tmp_path / "ds.yaml"
    config.write_text(DEEPSPEED_CONFIG)
    proc = _accelerate_launch(config, "--model", model, "--data", data, *TRAIN, "--sharding", "zero2",
                              "--output", str(tmp_path / "ds"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zero2 (DeepSpeed)" in " ".join(proc.stderr.split())
    on_fsdp = [m["loss"] for m in metrics(root / "fsdp") if "loss" in m]
    on_deepspeed = [m["loss"] for m in metrics(tmp_path / "ds") if "loss" in m]
    assert on_deepspeed == pytest.approx(on_fsdp, abs=1e-5)


@pytest.mark.heavy
def test_accelerate_launch_of_two_cpu_processes_that_starts_one_is_refused(tmp_path):
    """Issue 22: ``accelerate launch --num_processes 2`` on a machine without GPUs runs the script once (its
    simple launcher); memfit trained on that one process without a word. Now: one sentence, exit 1, and no
    run folder."""
    model, data = write_model(tmp_path), write_qa(tmp_path, n=8)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "memfit", "train", "--model", model, "--data", data, *TRAIN[:-2],
           "--output", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "started one" in proc.stderr and "torchrun --nproc_per_node" in proc.stderr
    # Accelerate's launcher prints its own traceback (CalledProcessError) for any child that exits non-zero;
    # memfit's part is the one sentence, with no frame of memfit's in any traceback.
    assert "error: accelerate launch was asked for several processes but started one" in proc.stderr
    assert "memfit/" not in proc.stderr.split("Traceback", 1)[-1]
    assert not (tmp_path / "run").exists()
