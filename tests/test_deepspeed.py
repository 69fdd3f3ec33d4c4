"""DeepSpeed ZeRO-2/ZeRO-3 through Accelerate (``training/deepspeed_engine.py``) on 2 CPU processes (gloo),
launched as ``accelerate launch`` with a DeepSpeed config would (``ACCELERATE_USE_DEEPSPEED=true`` and the
``ACCELERATE_DEEPSPEED_*`` variables): the same weights as a plain 1-process run, exact resume, a loadable
export. The launches need deepspeed importable (``pip install 'memfit[deepspeed]'``) and are skipped
otherwise; the config builder and the refusals are tested without it.

Each launch takes ~40-70 s on 2 shared cores (importing deepspeed is ~10 s of it; its first use ever
JIT-builds a small shared-memory op with ninja, ~20 s, cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from _launch_helpers import gloo_launch, launch_cases
from _train_helpers import max_diff, metrics, tiny_config, write_qa
from memfit.errors import UserError
from memfit.settings.config import RunConfig, TrainConfig
from memfit.spec import engines
from memfit.training import deepspeed_engine, sharding
from memfit.training.loop import run_training

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (memfit[deepspeed])")

ARGS = ["--tokenizer", "byte", "--seq-len", "64", "--micro-batch", "1", "--grad-accum", "2", "--max-steps", "6",
        "--lr", "0.01", "--warmup-steps", "2", "--optimizer", "adamw", "--no-packing", "--eval-every", "0",
        "--eval-fraction", "0", "--samples", "0", "--log-every", "1", "--max-grad-norm", "1.0"]


def _ds_env(stage: int) -> dict:
    """What ``accelerate launch --config_file ds.yaml`` sets for ``distributed_type: DEEPSPEED``."""
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2", "ACCELERATE_GRADIENT_CLIPPING": "1.0",
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"}


def _launch(stage: int, *args: str):
    return gloo_launch("-m", "memfit", "train", *args, env=_ds_env(stage), timeout=500)


def _rank0_error(proc) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "rank0]" in line or "Error" in line]
    return "\n".join(lines)[-3000:] or proc.stderr[-3000:]


def _plain_and_deepspeed(tmp_path, flag: str, stage: int, extra=()):
    # 22 samples, effective batch 4 = 1 x 2 accumulation x 2 ranks: the 6th step holds 2 samples (rank 1
    # runs dummy rows then); micro-batches hold different numbers of target tokens (write_qa).
    data = write_qa(tmp_path, n=22)
    common = dict(data=data, max_steps=6, lr=1e-2, warmup_steps=2, max_grad_norm=1.0)
    one = run_training(tiny_config(tmp_path / "one", run={"optimizer": "adamw"}, **common), show=False)
    two = tiny_config(tmp_path / "two", **common)
    proc = _launch(stage, "--model", two.source.model, "--data", data, *ARGS, "--sharding", flag, *extra,
                   "--output", two.folder.output)
    assert proc.returncode == 0, _rank0_error(proc)
    return one, two, proc


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """``{flag: (TrainConfig, CaseRun)}``: ZeRO-2 and ZeRO-3 with ``--save-every 3``, the two cases of ONE
    2-process launch (``_launch_helpers.launch_cases``; each case with its stage's variables)."""
    root = tmp_path_factory.mktemp("deepspeed")
    cases, configs = [], {}
    for flag, stage in (("zero2", 2), ("zero3", 3)):
        (root / flag).mkdir()
        data = write_qa(root / flag, n=22)
        two = tiny_config(root / flag / "two", data=data, max_steps=6, lr=1e-2, warmup_steps=2,
                          max_grad_norm=1.0)
        configs[flag] = two
        cases.append({"name": flag, "kind": "memfit", "env": _ds_env(stage),
                      "argv": ["train", "--model", two.source.model, "--data", data, *ARGS, "--sharding", flag,
                               "--save-every", "3", "--output", two.folder.output]})
    runs = launch_cases(cases, root / "launch", env={"ACCELERATE_USE_DEEPSPEED": "true"}, timeout_per_case=500)
    return {flag: (configs[flag], runs[flag]) for flag in configs}


@pytest.mark.heavy
@needs_deepspeed
@pytest.mark.parametrize(("flag", "stage"), [("zero2", 2), ("zero3", 3)])
def test_deepspeed_on_two_processes_matches_one_plain_process(tmp_path, flag, stage, deepspeed_runs):
    two, proc = deepspeed_runs[flag]
    assert proc.returncode == 0, proc.failure()
    common = dict(data=two.data, max_steps=6, lr=1e-2, warmup_steps=2, max_grad_norm=1.0)
    one = run_training(tiny_config(tmp_path / "one", run={"optimizer": "adamw"}, **common), show=False)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(two.folder.output)  # a plain HF folder (safetensors)
    assert (Path(two.folder.output) / "model.safetensors").is_file()
    assert max_diff(one.model, exported) < 1e-5
    assert [m["loss"] for m in metrics(two.folder.output)] == pytest.approx(
        [m["loss"] for m in metrics(one.summary.output)], abs=1e-5)
    # clipping ran inside DeepSpeed (max_grad_norm 1.0): its norm is what the plain run's clip measured
    assert [m["grad_norm"] for m in metrics(two.folder.output)] == pytest.approx(
        [m["grad_norm"] for m in metrics(one.summary.output)], rel=1e-4)
    step3 = Path(two.folder.output) / "checkpoints" / "step-3"
    assert json.loads((step3 / deepspeed_engine.MARKER).read_text()) == {"stage": stage, "num_processes": 2}
    ranks = sorted(p.name for p in (step3 / "pytorch_model").glob("*zero_pp_rank_*_optim_states.pt"))
    assert len(ranks) == 2  # each rank wrote its own ZeRO partition of the optimizer state
    assert f"{flag} (DeepSpeed) over 2 processes" in " ".join((proc.stdout + proc.stderr).split())
    run_json = json.loads((Path(two.folder.output) / "run.json").read_text())
    assert len(run_json["rank_peak_bytes"]) == 2 and min(run_json["rank_peak_bytes"]) > 0


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(("flag", "stage"), [("zero2", 2), ("zero3", 3)])
def test_deepspeed_checkpoint_resumes_exactly(tmp_path, flag, stage):
    _, two, _ = _plain_and_deepspeed(tmp_path, flag, stage, ["--save-every", "3"])
    from transformers import AutoModelForCausalLM

    straight = AutoModelForCausalLM.from_pretrained(two.folder.output)
    shutil.rmtree(Path(two.folder.output) / "checkpoints" / "step-6")
    proc = _launch(stage, "--model", two.source.model, "--data", two.data, *ARGS, "--sharding", flag, "--save-every", "3",
                   "--resume", "--output", two.folder.output)
    assert proc.returncode == 0, _rank0_error(proc)
    assert max_diff(straight, AutoModelForCausalLM.from_pretrained(two.folder.output)) < 1e-6
    # the same checkpoint on another stage: one sentence, nothing changed
    other = 3 if stage == 2 else 2
    proc = _launch(other, "--model", two.source.model, "--data", two.data, *ARGS, "--sharding", f"zero{other}",
                   "--resume", "--output", two.folder.output)
    assert proc.returncode != 0 and f"holds DeepSpeed ZeRO-{stage} partitions of 2 ranks" in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------ config, no launch
def test_ds_config_comes_from_the_run():
    run = RunConfig.of(micro_batch=3, grad_accum=4, num_processes=2, sharding="zero3", optimizer="adamw")
    ds = deepspeed_engine.ds_config(run, max_grad_norm=0.5, hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 3 * 4 * 2  # DeepSpeed checks micro x accumulation x ranks
    assert ds["gradient_clipping"] == 0.5
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    # Accelerate's "auto" rule from the hidden size 64: 64^2 = 4096, 0.9 x 4096 = 3686, 10 x 64 = 640
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (4096, 3686, 640)
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    two = deepspeed_engine.ds_config(run.replace(sharding="zero2", mixed_precision="bf16"), max_grad_norm=0.0)
    assert two["zero_optimization"]["stage"] == 2 and two["gradient_clipping"] == 0.0
    assert two["bf16"] == {"enabled": True} and "stage3_gather_16bit_weights_on_model_save" not in two[
        "zero_optimization"]


# --------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def ds_launch(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(engines, "deepspeed_available", lambda: True)


def test_deepspeed_not_installed_names_the_extra(ds_launch, monkeypatch):
    monkeypatch.setattr(engines, "deepspeed_available", lambda: False)
    with pytest.raises(UserError, match=r"asks for DeepSpeed, which is not installed.*memfit\[deepspeed\]"):
        sharding.check_run(RunConfig.of(sharding="zero2", optimizer="adamw"), cuda=False)


@pytest.mark.parametrize(("run", "message"), [
    ({"sharding": "fsdp"}, "asks for DeepSpeed but --sharding is fsdp"),
    ({"sharding": "ddp"}, "asks for DeepSpeed but --sharding is ddp"),
    ({"lora_r": 8}, "full fine-tunes only"),
    ({"lora_r": 8, "quantize": "4bit"}, "full fine-tunes only"),
    ({"optimizer_in_backward": True}, "--optimizer-in-backward cannot run under DeepSpeed"),
    ({"loss": "chunked"}, "--loss chunked is untested under DeepSpeed"),
    ({"offload": "optimizer"}, "--offload optimizer is untested under DeepSpeed"),
    ({"optimizer": "adamw-8bit"}, "--optimizer adamw-8bit is untested under DeepSpeed"),
    ({"dtype": "bf16"}, "--dtype fp32"),
    ({"mixed_precision": "bf16"}, "DeepSpeed on CPU runs in fp32"),
])
def test_what_deepspeed_cannot_run_here_is_refused(ds_launch, run, message):
    full = {"sharding": "zero2", "optimizer": "adamw", **run}
    with pytest.raises(UserError, match=message):
        sharding.check_run(RunConfig.of(**full), cuda=False)


def test_planner_refusal_follows_the_launch(ds_launch, monkeypatch):
    run = RunConfig.of(sharding="zero2", optimizer="adamw", lora_r=8)
    assert "full fine-tunes only" in engines.refusal(run, cuda=True)
    assert engines.refusal(run.replace(lora_r=0), cuda=True) is None
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")  # no DeepSpeed launch: FSDP2 runs LoRA under zero2
    assert engines.refusal(run, cuda=True) is None


@pytest.mark.parametrize(("env", "message"), [
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "zero_stage: 3 but --sharding zero2 means ZeRO stage 2"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "offload_optimizer_device: cpu"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}, "offload_param_device: nvme"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"}, "names a deepspeed_config_file"),
])
def test_accelerate_deepspeed_config_that_disagrees_is_refused(env, message):
    with pytest.raises(UserError, match=message):
        sharding.check_launch(RunConfig.of(sharding="zero2"), 2, env={"ACCELERATE_USE_DEEPSPEED": "true", **env})
    sharding.check_launch(RunConfig.of(sharding="zero2"), 2, env={"ACCELERATE_USE_DEEPSPEED": "true",
                                                                "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})


def test_accumulation_clipping_and_state_dict_must_agree():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    ds = {"placeholder": 1}
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                  state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds)))
    run = RunConfig.of(sharding="zero3", grad_accum=2, micro_batch=1, num_processes=2, optimizer="adamw")
    config = TrainConfig.of(run=run, max_grad_norm=1.0)
    with pytest.raises(UserError, match="gradient_accumulation_steps: 1 but the run accumulates 2"):
        deepspeed_engine.configure(accelerator, run, config, env={"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1"})
    with pytest.raises(UserError, match="gradient_clipping: 0.5 but --max-grad-norm is 1.0"):
        deepspeed_engine.configure(accelerator, run, config, env={"ACCELERATE_GRADIENT_CLIPPING": "0.5"})
    with pytest.raises(UserError, match="--state-dict full is for FSDP2"):
        deepspeed_engine.configure(accelerator, run, TrainConfig.of(run=run, state_dict="full"), env={})
    assert ds == {"placeholder": 1}  # nothing installed by a refused configure
    deepspeed_engine.configure(accelerator, run, config, hidden_size=64,
                               env={"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2", "ACCELERATE_GRADIENT_CLIPPING": "1.0"})
    assert ds == deepspeed_engine.ds_config(run, max_grad_norm=1.0, hidden_size=64)


