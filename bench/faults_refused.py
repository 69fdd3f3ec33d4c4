"""Fault census, third pass (issue 40): a refused run changes nothing, two commands on one folder, every number a
user can type, folders a failed run made, a damaged newest checkpoint.

Used by ``bench/faults.py`` (category ``refused``); the same classification (``sentence``, ``ok``, ``traceback``,
``accepted``/wrong, ``lost``). ``lost`` here: anything under the folder changed by a run that was refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from faults import base_run, copy_run, digest, fast

NUMBERS = {"max_steps": ["'²'", "'--5'", "'٣'", "'+-1'", "'1e3'", "'Ⅻ'"],
           "lr": ["7" * 400, "-" + "9" * 350, "'1e400'"],
           "seed": ["1" * 45, "'½'"], "lora_alpha": ["9" * 400], "eval_fraction": ["1" * 320],
           "warmup_steps": ["'１０'"], "keep_last": ["'0x10'"]}
"""YAML values of typed numbers: other digit systems, doubled signs, integers beyond a float, hex, full-width digits."""


def _record(c, name: str, result, *, expect: str, wrong: bool) -> None:
    """``c.record`` that also counts a refusal as not clean when it was wrong (the census' ``wrong`` marks only a
    success): a refused run that left a folder behind, or a sentence that does not name the cause."""
    if wrong and result.exit_code != 0:
        result = _Result(2, f"refused, but wrong: {' '.join(result.output.split())[:120]}\n")
    c.record("refused", name, result, expect=expect, wrong=wrong)


def _planted(run: Path) -> None:
    """A dead run's staging: a half checkpoint and a half export, named for a pid that is gone."""
    for folder in (run / "checkpoints" / ".tmp-step-9-4242-deadbeef", run / ".tmp-export-4242-deadbeef"):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")


def refused_cases(c, tmp: Path, model: str, data: str) -> None:
    base = base_run(c, tmp, model, data, "rx-base")
    for name, args in {"second run, no flag": fast(model, data, "{run}"),
                       "resume with a changed --seq-len": ["train", "--output", "{run}", "--resume", "--seq-len", "48"],
                       "resume of a finished run, no --extend-schedule": ["train", "--output", "{run}", "--resume",
                                                                          "--max-steps", "6"],
                       "plan -o onto the run's run.json": ["plan", "tiny", "--budget", "8GiB", "-o", "{run}/run.json"]
                       }.items():
        run = copy_run(base, tmp / f"rx-{len(c.rows)}")
        _planted(run)
        before = digest(run)
        result = c.invoke([a.replace("{run}", str(run)) for a in args])
        c.record("refused", f"refused ({name}) beside a dead run's staging", result, expect="refuse",
                 lost=digest(run) != before or not (run / ".tmp-export-4242-deadbeef").is_dir())
    for key, values in NUMBERS.items():
        for value in values:
            path = tmp / f"n-{len(c.rows)}.yaml"
            path.write_text(f"{key}: {value}\n", encoding="utf-8")
            out = tmp / f"n-{len(c.rows)}"
            result = c.invoke(fast(model, data, str(out), "--config", str(path)))
            _record(c, f"yaml {key}: {value[:12]}", result, expect="refuse", wrong=out.exists())
    _export_names(c, tmp, model, data, base)
    _made_folders(c, tmp, model, data)
    _damaged(c, tmp, base)
    resume = ["--output", "{run}", "--resume", "--max-steps", "6", "--extend-schedule", "--save-every", "2"]
    _concurrent(c, "two --resume of one run at once", copy_run(base, tmp / f"cc-{len(c.rows)}"), resume)
    merge = fast(model, data, "{run}", "--lora-r", "2", "--merge")[1:]
    _concurrent(c, "two --merge runs into one new folder", tmp / f"cc-{len(c.rows)}", merge)


def _export_names(c, tmp: Path, model: str, data: str, base: Path) -> None:
    lora = ["--lora-r", "2", "--merge"]  # PEFT's export writes a README.md; --merge a merged/ folder
    for name, (planted, extra) in {"folder named config.json": ("config.json/notes.txt", []),
                                   "file named merged": ("merged", lora), "foreign README.md": ("README.md", lora)
                                   }.items():
        out = tmp / f"ex-{len(c.rows)}"
        (out / planted).parent.mkdir(parents=True)
        (out / planted).write_text("mine")
        before = digest(out)
        result = c.invoke(fast(model, data, str(out), "--overwrite", *extra))
        c.record("refused", f"--overwrite over a {name}", result, expect="refuse",
                 lost=not before.items() <= digest(out).items())
    run = copy_run(base, tmp / f"ex-{len(c.rows)}")
    (run / "config.json").unlink()
    (run / "config.json").mkdir()
    before = digest(run)
    result = c.invoke(fast(model, data, str(run), "--overwrite"))
    c.record("refused", "--overwrite of a run whose config.json is now a folder", result, expect="refuse",
             lost=digest(run) != before)
    deep = tmp / "deep"
    deep.mkdir()
    (deep / "config.json").write_text(json.dumps({**json.loads(Path(model).read_text()), "num_hidden_layers": 100_000}))
    for command in (["estimate", str(deep)], ["plan", str(deep), "--budget", "8GiB"]):
        c.record("refused", f"{command[0]}: 100,000 layers", _within(command, 120), expect="refuse")


