"""Fault census, second pass (issue 27): the run folder, a checkpoint's run and data, files read back, free space.

Used by ``bench/faults.py`` (categories ``runfolder``, ``lineage``, ``readback``, and more ``disk`` cases);
the same classification (``sentence``, ``ok``, ``traceback``, ``accepted``/wrong, ``lost``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from unittest import mock

from faults import base_run, copy_run, digest, fast


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _resume(c, run: Path, *extra: str):
    return c.invoke(["train", "--output", str(run), "--resume", "--max-steps", "5", "--extend-schedule", *extra])


def _edit_state(step: Path, **changes) -> None:
    from memfit.training.runfolder import manifest

    state = json.loads((step / "trainer_state.json").read_text())
    state.update(changes)
    (step / "trainer_state.json").write_text(json.dumps(state))
    manifest.write_manifest(step)


def runfolder_cases(c, tmp: Path, model: str, data: str) -> None:
    from memfit.settings.config import TrainConfig
    from memfit.training.runfolder.folder import RunFolder

    base = base_run(c, tmp, model, data, "rf-base")
    for name, extra in {"--overwrite": ["--overwrite"], "--resume": ["--resume"]}.items():
        run = copy_run(base, tmp / f"rf-{len(c.rows)}")
        holder = RunFolder(run).open(TrainConfig.of(output=str(run), resume=True), is_main=True)
        (run / "checkpoints" / f".tmp-step-5-{holder.tag}").mkdir()
        before = digest(run)
        try:
            result = c.invoke(fast(model, data, str(run), *extra, "--max-steps", "6", "--extend-schedule"))
        finally:
            holder.close(failed=False)
        c.record("runfolder", f"second run ({name}) while one runs", result, expect="refuse",
                 lost=digest(run) != before)
    run = copy_run(base, tmp / f"rf-{len(c.rows)}")
    (run / "checkpoints" / "epoch=3.ckpt").write_text("theirs")
    (run / "memfit").mkdir()
    (run / "memfit" / "README.md").write_text("theirs")
    result = c.invoke(fast(model, data, str(run), "--overwrite"))
    c.record("runfolder", "--overwrite keeps another tool's files", result, expect="ok",
             wrong=not (run / "checkpoints" / "epoch=3.ckpt").exists() or not (run / "memfit" / "README.md").exists())
    out = tmp / f"rf-{len(c.rows)}"
    out.mkdir()
    (out / "run.json").write_text('{"tool": "other"}')
    result = c.invoke(fast(model, data, str(out), "--overwrite"))
    c.record("runfolder", "--overwrite over a foreign run.json", result, expect="refuse",
             wrong=(out / "run.json").read_text() != '{"tool": "other"}')
    run = copy_run(base, tmp / f"rf-{len(c.rows)}")
    elsewhere = tmp / f"elsewhere-{len(c.rows)}"
    elsewhere.mkdir()
    for name in ("run.json", "loss.png"):
        (elsewhere / name).write_text("theirs")
        (run / name).unlink()
        (run / name).symlink_to(elsewhere / name)
    (elsewhere / "staging").mkdir()
    (run / "checkpoints" / ".tmp-step-5").symlink_to(elsewhere / "staging")
    result = _resume(c, run)
    c.record("runfolder", "run.json, loss.png, .tmp-step-5 as links", result, expect="ok",
             wrong=any((elsewhere / n).read_text() != "theirs" for n in ("run.json", "loss.png"))
             or any((elsewhere / "staging").iterdir()))
    run = copy_run(base, tmp / f"rf-{len(c.rows)}")
    (run / ".memfit-run").unlink()
    (run / ".memfit-run").mkdir()
    c.record("runfolder", ".memfit-run as a folder", _resume(c, run), expect="refuse")
    target = tmp / "plot.png"
    target.symlink_to("/dev/null")
    c.record("runfolder", "estimate --plot onto a link to /dev/null",
             c.invoke(["estimate", "tiny", "--plot", str(target)]), expect="refuse",
             wrong=not Path("/dev/null").is_char_device())


def lineage_cases(c, tmp: Path, model: str, data: str) -> None:
    own_data = tmp / "lineage.jsonl"
    shutil.copy(data, own_data)
    base = base_run(c, tmp, model, str(own_data), "ln-base")
    run = copy_run(base, tmp / f"ln-{len(c.rows)}")
    _edit_state(run / "checkpoints" / "step-4", run_id="0" * 32)
    c.record("lineage", "a checkpoint of another run swapped in", _resume(c, run), expect="refuse")
    saved = own_data.read_bytes()
    own_data.write_bytes(saved.replace(b"1", b"2"))
    try:
        run = copy_run(base, tmp / f"ln-{len(c.rows)}")
        c.record("lineage", "data changed at the same path", _resume(c, run), expect="refuse")
        run = copy_run(base, tmp / f"ln-{len(c.rows)}")
        c.record("lineage", "data changed, --allow-data-change", _resume(c, run, "--allow-data-change"), expect="ok")
    finally:
        own_data.write_bytes(saved)
    for name in ("truncated", "hostile"):
        run = copy_run(base, tmp / f"ln-{len(c.rows)}")
        for step in ("step-2", "step-4"):
            rng = run / "checkpoints" / step / "random_states_0.pkl"
            if name == "truncated":
                rng.write_bytes(rng.read_bytes()[:40])
            else:
                rng.write_bytes(pickle.dumps(Evil()))
            _edit_state(rng.parent)
        c.record("lineage", f"{name} random_states_0.pkl, manifest recomputed", _resume(c, run), expect="refuse")


def readback_cases(c, tmp: Path, model: str, data: str) -> None:
    base = base_run(c, tmp, model, data, "rb-base")
    for field, value in {"tokens": "many", "resumes": 3, "fallbacks": [{"step": None}], "train_s": -1}.items():
        run = copy_run(base, tmp / f"rb-{len(c.rows)}")
        _edit_state(run / "checkpoints" / "step-4", **{field: value})
        result = _resume(c, run)
        c.record("readback", f"trainer_state {field} = {value!r}", result, expect="ok",
                 wrong=json.loads((run / "run.json").read_text())["resumes"][-1]["checkpoint"] != "step-2")
    for name, entry in {"without bytes": {"sha256": "0" * 64}, "a number": 7}.items():
        run = copy_run(base, tmp / f"rb-{len(c.rows)}")
        path = run / "checkpoints" / "step-4" / "manifest.json"
        doc = json.loads(path.read_text())
        doc["files"]["optimizer.bin"] = entry
        path.write_text(json.dumps(doc))
        c.record("readback", f"manifest entry {name}", _resume(c, run), expect="ok")
    for name, line in {"invalid UTF-8": b'{"step": 1, "x": "\xff"}', "step null": b'{"step": null}',
                       "step text": b'{"step": "two"}'}.items():
        run = copy_run(base, tmp / f"rb-{len(c.rows)}")
        path = run / "metrics.jsonl"
        path.write_bytes(line + b"\n" + path.read_bytes())
        c.record("readback", f"metrics.jsonl {name}", _resume(c, run), expect="refuse")


def space_cases(c, tmp: Path, model: str, data: str) -> None:
    """The free-space check before a save (injected: the file system reports no room once step-2 is saved)."""
    from memfit.training.runfolder import space

    real = space.free_bytes
    out = tmp / f"disk-{len(c.rows)}"
    with mock.patch.object(space, "free_bytes", lambda p: 0 if (Path(p) / "step-2").is_dir() else real(p)):
        result = c.invoke(fast(model, data, str(out), "--max-steps", "4", "--save-every", "2"))
    c.record("disk", "no room for the second checkpoint", result, expect="refuse",
             lost=not (out / "checkpoints" / "step-2" / "manifest.json").is_file())
