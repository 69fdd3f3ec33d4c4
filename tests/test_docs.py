"""The terminal output shown in README.md and docs/*.md is what the tool prints at 80 columns.

``scripts/doc_outputs.py`` finds every fenced ``$ memfit ...`` / ``$ cat FILE`` block (estimate, plan,
presets, data, train: the demo included, ~2-3 minutes on 2 cores) and reruns it in a scratch folder with
the inputs the docs name; ``python scripts/doc_outputs.py`` rewrites the docs when the output changes on
purpose. Its docstring states what compares by form only (train's timings, RSS and thread line).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from _doc_train_runs import OWN_PROCESS, TRAIN_OUTPUTS

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("doc_outputs", ROOT / "scripts" / "doc_outputs.py")
doc_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc_outputs)

CASES = [(path.relative_to(ROOT).as_posix(), argv, shown)
         for path in doc_outputs.doc_files() for _, _, argv, shown in doc_outputs.blocks(path.read_text())]


def test_the_docs_show_command_outputs():
    files = {case[0] for case in CASES}
    assert {"README.md", "docs/estimate.md", "docs/plan.md", "docs/train.md", "docs/data.md"} <= files, files
    commands = {argv[0] for _, argv, _ in CASES}
    assert {"estimate", "plan", "train", "data", "cat"} <= commands, commands


@functools.cache
def _fresh(argv_key: tuple[str, ...]) -> str:
    """The command's output now: in-process (``doc_outputs.run``), but the 300-step demo, which runs in a
    process of its own that overlaps the rest of the suite (``tests/_doc_train_runs.py``)."""
    if argv_key in OWN_PROCESS:
        return TRAIN_OUTPUTS.output(list(argv_key))
    return doc_outputs.run(list(argv_key))


def _first_difference(shown: str, fresh: str, argv: list[str]) -> str:
    """Where the normalised texts part, with some context: what CI prints when a doc disagrees."""
    want, got = (doc_outputs.normalise(doc_outputs.shown_part(shown)[0], argv), doc_outputs.normalise(fresh, argv))
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
    return f"docs:  ...{want[max(0, at - 150): at + 150]!r}\nfresh: ...{got[max(0, at - 150): at + 150]!r}"


@pytest.mark.parametrize("where, argv, shown", CASES, ids=[f"{c[0]}: memfit {' '.join(c[1])}" for c in CASES])
def test_doc_output_matches_the_tool(where, argv, shown):
    fresh = _fresh(tuple(argv))
    assert doc_outputs.agrees(shown, fresh, argv), (
        f"{where} shows an output of `memfit {' '.join(argv)}` that the tool no longer prints; "
        "run `python scripts/doc_outputs.py` and review the diff\n" + _first_difference(shown, fresh, argv))
    assert "…" not in fresh  # nothing cut at 80 columns
    # and nothing wider than the terminal (a one-sentence error is a single line the terminal wraps)
    assert all(len(line) <= doc_outputs.WIDTH for line in fresh.splitlines()
               if not line.startswith("error: ") and argv[0] != "cat" and "--json" not in argv)


def test_held_out_fraction_in_the_docs_is_the_default():
    from memfit.settings.config import TrainConfig

    data_md = (ROOT / "docs" / "data.md").read_text()
    assert f"default {TrainConfig().eval_fraction:g}" in data_md


def test_counts_the_docs_quote_are_the_tables():
    """Issue 22 found "20 presets" in the docs beside 21 in the table: the counts are checked here."""
    import re

    from memfit.planning.gpus import load_gpus
    from memfit.spec.model import preset_names

    readme = (ROOT / "README.md").read_text()
    estimate_md = (ROOT / "docs" / "estimate.md").read_text()
    assert re.search(r"architectures\.yaml \((\d+) models' config facts\)", readme).group(1) == str(len(preset_names()))
    assert re.search(r"gpus\.yaml \((\d+) GPUs\)", readme).group(1) == str(len(load_gpus()))
    assert re.search(r"`memfit presets` lists (\d+)", estimate_md).group(1) == str(len(preset_names()))


def test_the_readme_python_api_example_runs(monkeypatch, tmp_path):
    """README's "Python API" block: its settings build (nested groups by flat key) and estimate and plan run
    on it; trace and train are recorded instead of run (a minute of fake tensors, a training run)."""
    import re

    import memfit
    from memfit.settings.config import RunConfig, TrainConfig

    block = re.search(r"## Python API\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    called = {}
    monkeypatch.setattr(memfit, "trace", lambda model, run: called.setdefault("trace", (model, run)), raising=False)
    monkeypatch.setattr(memfit, "train", lambda config: called.setdefault("train", config), raising=False)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the docs' own example
    assert scope["b"].peak_bytes > 0 and scope["plans"].plans
    # lora_r=16 reached the nested group: r x sum(in + out) over Llama-3-8B's adapted linears, per layer
    # q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096, gate/up 4096+14336 each, down 14336+4096 = 81,920;
    # x 32 layers = 2,621,440
    assert scope["b"].trainable_params == 16 * 2_621_440
    assert isinstance(called["trace"][1], RunConfig) and called["trace"][1].mixed_precision.value == "bf16"
    assert isinstance(called["train"], TrainConfig) and called["train"].preference.beta == 0.1


def test_the_settings_reference_is_current_and_names_every_flag():
    """docs/settings.md is what ``scripts/settings_doc.py`` writes (rerun it after changing a flag), and a reader
    who searches it for a flag finds where that flag is defined."""
    spec = importlib.util.spec_from_file_location("settings_doc", ROOT / "scripts" / "settings_doc.py")
    settings_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(settings_doc)
    text = settings_doc.render()
    assert (ROOT / "docs" / "settings.md").read_text(encoding="utf-8") == text, \
        "docs/settings.md is stale: run python scripts/settings_doc.py"
    assert "| `--lora-r` | `src/memfit/settings/config.py` `LoraSettings.r` |" in text  # a generated flag: its field
    assert "| `--gpu` | `src/memfit/cli/plan.py` |" in text  # a command's own flag: its module
    for name, command in settings_doc.commands():
        for option in command.params:
            for flag in getattr(option, "opts", []):
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}`" in text.split(f"## memfit {name}\n", 1)[1].split("\n## ", 1)[0], (name, flag)
