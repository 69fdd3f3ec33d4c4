"""Progress reaches any terminal or file (issue 22, item 3), and a resume says where it resumed.

Without a live terminal (nohup, Slurm, CI, ``| tee``: here CliRunner's captured stderr) the run writes
plain step lines every ``--log-every`` steps and at least every ``progress.LOG_SECONDS`` seconds, and an
evaluation line after each evaluation; on a terminal it keeps the live line. A resume names its step
and checkpoint, the summary shows the whole run's wall time and this process's apart, and a finished
run is trained on past its end (its learning rate rising again from 0) only with ``--extend-schedule``.
Runs are 5-7 optimizer steps of the 2-layer hidden-64 Llama.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from _train_helpers import metrics, write_model, write_qa
from memfit.cli import cli
from memfit.training import progress
from memfit.training.progress import LiveProgress

#: The step line's stable format (docs/train.md): every field, units included.
STEP_LINE = re.compile(r"^step (\d+)/(\d+)  loss \d+\.\d{3}  lr \d\.\de[-+]\d\d  [\d.]+( [KMB])? tok/s  "
                       r"rss [\d.]+ (KiB|MiB|GiB)  elapsed \d+:\d\d  eta \d+:\d\d$")
EVAL_LINE = re.compile(r"^eval step (\d+)/(\d+)  held-out loss \d+\.\d{3}$")


def _run(args):
    return CliRunner().invoke(cli, args)


def _train(model, data, output, *extra):
    return ["train", "--model", str(model), "--tokenizer", "byte", "--data", str(data), "--seq-len", "32",
            "--micro-batch", "2", "--eval-every", "3", "--eval-fraction", "0.1", "--samples", "0", "--no-packing",
            "--optimizer", "adamw", "--warmup-steps", "1", "--output", str(output), *extra]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 5-step run (checkpoint every step, the newest two kept), run with --json; its CliRunner result."""
    tmp = tmp_path_factory.mktemp("logs")
    model, data = write_model(tmp / "m"), write_qa(tmp, n=24)
    result = _run(_train(model, data, tmp / "run", "--max-steps", "5", "--log-every", "2", "--save-every", "1",
                         "--json"))
    assert result.exit_code == 0, result.output
    return tmp / "run", result


# ------------------------------------------------------------------------------ plain lines without a TTY
def test_without_a_terminal_the_run_writes_plain_step_and_eval_lines(finished):
    _, result = finished
    json.loads(result.stdout)  # --json: stdout is the summary alone; the progress went to stderr
    lines = result.stderr.splitlines()
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m]
    assert steps == [2, 4, 5], result.stderr  # every --log-every 2 steps and the last
    assert [int(m.group(1)) for m in map(EVAL_LINE.match, lines) if m] == [3, 5]  # --eval-every 3 and the end
    assert "\r" not in result.stderr and "\x1b" not in result.stderr  # nothing redrawn, no escape codes
    # the eval line follows the step line of its step (step 5: the step line, then its evaluation)
    assert lines.index(next(x for x in lines if x.startswith("eval step 5/5"))) == \
        lines.index(next(x for x in lines if x.startswith("step 5/5"))) + 1


def _fake_clock(monkeypatch, start: float = 1000.0):
    now = {"t": start}

    class Clock:
        @staticmethod
        def perf_counter():
            return now["t"]

    monkeypatch.setattr(progress, "time", Clock)
    return now


def _plain_bar(console, **kw):
    return LiveProgress(20, 0, True, console=console, **kw)


UPDATE = dict(loss=1.2344, lr=9.5e-4, tokens_per_s=1234.0, memory=255_433_523, skipped=0, eval_loss=None,
              memory_label="rss")


def test_a_plain_line_at_least_every_log_seconds_between_log_every_lines(monkeypatch):
    now = _fake_clock(monkeypatch)
    console = Console(file=io.StringIO(), width=40, _environ={})  # a file: not a terminal, 40 columns
    bar = _plain_bar(console, log_every=100)
    assert not bar.live
    for step in range(1, 21):
        now["t"] += 11.0  # 11 s a step: 30 s have passed at steps 3, 6, 9, ... since the previous line
        bar.update(step, **UPDATE)
    lines = console.file.getvalue().splitlines()
    assert [int(STEP_LINE.match(x).group(1)) for x in lines] == [3, 6, 9, 12, 15, 18, 20]  # and the last
    # one line each, never wrapped at the console's 40 columns; 3 steps in 33 s, 17 to go: 187 s
    assert lines[0] == "step 3/20  loss 1.234  lr 9.5e-04  1.2 K tok/s  rss 243.6 MiB  elapsed 0:33  eta 3:07"


