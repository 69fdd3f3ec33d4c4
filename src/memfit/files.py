"""Writing a user-named file safely: whole or not at all, never onto a device, with the usual mode.

``plan -o FILE`` and ``--accelerate-config FILE`` write where the user says. ``tempfile.mkstemp`` +
``os.replace`` makes the write atomic, but on its own it (1) leaves the file mode 0600, mkstemp's,
where every other tool writes 0666 minus the umask, and (2) replaces whatever the name pointed at: a
character device such as ``/dev/null`` would be swapped for a regular file (as root, breaking the
machine's null device). ``write_text_atomic`` refuses such targets and gives the file the mode a
plain ``open(path, "w")`` would (an existing file keeps its own).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from memfit.errors import UserError


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set and restore at once
    os.umask(mask)
    return mask


def write_text_atomic(path: Path, text: str, *, what: str = "") -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``.

    Raises:
        UserError: ``path`` is a folder or a special file (device, FIFO, socket), or the write fails
            (no space, read-only); nothing is left under ``path`` or beside it.
    """
    path = Path(path).expanduser()
    label = f"{what} {path}".strip()
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    except OSError as err:
        raise UserError(f"Could not write {label} ({err.strerror or err}); nothing was written there.") from None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise UserError(f"{label} is a folder; give a file name.")
    if info is not None and not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        raise UserError(f"{label} is not a regular file (a device, pipe or socket); give a file name.")
    mode = stat.S_IMODE(info.st_mode) if info is not None and stat.S_ISREG(info.st_mode) else 0o666 & ~_umask()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # a symlink at ``path`` is replaced, never written through
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise UserError(f"Could not write {label} ({err.strerror or err}); nothing was written there.") from None
