"""Defaults for real runs (issue 22, item 2): --seq-len from the data, --lr by method, one epoch, --truncate;
the demo keeps its own; LoRA options without --lora-r are refused (item 7)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from _train_helpers import TINY_LLAMA, write_model, write_qa
from memfit.cli import cli
from memfit.settings import defaults
from memfit.settings.config import RunConfig, TrainConfig
from memfit.training import derived


def _text_records(path, sizes):
    """One ``{"text": ...}`` record of ``n`` bytes per size: the byte tokenizer makes it ``n + 2`` tokens
    (bos + one token per byte + eos), so the lengths the percentile reads are known exactly."""
    path.write_text("".join(json.dumps({"text": "a" * n}) + "\n" for n in sizes))
    return str(path)


def _user_config(tmp_path, data, **overrides) -> TrainConfig:
    """A real run as the CLI builds it: the user's model and data, nothing else given (``explicit=()``)."""
    base = dict(model=write_model(tmp_path / "model"), tokenizer="byte", data=data, eval_fraction=0.0,
                explicit=(), output=str(tmp_path / "out"))
    return TrainConfig.of(**{**base, **overrides})


def test_seq_len_is_the_99th_percentile_of_the_tokenized_lengths_rounded_up(tmp_path):
    # 99 records of 20..118 bytes (22..120 tokens) and one of 300 bytes (302 tokens). Nearest rank: the
    # 99th shortest of 100 (ceil(0.99 x 100) = 99) is 120 tokens; rounded up to a multiple of 64: 128.
    # Only the 302-token record is longer.
    data = _text_records(tmp_path / "d.jsonl", [*range(20, 119), 300])
    config, note = derived.with_seq_len(_user_config(tmp_path, data), resumed=False)
    assert config.run.seq_len == 128
    assert note == ("seq-len 128 (99th percentile of 100 tokenized training records, 120 tokens, rounded up to a "
                    "multiple of 64; 1 record(s) longer; --seq-len to choose)")


def test_seq_len_is_capped_by_the_model_context(tmp_path):
    # 300 bytes = 302 tokens -> 320 rounded up, beyond TINY_LLAMA's 256 positions: 256
    data = _text_records(tmp_path / "d.jsonl", [300] * 10)
    config, note = derived.with_seq_len(_user_config(tmp_path, data), resumed=False)
    assert config.run.seq_len == TINY_LLAMA["max_position_embeddings"] == 256
    assert "302 tokens, capped by the model's context of 256; 10 record(s) longer" in note


def test_given_seq_len_demo_and_resume_are_not_derived(tmp_path):
    data = _text_records(tmp_path / "d.jsonl", [300] * 10)
    given = _user_config(tmp_path, data, run=RunConfig.of(seq_len=64), explicit=("seq_len",))
    assert derived.with_seq_len(given, resumed=False) == (given, None)
    assert derived.with_seq_len(_user_config(tmp_path, data), resumed=True)[0].run.seq_len == 128  # the restored length stays
    demo = TrainConfig.of(explicit=())
    assert derived.with_seq_len(demo, resumed=False) == (demo, None)


@pytest.mark.parametrize(("random_init", "lora", "lr", "why"), [
    (True, False, 1e-3, "random weights"), (True, True, 1e-3, "random weights"),
    (False, True, 2e-4, "LoRA default"), (False, False, 2e-5, "full fine-tune of a pretrained model")])
def test_lr_by_method(tmp_path, random_init, lora, lr, why):
    config, note = derived.with_lr(_user_config(tmp_path, "d.jsonl"), random_init=random_init, lora=lora)
    assert config.optim.lr == lr
    assert note == f"lr {defaults.fmt_lr(lr)} ({why}; --lr to choose)"
    given = _user_config(tmp_path, "d.jsonl", lr=0.05)
    assert derived.with_lr(given, random_init=random_init, lora=lora) == (given, None)


