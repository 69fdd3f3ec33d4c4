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
