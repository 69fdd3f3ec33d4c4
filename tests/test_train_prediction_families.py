"""Train's predicted peak against the tensor peak it measures, family by family (issue 34, item 5).

The demo's Llama is within 0.2%; a first real fine-tune of another family was 35% off. Each family of the
accuracy grid that trains here (small configs from ``_accuracy_models``, byte tokenizer, the QA data) runs
3 steps of AdamW with LoRA or in full, on the recipe ``estimate`` picks for it: hand-written (Llama GQA,
Qwen 2) or derived from traces (Qwen 3, OLMo 2, GPT-NeoX: no hand-written recipe). The measured step is
compared with the prediction at that step's own rows (``run.json``'s ``predicted_at_measured_rows`` where
the rows were shorter than ``--seq-len``): within 3%. The two hand-written families run again on the derived
recipe, as they would on versions outside the verified range (``versions.unverified`` made non-empty).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _accuracy_models import accuracy_config
from _train_helpers import tiny_config
from memfit.integrations import versions

#: (family, run settings, derived recipe forced on a hand-written family)
FAMILIES = [("llama-gqa", {}, False), ("qwen2", {"lora_r": 8}, False), ("qwen3", {}, False),
            ("olmo2", {"lora_r": 8}, False), ("gpt_neox", {"mixed_precision": "bf16"}, False),
            ("llama-gqa", {"mixed_precision": "bf16"}, True), ("qwen2", {"lora_r": 8}, True)]


@pytest.mark.heavy
@pytest.mark.parametrize("family, run, forced", FAMILIES,
                         ids=[f + ("-derived" if forced else "") for f, _, forced in FAMILIES])
def test_train_predicts_its_measured_peak_within_3_percent(family, run, forced, tmp_path, monkeypatch):
    from memfit.training.loop import run_training

    if forced:  # what a fresh install outside the verified versions gets: every family on the derived path
        monkeypatch.setattr(versions, "unverified", lambda installed=None: {"transformers": "9.0.0"})
    folder = tmp_path / family
    accuracy_config(family).save_pretrained(folder)
    cfg = tiny_config(tmp_path, model=str(folder / "config.json"),
                      run={"optimizer": "adamw", "micro_batch": 2, "seq_len": 96, **run})
    run_training(cfg, show=False)
    record = json.loads((Path(cfg.folder.output) / "run.json").read_text())
    measured = record["peak_memory"]["peak_bytes"]
    predicted = record["predicted_at_measured_rows"] or record["predicted_peak_bytes"]
    recipe = record["predicted"]["recipe"]
    derived = family in ("qwen3", "olmo2", "gpt_neox") or bool(versions.unverified())  # (other versions: all derived)
    assert recipe.startswith("derived" if derived else "hand-written"), recipe
    assert abs(measured - predicted) <= 0.03 * measured, (family, measured, predicted, record["peak_memory"])