def test_demo_defaults_are_unchanged(tmp_path):
    """No --model, no --data: 128 x 4, lr 1e-3, 300 steps, and no "default ..." line (docs show this run)."""
    demo = TrainConfig.of(explicit=())
    assert (demo.run.seq_len, demo.run.micro_batch, demo.optim.warmup_steps) == (128, 4, 10)
    assert derived.with_lr(demo, random_init=True, lora=False) == (TrainConfig.of(explicit=(), lr=1e-3), None)
    assert derived.total_steps(demo, steps_per_epoch=25) == (300, None)
    assert derived.total_steps(_user_config(tmp_path, "d.jsonl"), steps_per_epoch=25)[0] == 25  # a real run: 1 epoch


def _train(*args):
    return CliRunner().invoke(cli, ["train", "--tokenizer", "byte", "--eval-every", "0", "--samples", "0", *args])


def test_a_real_run_derives_and_names_its_defaults_and_resume_keeps_them(tmp_path, monkeypatch):
    data = _text_records(tmp_path / "d.jsonl", [*range(20, 119), 300])
    out = tmp_path / "out"
    result = _train("--model", write_model(tmp_path / "m"), "--data", data, "--eval-fraction", "0",
                    "--micro-batch", "8", "--output", str(out))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the preamble wraps at the terminal's width
    assert "default seq-len 128 (99th percentile of 100 tokenized training records, 120 tokens" in text
    assert "default lr 1e-3 (random weights; --lr to choose)" in text
    run = json.loads((out / "run.json").read_text())
    steps = run["steps"]
    assert f"default 1 epoch = {steps} step(s) (neither --epochs nor --max-steps given" in text
    assert run["run"]["seq_len"] == 128 and run["settings"]["lr"] == 1e-3
    # --resume continues with the saved length and lr: nothing is derived again (a changed file could give another)
    monkeypatch.setattr(defaults, "seq_len_from_lengths", lambda *a: pytest.fail("--resume derived the seq-len"))
    again = _train("--output", str(out), "--resume", "--max-steps", str(steps + 1), "--extend-schedule")
    assert again.exit_code == 0, again.output
    assert "default " not in " ".join(again.output.split())
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["steps"] == steps + 1 and resumed["run"]["seq_len"] == 128 and resumed["settings"]["lr"] == 1e-3


def _fast(tmp_path, *extra):
    """24 QA records, 4 per step, no packing, nothing held out: 6 steps per epoch."""
    return ["--model", write_model(tmp_path / "m"), "--data", write_qa(tmp_path), "--seq-len", "64",
            "--micro-batch", "4", "--packing", "none", "--eval-fraction", "0", "--optimizer", "sgd",
            "--save-every", "0", *extra]


def test_epochs_are_never_capped_by_a_max_steps_not_given_with_them(tmp_path):
    first = _train(*_fast(tmp_path), "--max-steps", "2", "--save-every", "2", "--output", str(tmp_path / "out"))
    assert first.exit_code == 0, first.output
    # the run saved --max-steps 2; an --epochs given on resume is not capped by it
    again = _train("--output", str(tmp_path / "out"), "--resume", "--epochs", "3", "--extend-schedule")
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "out" / "run.json").read_text())["steps"] == 3 * 6
    fresh = _train(*_fast(tmp_path), "--epochs", "3", "--output", str(tmp_path / "fresh"))
    assert fresh.exit_code == 0, fresh.output
    assert json.loads((tmp_path / "fresh" / "run.json").read_text())["steps"] == 3 * 6


