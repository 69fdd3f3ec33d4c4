"""A normal run shows no warnings caused by memfit's use of its dependencies, and no foreign progress bars.

pyproject's ``filterwarnings`` ignores Deprecation/FutureWarning for the whole suite, so these tests
record warnings themselves (``catch_warnings(record=True)`` + ``simplefilter("always")``).
"""

from __future__ import annotations

import json
import warnings

import pytest

from _train_helpers import TINY_LLAMA
from memfit.config import RunConfig, TrainConfig
from memfit.training.loop import train


def _warnings_of(config: TrainConfig) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(config, show=True)
    assert summary["steps"] == config.max_steps
    return [f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}" for w in caught]


@pytest.mark.parametrize("lora_r", [0, 8], ids=["full", "lora"])
def test_demo_with_checkpointing_warns_nothing(tmp_path, lora_r):
    """The demo's settings (tiny preset, shipped corpus, eval, samples) for 2 steps with checkpointing.

    Before memfit used transformers 5's ``activation_checkpointing_enable`` (and hid PEFT's read of
    ``is_gradient_checkpointing``) this caught two FutureWarnings per run.
    """
    run = RunConfig(seq_len=128, micro_batch=4, grad_checkpointing=True, lora_r=lora_r)
    config = TrainConfig(run=run, max_steps=2, eval_every=2, samples=1, output=str(tmp_path / "out"),
                         merge=bool(lora_r))
    assert _warnings_of(config) == []


def test_loading_a_checkpoint_shows_no_loading_bar(tmp_path, capfd):
    """transformers 5 prints a tqdm "Loading weights" bar inside from_pretrained; memfit switches it off."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    folder = tmp_path / "ckpt"
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    capfd.readouterr()
    (tmp_path / "data.txt").write_text("\n\n".join(f"Tom found {i} kites. The end." for i in range(40)))
    config = TrainConfig(model=str(folder), tokenizer="byte", data=str(tmp_path / "data.txt"),
                         run=RunConfig(seq_len=64, micro_batch=2, grad_checkpointing=True), max_steps=1,
                         eval_every=0, samples=0, output=str(tmp_path / "out"))
    assert _warnings_of(config) == []
    err = capfd.readouterr().err
    assert "Loading weights" not in err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored after the load
    assert json.loads((tmp_path / "out" / "run.json").read_text())["steps"] == 1
