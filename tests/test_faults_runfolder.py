"""The fault suite, second pass (issue 27, items 1, 2, 3 and 6): a run folder only its own run changes,
checkpoints that know their run and data, files read back through a schema, and a real full disk.

Same conventions as ``test_faults.py`` (whose helpers it uses): each case asserts the exit status, the one
``error:`` line, and that what was intact (or someone else's) before is still there, byte for byte.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _train_helpers import write_model, write_qa
from memfit.training.runfolder import manifest
from test_faults import _one_sentence, _run, _steps, _train


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _edit_state(step: Path, **changes) -> None:
    """Change fields of a checkpoint's trainer_state.json and write its manifest again (as a tool would)."""
    state = json.loads((step / "trainer_state.json").read_text())
    state.update(changes)
    (step / "trainer_state.json").write_text(json.dumps(state))
    manifest.write_manifest(step)


def _norm(result) -> str:
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4, with its own data file (cases change it and put it back)."""
    tmp = tmp_path_factory.mktemp("own")
    model, data = write_model(tmp / "m"), write_qa(tmp, n=24)
    result = _run(_train(model, data, tmp / "run", "--max-steps", "4", "--save-every", "2", "--log-every", "1"))
    assert result.exit_code == 0, result.output
    return tmp / "run", Path(model), Path(data)


@pytest.fixture
def run(tmp_path, own_run):
    return shutil.copytree(own_run[0], tmp_path / "run", symlinks=True)


def _resume(run, *extra):
    return _run(["train", "--output", str(run), "--resume", "--max-steps", "5", "--extend-schedule", *extra])


# ------------------------------------------------------------------------------ 1. only its own run changes it
@pytest.mark.parametrize("how", [["--overwrite"], ["--resume", "--max-steps", "6", "--extend-schedule"]])
def test_refused_run_touches_nothing_of_the_running_one(tmp_path, run, own_run, how):
    from memfit.settings.config import TrainConfig
    from memfit.training.runfolder.folder import RunFolder

    holder = RunFolder(run).open(TrainConfig.of(output=str(run), resume=True), is_main=True)  # run A, saving
    staging = [run / "checkpoints" / f".tmp-step-5-{holder.tag}", run / f".tmp-export-{holder.tag}"]
    for folder in staging:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    before = _digest(run)
    try:
        args = ["train", "--output", str(run), *how] if how[0] == "--resume" else _train(*own_run[1:], run, *how)
        _one_sentence(_run(args), "Another memfit run (pid")
        assert _digest(run) == before  # A's staging folders and checkpoints: untouched
    finally:
        holder.close(failed=False)


def test_staging_folders_carry_pid_and_a_random_suffix(tmp_path, own_run, monkeypatch):
    seen = []
    real = manifest.write_manifest
    monkeypatch.setattr(manifest, "write_manifest", lambda folder: (seen.append(folder.name), real(folder))[1])
    out = tmp_path / "out"
    assert _run(_train(*own_run[1:], out, "--max-steps", "1")).exit_code == 0
    assert re.fullmatch(rf"\.tmp-step-1-{os.getpid()}-[0-9a-f]{{8}}", seen[0]), seen
    assert not list((out / "checkpoints").glob(".tmp-*")) and not list(out.glob(".tmp-*"))


def test_overwrite_removes_only_what_memfit_wrote(tmp_path, run, own_run):
    (run / "checkpoints" / "epoch=3.ckpt").write_text("another tool's")
    (run / "memfit").mkdir()
    (run / "memfit" / "README.md").write_text("mine")
    result = _run(_train(*own_run[1:], run, "--overwrite", "--max-steps", "1"))
    assert result.exit_code == 0, result.output
    assert (run / "checkpoints" / "epoch=3.ckpt").read_text() == "another tool's"
    assert (run / "memfit" / "README.md").read_text() == "mine"
    assert _steps(run) == ["step-1"]  # the old run's step-2 and step-4 were memfit's: replaced


def test_overwrite_refuses_a_foreign_run_json(tmp_path, own_run):
    out = tmp_path / "project"
    out.mkdir()
    (out / "run.json").write_text('{"tool": "other"}')
    line = _one_sentence(_run(_train(*own_run[1:], out, "--overwrite")), "was not written by memfit")
    assert "run.json" in line
    assert (out / "run.json").read_text() == '{"tool": "other"}' and sorted(p.name for p in out.iterdir()) == [
        "run.json"]


def test_links_in_the_run_folder_are_replaced_never_written_through(tmp_path, run):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("run.json", "loss.png", "metrics.jsonl"):
        (elsewhere / name).write_text("not memfit's")
        if (run / name).exists():
            (run / name).unlink()
    for name in ("run.json", "loss.png", "metrics.jsonl"):
        (run / name).symlink_to(elsewhere / name)
    (elsewhere / "staging").mkdir()
    (run / "checkpoints" / ".tmp-step-5").symlink_to(elsewhere / "staging")
    result = _resume(run)
    assert result.exit_code == 0, result.output
    assert all((elsewhere / n).read_text() == "not memfit's" for n in ("run.json", "loss.png", "metrics.jsonl"))
    assert not any((elsewhere / "staging").iterdir())
    assert not (run / "run.json").is_symlink() and json.loads((run / "run.json").read_text())["steps"] == 5
    assert manifest.problem(run / "checkpoints" / "step-5") is None


def test_checkpoints_folder_as_a_link_is_refused(tmp_path, run):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run / "checkpoints", elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    before = _digest(elsewhere)
    _one_sentence(_resume(run), "is a symbolic link inside the run folder")
    assert _digest(elsewhere) == before


def test_lock_file_as_a_folder_is_one_sentence(run):
    (run / ".memfit-run").unlink()
    (run / ".memfit-run").mkdir()
    _one_sentence(_resume(run), ".memfit-run is a folder or special file, not memfit's lock file")


@pytest.mark.parametrize("target", ["/dev/null", "/dev/full"])
def test_plot_never_replaces_a_device(tmp_path, target):
    (tmp_path / "x.png").symlink_to(target)
    _one_sentence(_run(["estimate", "tiny", "--plot", str(tmp_path / "x.png")]), "is a link to a folder or special file")
    assert Path(target).is_char_device() and (tmp_path / "x.png").is_symlink()


def test_plot_onto_a_full_disk_is_one_sentence(tmp_path, monkeypatch):
    import memfit.files as files

    def full(fd, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    _one_sentence(_run(["estimate", "tiny", "--plot", str(tmp_path / "x.png")]), "(No space left on device)")
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def test_one_atomic_writer():
    src = Path(__file__).parent.parent / "src" / "memfit"
    writers = [str(p.relative_to(src)) for p in src.rglob("*.py") if "os.replace(tmp" in p.read_text()]
    assert writers == ["files.py"], writers


# ------------------------------------------------------------------------------ 2. a checkpoint knows its run
def test_checkpoint_of_another_run_is_refused(run):
    _edit_state(run / "checkpoints" / "step-4", run_id="0123456789abcdef0123456789abcdef")
    line = _one_sentence(_resume(run), "belongs to another run (run id 0123456789ab)")
    assert json.loads((run / ".memfit-files.json").read_text())["run_id"][:12] in line


def test_changed_data_is_refused_unless_allowed(run, own_run):
    data = own_run[2]
    saved = data.read_bytes()
    try:
        data.write_bytes(saved.replace(b"1", b"2"))
        line = _one_sentence(_resume(run), "changed since step-4 was saved")
        assert "--allow-data-change" in line and str(data) in line
        result = _resume(run, "--allow-data-change")
        assert result.exit_code == 0, result.output
        assert "training on the new data" in _norm(result)
    finally:
        data.write_bytes(saved)


@pytest.mark.parametrize("damage", ["truncated", "hostile"])
def test_rng_state_that_cannot_be_restored_is_said(run, damage):
    from test_faults import _unsafe_pickle

    for step in ("step-4", "step-2") if damage == "hostile" else ("step-4",):
        rng = run / "checkpoints" / step / "random_states_0.pkl"
        rng.write_bytes(rng.read_bytes()[:40]) if damage == "truncated" else _unsafe_pickle(rng)
        manifest.write_manifest(rng.parent)  # recomputed: the manifest alone does not catch it
    result = _resume(run)
    if damage == "truncated":  # step-2 is intact: used, and the reason said
        assert result.exit_code == 0, result.output
        assert "step-4 has random_states_0.pkl that cannot be read back" in _norm(result)
        assert json.loads((run / "run.json").read_text())["resumes"][-1]["checkpoint"] == "step-2"
    else:
        _one_sentence(result, "random_states_0.pkl that cannot be read back")


# ------------------------------------------------------------------------------ 3. read back through a schema
@pytest.mark.parametrize("field, value", [("tokens", "many"), ("resumes", 3), ("fallbacks", [{"step": None}]),
                                          ("wall_s", -1)])
def test_damaged_trainer_state_falls_back_naming_the_field(run, field, value):
    _edit_state(run / "checkpoints" / "step-4", **{field: value})
    result = _resume(run)
    assert result.exit_code == 0, result.output
    assert f"step-4 has trainer_state.json that has {field} =" in _norm(result)


@pytest.mark.parametrize("entry, said", [({"sha256": "0" * 64}, "without a byte count"), (7, "not an object")])
def test_damaged_manifest_entry_falls_back(run, entry, said):
    path = run / "checkpoints" / "step-4" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["files"]["optimizer.bin"] = entry
    path.write_text(json.dumps(doc))
    result = _resume(run)
    assert result.exit_code == 0, result.output
    assert said in _norm(result) and "resuming from step-2" in _norm(result)


@pytest.mark.parametrize("line, said", [(b'{"step": 1, "loss": 1.0, "x": "\xff\xfe"}', "is not UTF-8 text"),
                                        (b'{"step": null, "loss": 1.0}', "has step = None"),
                                        (b'{"step": "two", "loss": 1.0}', "has step = 'two'")])
def test_damaged_metrics_line_is_one_sentence(run, line, said):
    path = run / "metrics.jsonl"
    path.write_bytes(line + b"\n" + path.read_bytes())
    _one_sentence(_resume(run), f"metrics.jsonl line 1 {said}")


def test_damaged_ledger_is_one_sentence(run):
    (run / ".memfit-files.json").write_text('{"run_id": 5, "files": []}')
    _one_sentence(_resume(run), "its field run_id is 5")


# ------------------------------------------------------------------------------ 6. a full disk
def test_too_little_free_space_stops_before_the_save(tmp_path, own_run, monkeypatch):
    from memfit.training.runfolder import space

    real = space.free_bytes
    monkeypatch.setattr(space, "free_bytes", lambda p: 0 if (Path(p) / "step-2").is_dir() else real(p))  # full
    # once step-2 is saved
    out = tmp_path / "out"
    line = _one_sentence(_run(_train(*own_run[1:], out, "--max-steps", "4", "--save-every", "2")),
                         "is free under")
    assert "needs about" in line and "the size of step-2" in line and "step-2 (continue with" in line
    assert _steps(out) == ["step-2"] and manifest.problem(out / "checkpoints" / "step-2") is None
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_write_error_reported_as_another_exception_is_a_full_disk(tmp_path, own_run, monkeypatch):
    """torch.save on a full disk raises RuntimeError ('... file write failed'), not OSError."""
    import accelerate.checkpointing as ack

    from memfit.training import guard

    real_save, calls = ack.save, {"n": 0}

    def save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            Path(path).write_bytes(b"\0" * 64)
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0: file write failed")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ack, "save", save)
    monkeypatch.setattr(guard, "free_bytes", lambda path: 0)
    out = tmp_path / "out"
    line = _one_sentence(_run(_train(*own_run[1:], out, "--max-steps", "4", "--save-every", "2")),
                         "failed (No space left on device)")
    assert "step-2" in line and _steps(out) == ["step-2"]
    assert not list((out / "checkpoints").glob(".tmp-*"))


TMPFS_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys
    from click.testing import CliRunner
    from memfit.cli import cli
    from memfit.training.runfolder import space
    root, model, data = sys.argv[1:4]
    real_check = space.check_before_save
    def fill(leave):  # a filler file that leaves ``leave`` bytes free
        st = os.statvfs(root)
        with open(os.path.join(root, "filler"), "wb") as fh:
            fh.write(b"x" * max(st.f_bavail * st.f_frsize - leave, 0))
    # A checkpoint of this model is about 1.5 MB and its estimate before the first save 2.6 MB (margin
    # included): "check" leaves 3.5 MB (step-2 fits, step-4 is refused before writing), "write" 2.5 MB
    # (step-4's write itself fails), "export" 0.3 MB (the 0.5 MB model.safetensors fails), "plot" nothing.
    cases = {"check": 3_500_000, "write": 2_500_000, "export": 300_000, "plot": 0}
    found = {}
    for case, leave in cases.items():
        out = os.path.join(root, case)
        fill(leave)
        space.check_before_save = real_check if case != "write" else (lambda *args: None)
        train = ["train", "--model", model, "--tokenizer", "byte", "--data", data, "--seq-len", "32",
                 "--micro-batch", "2", "--eval-every", "0", "--samples", "0", "--no-packing", "--optimizer",
                 "adamw", "--output", out]
        args = {"check": train + ["--max-steps", "4", "--save-every", "2"],
                "write": train + ["--max-steps", "4", "--save-every", "2"],
                "export": train + ["--max-steps", "2", "--save-every", "0"],
                "plot": ["estimate", "tiny", "--plot", os.path.join(root, "x.png")]}[case]
        r = CliRunner().invoke(cli, args)
        found[case] = {"exit": r.exit_code, "output": r.output, "exc": repr(r.exception),
                       "listing": sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                                         for f in fs)}
        os.remove(os.path.join(root, "filler"))
    print(json.dumps(found))
""")


@pytest.mark.slow
def test_a_real_full_disk(tmp_path, own_run):
    """A 20 MB tmpfs (in a private mount namespace), filled up: before a save, in the write itself, at the
    export, and under ``estimate --plot``. One sentence each, no partial file, no traceback."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mount}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here (unshare -m + mount: {probe.stderr.strip()[:120]})")
    script = tmp_path / "case.py"
    script.write_text(TMPFS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    shell = f"mount -t tmpfs -o size=20m tmpfs {mount} && {sys.executable} {script} {mount} {own_run[1]} {own_run[2]}"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    said = {"plot": "(No space left on device)", "check": "is free under", "write": "failed (No space left on device)",
            "export": "failed (No space left on device)"}
    for case, doc in found.items():
        errors = [line for line in doc["output"].splitlines() if line.startswith("error: ")]
        assert doc["exit"] == 1 and len(errors) == 1 and said[case] in errors[0], (case, doc)
        assert "Traceback" not in doc["output"], (case, doc["output"])
        assert not [p for p in doc["listing"] if ".tmp" in p], (case, doc["listing"])
        if case in ("check", "write"):
            assert "step-2 (continue with" in errors[0], errors[0]
            assert f"{case}/checkpoints/step-2/manifest.json" in doc["listing"]