def _chats(path, questions: list[int], reply: str = "ok"):
    """Conversations with questions of the given byte sizes and a short reply."""
    lines = [json.dumps({"messages": [{"role": "user", "content": "q" * n}, {"role": "assistant", "content": reply}]})
             for n in questions]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_truncate_keeps_long_conversations_cut_where_the_cut_keeps_a_reply(tmp_path):
    from _data_helpers import tokenize
    from memfit.data.arrow import tokenize_dataset
    from memfit.data.dataset import byte_tokenizer
    from memfit.data.formats import Fields
    from memfit.data.sources import load_examples, load_parts

    # byte chat template: ~27 marker tokens a conversation; a 20-byte question fits 64 tokens with
    # its reply, a 100-byte one does not (its reply starts after the cut), a multi-turn one keeps its first turn
    path = tmp_path / "c.jsonl"
    short, long_question = {"messages": [{"role": "user", "content": "q" * 20}, {"role": "assistant", "content": "ok"}]}, \
        {"messages": [{"role": "user", "content": "q" * 100}, {"role": "assistant", "content": "ok"}]}
    turns = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                          {"role": "user", "content": "q" * 100}, {"role": "assistant", "content": "ok"}]}
    path.write_text("\n".join(json.dumps(r) for r in (short, long_question, turns)) + "\n")
    tok = byte_tokenizer()
    common = dict(seq_len=64, packing="documents", eval_fraction=0.0, seed=0)
    dropped = tokenize(load_examples(str(path)), tok, **common)
    assert (dropped.dropped_long, dropped.truncated_long, len(dropped.train)) == (2, 0, 1)
    cut = tokenize(load_examples(str(path)), tok, truncate=True, **common)
    assert (cut.dropped_long, cut.truncated_long) == (1, 1)  # the multi-turn one kept, its first reply whole
    assert sum(len(row["input_ids"]) for row in cut.train) == sum(len(row["input_ids"]) for row in dropped.train) + 64
    parts = [(part.ds, part.where, None, Fields()) for part in load_parts(str(path))]
    arrow = tokenize_dataset(parts, tok, fmt=None, fields=Fields(), train_on_prompt=False, num_proc=1, where="c",
                             truncate=True, **common)
    assert (arrow.dropped_long, arrow.truncated_long) == (1, 1)
    assert list(arrow.train) == cut.train  # the on-disk path cuts exactly as the in-memory one


def test_truncate_on_the_command_line(tmp_path):
    # short questions, 100-byte replies: longer than --seq-len 64, the cut keeps the start of the reply
    args = ["--model", write_model(tmp_path / "m"), "--data", _chats(tmp_path / "c.jsonl", [10] * 8, "x" * 100),
            "--seq-len", "64", "--max-steps", "1"]
    refused = _train(*args, "--output", str(tmp_path / "a"))
    assert refused.exit_code == 1, refused.output
    assert "8 conversation(s) longer than --seq-len 64 were dropped; raise --seq-len, or add --truncate" in refused.output
    kept = _train(*args, "--output", str(tmp_path / "b"), "--truncate")
    assert kept.exit_code == 0, kept.output
    assert "8 conversation(s) longer than --seq-len 64 cut to it (--truncate)" in " ".join(kept.output.split())


class NothingTrained(Exception):
    """Raised by a fake run_training: these tests only look at the config the CLI built."""


@pytest.fixture
def built(monkeypatch):
    """The ``TrainConfig`` ``memfit train`` hands to ``memfit.train`` (which then trains nothing)."""
    import memfit

    seen = {}

    def fake(config, **_):
        seen["config"] = config
        raise NothingTrained

    monkeypatch.setattr(memfit, "train", fake)  # the name the CLI calls
    return seen


@pytest.mark.parametrize("args", [["train", "--lora-targets", "q_proj"], ["estimate", "tiny", "--lora-alpha", "32"],
                                  ["plan", "tiny", "--full", "--lora-dropout", "0.1"]])
def test_lora_options_without_lora_r_are_refused(args, built):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "which only --lora-r turns on; add --lora-r" in lines[0], result.output


def test_lora_options_with_lora_r_given_are_accepted(tmp_path, built):
    # the planner's launch line spells out every setting of a full fine-tune: --lora-r 0 is given
    launch = ["train", "--lora-r", "0", "--lora-alpha", "16.0", "--lora-targets", "all-linear"]
    assert isinstance(CliRunner().invoke(cli, launch).exception, NothingTrained)
    plan = tmp_path / "plan.yaml"
    plan.write_text("lora_r: 8\n")
    assert isinstance(CliRunner().invoke(cli, ["train", "--config", str(plan), "--lora-targets", "q_proj"]).exception,
                      NothingTrained)
    assert built["config"].run.lora.r == 8 and built["config"].run.lora.targets == ("q_proj",)
    plan.write_text("lora_targets: q_proj\n")
    refused = CliRunner().invoke(cli, ["train", "--config", str(plan)])
    assert refused.exit_code == 1 and "--lora-targets shapes LoRA adapters" in refused.output