def _env() -> dict[str, str]:
    """A memfit subprocess's environment: this checkout's memfit (``sys.path``), one torch thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


class _Result:
    """What the census reads of a command run in a subprocess (``exit_code``, ``exception``, ``output``)."""

    def __init__(self, exit_code: int, output: str) -> None:
        self.exit_code, self.exception, self.output = exit_code, None, output


def _within(command: list[str], seconds: float) -> _Result:
    """``memfit COMMAND`` in a subprocess, killed after ``seconds`` (a hang is recorded as ``other``, exit 124)."""
    try:
        done = subprocess.run([sys.executable, "-m", "memfit", *command], env=_env(), capture_output=True, text=True,
                              timeout=seconds)
    except subprocess.TimeoutExpired:
        return _Result(124, f"still running after {seconds:.0f} s\n")
    return _Result(done.returncode, done.stdout + done.stderr)


def _made_folders(c, tmp: Path, model: str, data: str) -> None:
    """Runs that fail after their folder was made (injected: building the optimizer fails, as a bad
    ``--optimizer`` setting or an out-of-memory there would), into a new nested ``--output`` and into the
    ``runs/`` a run without ``--output`` makes; and a model too large for this machine, found after a run
    without ``--output`` claimed its folder. Nothing any of them made may be left."""
    from unittest import mock

    from memfit.errors import UserError
    from memfit.training import session

    huge = tmp / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({**json.loads(Path(model).read_text()), "vocab_size": 10**12}))
    failing = mock.patch.object(session, "build_optimizer", side_effect=UserError("Injected failure."))
    for name, source, output, inject in [("fails after the folder is made, new nested --output", model, "a/b/run", True),
                                         ("fails after the folder is made, no --output", model, None, True),
                                         ("model too large, no --output", str(huge), None, False)]:
        kept = tmp / f"kept-{len(c.rows)}"
        kept.mkdir()
        args = fast(source, data, output or "x", "--init", "random")
        args = args if output else [a for a in args if a not in ("--output", "x")]
        old = os.getcwd()
        os.chdir(kept)
        try:
            with failing if inject else mock.patch.dict({}):
                result = c.invoke(args)
        finally:
            os.chdir(old)
        _record(c, name, result, expect="refuse", wrong=any(kept.iterdir()))


def _damaged(c, tmp: Path, base: Path) -> None:
    run = copy_run(base, tmp / f"dm-{len(c.rows)}")
    (run / "checkpoints" / "step-4" / "manifest.json").unlink()
    result = c.invoke(["train", "--output", str(run), "--resume", "--max-steps", "4"])
    c.record("refused", "newest manifest.json deleted", result, expect="ok",
             wrong="step-4 lacks manifest.json" not in result.output)
    for step in ("step-2", "step-4"):  # step-4 saved again by the resume, or not (an older memfit exports only)
        (run / "checkpoints" / step / "manifest.json").unlink(missing_ok=True)
    result = c.invoke(["train", "--output", str(run), "--resume"])
    _record(c, "every manifest.json deleted", result, expect="refuse", wrong="lacks manifest.json" not in result.output)


def _concurrent(c, name: str, run: Path, extra: list[str]) -> None:
    """Two real runs of one folder at once (two processes; ``extra``: their flags, ``{run}`` for the folder): one
    goes on, the other is refused, and every checkpoint the folder holds afterwards is intact."""
    args = [sys.executable, "-m", "memfit", "train", *[a.replace("{run}", str(run)) for a in extra]]
    both = [subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outputs = [p.communicate(timeout=900)[0] for p in both]
    codes = sorted(p.returncode for p in both)
    from memfit.training.runfolder import manifest

    intact = all(manifest.problem(p) is None for p in (run / "checkpoints").glob("step-*"))
    refused = [o for o in outputs if o.strip().splitlines()[-1:] and o.strip().splitlines()[-1].startswith("error: ")]

    one_won = codes == [0, 1] and len(refused) == 1  # the census classifies the pair as one result
    pair = _Result(1, refused[0]) if one_won else _Result(codes[-1] or 2, f"exits {codes}\n")
    c.record("refused", name, pair, expect="refuse", lost=not intact)