def test_checkpoints_resume_only_under_the_engine_stage_and_ranks_that_wrote_them(tmp_path):
    run = RunConfig.of(sharding="zero2")
    with pytest.raises(UserError, match="was not written by DeepSpeed"):
        deepspeed_engine.check_resumable(str(tmp_path), run, 2, deepspeed=True)
    deepspeed_engine.check_resumable(str(tmp_path), run, 2, deepspeed=False)  # not DeepSpeed's: others decide
    (tmp_path / deepspeed_engine.MARKER).write_text(json.dumps({"stage": 2, "num_processes": 2}))
    deepspeed_engine.check_resumable(str(tmp_path), run, 2, deepspeed=True)
    with pytest.raises(UserError, match="only a DeepSpeed launch can resume"):
        deepspeed_engine.check_resumable(str(tmp_path), run, 2, deepspeed=False)
    with pytest.raises(UserError, match="ZeRO-2 partitions of 2 ranks; resume it with the same stage and number"):
        deepspeed_engine.check_resumable(str(tmp_path), run, 4, deepspeed=True)


def test_cli_refuses_lora_under_a_deepspeed_launch_in_one_sentence_and_writes_nothing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from memfit.cli import cli

    out = tmp_path / "out"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # in-process: the refusal, not the launch, is the point
    result = CliRunner().invoke(cli, ["train", "--model", "tiny", "--sharding", "zero2", "--lora-r", "8",
                                      "--max-steps", "1", "--output", str(out)])
    # exit 1 by memfit's own SystemExit (an uncaught exception would be the traceback), nothing on stdout
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit) and "Traceback" not in result.stderr
    expected = "full fine-tunes only" if HAS_DEEPSPEED else "not installed"
    assert expected in result.stderr + result.stdout
    assert not out.exists()