def test_a_library_run_without_lr_resumes_with_its_saved_lr(tmp_path):
    """``TrainConfig.of(lr=None)`` is "not given": ``--resume`` takes the run's derived lr instead of
    refusing "--lr differs"."""
    from _train_helpers import tiny_config
    from memfit.training.loop import run_training

    cfg = tiny_config(tmp_path, max_steps=2, save_every=2).replace(lr=None)
    run_training(cfg, show=False)
    resumed = run_training(cfg.replace(resume=True, max_steps=3, extend_schedule=True), show=False)
    assert resumed.summary.steps == 3
    assert json.loads((tmp_path / "out" / "run.json").read_text())["settings"]["lr"] == 1e-3  # random weights


# --------------------------------------------------- one meaning per default: estimate, plan and train agree


def _json(*args):
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_estimate_and_plan_default_to_the_run_train_runs_with_no_flags():
    """``memfit estimate tiny`` prices the step ``memfit train`` (the tiny demo) runs, and ``memfit plan tiny``
    searches for that run's effective batch at its length."""
    train_run = TrainConfig.of(explicit=()).run  # what `memfit train` runs given nothing
    priced = _json("estimate", "tiny")["config"]
    assert (priced["seq_len"], priced["micro_batch"], priced["grad_accum"]) == \
        (train_run.seq_len, train_run.micro_batch, train_run.grad_accum) == (128, 4, 1)
    best = _json("plan", "tiny", "--budget", "2GiB")["plans"][0]["config"]
    assert best["seq_len"] == train_run.seq_len
    assert best["micro_batch"] * best["grad_accum"] == train_run.micro_batch * train_run.grad_accum


def test_with_data_estimate_and_plan_derive_the_length_train_derives(tmp_path):
    data = _text_records(tmp_path / "d.jsonl", [*range(20, 150), 300])  # 99th percentile 151 tokens: 192 (128 records: 3 held out)
    model = write_model(tmp_path / "model")
    trained, _ = derived.with_seq_len(_user_config(tmp_path, data), resumed=False)
    assert trained.run.seq_len == 192
    shape = ("--data", data, "--tokenizer", "byte")
    assert _json("estimate", model, *shape)["config"]["seq_len"] == trained.run.seq_len
    assert _json("plan", model, *shape, "--budget", "1GiB")["plans"][0]["config"]["seq_len"] == trained.run.seq_len
    result = CliRunner().invoke(cli, ["estimate", model, *shape])
    assert "seq-len 192 (99th percentile of 128 tokenized training records, 151 tokens" in " ".join(result.output.split())


def test_a_model_of_few_positions_is_planned_within_them(tmp_path):
    """``memfit plan MODEL --budget`` on a model with fewer positions than the default length: the length is
    capped by the model's context (as train caps the length it derives) and the difference is said, not
    refused ("--seq-len 1024 is beyond the model's 512 positions" before)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**TINY_LLAMA, "max_position_embeddings": 96}))
    model = str(tmp_path / "m")
    assert _json("plan", model, "--budget", "1GiB")["plans"][0]["config"]["seq_len"] == 96
    result = CliRunner().invoke(cli, ["estimate", model])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "seq 96 x micro-batch 4" in text and "derives it from its data, the shipped corpus without --data" in text


def test_estimate_says_where_train_s_default_precision_depends_on_the_gpu():
    """``memfit train`` on a GPU with bf16 autocasts in bf16 when no --mixed-precision is given
    (``training.setup.default_precision``); an estimate for a CUDA target cannot know that GPU, so it prices
    none and says so, and stays quiet once the precision is given or the target is the CPU (train's default
    there is none too)."""
    def words(*args: str) -> str:  # the output as words (rich wraps at the terminal's width)
        return " ".join(CliRunner().invoke(cli, ["estimate", "tiny", *args]).output.split())

    assert defaults.PRECISION_ON_A_GPU in words()
    assert defaults.PRECISION_ON_A_GPU not in words("--mixed-precision", "bf16")
    assert defaults.PRECISION_ON_A_GPU not in words("--device", "cpu")
