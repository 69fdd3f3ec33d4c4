"""A tied-embedding model (``tie_word_embeddings``: the output head is the input embedding) under FSDP on
2 CPU processes, saved as a full state dict (``--state-dict full``) and resumed.

Why it needs its own test: an unsharded run's checkpoint keeps one name of the tied pair (safetensors
keeps one name per storage, so Accelerate's save drops one), which a sharded run loads non-strictly
(``training.sharding._load_full``); a sharded run's full checkpoint holds both names (FSDP2 gathers the
shared parameter once per name). Either way the weights, the tie and the AdamW state must come back
whole. ~1-2 minutes per test (2 launches of 2 processes on 2 shared cores): marked slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _train_helpers import TINY_LLAMA, max_diff, tiny_config, write_qa
from memfit.training.loop import run_training
from test_train_fsdp import ARGS, _launch


def _tied_model(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "tie_word_embeddings": True}))
    return str(path)


@pytest.mark.slow
def test_tied_model_full_state_dict_resumes_under_fsdp(tmp_path):
    data, model = write_qa(tmp_path, n=22), _tied_model(tmp_path / "model")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["--model", model, "--data", data, *ARGS, "--sharding", "fsdp", "--state-dict", "full",
              "--save-every", "3"]
    proc = _launch(*common, "--output", str(straight))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    # FSDP2 gathers the tied parameter once per name: the full checkpoint holds both, equal (a strict load)
    saved = load_file(str(straight / "checkpoints" / "step-3" / "model.safetensors"))
    assert (saved["lm_head.weight"] == saved["model.embed_tokens.weight"]).all()
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    proc = _launch(*common, "--resume", "--output", str(resumed))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    a, b = AutoModelForCausalLM.from_pretrained(straight), AutoModelForCausalLM.from_pretrained(resumed)
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()  # still tied when exported
    # The same 6 steps, interrupted at step 3 or not: the same weights (float summation order aside).
    assert max_diff(a, b) < 1e-6


@pytest.mark.slow
def test_tied_model_unsharded_checkpoint_resumes_under_fsdp(tmp_path):
    # An unsharded run's checkpoint (Accelerate's save_state) keeps one name of the tied pair: the sharded
    # run loads it non-strictly (training.sharding._load_full) and must still get the head = the embedding.
    data, model = write_qa(tmp_path, n=22), _tied_model(tmp_path / "model")
    common = dict(data=data, max_steps=6, lr=1e-2, warmup_steps=2)
    config = tiny_config(tmp_path / "one", run={"optimizer": "adamw"}, save_every=3, **common)
    config = config.replace(model=model)
    reference = run_training(config, show=False)
    from safetensors.torch import load_file

    checkpoints = Path(config.folder.output) / "checkpoints"
    assert len(load_file(str(checkpoints / "step-3" / "model.safetensors"))) == len(saved_names(reference.model)) - 1
    shutil.rmtree(checkpoints / "step-6")
    proc = _launch("--model", model, "--data", data, *ARGS, "--sharding", "fsdp", "--save-every", "3", "--resume",
                   "--output", config.folder.output)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    sharded = AutoModelForCausalLM.from_pretrained(config.folder.output)
    assert sharded.lm_head.weight.data_ptr() == sharded.model.embed_tokens.weight.data_ptr()
    assert max_diff(reference.model, sharded) < 1e-6


def saved_names(model) -> list[str]:
    return list(model.state_dict())
