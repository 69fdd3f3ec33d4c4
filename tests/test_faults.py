"""The fault suite (issue 14): every bad input, corrupt checkpoint, mismatched resume, interrupt, NaN and
full disk ends in one sentence (no traceback) and loses no checkpoint that was intact before.

Each case asserts the exit status, the one ``error:`` line, and, where checkpoints exist, that the
earlier ones survive and still verify. Runs are 2-5 optimizer steps of the 2-layer hidden-64 Llama.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from _train_helpers import TINY_LLAMA, write_model, write_qa
from memfit.cli import cli
from memfit.training.runfolder import manifest


def _run(args):
    return CliRunner().invoke(cli, args)


def _train(model, data, output, *extra):
    return ["train", "--model", str(model), "--tokenizer", "byte", "--data", str(data), "--seq-len", "32",
            "--micro-batch", "2", "--max-steps", "2", "--eval-every", "0", "--samples", "0", "--no-packing",
            "--optimizer", "adamw", "--output", str(output), *extra]


def _one_sentence(result, pattern, *, code=1):
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.output
    assert pattern in lines[0], lines[0]
    return lines[0]


def _steps(output) -> list[str]:
    return sorted(p.name for p in (Path(output) / "checkpoints").glob("step-*"))


@pytest.fixture
def inputs(tmp_path):
    return Path(write_model(tmp_path / "m")), Path(write_qa(tmp_path, n=24))


# ------------------------------------------------------------------------------ model config (no training)
@pytest.mark.parametrize("change, pattern", [
    ({"hidden_size": 0}, "hidden_size = 0"),
    ({"vocab_size": -5}, "vocab_size = -5"),
    ({"num_key_value_heads": 3}, "3 key/value heads, which do not divide its 4 attention heads"),
    ({"num_hidden_layers": 0}, "at least one layer"),
])
@pytest.mark.parametrize("command", ["estimate", "plan", "train"])
def test_bad_model_config_is_one_sentence_on_every_path(tmp_path, inputs, command, change, pattern):
    bad = tmp_path / "bad" / "config.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({**TINY_LLAMA, **change}))
    args = {"estimate": ["estimate", str(bad.parent), "--seq-len", "32"],
            "plan": ["plan", str(bad.parent), "--budget", "8GiB", "--seq-len", "32", "--batch", "4"],
            "train": _train(bad, inputs[1], tmp_path / "out")}[command]
    _one_sentence(_run(args), pattern)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, pattern", [("", "is empty"), ("{oops", "is not valid JSON")])
@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_empty_or_invalid_config_json_in_a_folder(tmp_path, command, text, pattern):
    (tmp_path / "config.json").write_text(text)
    extra = ["--budget", "8GiB"] if command == "plan" else []
    _one_sentence(_run([command, str(tmp_path), *extra]), pattern)


def test_config_only_folder_needs_init_random(tmp_path, inputs):
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    _one_sentence(_run(_train(folder, inputs[1], tmp_path / "o1")), "has a config.json but no weights")
    assert not (tmp_path / "o1").exists()
    result = _run(_train(folder, inputs[1], tmp_path / "o2", "--init", "random", "--max-steps", "1"))
    assert result.exit_code == 0, result.output


def test_truncated_weights_are_one_sentence(tmp_path, inputs):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "trunc"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _one_sentence(_run(_train(folder, inputs[1], tmp_path / "o")), "is truncated or damaged")


# ------------------------------------------------------------------------------ flags and YAML (no training)
@pytest.mark.parametrize("extra, pattern", [
    (["--lr", "nan"], "--lr must be a finite positive number, got nan"),
    (["--lr", "-1"], "--lr must be a finite positive number, got -1"),
    (["--lr", "inf"], "--lr must be a finite positive number, got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0"),
    (["--max-steps", "-3"], "--max-steps must be a positive whole number, got -3"),
    (["--warmup-steps", "-5"], "--warmup-steps must be 0 or a positive whole number, got -5"),
    (["--lora-r", "4", "--lora-alpha", "-16"], "--lora-alpha must be a finite positive number, got -16"),
    (["--save-every", "-1"], "--save-every must be 0 or a positive whole number, got -1"),
    (["--epochs", "0"], "--epochs must be a positive whole number, got 0"),
    (["--keep-last", "0"], "--keep-last must be a positive whole number"),
    (["--attn-implementation", "flash_attention_2"], "needs the flash-attn package"),
])
def test_bad_flag_is_one_sentence(tmp_path, inputs, extra, pattern):
    if "flash" in pattern and __import__("importlib").util.find_spec("flash_attn"):
        pytest.skip("flash-attn is installed here")
    _one_sentence(_run(_train(*inputs, tmp_path / "out", *extra)), pattern)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, pattern", [
    ("lr: fast\n", "--lr must be a finite positive number, got 'fast'"),
    ("max_steps: ten\n", "--max-steps must be a positive whole number, got 'ten'"),
    ("packing: 3\n", "Unknown --packing 3; choose one of: documents, concat, none."),
    ("seq_len: 3.5\n", "--seq-len must be a positive whole number, got 3.5"),
    ("max_step: 5\n", "max_step (did you mean max_steps?)"),
])
def test_yaml_values_are_checked_in_the_flags_words(tmp_path, inputs, text, pattern):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    _one_sentence(_run(_train(*inputs, tmp_path / "out", "--config", str(config))), pattern)


def test_yaml_turning_on_trust_remote_code_is_echoed(tmp_path, inputs):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"trust_remote_code": True, "max_steps": -1}))
    result = _run(_train(*inputs, tmp_path / "out", "--config", str(config)))
    assert "turns on trust_remote_code" in result.output


def test_output_an_existing_file_and_plan_output_checked_before_the_search(tmp_path, inputs):
    existing = tmp_path / "a-file"
    existing.write_text("mine")
    _one_sentence(_run(_train(*inputs, existing)), "is an existing file, not a folder")
    assert existing.read_text() == "mine"
    _one_sentence(_run(["plan", "tiny", "--budget", "8GiB", "--output", str(existing / "plan.yaml")]),
                  "which is a file, not a folder")


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """4 steps with checkpoints at 2 and 4 (AdamW), to copy and damage."""
    tmp = tmp_path_factory.mktemp("base")
    model, data = write_model(tmp / "m"), write_qa(tmp, n=24)
    result = _run(_train(model, data, tmp / "run", "--max-steps", "4", "--save-every", "2", "--log-every", "1"))
    assert result.exit_code == 0, result.output
    assert _steps(tmp / "run") == ["step-2", "step-4"]
    return tmp / "run", model, data


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _unsafe_pickle(path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path.write_bytes(pickle.dumps(Evil()))


CORRUPTIONS = {
    "truncated weights": (lambda s: _truncate(s / "model.safetensors"), "model.safetensors of 100 bytes"),
    "empty weights": (lambda s: (s / "model.safetensors").write_bytes(b""), "model.safetensors of 0 bytes"),
    "missing optimizer.bin": (lambda s: (s / "optimizer.bin").unlink(), "lacks optimizer.bin"),
    "missing scheduler.bin": (lambda s: (s / "scheduler.bin").unlink(), "lacks scheduler.bin"),
    "garbage state": (lambda s: (s / "trainer_state.json").write_text("{garbage"), "trainer_state.json"),
    "state is a list": (lambda s: (s / "trainer_state.json").write_text("[1]"), "trainer_state.json"),
    "unsafe pickle": (lambda s: _unsafe_pickle(s / "optimizer.bin"), "has optimizer.bin of 48 bytes"),
    "same size, other bytes": (lambda s: _flip_byte(s / "scheduler.bin"), "scheduler.bin changed since it was saved"),
    "a file, not a folder": (lambda s: (shutil.rmtree(s), s.write_text("x")), "is a file"),
    "manifest deleted": (lambda s: (s / "manifest.json").unlink(), "lacks manifest.json"),
    "an older memfit's (no manifest, no run id)": (lambda s: _as_older_memfits(s), None),
}


def _as_older_memfits(step: Path) -> None:
    """A checkpoint as a memfit from before manifests wrote it: no manifest.json, no run id in its state."""
    (step / "manifest.json").unlink()
    state = json.loads((step / "trainer_state.json").read_text())
    for key in ("run_id", "data_fingerprint"):
        state.pop(key, None)
    (step / "trainer_state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_damaged_latest_checkpoint_resumes_from_the_newest_intact_one(tmp_path, base_run, name):
    src, model, data = base_run
    run = shutil.copytree(src, tmp_path / "run")
    damage, reason = CORRUPTIONS[name]
    damage(run / "checkpoints" / "step-4")
    before = (run / "checkpoints" / "step-2" / "manifest.json").read_text()
    if reason is None:  # an older memfit's checkpoint is checked by structure: this one is still whole
        # step-4 ended the 4-step run: training on to 5 takes --extend-schedule (test_train_logs.py)
        result = _run(["train", "--output", str(run), "--resume", "--max-steps", "5", "--extend-schedule"])
        assert result.exit_code == 0, result.output
        assert json.loads((run / "run.json").read_text())["resumes"][0]["checkpoint"] == "step-4"
        return
    result = _run(["train", "--output", str(run), "--resume", "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    assert "resuming from step-2, the newest intact checkpoint: step-4" in " ".join(result.output.split())
    assert reason in " ".join(result.output.split())
    doc = json.loads((run / "run.json").read_text())
    assert doc["steps"] == 3 and doc["resumes"][0]["checkpoint"] == "step-2"
    # step-2 was intact before and still is (keep-last 2: step-3 and step-2); step-3 is complete
    assert (run / "checkpoints" / "step-2" / "manifest.json").read_text() == before
    assert manifest.problem(run / "checkpoints" / "step-2") is None
    assert manifest.problem(run / "checkpoints" / "step-3") is None


def test_no_intact_checkpoint_is_one_sentence(tmp_path, base_run):
    run = shutil.copytree(base_run[0], tmp_path / "run")
    for step in ("step-2", "step-4"):
        _truncate(run / "checkpoints" / step / "model.safetensors")
    line = _one_sentence(_run(["train", "--output", str(run), "--resume", "--max-steps", "5"]),
                         "found no intact checkpoint")
    assert "step-4 has model.safetensors of 100 bytes" in line and "step-2" in line


def test_refused_unsafe_pickle_does_not_advise_disabling_the_check(tmp_path, base_run):
    run = shutil.copytree(base_run[0], tmp_path / "run")
    for step in ("step-2", "step-4"):  # a checkpoint from before manifests: nothing to compare against
        _as_older_memfits(run / "checkpoints" / step)
    _unsafe_pickle(run / "checkpoints" / "step-4" / "optimizer.bin")
    line = _one_sentence(_run(["train", "--output", str(run), "--resume", "--max-steps", "5", "--extend-schedule"]),
                         "does not run such files")
    assert "weights_only" not in line and "False" not in line


# ------------------------------------------------------------------------------ resume = the same run
def test_bare_resume_continues_the_runs_own_model_data_and_schedule(tmp_path, base_run):
    src, model, data = base_run
    run = shutil.copytree(src, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-4")  # steps 3 and 4 were logged, and will be again
    result = _run(["train", "--output", str(run), "--resume", "--max-steps", "6"])
    assert result.exit_code == 0, result.output
    doc = json.loads((run / "run.json").read_text())
    settings = doc["settings"]
    assert settings["data"] == str(Path(data).resolve()) and settings["model"] == str(Path(model).resolve())
    assert settings["seq_len"] == 32 and settings["optimizer"] == "adamw" and settings["packing"] == "none"
    assert doc["steps"] == 6
    logged = [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())]
    steps = [r["step"] for r in logged if "loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, 7))  # no step logged twice
    assert [r["step"] for r in logged if r.get("event") == "resume"] == [2]
    saved = json.loads((run / "checkpoints" / "step-6" / "trainer_state.json").read_text())
    first_part = json.loads((Path(src) / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert doc["wall_s"] > first_part["wall_s"] > 0 and saved["wall_s"] > first_part["wall_s"]  # times add up


@pytest.mark.parametrize("extra, setting", [
    (["--optimizer", "sgd"], "--optimizer"), (["--lora-r", "4"], "--lora-r"), (["--seq-len", "48"], "--seq-len"),
    (["--lr", "0.5"], "--lr"), (["--data", "__other__"], "--data"),
])
def test_resume_refuses_a_changed_setting_before_loading(tmp_path, base_run, extra, setting):
    run = shutil.copytree(base_run[0], tmp_path / "run")
    if extra[-1] == "__other__":
        extra = ["--data", write_qa(tmp_path, n=30, seed=5)]
    before = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    line = _one_sentence(_run(["train", "--output", str(run), "--resume", "--max-steps", "5", *extra]),
                         f"{setting} differs")
    assert "drop " + setting in line
    assert before == {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}


def test_checkpoint_of_another_architecture_is_refused(tmp_path, base_run):
    run = shutil.copytree(base_run[0], tmp_path / "run")
    model = json.loads((run / "checkpoints" / "step-4" / "trainer_state.json").read_text())["settings"]["model"]
    Path(model).write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 3}))  # the model changed in place
    try:
        _one_sentence(_run(["train", "--output", str(run), "--resume", "--max-steps", "5"]),
                      "does not belong to this run: the model's architecture differs")
    finally:
        Path(model).write_text(json.dumps(TINY_LLAMA))


# ------------------------------------------------------------------------------ the run folder
def test_second_run_into_a_locked_folder_is_refused(tmp_path, inputs, base_run):
    from memfit.settings.config import TrainConfig
    from memfit.training.runfolder.folder import RunFolder

    run = shutil.copytree(base_run[0], tmp_path / "run")
    holder = RunFolder(run).open(TrainConfig.of(output=str(run), resume=True), is_main=True)
    try:
        _one_sentence(_run(["train", "--output", str(run), "--resume", "--max-steps", "5", "--extend-schedule"]),
                      f"Another memfit run (pid {os.getpid()}) is writing to")
    finally:
        holder.close(failed=False)
    # A lock file left by a killed run holds no lock: the next run goes ahead.
    assert (run / ".memfit-run").exists()
    assert _run(["train", "--output", str(run), "--resume", "--max-steps", "5", "--extend-schedule"]).exit_code == 0


def test_never_writes_into_inputs_or_foreign_folders(tmp_path, inputs):
    model, data = inputs
    (model.parent / "README.md").write_text("mine")
    _one_sentence(_run(_train(model, data, model.parent, "--overwrite")), "is the --model folder")
    assert sorted(p.name for p in model.parent.iterdir()) == ["README.md", "config.json"]
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    _one_sentence(_run(_train(model, data, user)), "holds files that are not a memfit run")
    assert [p.name for p in user.iterdir()] == ["notes.txt"]
    result = _run(_train(model, data, user, "--overwrite", "--max-steps", "1"))
    assert result.exit_code == 0, result.output
    assert (user / "notes.txt").read_text() == "mine"  # --overwrite replaces only memfit's own files


def test_failure_before_training_leaves_no_folder(tmp_path, inputs):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    _one_sentence(_run(_train(inputs[0], bad, tmp_path / "out")), "is not valid JSON")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ interrupt, NaN, full disk
def test_ctrl_c_saves_at_the_step_boundary_and_says_how_to_resume(tmp_path, inputs, monkeypatch):
    from memfit.training import step as step_module

    real = step_module.train_step
    calls = {"n": 0}

    def step_then_ctrl_c(*args, **kwargs):
        calls["n"] += 1
        result = real(*args, **kwargs)
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only sets a flag: the step finishes
        return result

    monkeypatch.setattr("memfit.training.loop.train_step", step_then_ctrl_c)
    out = tmp_path / "out"
    line = _one_sentence(_run(_train(*inputs, out, "--max-steps", "50")), "Interrupted at step 3", code=130)
    assert f"continue with: memfit train --output {out} --resume" in line
    assert manifest.problem(out / "checkpoints" / "step-3") is None
    monkeypatch.setattr("memfit.training.loop.train_step", real)
    result = _run(["train", "--output", str(out), "--resume", "--max-steps", "4"])
    assert result.exit_code == 0, result.output


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, inputs, monkeypatch):
    import torch

    from memfit.training import step as step_module

    real = step_module.micro_loss
    calls = {"n": 0}

    def nan_at_step_3(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * torch.tensor(float("nan")) if calls["n"] == 3 else loss

    monkeypatch.setattr(step_module, "micro_loss", nan_at_step_3)
    out = tmp_path / "out"
    line = _one_sentence(_run(_train(*inputs, out, "--max-steps", "4", "--save-every", "2")),
                         "At step 3 the loss became nan")
    assert "newest complete checkpoint is" in line and "step-2" in line
    assert _steps(out) == ["step-2"] and not (out / "model.safetensors").exists()
    from safetensors.torch import load_file

    weights = load_file(str(out / "checkpoints" / "step-2" / "model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in weights.values())


def _full_disk_after(real, after):
    calls = {"n": 0}

    def writer(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            Path(path).write_bytes(b"\0" * 64)  # what a full disk leaves: part of a file
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(obj, path, *args, **kwargs)
    return writer


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, inputs, monkeypatch):
    import accelerate.checkpointing as ack

    monkeypatch.setattr(ack, "save", _full_disk_after(ack.save, 3))  # model, optimizer, scheduler of step-2 pass
    out = tmp_path / "out"
    line = _one_sentence(_run(_train(*inputs, out, "--max-steps", "4", "--save-every", "2")),
                         "failed (No space left on device)")
    assert "newest complete checkpoint is" in line and "step-2" in line
    assert _steps(out) == ["step-2"] and manifest.problem(out / "checkpoints" / "step-2") is None
    assert not list((out / "checkpoints").glob(".tmp-*"))  # no half-written checkpoint left behind
    monkeypatch.undo()
    assert _run(["train", "--output", str(out), "--resume"]).exit_code == 0


def test_full_disk_during_the_export_leaves_no_half_file_under_a_final_name(tmp_path, inputs, monkeypatch):
    import transformers.modeling_utils as tmu

    monkeypatch.setattr(tmu, "safe_save_file", _full_disk_after(tmu.safe_save_file, 0))
    out = tmp_path / "out"
    _one_sentence(_run(_train(*inputs, out, "--save-every", "2")), "Writing model.safetensors under")
    assert not (out / "model.safetensors").exists() and not list(out.glob(".tmp-export*"))
    monkeypatch.undo()
    result = _run(["train", "--output", str(out), "--resume"])  # nothing left to train: exports again
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").stat().st_size > 1000


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from memfit.training.runfolder import manifest
    import accelerate.checkpointing as ack
    where, args = sys.argv[1], sys.argv[2:]
    calls = {"n": 0}
    if where == "manifest":  # killed after every data file of step-2 is written, before its manifest
        real = manifest.write_manifest
        def hook(folder):
            calls["n"] += 1
            if calls["n"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(folder)
        manifest.write_manifest = hook
    else:  # killed halfway through writing step-2's optimizer state
        real = ack.save
        def hook(obj, path, *a, **k):
            calls["n"] += 1
            if calls["n"] == 5:
                open(path, "wb").write(b"partial")
                os.kill(os.getpid(), signal.SIGKILL)
            return real(obj, path, *a, **k)
        ack.save = hook
    from memfit.cli import main
    main(args)
""")


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """``{where: (output folder, exit code, stderr)}``: both kills, started at once (each a fresh process
    that SIGKILLs itself; one thread each, so the two use the 2 cores the waiting test process leaves idle)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = {}
    for where in ("manifest", "optimizer"):
        tmp = tmp_path_factory.mktemp(f"kill-{where}")
        model, data, out = write_model(tmp / "m"), write_qa(tmp, n=24), tmp / "out"
        args = _train(model, data, out, "--max-steps", "4", "--save-every", "1")
        started[where] = out, subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, where, *args], env=env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = {}
    for where, (out, proc) in started.items():
        stderr = proc.communicate(timeout=300)[1].decode(errors="replace")  # reads all, then waits
        done[where] = out, proc.returncode, stderr
    return done


@pytest.mark.heavy
@pytest.mark.parametrize("where", ["manifest", "optimizer"])
def test_kill_9_during_a_save_leaves_a_resumable_run(killed_runs, where):
    out, returncode, stderr = killed_runs[where]
    assert returncode == -signal.SIGKILL, stderr[-2000:]
    assert manifest.problem(out / "checkpoints" / "step-1") is None
    result = _run(["train", "--output", str(out), "--resume"])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "run.json").read_text())
    assert doc["steps"] == 4 and doc["resumes"][0]["checkpoint"] == "step-1"


# ------------------------------------------------------------------------------ checkpoint policy
def test_checkpoints_on_by_default_and_keep_last(tmp_path, inputs):
    out = tmp_path / "out"
    result = _run(_train(*inputs, out, "--max-steps", "5", "--save-every", "1", "--keep-last", "2"))
    assert result.exit_code == 0, result.output
    assert _steps(out) == ["step-4", "step-5"]
    default = tmp_path / "default"
    assert _run(_train(*inputs, default, "--max-steps", "3")).exit_code == 0
    assert _steps(default) == ["step-2", "step-3"]  # every max(3 // 10, 1) = 1 step, the last 2 kept


def test_merged_export_is_self_contained(tmp_path, inputs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    result = _run(_train(*inputs, out, "--lora-r", "4", "--merge", "--max-steps", "1", "--save-every", "0"))
    assert result.exit_code == 0, result.output
    assert not (out / "checkpoints").exists()  # --save-every 0: none
    tokenizer = AutoTokenizer.from_pretrained(out / "merged")  # no other folder needed
    model = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert model(**tokenizer("1+1=", return_tensors="pt")).logits.shape[-1] == TINY_LLAMA["vocab_size"]