def test_no_rollback_snapshot_is_predicted_under_deepspeed(monkeypatch):
    # DeepSpeed steps inside backward and leaves no gradients for memfit's snapshot to copy: the CPU
    # prediction must not add it (it did: 147.7 MiB predicted against 111.4 measured for the tiny preset)
    from memfit.memory.estimate import estimate, rollback_snapshot_bytes
    from memfit.memory.snapshot import device_estimate
    from memfit.spec.model import load_spec

    spec, run = load_spec("tiny"), RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw", num_processes=2,
                                             sharding="zero2")
    plain = estimate(spec, run, device="cpu").peak_bytes
    assert device_estimate(spec, run, "cpu").peak_bytes == plain + rollback_snapshot_bytes(spec, run)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # the launch's engine: DeepSpeed's layout, no snapshot
    assert device_estimate(spec, run, "cpu").peak_bytes == estimate(spec, run, device="cpu",
                                                                     engine="deepspeed").peak_bytes


# --------------------------------------------------------------------------- per-rank memory, predicted
# The tiny preset (6.5 M params, fp32 AdamW, single-tensor on CPU), seq 128 x micro-batch 2, the shipped corpus
# packed with ``concat`` (every row 128 tokens: with ``documents`` a rank's micro-batch can be shorter, which
# was the 9 MiB between the ranks once measured), step 3 counted on live tensors by ``measure.StepPeak``.
# Measured 2026-12-01 (deepspeed 0.19.8, torch 2.13), MiB per rank (rank 0 / rank 1) against the prediction
# (``memory.deepspeed_layout`` through ``estimate(..., engine="deepspeed", rank=r)``):
#   ZeRO-2 111.43 / 119.17, predicted 111.45 / 118.66 (+0.02% / -0.43%): rank 0's peak is the step (whole
#     fp32 parameters 24.77 + master, moments and gradient partition 4 x 12.38 + the flat gradient copy and
#     AdamW's 2 temporaries 3 x 12.38); rank 1, which owns the head, holds its gradient partition from
#     backward's start, rank 0 only from the 5th layer down (``deepspeed_layout.partition_reached``).
#   ZeRO-3 130.92 / 130.92, predicted 131.04 (+0.09%): backward's start, with every parameter still gathered
#     (autograd saves the gathered projection weights: ``deepspeed_layout.gathered_zero3``) on top of 5 x 12.38
#     of partitions (bit16, gradients, fp32 master, 2 moments) and the 0.25 MiB reduce bucket.
# The FSDP2 layout predicted 111.5 (zero2) and 88.8 (zero3) for the same runs. Mutations (each term broken on
# purpose, this test failing): see the report of the change that added it.
DS_MEMORY_ARGS = ["--model", "tiny", "--seq-len", "128", "--micro-batch", "2", "--max-steps", "3", "--optimizer",
                  "adamw", "--packing", "concat", "--eval-every", "0", "--eval-fraction", "0", "--samples", "0",
                  "--save-every", "0", "--log-every", "1", "--max-grad-norm", "1.0"]


