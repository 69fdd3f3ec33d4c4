"""Keep the terminal output shown in README.md and docs/*.md equal to what the tool prints.

Every fenced block line ``$ memfit ...`` (estimate, plan, presets, train, data) or ``$ cat FILE`` holds
that command's output at 80 columns, up to the next ``$ `` line or the end of the block. A shown output
that ends with a ``...`` line is the beginning of the output (the rest is left out on purpose).
``python scripts/doc_outputs.py`` reruns every such command and rewrites the docs; ``tests/test_docs.py``
fails when a doc and the tool disagree.

The commands run in-process (``click.testing.CliRunner``), one after another in one scratch folder that
holds the inputs the docs name (``FIXTURES``: ``chats.jsonl``, ``data/bad.jsonl``, ...), so relative
``--output`` folders and the files a command writes (``plan.yaml``) land there, never in the checkout.

What may differ from run to run, and how it is compared (the stated tolerance; all else is exact):

* estimate, plan, presets, data: the text as printed, except the search time ("searched in N ms").
* train: its numbers (losses, parameters, sequences, steps, predicted and measured tensor peaks, samples)
  are exact: the run is seeded and deterministic whatever the thread count. Timings (wall time,
  tokens/s, elapsed and ETA), the process' RSS and the torch-threads line (chosen from the idle cores,
  or from OMP_NUM_THREADS) depend on the machine, its load and its environment, so they compare by form
  only (any value); the note a loaded machine gets mid-run ("steps
  now take 3.0x as long as the first ones") is not compared at all, and of the live progress line only
  the step, loss and held-out loss are (which other fields fit 80 columns depends on the speed). Train's output is compared as words, so a
  table that is one column wider because "1,224 tokens/s" became "987 tokens/s" is not a difference.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shlex
import shutil
import sys
import tempfile
from functools import cache, lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 80
CHECKED = ("estimate", "plan", "presets", "train", "data")
_UNCHECKED_FLAGS = ("--exact", "--plot", "--timeline", "--gpu auto", "--resume")
_VARYING = [
    # the line wraps after "step:" or not depending on how many digits the search time has
    (re.compile(r"searched in (?:\d+|N) ms; tokens per optimizer step:\s+"), "searched in N ms; tokens per optimizer step: "),
    (re.compile(r"searched in \d+ ms"), "searched in N ms"),
]
#: train: the machine-dependent fields (see the module docstring), applied to the output as words.
_TRAIN_VARYING = [
    (re.compile(r"torch threads: \d+ \(.*?to choose\)"), "torch threads: T (machine)"),
    # ... or where the environment chose them (OMP_NUM_THREADS: torchrun, a user's shell)
    (re.compile(r"torch threads: \d+ \(from [\w-]+; \d+ core\(s\) available\)"), "torch threads: T (machine)"),
    (re.compile(r"\d+(?:\.\d+)? [KM]? ?tok/s"), "R tok/s"),
    (re.compile(r"[\d,.]+ [KM]?tokens/s"), "R tokens/s"),
    (re.compile(r"rss [\d.]+ [KMG]iB"), "rss M"),
    (re.compile(r"(process peak RSS )[\d.]+ [KMG]iB"), r"\1M"),
    (re.compile(r"\d+:\d\d(:\d\d)? +eta \d+:\d\d(:\d\d)?"), "T eta T"),
    (re.compile(r"(wall time )[\d.]+ s \(training loop [\d.]+ s\)"), r"\1T s (training loop T s)"),
    (re.compile(r"(wall time )[\d.]+ s"), r"\1T s"),
    (re.compile(r"(elapsed )[\d:]+"), r"\1T"),
    # said only when the machine is loaded mid-run (training/threads.LoadWatch): how busy CI's machine is
    (re.compile(r" ?note: steps now take [\d.]+x as long as the first ones \(.*?\): the machine seems loaded "
                r"by other processes\. If it stays slow, fewer threads may help \(--threads 1\)\."), ""),
    # the live line keeps the fields that fit 80 columns, so a faster machine's "1.2 K tok/s" can push out
    # its memory or elapsed time: only the step, loss and eval are compared there
    (re.compile(r"(step \d+/\d+ loss [\d.]+(?: eval [\d.]+)?)(?: R tok/s)?(?: rss M)?(?: T eta T| eta [\d:-]+)?"),
     r"\1 [rate, memory, time]"),
]
_BOX = re.compile(r"[┌┐└┘├┤┬┴┼─│━┃┏┓┗┛┡┩╇╈┳┻╋]+")

#: The inputs the documented commands name, created in the scratch folder (None: an empty folder).
FIXTURES: dict[str, str | None] = {
    "data/bad.jsonl": '{"text": "one"}\n{"text": "two"}\n{"text": "three" "four"}\n',
    "data/none.jsonl": '{"text": "one"}\n{"body": "two"}\n',
    "data/empty.txt": "",
    "emptydir": None,
    "table.xlsx": "not a spreadsheet",
    "chats.jsonl": (
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}, '
        '{"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}, '
        '{"role": "assistant", "content": "6."}]}\n'
        '{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]}\n'
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}\n'
        '{"messages": [{"role": "user", "content": "Anyone there?"}]}\n'
    ),
}


def _write_fixtures(root: Path) -> None:
    for rel, content in FIXTURES.items():
        path = root / rel
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a first row", "a second row"], "n": [1, 2]}), root / "data.parquet")
    for example in sorted((ROOT / "docs" / "examples").glob("*.y*ml")):  # other tools' configs (docs/interop.md)
        (root / "examples").mkdir(exist_ok=True)
        (root / "examples" / example.name).write_text(example.read_text())


@lru_cache(maxsize=1)
def scratch() -> Path:
    """The folder every documented command runs in (made once per process, with ``FIXTURES``; removed when
    the process exits: it holds only what the commands wrote, among them the demo's run folder)."""
    root = Path(tempfile.mkdtemp(prefix="memfit-docs-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    _write_fixtures(root)
    return root


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def checked_command(line: str) -> list[str] | None:
    """The argv (after ``memfit``; ``["cat", FILE]`` for a ``$ cat`` line) of a line kept in step, or None."""
    if line.startswith("$ cat ") and len(shlex.split(line[2:])) == 2:
        return shlex.split(line[2:])
    if not line.startswith(tuple(f"$ memfit {c}" for c in CHECKED)) or line.endswith("\\"):
        return None
    argv = shlex.split(line[2:], comments=True)
    padded = f" {line} "  # whole flags only: "-o" must not match "--offload" or "--no-optimizer-in-backward"
    if any(f" {flag} " in padded or f" {flag}=" in padded for flag in _UNCHECKED_FLAGS):
        return None
    return argv[1:]


def normalise(text: str, argv: list[str] | None = None) -> str:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    out = "\n".join(lines)
    for pattern, repl in _VARYING:
        out = pattern.sub(repl, out)
    if argv and argv[0] == "train" and "error:" not in out:
        out = " ".join(_BOX.sub(" ", out).split())  # words: wrapping and table widths aside
        for pattern, repl in _TRAIN_VARYING:
            out = pattern.sub(repl, out)
    return out


def shown_part(shown: str) -> tuple[str, bool]:
    """The shown output, and whether it is only the beginning (its last line is ``...``)."""
    lines = shown.rstrip("\n").splitlines()
    if lines and lines[-1].strip() == "...":
        return "\n".join(lines[:-1]), True
    return shown, False


def agrees(shown: str, fresh: str, argv: list[str]) -> bool:
    """Whether a doc's output agrees with a fresh run (under the stated tolerance)."""
    part, is_prefix = shown_part(shown)
    want, got = normalise(part, argv), normalise(fresh, argv)
    return got.startswith(want) if is_prefix else got == want


_ESCAPE = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def terminal_screen(stream: str) -> str:
    """What a terminal shows once ``stream`` (text with ``\\r`` and ANSI cursor codes) is written to it.

    ``memfit train`` runs with rich's terminal forced on (``TTY_COMPATIBLE``/``TTY_INTERACTIVE``), so the
    docs show the live progress line as a user's terminal leaves it, not the plain log lines a pipe
    gets. Handles what rich's ``Live`` writes: carriage return, erase line (``K``), cursor up (``A``);
    colours and cursor visibility are dropped.
    """
    lines: list[list[str]] = [[]]
    row = col = 0
    pos = 0
    for match in [*_ESCAPE.finditer(stream), None]:
        text = stream[pos: match.start() if match else len(stream)]
        for ch in text:
            if ch == "\n":
                row, col = row + 1, 0
                while len(lines) <= row:
                    lines.append([])
            elif ch == "\r":
                col = 0
            else:
                line = lines[row]
                line.extend(" " * (col - len(line) + 1) if col >= len(line) else "")
                line[col] = ch
                col += 1
        if match is None:
            break
        arg, code = match.groups()
        if code == "K":
            lines[row] = lines[row][:col] if arg in ("", "0") else []
        elif code == "A":
            row = max(0, row - int(arg or 1))
        pos = match.end()
    return "\n".join("".join(line).rstrip() for line in lines).strip("\n")


@contextlib.contextmanager
def _cwd(path: Path):
    """``contextlib.chdir`` (Python 3.11+) for 3.10."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@cache
def _run_cached(argv: tuple[str, ...]) -> str:
    if argv[0] == "cat":
        return (scratch() / argv[1]).read_text()
    from click.testing import CliRunner

    from memfit.cli import cli

    env = {"COLUMNS": str(WIDTH), "LINES": "50"}
    if argv[0] == "train":  # as a terminal shows it: the live line, not a pipe's plain log lines
        env.update(TTY_COMPATIBLE="1", TTY_INTERACTIVE="1", NO_COLOR="1")
    with _cwd(scratch()):
        result = CliRunner(env=env).invoke(cli, list(argv))
    if result.exit_code not in (0, 1):  # 1: a user error, shown in the docs on purpose
        raise RuntimeError(f"memfit {' '.join(argv)} failed: {result.output}")
    return terminal_screen(result.output)


def run(argv: list[str]) -> str:
    """The command's output as a terminal ``WIDTH`` columns wide shows it (each command runs once per
    process: the README and docs/train.md show the same demo)."""
    return _run_cached(tuple(argv))


def blocks(text: str):
    """(start, end, argv, shown output) of every checked command in ``text`` (character offsets of the output)."""
    for fence in re.finditer(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        body_start = fence.start(1)
        body = fence.group(1)
        commands = [m for m in re.finditer(r"^\$ .*$", body, flags=re.M)]
        for i, cmd in enumerate(commands):
            argv = checked_command(cmd.group(0))
            if argv is None:
                continue
            out_start = cmd.end() + 1
            out_end = commands[i + 1].start() if i + 1 < len(commands) else len(body)
            yield body_start + out_start, body_start + out_end, argv, body[out_start:out_end]


def update(path: Path) -> int:
    """Rewrite the outputs in ``path``; returns how many changed. A shown beginning (``...``) keeps as
    many lines as it showed."""
    text = path.read_text()
    changed = 0
    found = [(start, end, argv, shown, run(argv)) for start, end, argv, shown in blocks(text)]  # in order: a
    for start, end, argv, shown, fresh in reversed(found):  # `$ cat FILE` reads what a command above wrote
        if agrees(shown, fresh, argv):
            continue
        changed += 1
        if argv[0] != "train":  # train's text is a real run's, timings included; the others' are exact
            fresh = normalise(fresh, argv)
        part, is_prefix = shown_part(shown)
        if is_prefix:
            fresh = "\n".join(fresh.splitlines()[: len(part.splitlines())]) + "\n..."
        keep_blank = "\n" if shown.endswith("\n\n") else ""
        text = text[:start] + fresh + "\n" + keep_blank + text[end:]
    path.write_text(text)
    return changed


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1:2] == ["--print"]:  # one command's output, in a process of its own (tests/test_docs.py)
        import json

        sys.stdout.write(run(json.loads(sys.argv[2])))
        sys.exit(0)
    only = {Path(arg).resolve() for arg in sys.argv[1:]}  # python scripts/doc_outputs.py [FILE.md ...]
    for file in doc_files():
        if only and file.resolve() not in only:
            continue
        n = update(file)
        print(f"{file.relative_to(ROOT)}: {n} output(s) rewritten", file=sys.stderr)
