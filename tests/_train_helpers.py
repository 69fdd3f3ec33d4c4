"""Helpers for the train tests: a 2-layer hidden-64 Llama as a bare config.json (random init, no
download), small generated data files, and a ``TrainConfig`` sized to run in seconds on 2 CPU cores."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from memfit.settings.config import RunConfig, TrainConfig

TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

WORDS = "the cat sat on a warm mat and saw one red kite near old barn by river".split()


def write_model(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def write_qa(root: Path, n: int = 24, seed: int = 0) -> str:
    """prompt/completion records of very different lengths (4 to ~60 bytes of prompt), so micro-batches
    of one step hold different numbers of target tokens: the case where per-micro-batch means are wrong."""
    rng = random.Random(seed)
    path = root / "qa.jsonl"
    with path.open("w") as fh:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            filler = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 10)))
            answer = " ".join([str(a + b)] * rng.randint(1, 6))
            fh.write(json.dumps({"prompt": f"{filler} {a}+{b}=", "completion": f" {answer}."}) + "\n")
    return str(path)


def write_pairs(path: Path, n: int = 12, **changes) -> str:
    """``n`` prompt/chosen/rejected records (the right sum and a wrong one); ``r3={...}`` replaces record 3."""
    rows = [{"prompt": f"{a}+{a}=", "chosen": f" {2 * a}.", "rejected": f" {2 * a + 1}."} for a in range(n)]
    for index, record in changes.items():
        rows[int(index[1:])] = record
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_text(root: Path, n: int = 60, seed: int = 0) -> str:
    rng = random.Random(seed)
    path = root / "text.txt"
    docs = []
    for _ in range(n):
        name = rng.choice(["Tom", "Ann", "Max", "Lily"])
        thing = rng.choice(["kite", "hat", "ball", "book"])
        docs.append(f"{name} found a {thing}. {name} liked the {thing}. The end.")
    path.write_text("\n\n".join(docs))
    return str(path)


def tiny_config(tmp: Path, *, run: dict | None = None, **overrides) -> TrainConfig:
    """3 SGD steps of 4 sequences on the QA data, fp32, no packing, no eval, no samples."""
    base = dict(model=write_model(tmp / "model"), tokenizer="byte", data=write_qa(tmp),
                lr=0.5, warmup_steps=0, max_steps=3, eval_every=0,
                eval_fraction=0.0, samples=0, log_every=1, output=str(tmp / "out"), max_grad_norm=0.0)
    run_kw = dict(seq_len=64, micro_batch=4, grad_accum=1, optimizer="sgd", packing="none")
    run_kw.update(run or {})
    if "packing" in overrides:  # a run setting (it changes the attention mask), accepted here for brevity
        run_kw["packing"] = overrides.pop("packing")
    base.update(overrides)
    return TrainConfig.of(run=RunConfig.of(**run_kw), **base)


def metrics(output: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines()]


def max_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def crash_after_first_checkpoint_then_resume(cfg: TrainConfig, monkeypatch):
    """Run ``cfg`` until its first checkpoint has landed, kill it there (``KeyboardInterrupt`` right after
    the save), then ``--resume`` it to the end; returns the resumed run's result."""
    import pytest

    from memfit.training.loop import run_training
    from memfit.training.runfolder import checkpoint

    real_save = checkpoint.save_checkpoint

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt  # killed right after the checkpoint landed

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, show=False)
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)
    return run_training(cfg.replace(resume=True), show=False)


FOREIGN = [
    (r"^foreign log record ", "a dependency's log record (reported by the driver)"),
    (r"^\S.*\.py:\d+: \w*Warning\b", "a Python warning"),
    (r"^\s*warnings\.warn\(", "a Python warning's source line"),
    (r"^\w*(Warning|Error): ", "a warning category or an exception"),
    (r"Traceback \(most recent call last\)", "a traceback"),
    (r"^\[RANK \d+\] ", "Accelerate's logger format"),
    (r"^(WARNING|ERROR|INFO|CRITICAL|DEBUG)\b", "the logging module's default format"),
    (r"Failed to load|Removed shared tensor|Merge lora module", "a message of issue 22"),
    (r"\d+%\|| it/s\]| s/it\]", "a tqdm progress bar"),
]
"""Patterns of lines that memfit never prints itself (its own warnings start with a lowercase ``warning:``)."""


def foreign_lines(text: str) -> list[str]:
    """The lines of ``text`` that match ``FOREIGN``, each with why."""
    return [f"{why}: {line}" for line in text.splitlines() for pattern, why in FOREIGN if re.search(pattern, line)]


def assert_one_sentence(result, pattern: str) -> None:
    """A click result that is memfit's one-sentence user error: exit 1, no traceback, one ``error:`` line
    holding ``pattern``."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.output
    assert pattern in lines[0], lines[0]
