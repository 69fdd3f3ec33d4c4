"""bench/interop_sweep.py's classification of one config (the sweep itself reads the tools' git mirrors, which CI does
not have): priced, refused in one sentence, a crash, or priced but looking mis-read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import interop_sweep  # noqa: E402

DATA = Path(__file__).parent / "data" / "interop"


def test_a_config_memfit_reads_right_is_priced():
    outcome = interop_sweep.classify(DATA / "llamafactory_lora_dpo.yaml")
    assert (outcome.kind, outcome.fallback) == ("priced", False)
    assert outcome.detail.startswith("llamafactory dpo r8")


def test_a_config_memfit_cannot_price_is_refused_with_its_sentence():
    outcome = interop_sweep.classify(DATA / "axolotl_reward_model_qwen2.yaml")
    assert outcome.kind == "refused" and "reward_model: the file trains a reward model" in outcome.detail


def test_a_hub_model_without_a_preset_is_priced_on_the_fallback(tmp_path):
    path = tmp_path / "run.yml"
    path.write_text("base_model: someone/unknown-7b\nmicro_batch_size: 1\nsequence_len: 512\n")
    outcome = interop_sweep.classify(path)
    assert (outcome.kind, outcome.fallback) == ("priced", True)


@pytest.mark.parametrize("name, text, doubt", [
    ("kto.yml", "base_model: meta-llama/Llama-3.2-1B\nmicro_batch_size: 1\n", "objective words 'kto' priced as sft"),
    ("run.yml", "# accelerate launch --num_processes 1 -m axolotl.cli.train run.yml\nbase_model: meta-llama/Llama-3.2-1B"
                "\nmicro_batch_size: 1\ndeepspeed: ds_config.json\n", "distributed (deepspeed, launch)"),
])
def test_a_priced_config_that_looks_misread_is_suspect(tmp_path, name, text, doubt):
    """An SFT price for a file whose name says KTO; a DeepSpeed launch priced replicated (its config not found here)."""
    path = tmp_path / name
    path.write_text(text)
    outcome = interop_sweep.classify(path)
    assert outcome.kind == "suspect" and doubt in outcome.detail


def test_any_other_exception_is_a_crash(tmp_path, monkeypatch):
    import memfit.interop

    def broken(path, fmt=None):
        raise KeyError("boom")

    monkeypatch.setattr(memfit.interop, "read", broken)
    outcome = interop_sweep.classify(DATA / "llamafactory_lora_dpo.yaml")
    assert outcome.kind == "crash" and outcome.detail.startswith("KeyError: 'boom'")
