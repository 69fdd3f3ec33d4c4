"""Issue 22's "done when", as one user would do it: ``memfit train --model ORG/NAME --data chat.jsonl --lora-r 16``
against a local Hub cache with ``HF_HUB_OFFLINE=1``, run by the console entry point with its output going to
a log file (no terminal), then the adapter loaded from another directory.

The run is the user's command with the defaults memfit derives for a user's model and data (no --seq-len,
--lr or --max-steps: one epoch). ``--log-every 1`` only so the log file is sure to hold step lines whatever
the machine's speed. The log must hold memfit's lines only (``_train_helpers.FOREIGN``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from _train_helpers import foreign_lines
from test_hub import COMMIT, put_in_cache, tiny_model_folder


def _chat_file(path: Path, n: int = 24) -> str:
    """Short multi-turn conversations ({"messages": [...]}) with a system turn in some."""
    rng = random.Random(0)
    colours = ["red", "green", "blue", "yellow", "purple", "orange"]
    with path.open("w") as fh:
        for i in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
            turns += [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"{a + b}."},
                      {"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": colours[i % len(colours)].capitalize() + "."}]
            fh.write(json.dumps({"messages": turns}) + "\n")
    return str(path)


@pytest.mark.heavy
def test_a_first_fine_tune_of_a_hub_model_logs_to_a_file_and_loads_anywhere(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    put_in_cache(cache, "org/tiny-chat", tiny_model_folder(tmp_path / "src"))
    data = _chat_file(tmp_path / "chat.jsonl")
    log = tmp_path / "train.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": ""}
    with log.open("w") as fh:  # stdout and stderr into one file, as `memfit train ... > train.log 2>&1`
        proc = subprocess.run([sys.executable, "-m", "memfit", "train", "--model", "org/tiny-chat", "--data", data,
                               "--lora-r", "16", "--output", str(tmp_path / "run"), "--log-every", "1"],
                              stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert foreign_lines(text) == [], text[-3000:]
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert steps and all(" loss " in line and " eta " in line for line in steps), text[-3000:]
    assert "org/tiny-chat" in text and COMMIT[:12] in text  # the preamble names the Hub model and commit
    assert "memfit train: summary" in text
    # Issue 34: the summary compared the measured step with the prediction for full --seq-len rows, 15-55% high,
    # while the chat rows are padded to the micro-batch's longest conversation; at the measured step's own shape
    # the prediction is within 3% (0.1% when this test was written).
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    rows, measured = record["peak_memory"]["cpu_tensor_peak_rows"], record["peak_memory"]["peak_bytes"]
    assert rows[1] < record["run"]["seq_len"] and record["predicted_at_measured_rows"] < record["predicted_peak_bytes"]
    assert abs(measured - record["predicted_at_measured_rows"]) <= 0.03 * measured, record["peak_memory"]
    assert f"at step {record['peak_memory']['cpu_tensor_peak_step']}'s {rows[0]} x {rows[1]} tokens" in " ".join(
        line.strip("│ ") for line in text.splitlines())

    # The adapter names its base by Hub id, so it loads from any directory (here: another one, offline).
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/tiny-chat"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "run"))
    assert any("lora_A" in name for name, _ in model.named_parameters())
