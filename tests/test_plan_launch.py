"""memfit plan proposes only what memfit train runs, prints the launch command, writes the Accelerate
config; the peaks outside the step (evaluation, full-state save) are predicted and kept under the budget."""

from __future__ import annotations

import shlex

import pytest
import yaml
from click.testing import CliRunner

from memfit.cli import cli
from memfit.memory.outside import outside_step
from memfit.memory.states import model_states
from memfit.planning import launch
from memfit.planning.search import plan
from memfit.report.runs import shell_lines
from memfit.settings.config import RunConfig
from memfit.spec import engines
from memfit.training import sharding


@pytest.fixture(scope="module")
def tiny():
    from memfit.spec.model import load_spec

    return load_spec("tiny")


def test_plan_proposes_only_runnable_sharding_and_offload():
    result = plan("llama-3-8b", "80GiB", seq_len=2048, batch=64, num_processes=8)
    assert result.plans
    for p in result.plans:  # every candidate, fitting or not, is one train would start
        assert engines.refusal(p.config, cuda=True) is None
    assert all(str(p.config.offload) != "optimizer" for p in result.plans)


def test_train_flags_round_trip_through_the_train_cli():
    # The printed flags parse back, through memfit train's own options, into the same RunConfig.
    import click

    from memfit.cli.options import memory_options, run_config_from

    parsed = {}

    @click.command()
    @memory_options("train")
    def probe(**kwargs):
        parsed.update(kwargs)

    run = RunConfig.of(seq_len=512, micro_batch=2, grad_accum=4, num_processes=8, sharding="zero3", offload="params",
                    dtype="bf16", grad_checkpointing=True)
    flags = launch.train_flags("llama-3-8b", run)
    probe.main(flags[2:], standalone_mode=False)
    assert run_config_from(parsed) == run


def test_accelerate_config_agrees_with_the_flags_train_checks():
    run = RunConfig.of(num_processes=2, sharding="zero2", mixed_precision="bf16")
    cfg = launch.accelerate_config(run)
    assert cfg["distributed_type"] == "FSDP" and cfg["num_processes"] == 2 and cfg["mixed_precision"] == "bf16"
    fsdp = cfg["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is False
    assert not fsdp["fsdp_offload_params"]
    assert launch.accelerate_config(run.replace(sharding="zero3", offload="params"))["fsdp_config"]["fsdp_offload_params"]
    # What `accelerate launch --config_file` exports from this file passes train's launch check.
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
           "FSDP_OFFLOAD_PARAMS": "false"}
    sharding.check_launch(run, 2, env=env)
    assert launch.accelerate_config(RunConfig.of(num_processes=4))["distributed_type"] == "MULTI_GPU"


def test_cli_prints_the_launch_command_and_writes_the_config(tmp_path):
    path = tmp_path / "acc.yaml"
    res = CliRunner().invoke(cli, ["plan", "tiny", "--budget", "4GiB", "--seq-len", "128", "--batch", "8",
                                   "--num-processes", "2", "--sharding", "fsdp", "--accelerate-config", str(path)])
    assert res.exit_code == 0, res.output
    shown = res.output.split("Launch:\n", 1)[1].split("\n(", 1)[0].split("\nWrote", 1)[0]
    words = shlex.split(shown.replace("\\\n", " "))  # the shell joins the continued lines
    assert words[:4] == ["accelerate", "launch", "--config_file", str(path)]
    assert words[4:7] == ["-m", "memfit", "train"] and words[words.index("--sharding") + 1] == "fsdp"
    assert yaml.safe_load(path.read_text())["fsdp_config"]["fsdp_reshard_after_forward"] is True


