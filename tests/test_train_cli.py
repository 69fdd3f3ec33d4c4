"""memfit train through the CLI: every bad input is one sentence and exit 1; --config; --json."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from _train_helpers import assert_one_sentence, write_model, write_qa
from memfit.cli import cli


class NothingTrained(Exception):
    """Raised by a fake run_training: the test only looks at the config the CLI built."""

def _run(args):
    return CliRunner().invoke(cli, ["train", *args])


def _fast(tmp_path, *extra):
    return ["--model", write_model(tmp_path / "m"), "--tokenizer", "byte", "--data", write_qa(tmp_path),
            "--seq-len", "64", "--micro-batch", "4", "--max-steps", "2", "--eval-every", "0", "--samples", "0",
            "--packing", "none", "--output", str(tmp_path / "out"), *extra]


def _bad_inputs(tmp):
    empty = tmp / "empty.txt"
    empty.write_text("")
    broken = tmp / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": oops}\n')
    not_lm = tmp / "resnet"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    taken = tmp / "taken"
    taken.mkdir()
    (taken / "run.json").write_text("{}")
    return {
        "missing data": (["--data", str(tmp / "nope.txt")], "does not exist"),
        "empty data": (["--data", str(empty)], "is empty"),
        "malformed jsonl": (["--data", str(broken)], f"{broken} line 2 is not valid JSON"),
        "unknown preset": (["--model", "tinyy"], "Did you mean tiny"),
        "not a causal LM": (["--model", str(not_lm)], "cannot build as a causal language model"),
        "seq-len beyond positions": (["--seq-len", "512"], "beyond the model's 256 positions"),
        "resume without checkpoint": (["--resume", "--output", str(tmp / "fresh")], "found no checkpoint"),
        "output holds another run": (["--output", str(taken)], "already holds a training run; pass --overwrite"),
        "batch not a multiple": (["--batch", "6"], "is not a multiple of micro-batch x processes = 4"),
    }


@pytest.mark.parametrize("case", [
    "missing data", "empty data", "malformed jsonl", "unknown preset", "not a causal LM",
    "seq-len beyond positions", "resume without checkpoint", "output holds another run", "batch not a multiple"])
def test_bad_input_is_one_sentence(tmp_path, case):
    args, pattern = _bad_inputs(tmp_path)[case]
    assert_one_sentence(_run(_fast(tmp_path, *args)), pattern)
    # Model, tokenizer, data and lengths are checked before the output folder is created: nothing is left behind.
    assert not (tmp_path / "out").exists() and not (tmp_path / "fresh").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 autocast is refused on CPU only")
def test_fp16_on_cpu_is_refused(tmp_path):
    assert_one_sentence(_run(_fast(tmp_path, "--mixed-precision", "fp16")), "use --mixed-precision bf16")


def test_config_file_and_explicit_flags(tmp_path, monkeypatch):
    seen = {}

    def fake_train(config, **kwargs):  # record the config, train nothing
        seen["config"] = config
        raise NothingTrained

    import memfit

    monkeypatch.setattr(memfit, "train", fake_train)  # the name the CLI calls
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"micro_batch": 2, "grad_accum": 3, "max_steps": 7, "lr": 0.01, "lora_r": 8}))
    result = _run(["--config", str(cfg), "--max-steps", "3"])
    assert isinstance(result.exception, NothingTrained), result.output
    config = seen["config"]
    assert (config.run.micro_batch, config.run.grad_accum, config.run.lora.r) == (2, 3, 8)  # from the file
    assert config.length.max_steps == 3 and config.optim.lr == 0.01  # typed flag wins over the file
    assert set(config.pinned) == {"micro_batch", "grad_accum", "lora_r"}


def test_json_summary_on_stdout(tmp_path):
    result = CliRunner().invoke(cli, ["train", *_fast(tmp_path, "--json")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # nothing else on stdout (the progress bar is on stderr)
    assert summary["steps"] == 2 and summary["sequences"] == 8
    assert summary["final_eval_loss"] is None  # no held-out evaluation was asked for: null, not NaN
    assert summary["peak_memory"]["device"] == "cpu"


def test_help_has_examples():
    result = _run(["--help"])
    assert result.exit_code == 0 and "Examples:" in result.output and "--check-equivalence" in result.output
