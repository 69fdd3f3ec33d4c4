"""memfit train's options around the loop: --budget, --check-equivalence, --tracker tensorboard, the
default output folder, end-of-run samples, and the bf16 default on a GPU.

Every run is 1-3 optimizer steps of the 2-layer hidden-64 Llama of ``_train_helpers`` on 2 CPU cores.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from _train_helpers import write_model, write_qa, write_text
from memfit.cli import cli
from memfit.data.dataset import Example, split_documents
from memfit.data.sources import load_examples


class NothingTrained(Exception):
    """Raised by a fake run_training: the test only looks at the config the CLI built."""

def _run(args):
    return CliRunner().invoke(cli, ["train", *args])


def _args(tmp_path, *extra, data=None):
    """A 2-step run of 4 sequences; no --output unless given in ``extra``."""
    return ["--model", write_model(tmp_path / "m"), "--tokenizer", "byte", "--data", data or write_qa(tmp_path),
            "--seq-len", "64", "--micro-batch", "4", "--max-steps", "2", "--eval-every", "0", "--samples", "0",
            "--packing", "none", "--optimizer", "sgd", *extra]


def _error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.output
    return lines[0]


# --------------------------------------------------------------------------------------------- --budget
def test_budget_trains_the_chosen_plan_with_the_asked_batch(tmp_path):
    # --batch 8 is the effective batch; --dtype fp32 was typed so the planner must keep it; no --lora-r,
    # so a full fine-tune. 1 GiB holds every candidate of this 0.1 M-parameter model (a few MiB predicted
    # on this CPU, no CUDA context), so the planner's fastest plan is the one trained.
    out = tmp_path / "out"
    result = _run(_args(tmp_path, "--budget", "1GiB", "--batch", "8", "--dtype", "fp32", "--max-steps", "1",
                        "--output", str(out), "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    plan = summary["plan"]
    chosen = plan["chosen"]["config"]
    assert summary["run"] == chosen  # trained exactly what the planner chose (no OOM fallback happened)
    assert summary["fallbacks"] == []
    assert chosen["micro_batch"] * chosen["grad_accum"] * chosen["num_processes"] == 8
    assert chosen["dtype"] == "fp32" and chosen["lora_r"] == 0 and chosen["seq_len"] == 64
    assert plan["chosen"]["peak_bytes"] * (1 + plan["safety_margin"]) <= plan["budget_bytes"] == 2**30
    assert summary["sequences"] == 8  # one step of the effective batch
    assert json.loads((out / "run.json").read_text())["plan"] == plan
    assert f"plan for 1GiB: {plan['description']}" in result.output.replace("\n", " ")  # shown before training


def test_budget_keeps_lora_rank_when_given(tmp_path):
    from memfit.settings.config import TrainConfig
    from memfit.training.budget import constraints_for

    config = TrainConfig.from_flat({"model": "tiny", "lora_r": 8, "mixed_precision": "bf16",
                                    "pinned": ("lora_r", "mixed_precision", "micro_batch")})
    pins = constraints_for(config, config.run)
    assert pins["lora_r"] == 8 and pins["mixed_precision"] == "bf16" and "micro_batch" not in pins
    assert constraints_for(TrainConfig(), TrainConfig().run)["lora_r"] == 0  # nothing typed: full fine-tune
    assert "dtype" not in constraints_for(TrainConfig(), TrainConfig().run)  # untyped: the planner's choice


def test_budget_on_a_cpu_computes_in_fp32_where_an_fp32_plan_fits(tmp_path):
    # No CUDA here. The planner ranks by the reference GPU's speeds, where bf16 is the faster, but a CPU
    # without bf16 matrix units runs bf16 ~15x slower (training/budget.CPU_PRECISION): so with no precision
    # typed, fp32 plans come first, and a budget no fp32 plan fits is planned again with bf16 allowed.
    from memfit.planning.search import plan
    from memfit.planning.space import Constraints
    from memfit.settings.config import DType, Precision, TrainConfig
    from memfit.training.budget import constraints_for, cpu_pins, plan_line, plan_run

    model = write_model(tmp_path / "m")
    flat = {"model": model, "tokenizer": "byte", "seq_len": 64, "micro_batch": 8, "pinned": ("seq_len",)}
    roomy = TrainConfig.from_flat({**flat, "budget": "1GiB"})
    chosen, result = plan_run(roomy, roomy.run)
    assert (chosen.dtype, chosen.mixed_precision) == (DType.FP32, Precision.NO)
    assert "fp32 plans first on a CPU" in plan_line(roomy, result, cuda=False)
    assert "fp32 plans first" not in plan_line(roomy, result, cuda=True)  # a GPU ranks its own speeds

    # Unpinned, every plan of this model fits 1 GiB and a bf16 one ranks first: the pin is what chose fp32.
    every = plan(model, "1GiB", seq_len=64, batch=8, cpu=True,
                 constraints=Constraints.from_flat(constraints_for(roomy, roomy.run)))
    assert (every.best.config.dtype, every.best.config.mixed_precision) != (DType.FP32, Precision.NO)

    # A budget between the smallest bf16 peak and the smallest fp32 one: only bf16 plans fit, and one is trained.
    def smallest(dtype):
        return min(p.peak_bytes for p in every.plans if p.config.dtype is dtype)

    bf16, fp32 = smallest(DType.BF16), smallest(DType.FP32)
    assert bf16 < fp32
    budget = int((bf16 + fp32) / 2 * (1 + every.safety_margin))
    tight = TrainConfig.from_flat({**flat, "budget": str(budget)})
    chosen, result = plan_run(tight, tight.run)
    assert chosen.dtype is DType.BF16 and result.best.peak_bytes * (1 + result.safety_margin) <= budget
    assert "the planner has no fp32 plan that fits" in plan_line(tight, result, cuda=False)

    # A typed precision is the user's: only the other one is pinned first.
    typed = TrainConfig.from_flat({**flat, "budget": "1GiB", "mixed_precision": "bf16",
                                   "pinned": ("seq_len", "mixed_precision")})
    assert cpu_pins(typed, cuda=False) == {"dtype": "fp32"} and cpu_pins(typed, cuda=True) == {}
    chosen, _ = plan_run(typed, typed.run)
    assert (chosen.dtype, chosen.mixed_precision) == (DType.FP32, Precision.BF16)

    # LoRA: on a CPU the planner has an fp32 LoRA regime (planning/space.regimes(cpu=True)), which the pin picks.
    lora = TrainConfig.from_flat({**flat, "budget": "1GiB", "lora_r": 8, "pinned": ("seq_len", "lora_r")})
    chosen, result = plan_run(lora, lora.run)
    assert chosen.lora.r == 8 and (chosen.dtype, chosen.mixed_precision) == (DType.FP32, Precision.NO)
    assert "fp32 plans first on a CPU" in plan_line(lora, result, cuda=False)
    gpu_regimes = {(r.config.dtype, r.config.mixed_precision) for r in plan(
        model, "1GiB", seq_len=64, batch=8, constraints=Constraints.from_flat(constraints_for(lora, lora.run))).plans}
    assert (DType.FP32, Precision.NO) not in gpu_regimes  # a GPU plans LoRA with autocast only

    # A typed --quantize 4bit: the planner's QLoRA regimes all autocast, so the fp32 pass has no candidate
    # (NoCandidatesError) and the budget is planned again unpinned.
    from memfit.integrations import quant_support

    if quant_support.runs_on("cpu"):
        qlora = TrainConfig.from_flat({**flat, "budget": "1GiB", "lora_r": 8, "quantize": "4bit",
                                       "pinned": ("seq_len", "lora_r", "quantize")})
        chosen, result = plan_run(qlora, qlora.run)
        assert chosen.quantize.value == "4bit" and chosen.mixed_precision is Precision.BF16
        assert "the planner has no fp32 plan that fits" in plan_line(qlora, result, cuda=False)


def test_the_accelerator_autocasts_in_the_precision_the_budget_planned(tmp_path, monkeypatch):
    """--budget chooses the run before the Accelerator is built from it. On a CPU ``memfit train`` defaults to no
    autocast; a LoRA budget that only the bf16-autocast regimes fit is trained under bf16 autocast, not under the
    flags' "no" the plan replaced (the Accelerator was built from the flags before the plan: planned bf16 AMP,
    trained in fp32)."""
    from memfit.planning.search import plan
    from memfit.planning.space import Constraints
    from memfit.settings.config import Precision, TrainConfig
    from memfit.training import session
    from memfit.training.budget import constraints_for

    model = write_model(tmp_path / "m")
    lora = TrainConfig.from_flat({"model": model, "tokenizer": "byte", "seq_len": 64, "micro_batch": 4,
                                  "lora_r": 8, "optimizer": "sgd", "packing": "none", "budget": "1GiB",
                                  "pinned": ("seq_len", "lora_r", "optimizer", "packing")})  # as _args types them
    every = plan(model, "1GiB", seq_len=64, batch=4, cpu=True,
                 constraints=Constraints.from_flat(constraints_for(lora, lora.run))).plans
    amp = min(p.peak_bytes for p in every if p.config.mixed_precision is Precision.BF16)
    plain = min(p.peak_bytes for p in every if p.config.mixed_precision is Precision.NO)
    assert amp < plain
    budget = f"{int((amp + plain) / 2 * 1.05) // 1024}KiB"  # with the planner's 5% margin: only autocast plans fit
    built = []
    real_build = session.build_accelerator

    def recording(run, config):
        accelerator = real_build(run, config)
        built.append(accelerator.mixed_precision)
        return accelerator

    monkeypatch.setattr(session, "build_accelerator", recording)
    result = _run(_args(tmp_path, "--lora-r", "8", "--budget", budget, "--max-steps", "1", "--json"))
    assert result.exit_code == 0, result.output
    trained = json.loads(result.stdout)["run"]
    assert trained["mixed_precision"] == "bf16" and built == ["bf16"]


def test_a_budget_whose_fitting_plans_all_are_refused_names_the_refusal(tmp_path):
    # GPT-2 small (124 M, fp32 AdamW state: ~2 GB) fits 1 GiB on this CPU only with --optimizer-in-backward,
    # which cannot clip at the default --max-grad-norm 1.0: the sentence says so (it said "the fitting ones
    # need CUDA-only features" whatever the refusal was), and nothing is written.
    out = tmp_path / "out"
    line = _error_line(_run(["--model", "gpt2", "--tokenizer", "byte", "--data", write_qa(tmp_path), "--seq-len", "64",
                             "--batch", "4", "--budget", "1GiB", "--output", str(out)]))
    assert line == ("error: No plan that fits 1GiB can be trained on this machine (the fastest is refused: "
                    "--optimizer-in-backward steps each parameter before the global gradient norm is known, so it "
                    "cannot clip; add --max-grad-norm 0); try a larger --budget.")
    assert not out.exists()


def test_impossible_budget_is_the_planners_sentence_and_writes_nothing(tmp_path, monkeypatch):
    # No CUDA here: the budget is this CPU's memory, planned with CPU terms (no CUDA context, the rollback
    # snapshot counted), where this 0.1 M-parameter model's smallest plan needs ~1-3 MiB; 512 KiB holds none.
    monkeypatch.chdir(tmp_path)
    line = _error_line(_run(_args(tmp_path, "--budget", "512KiB", "--output", str(tmp_path / "out"))))
    assert "Nothing fits in 0.5 MiB with a 5% safety margin: the smallest peak reached on this CPU is" in line
    assert "so it needs a --budget of about" in line and "GPU" not in line  # a GPU's peak would differ
    assert not (tmp_path / "out").exists()
    _error_line(_run(_args(tmp_path, "--budget", "512KiB")))  # the default folder is not created either
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------- --check-equivalence
def test_check_equivalence_on_prompt_completion_data(tmp_path):
    # write_qa's prompts are 4 to ~60 bytes and completions 3 to ~20: the micro-batches of a step hold
    # different numbers of target tokens, where per-micro-batch mean losses would differ by far more.
    result = _run(["--check-equivalence", "--model", write_model(tmp_path / "m"), "--tokenizer", "byte",
                   "--data", write_qa(tmp_path), "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "4",
                   "--packing", "none"])
    assert result.exit_code == 0, result.output
    assert "8 x 1 vs 2 x 4, 3 steps (adamw, fp32): equivalent" in result.output
    diff = float(re.search(r"largest weight difference (\S+)", result.output).group(1))
    assert diff < 1e-6
    assert not list(tmp_path.glob("runs")), "the check trains in temporary folders"


# --------------------------------------------------------------------------------- --tracker tensorboard
def test_tensorboard_event_files_under_output(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "out"
    result = _run(_args(tmp_path, "--tracker", "tensorboard", "--output", str(out), "--log-every", "1"))
    assert result.exit_code == 0, result.output
    events = list(out.rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events), list(out.rglob("*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = set()
    for event_file in events:
        acc = EventAccumulator(str(event_file))
        acc.Reload()
        scalars |= set(acc.Tags()["scalars"])
    assert "loss" in scalars  # the per-step metrics reached TensorBoard, not just the hyper-parameters


# ----------------------------------------------------------------------------------- default output folder
def test_default_output_is_a_new_timestamped_folder_each_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _args(tmp_path, "--max-steps", "1", "--samples", "2", data=write_text(tmp_path))
    first, second = _run(args), _run(args)  # the same command twice: no "already holds a run"
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(folders) == 2, folders
    for name in folders:  # the model is m/config.json: its folder names the run
        assert re.fullmatch(r"m-\d{8}-\d{6}(-2)?", name), name
        assert (tmp_path / "runs" / name / "run.json").is_file()
    # Samples are printed after the summary table.
    assert first.output.index("memfit train: summary") < first.output.index("sample 1: ")


def test_default_output_never_reuses_a_folder(tmp_path):
    from memfit.training.runfolder.checkpoint import default_output

    now = 1_700_000_000.0
    first = default_output("tiny", tmp_path, now)
    assert re.fullmatch(r"tiny-\d{8}-\d{6}", first.name)
    first.mkdir()
    assert default_output("tiny", tmp_path, now).name == first.name + "-2"  # same second: a suffix
    assert default_output(str(tmp_path / "ckpt" / "Qwen 2.5"), tmp_path, now).name.startswith("Qwen-2.5-")


def test_resume_without_output_is_one_sentence(tmp_path):
    line = _error_line(_run(_args(tmp_path, "--resume")))
    assert line.startswith("error: --resume needs --output DIR")


# ------------------------------------------------------------------------------------------- samples
def test_sample_prompts_are_document_beginnings():
    from memfit.data.dataset import byte_tokenizer
    from memfit.training.samples import prompt_ids, prompt_text

    assert prompt_text(Example(text="Once upon a time, there was a duck.")) == "Once upon a time"
    assert prompt_text(Example(text="Lily found a kite. Lily liked it.")) == "Lily found a"  # not mid-word
    assert prompt_text(Example(prompt="Q: What is 2+2?\nA:", completion=" 4.")) == "Q: What is 2+2?\nA:"
    # The byte tokenizer: bos = 1, byte b = 3 + b ("O" = 79 -> 82): framed as a document starts in training.
    assert prompt_ids(byte_tokenizer(), "Once") == [1, 82, 113, 102, 104]


def test_samples_continue_held_out_documents(tmp_path):
    from _train_helpers import tiny_config
    from memfit.training.loop import run_training

    data = write_text(tmp_path)
    cfg = tiny_config(tmp_path, data=data, samples=3, eval_fraction=0.1, max_steps=1, packing=True)
    samples = run_training(cfg, show=False).summary.samples
    examples = load_examples(data)
    _, held = split_documents(len(examples), 0.1, cfg.seed)  # 6 of write_text's 60 documents
    assert len(held) == 6 and len(samples) == 3
    for sample, index in zip(samples, [held[0], held[2], held[4]], strict=True):  # spread over the held-out ones
        assert examples[index].text.startswith(sample["prompt"]) and len(sample["prompt"]) >= 8
        assert isinstance(sample["completion"], str)


def test_spread_picks_documents_across_the_corpus():
    from memfit.training.setup import spread

    assert spread(list(range(10)), 3) == [0, 3, 6]  # i * 10 // 3 for i = 0, 1, 2
    assert spread([5, 6], 3) == [5, 6] and spread([5, 6], 0) == []


# ------------------------------------------------------------------------------- GPU: bf16 by default
@pytest.mark.parametrize(("cuda", "bf16", "expected"), [(True, True, "bf16"), (True, False, "no"), (False, False, "no")])
def test_default_precision_follows_the_device(monkeypatch, cuda, bf16, expected):
    from memfit.training.setup import default_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert default_precision().value == expected


@pytest.mark.parametrize(("typed", "expected"), [((), "bf16"), (("--mixed-precision", "no"), "no")])
def test_cli_uses_bf16_on_a_bf16_gpu_unless_told(monkeypatch, typed, expected):
    import memfit

    seen = {}

    def fake_train(config, **kwargs):  # the decision is the CLI's; nothing is trained (there is no GPU here)
        seen["config"] = config
        raise NothingTrained

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(memfit, "train", fake_train)  # the name the CLI calls
    result = _run(list(typed))
    assert isinstance(result.exception, NothingTrained), result.output
    assert seen["config"].run.mixed_precision.value == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_is_built_on_the_gpu(tmp_path):
    from _train_helpers import tiny_config
    from memfit.training.setup import build_model

    cfg = tiny_config(tmp_path)
    bundle = build_model(cfg, cfg.run, device=torch.device("cuda"))
    assert {p.device.type for p in bundle.model.parameters()} == {"cuda"}
    cpu = build_model(cfg, cfg.run)
    assert {p.device.type for p in cpu.model.parameters()} == {"cpu"}


def test_model_built_on_cpu_when_asked(tmp_path):
    from _train_helpers import tiny_config
    from memfit.training.setup import build_model

    cfg = tiny_config(tmp_path)
    a = build_model(cfg, cfg.run, device=torch.device("cpu")).model
    b = build_model(cfg, cfg.run).model  # the default: CPU, as before
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert Path(cfg.source.model).is_file()


def test_from_memfit_train_to_loss_backward_are_four_frames(tmp_path, monkeypatch):
    """The training wing reads top to bottom: ``memfit.train`` -> ``fit`` (the loop) -> ``train_step`` (forward,
    backward, step) -> Accelerate's ``backward``, which calls ``loss.backward()``. (Before issue 37: seven frames
    from the CLI's command, with run_training, run_loop and run_step between.)"""
    import traceback

    stacks = []
    real_backward = torch.Tensor.backward

    def spy(self, *args, **kwargs):
        stacks.append(traceback.extract_stack()[:-1])
        return real_backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", spy)
    result = _run(_args(tmp_path, "--max-steps", "1", "--output", str(tmp_path / "out")))
    assert result.exit_code == 0, result.output
    stack = stacks[0]
    start = max(i for i, f in enumerate(stack) if f.name == "train" and f.filename.endswith("training/loop.py"))
    assert [f.name for f in stack[start:]] == ["train", "fit", "train_step", "backward"]


def test_the_session_and_its_parts_are_typed_without_any():
    """Issue 37: what ``fit`` and ``finish`` read is typed; no field of the session or of its named parts is ``Any``
    (or ``object``), so a reader can follow each one to its class."""
    import typing

    from memfit.planning.search import PlanResult
    from memfit.training import parts
    from memfit.training.session import TrainSession

    for cls in (TrainSession, parts.RunOutput, parts.TrainLoader, parts.HeldOut, parts.StepParts, parts.Planned,
                parts.Reporting):
        hints = typing.get_type_hints(cls, localns={"PlanResult": PlanResult})  # PlanResult: TYPE_CHECKING only
        assert hints, cls.__name__
        untyped = {name: hint for name, hint in hints.items() if hint is object or "Any" in str(hint)}
        assert not untyped, (cls.__name__, untyped)