def test_outside_step_peaks(tiny):
    # tiny preset (presets/architectures.yaml): 6,492,416 params, hidden H 256, intermediate I 768, vocab
    # V 384, 8 layers of L = 786,976 params (the estimator spreads the final norm's 256 over the layers:
    # (6,492,416 - 2 x 98,304) / 8), untied head (tail = head + final norm = 98,560 params);
    # fsdp over 2 ranks, fp32 AdamW, evaluation at the micro-batch: B x T = 2 x 64 = 128 tokens.
    run = RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw", num_processes=2, sharding="fsdp")
    states = model_states(tiny, run)
    resident = states.weights + states.optimizer
    out = outside_step(tiny, run)
    # the gathering moment: 3 layers (one unsharded, 2 flat all-gather outputs) + 2 x B T H fp32 + the tail,
    # kept gathered from the previous batch's head (394,240 B)
    gathering = 3 * 786_976 * 4 + 2 * 128 * 256 * 4 + 98_560 * 4  # 10,100,096; beats one layer computing (4,851,840)
    assert out.evaluation == resident + gathering  # and the head (2 x tail + 8 B T V = 1,181,696)
    # GPU save: 4 copies of the largest tensor (a 768 x 256 MLP weight) on the device of every rank; rank
    # 0's host gathers the full model + both AdamW moments (3 x 25,969,664 B) + the rotary buffer (128 B).
    assert out.checkpoint_full == out.export == (resident + 4 * 196_608 * 4,) * 2
    assert out.save_host == 3 * 6_492_416 * 4 + tiny.buffer_bytes
    # on CPU the host is the device: rank 0 holds it (+ the rollback snapshot, resident on every rank)
    cpu = outside_step(tiny, run, "cpu")
    snapshot = 3 * 6_492_416 * 4 // 2  # this rank's parameters and moments
    assert cpu.checkpoint_full[0] == resident + snapshot + out.save_host + 2 * 196_608 * 4  # 2 copies in flight
    assert cpu.export == (resident + snapshot + 2 * (6_492_416 * 4 + tiny.buffer_bytes),
                          resident + snapshot + 4 * 196_608 * 4)
    assert cpu.save_host == 0
    unsharded = outside_step(tiny, run.replace(sharding="ddp"))
    # DDP saves from what it holds; samples add a KV cache and the sampling's own tensors: three fp32 vectors
    # of the 384-token vocabulary and the int64 ids and attention mask of 176 positions
    assert unsharded.save_host == 0 and unsharded.save_device == unsharded.generation - \
        (2 * 8 + 1) * 2 * 64 * (16 + 1 + 160 - 1) * 4 - (3 * 384 * 4 + 2 * 176 * 8)


def test_planner_keeps_the_peaks_outside_the_step_under_the_budget(tiny, monkeypatch):
    # A plan fits only if evaluation and the full-state save fit too: make the save 1 GiB above the
    # step's peak and the same budget that held the step no longer holds the plan.
    from memfit.memory import outside
    from memfit.planning.gpus import gpu_by_name
    from memfit.planning.search import evaluate

    run = RunConfig.of(seq_len=128, micro_batch=2, optimizer="adamw", num_processes=2, sharding="fsdp")
    a100 = gpu_by_name("a100-80gb")
    step = evaluate(tiny, run, a100, 10**15)
    budget = int(step.needed_bytes * 1.06)  # every phase's reserved memory + context + NCCL (planning.fit)
    assert evaluate(tiny, run, a100, budget).fits
    real = outside.outside_step(tiny, run)
    assert real.device_peak() + step.breakdown.other < step.peak_bytes  # tiny: the step is the peak
    big = outside.OutsideStep(evaluation=real.evaluation, checkpoint_full=(step.peak_bytes + 2**30, 0),
                              export=real.export, generation=real.generation, save_host=0)
    monkeypatch.setattr(outside, "outside_step", lambda spec, run, device="cuda", loaded_from=None: big)
    assert not evaluate(tiny, run, a100, budget).fits


def test_launch_command_is_folded_to_80_columns_and_pastes_as_the_same_command():
    run = RunConfig.of(seq_len=2048, micro_batch=4, grad_accum=4, num_processes=2, sharding="fsdp", lora_r=16)
    command = launch.launch_command("llama-3-8b", run, "acc.yaml")
    assert len(command) > 200  # one line would be cut or wrapped mid-flag by the terminal
    folded = shell_lines(command)
    assert all(len(line) <= 80 for line in folded.splitlines())
    assert all(line.endswith(" \\") for line in folded.splitlines()[:-1])
    assert shlex.split(folded.replace("\\\n", " ")) == shlex.split(command)
    lines = folded.splitlines()
    assert not any(line.rstrip(" \\").endswith("--seq-len") for line in lines)  # a flag stays with its value