def test_log_every_lines_and_the_evaluation_line(monkeypatch):
    now = _fake_clock(monkeypatch)
    console = Console(file=io.StringIO(), _environ={})
    bar = _plain_bar(console, log_every=4)
    for step in range(1, 11):
        now["t"] += 1.0
        evaluated = step == 5
        bar.update(step, **{**UPDATE, "eval_loss": 2.5 if step >= 5 else None}, evaluated=evaluated)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 3 and STEP_LINE.match(lines[0]) and STEP_LINE.match(lines[2]), lines
    assert lines[0].startswith("step 4/20  ") and lines[2].startswith("step 8/20  ")
    assert lines[1] == "eval step 5/20  held-out loss 2.500"  # its own line, at the step it ran


@pytest.mark.parametrize("environ, live", [
    ({}, False),  # a file or pipe
    ({"TTY_COMPATIBLE": "1", "TERM": "xterm"}, True),  # a terminal (rich's override, as isatty would say)
    ({"TTY_COMPATIBLE": "1", "TERM": "dumb"}, False),  # a terminal that cannot redraw a line
    ({"TTY_COMPATIBLE": "1", "TERM": "xterm", "TTY_INTERACTIVE": "0"}, False),  # colours, but no animation
    ({"FORCE_COLOR": "1", "TERM": "xterm"}, True),
])
def test_the_live_line_only_where_rich_can_redraw_it(monkeypatch, environ, live):
    _fake_clock(monkeypatch)
    console = Console(file=io.StringIO(), width=80, _environ=environ)
    with _plain_bar(console, log_every=1) as bar:
        assert bar.live is live
        bar.update(1, **UPDATE)
    out = console.file.getvalue()
    assert ("elapsed 0:00" in out) is not live  # the plain line's field; the live line writes "0:00" bare
    assert ("━" in out) is live  # the live line's bar


# ------------------------------------------------------------------------------ resume
def test_training_a_finished_run_on_is_refused_without_extend_schedule(tmp_path, finished):
    run = shutil.copytree(finished[0], tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    result = _run(["train", "--output", str(run), "--resume", "--max-steps", "7"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "finished its 5 steps with its learning rate decayed to 0" in errors[0]
    assert "add --extend-schedule" in errors[0]
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}  # refused before the folder is touched

    result = _run(["train", "--output", str(run), "--resume", "--max-steps", "7", "--extend-schedule"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()  # each a whole line in a log, however long (no wrap at 80 columns)
    assert f"resumed from checkpoint step 5 of 7 ({run}/checkpoints/step-5)" in lines
    assert any(re.fullmatch(r"learning-rate schedule recomputed over 7 steps \(was 5\): at step 5 the lr is "
                            r"\d\.\de-0\d \(was 0\.0e\+00\), decaying to 0 at step 7", line) for line in lines), lines
    logged = [m for m in metrics(run) if "loss" in m]
    lr = {m["step"]: m["lr"] for m in logged}  # --log-every 2 (the run's own), and the last steps
    assert sorted(lr) == [2, 4, 5, 6, 7] and lr[5] == 0.0 and lr[6] > 0 and lr[7] == 0.0

    doc = json.loads((run / "run.json").read_text())
    saved = json.loads((finished[0] / "checkpoints" / "step-5" / "trainer_state.json").read_text())["wall_s"]
    assert 0 < doc["process_wall_s"] < doc["wall_s"]  # this process alone, the whole run
    assert doc["wall_s"] == pytest.approx(saved + doc["process_wall_s"], abs=0.05)  # the parts add up
    rows = [_flat(line) for line in result.stdout.splitlines()]
    assert any(f"wall time │ {doc['wall_s']:.1f} s, whole run (training loop" in row for row in rows), rows
    assert any(f"wall time (this process) │ {doc['process_wall_s']:.1f} s, resumed from step 5" in row
               for row in rows), rows


def test_an_unfinished_run_given_more_steps_says_its_schedule_changed(tmp_path, finished):
    run = shutil.copytree(finished[0], tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-5")  # killed after step 4's checkpoint
    result = _run(["train", "--output", str(run), "--resume", "--max-steps", "7"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert f"resumed from checkpoint step 4 of 7 ({run}/checkpoints/step-4)" in lines
    assert any(line.startswith("learning-rate schedule recomputed over 7 steps (was 5): at step 4 the lr is")
               for line in lines), lines
    assert re.search(r"step 7/7  loss", result.stderr)


def test_same_length_resume_says_where_and_nothing_about_the_schedule(tmp_path, finished):
    run = shutil.copytree(finished[0], tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-5")
    result = _run(["train", "--output", str(run), "--resume"])
    assert result.exit_code == 0, result.output
    assert f"resumed from checkpoint step 4 of 5 ({run}/checkpoints/step-4)" in result.stderr.splitlines()
    assert "schedule" not in result.stderr


def test_extend_schedule_without_resume_is_one_sentence(tmp_path):
    result = _run(["train", "--output", str(tmp_path / "out"), "--extend-schedule"])
    assert result.exit_code == 1
    assert result.output.strip() == ("error: --extend-schedule continues a finished run past its end and needs "
                                     "--resume (and --output, the run's folder).")
    assert not Path(tmp_path / "out").exists()