@needs_deepspeed
@pytest.mark.slow  # ~50-60 s per stage on 2 shared cores (importing deepspeed is ~10 s of it)
@pytest.mark.parametrize(("flag", "stage"), [("zero2", 2), ("zero3", 3)])
def test_deepspeed_per_rank_peak_matches_the_prediction(tmp_path, flag, stage):
    from memfit.memory.estimate import estimate
    from memfit.spec.model import load_spec
    from memfit.units import MiB

    out = tmp_path / "out"
    env = {**_ds_env(stage), "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1"}  # clipping 1.0, as the flags say
    proc = gloo_launch("-m", "memfit", "train", *DS_MEMORY_ARGS, "--sharding", flag, "--output", str(out),
                       env=env, timeout=500)
    assert proc.returncode == 0, _rank0_error(proc)
    measured = json.loads((out / "run.json").read_text())["rank_peak_bytes"]
    run = RunConfig.of(seq_len=128, micro_batch=2, optimizer="adamw", num_processes=2, sharding=flag, packing="concat")
    spec = load_spec("tiny")
    predicted = [estimate(spec, run, device="cpu", engine="deepspeed", rank=r).peak_bytes for r in range(2)]
    errors = [(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    assert all(abs(e) < 0.03 for e in errors), (
        f"predicted {[round(p / MiB, 2) for p in predicted]} MiB, measured {[round(m / MiB, 2) for m in measured]}")
    # the preamble shows the largest rank's prediction, named as DeepSpeed's
    text = " ".join((proc.stdout + proc.stderr).split())
    assert f"{flag} (DeepSpeed) over 2 processes" in text
    assert estimate(spec, run, device="cpu", engine="deepspeed").peak_bytes == max(predicted)


def test_deepspeed_layout_differs_from_fsdp2_only_where_deepspeed_runs():
    from memfit.memory.estimate import estimate
    from memfit.spec.model import load_spec

    spec = load_spec("tiny")
    for flag in ("ddp", "fsdp"):  # not DeepSpeed's: the engine changes nothing
        run = RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw", num_processes=2, sharding=flag)
        assert estimate(spec, run, device="cpu", engine="deepspeed") == estimate(spec, run, device="cpu")
    run = RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw", num_processes=2, sharding="zero3")
    ds = estimate(spec, run, device="cpu", engine="deepspeed")
    # ZeRO-3 keeps 5 partitions (bit16 weights, gradients, fp32 master, 2 moments) and the whole model gathered
    assert ds.optimizer == 3 * 4 * spec.params // 2
    assert ds.peak_bytes > estimate(spec, run, device="cpu").peak_bytes
    with pytest.raises(UserError, match="engine must be one of fsdp2, deepspeed"):
        estimate(spec, run, device="cpu", engine="megatron")
