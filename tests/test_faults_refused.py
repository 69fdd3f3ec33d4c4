"""The fault suite, third pass (issue 40): a refused run changes nothing, concurrent runs of one folder leave its
newest checkpoint intact, every number a user can type is one sentence, and a failed run removes only what it made.

Same conventions as ``test_faults.py`` (whose helpers it uses): each case asserts the exit status, the one
``error:`` line, and that what was there before is still there, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _train_helpers import TINY_LLAMA, write_model, write_qa
from memfit.training.runfolder import manifest
from test_faults import _one_sentence, _run, _train


def _digest(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's sha256, a folder's mark (an empty staging folder counts too)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("own")
    model, data = write_model(tmp / "m"), write_qa(tmp, n=24)
    result = _run(_train(model, data, tmp / "run", "--max-steps", "4", "--save-every", "2"))
    assert result.exit_code == 0, result.output
    return tmp / "run", Path(model), Path(data)


@pytest.fixture
def run(tmp_path, own_run):
    return shutil.copytree(own_run[0], tmp_path / "run", symlinks=True)


def _dead_runs_staging(run: Path) -> list[Path]:
    """What a killed run left: its half-written checkpoint and export, named for a pid that is gone."""
    staging = [run / "checkpoints" / ".tmp-step-6-4242-deadbeef", run / ".tmp-export-4242-deadbeef"]
    for folder in staging:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half of it")
    return staging


# ------------------------------------------------------------------------------ 1. a refused run changes nothing
def test_refused_runs_leave_a_dead_runs_staging_and_a_going_resume_cleans_it(run, own_run):
    staging = _dead_runs_staging(run)
    before = _digest(run)
    model, data = own_run[1:]
    _one_sentence(_run(_train(model, data, run)), "already holds a training run")
    assert _digest(run) == before
    _one_sentence(_run(["train", "--output", str(run), "--resume", "--max-steps", "6", "--extend-schedule",
                        "--seq-len", "48"]), "--seq-len")  # a resume that does not match the run
    assert _digest(run) == before
    _one_sentence(_run(["train", "--output", str(run), "--resume", "--max-steps", "6"]), "--extend-schedule")
    assert _digest(run) == before
    result = _run(["train", "--output", str(run), "--resume", "--max-steps", "5", "--extend-schedule"])
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in staging)  # the run that owns the folder removes them


# ------------------------------------------------------------------------------ 2. numbers typed into YAML
@pytest.mark.parametrize("text, pattern", [
    ("max_steps: '²'\n", "--max-steps must be a positive whole number, got '²'"),
    ("max_steps: '--5'\n", "--max-steps must be a positive whole number, got '--5'"),
    ("save_every: '+-2'\n", "--save-every must be"),
    ("warmup_steps: '٣'\n", "--warmup-steps must be"),
    (f"lr: {'7' * 400}\n", "--lr must be a finite positive number, got a whole number of 1329 bits"),
    (f"weight_decay: -{'9' * 350}\n", "--weight-decay must be"),
    (f"seed: {'1' * 45}\n", "--seed must be"),
])
def test_every_number_in_yaml_is_one_sentence(tmp_path, text, pattern):
    config = tmp_path / "c.yaml"
    config.write_text(text, encoding="utf-8")
    model, data = write_model(tmp_path / "m"), write_qa(tmp_path)
    _one_sentence(_run(_train(model, data, tmp_path / "out", "--config", str(config))), pattern)
    assert not (tmp_path / "out").exists()


def test_absurd_layer_count_is_refused_in_seconds(tmp_path):
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 100_000}))
    for args in (["estimate", str(folder), "--seq-len", "32"], ["plan", str(folder), "--budget", "8GiB"]):
        _one_sentence(_run(args), "num_hidden_layers = 100000, more than the 2,048 layers")


# ------------------------------------------------------------------------------ 3. names the export writes
@pytest.mark.parametrize("planted, pattern", [
    ("config.json/", "is a folder, where memfit writes a file"),
    ("merged", "merged was not written by memfit"),  # this run merged nothing: a merged there is someone else's
])
def test_overwrite_refuses_an_export_name_of_the_wrong_kind_before_training(run, own_run, planted, pattern):
    path = run / planted.rstrip("/")
    if path.exists():
        path.unlink()
    if planted.endswith("/"):
        path.mkdir()
        (path / "notes.txt").write_text("mine")
    else:
        path.write_text("mine")
    before = _digest(run)
    _one_sentence(_run(_train(*own_run[1:], run, "--overwrite")), pattern)
    assert _digest(run) == before  # refused before --overwrite removed anything


def test_overwrite_refuses_a_foreign_readme_the_adapter_export_would_replace(tmp_path, own_run):
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("my project")
    _one_sentence(_run(_train(*own_run[1:], out, "--overwrite")), "README.md was not written by memfit")
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]


def test_export_refuses_a_folder_planted_during_the_run(tmp_path, own_run, monkeypatch):
    from memfit.training.runfolder import checkpoint

    real = checkpoint._move_into_place
    monkeypatch.setattr(checkpoint, "_move_into_place",
                        lambda staging, output: ((output / "config.json").mkdir(), real(staging, output))[1])
    out = tmp_path / "out"
    _one_sentence(_run(_train(*own_run[1:], out, "--max-steps", "1")), "config.json is a folder, where the export")
    assert manifest.problem(out / "checkpoints" / "step-1") is None  # the trained model is kept
    assert not list(out.glob(".tmp-export-*")) and not (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------ 4. folders a failed run made
def _fail_after_the_folder_is_made(monkeypatch):
    from memfit.errors import UserError
    from memfit.training import session

    def refuse(*args, **kwargs):
        raise UserError("Refused on purpose after the run folder was made.")

    monkeypatch.setattr(session, "build_optimizer", refuse)


def test_failed_run_removes_the_nested_folders_it_made_and_nothing_above(tmp_path, own_run, monkeypatch):
    _fail_after_the_folder_is_made(monkeypatch)
    kept = tmp_path / "kept"
    kept.mkdir()
    _one_sentence(_run(_train(*own_run[1:], kept / "a" / "b" / "run")), "Refused on purpose")
    assert kept.is_dir() and not any(kept.iterdir())


def test_default_folders_are_unique_and_removed_after_an_early_failure(tmp_path, own_run, monkeypatch):
    from memfit.training.runfolder.checkpoint import default_output
    from memfit.training.runfolder.folder import RunFolder

    base = default_output("tiny", tmp_path / "runs", 0.0)
    first, second = RunFolder.claim_fresh(base), RunFolder.claim_fresh(base)  # two runs, the same second
    assert first.output == base and second.output.name == base.name + "-2"
    assert first.made_parents == [tmp_path / "runs"] and second.made_parents == []
    monkeypatch.chdir(tmp_path / "runs")
    _fail_after_the_folder_is_made(monkeypatch)
    args = [a for a in _train(*own_run[1:], "x") if a not in ("--output", "x")]
    _one_sentence(_run(args), "Refused on purpose")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [base.name, base.name + "-2"]


# ------------------------------------------------------------------------------ 5. one folder, two commands
def test_plan_output_onto_a_runs_own_file_is_refused(run):
    before = _digest(run)
    for name in ("run.json", "metrics.jsonl", "config.json", ".memfit-run"):
        _one_sentence(_run(["plan", "tiny", "--budget", "8GiB", "-o", str(run / name)]), "is a file of the memfit run")
    assert _digest(run) == before


@pytest.mark.slow
def test_two_resumes_of_one_run_at_once_one_wins_and_the_checkpoint_stays_intact(run):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-m", "memfit", "train", "--output", str(run), "--resume", "--max-steps", "6",
            "--extend-schedule", "--save-every", "2"]
    both = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    results = sorted((p.wait(timeout=600), p.stdout.read()) for p in both)
    assert [code for code, _ in results] == [0, 1], results
    assert "Another memfit run (pid" in results[1][1]
    assert [manifest.problem(run / "checkpoints" / s) for s in ("step-4", "step-6")] == [None, None]


# ------------------------------------------------------------------------------ 6. Ctrl-C and damaged checkpoints
def test_ctrl_c_outside_a_runs_guard_exits_130_and_ignores_the_next(monkeypatch, tmp_path):
    import memfit

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(memfit, "train", interrupted)
    previous = signal.getsignal(signal.SIGINT)
    try:
        model, data = write_model(tmp_path / "m"), write_qa(tmp_path)
        _one_sentence(_run(_train(model, data, tmp_path / "o")), "Interrupted by Ctrl-C", code=130)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a second press cannot turn 130 into -2
    finally:
        signal.signal(signal.SIGINT, previous)


def test_deleted_manifest_is_named_and_a_fallback_says_so(run):
    (run / "checkpoints" / "step-4" / "manifest.json").unlink()
    assert manifest.problem(run / "checkpoints" / "step-4") == "lacks manifest.json (deleted, or its save never finished)"
    result = _run(["train", "--output", str(run), "--resume", "--max-steps", "4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    said = next(i for i, line in enumerate(lines) if "step-4 lacks manifest.json" in line)
    assert said < next(i for i, line in enumerate(lines) if line.startswith("resumed from checkpoint step 2"))
    (run / "checkpoints" / "step-2" / "manifest.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-4")
    line = _one_sentence(_run(["train", "--output", str(run), "--resume"]), "found no intact checkpoint")
    assert "lacks manifest.json" in line and "learning rate" not in line


def test_ctrl_c_during_the_guards_clean_up_lets_it_finish():
    from memfit.errors import UserError
    from memfit.training.guard import RunGuard

    class Folder:  # a run folder whose clean-up is hit by a Ctrl-C half way
        started, done = False, []

        def remove_partial_writes(self):
            os.kill(os.getpid(), signal.SIGINT)
            self.done.append("staging")

        def close(self, *, failed):
            self.done.append(f"closed, failed={failed}")

    folder = Folder()
    before = signal.getsignal(signal.SIGINT)  # (an xdist worker ignores SIGINT: SIG_IGN, not the default handler)
    with pytest.raises(UserError, match="refused"):
        with RunGuard() as guard:
            guard.folder = folder
            raise UserError("refused")
    assert folder.done == ["staging", "closed, failed=True"]
    assert signal.getsignal(signal.SIGINT) is before
