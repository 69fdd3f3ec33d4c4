"""User-facing errors.

A ``UserError`` is something the user can fix (a bad flag, a missing file, a budget nothing fits).
Its message is one sentence; the CLI prints it without a traceback and exits 1.
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user caused and can fix; ``str(err)`` is one clear sentence."""

    exit_code = 1


class NothingFitsError(UserError):
    """No configuration fits the memory budget (raised by the planner)."""


class NoCandidatesError(UserError):
    """The pinned settings leave the planner no configuration to try (raised by ``planning.space``)."""


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
"""Terminal control characters (C0, DEL, C1) -> their ``\\xNN`` escape: an escape sequence carried by a
user's value (a JSONL field name, a path) would otherwise recolour, move or retitle the user's terminal."""


def printable(text: str) -> str:
    """``text`` with every terminal control character escaped (``\\x1b[31m`` shown, not obeyed); a line
    break inside a value is escaped too, so an echoed sentence stays one line."""
    return str(text).translate(_CONTROLS)


_CONTROLS_KEEP_LINES = {c: v for c, v in _CONTROLS.items() if chr(c) not in "\n\t"}


def printable_lines(text: str) -> str:
    """``printable`` for text shown as lines (a previewed record): line breaks and tabs kept, every other
    control character escaped."""
    return str(text).translate(_CONTROLS_KEEP_LINES)
