"""Keep the terminal output shown in README.md and docs/*.md equal to what the tool prints.

A fenced block whose first line is ``$ memfit estimate ...``, ``$ memfit plan ...`` or
``$ memfit presets`` (cheap, deterministic commands: no ``--exact``, ``--plot``, ``--output``) holds
the command's output at 80 columns up to the next ``$ `` line or the end of the block.
``python scripts/doc_outputs.py`` rewrites those outputs from real runs; ``tests/test_docs.py`` fails
when a doc and the tool disagree. Timings ("searched in 91 ms") vary run to run and compare as ``N``.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 80
CHECKED = ("estimate", "plan", "presets")
_UNCHECKED_FLAGS = ("--exact", "--plot", "--output", "-o", "--timeline", "--gpu auto")
_VARYING = [
    # the line wraps after "step:" or not depending on how many digits the search time has
    (re.compile(r"searched in \d+ ms; tokens per optimizer step:\s+"), "searched in N ms; tokens per optimizer step: "),
    (re.compile(r"searched in \d+ ms"), "searched in N ms"),
]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def checked_command(line: str) -> list[str] | None:
    """The argv of a ``$ memfit ...`` line this module keeps in step, or None."""
    if not line.startswith(tuple(f"$ memfit {c}" for c in CHECKED)) or line.endswith("\\"):
        return None
    argv = shlex.split(line[2:])
    padded = f" {line} "  # whole flags only: "-o" must not match "--offload" or "--no-optimizer-in-backward"
    if any(f" {flag} " in padded or f" {flag}=" in padded for flag in _UNCHECKED_FLAGS):
        return None
    return argv[1:]


def normalise(text: str) -> str:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    out = "\n".join(lines)
    for pattern, repl in _VARYING:
        out = pattern.sub(repl, out)
    return out


def run(argv: list[str]) -> str:
    """The command's output as a terminal ``WIDTH`` columns wide shows it."""
    from click.testing import CliRunner

    from memfit.cli import cli

    result = CliRunner(env={"COLUMNS": str(WIDTH), "LINES": "50"}).invoke(cli, argv)
    if result.exit_code not in (0, 1):  # 1: a user error, shown in the docs on purpose
        raise RuntimeError(f"memfit {' '.join(argv)} failed: {result.output}")
    return normalise(result.output)


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
    """Rewrite the outputs in ``path``; returns how many changed."""
    text = path.read_text()
    changed = 0
    for start, end, argv, shown in reversed(list(blocks(text))):
        fresh = run(argv)
        if normalise(shown) != fresh:
            changed += 1
        keep_blank = "\n" if shown.endswith("\n\n") else ""
        text = text[:start] + fresh + "\n" + keep_blank + text[end:]
    path.write_text(text)
    return changed


if __name__ == "__main__":
    for file in doc_files():
        n = update(file)
        print(f"{file.relative_to(ROOT)}: {n} output(s) rewritten", file=sys.stderr)
