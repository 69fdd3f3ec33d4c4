"""Writing a file safely: whole or not at all, never onto a device, never through a link, with the usual mode.

The one atomic writer of memfit: ``plan -o FILE``, ``--accelerate-config FILE``, ``estimate --plot``,
the run folder's ``run.json``, ``loss.png``, ``trainer_state.json``, manifests and the derived-recipe
cache all go through ``write_atomic``. ``tempfile.mkstemp`` + ``os.replace`` makes the write atomic,
but on its own it (1) leaves the file mode 0600, mkstemp's, where every other tool writes 0666 minus
the umask, and (2) replaces whatever the name pointed at: a character device such as ``/dev/null``
would be swapped for a regular file (as root, breaking the machine's null device). So:

- a folder, a device, FIFO or socket at the name (or a link to one) is refused in one sentence;
- a symlink at the name is replaced by the new file (``os.replace`` renames over the link itself),
  never written through; the temporary file is opened ``O_CREAT | O_EXCL | O_NOFOLLOW``;
- with ``root`` (a run folder), no folder between ``root`` and the file may be a symlink, so a
  planted ``checkpoints -> elsewhere`` is refused rather than followed;
- the file gets the mode a plain ``open(path, "w")`` would (an existing regular file keeps its own).

``append_line`` is the one appender (``metrics.jsonl``): ``O_APPEND | O_NOFOLLOW``, regular files only.
``user_path`` is how every path a user typed becomes a ``Path``.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tempfile
from pathlib import Path

from memfit.errors import UserError


def user_path(text: str | os.PathLike) -> Path:
    """A path as the user typed it, ``~`` and ``~user`` expanded where they can be: ``Path.expanduser`` raises
    ``RuntimeError`` for a user who does not exist (``--data ~nouser/x.txt`` ended in a traceback), while
    ``os.path.expanduser`` leaves that path as typed, so the caller's "does not exist" sentence names it."""
    return Path(os.path.expanduser(os.fspath(text)))


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set and restore at once
    os.umask(mask)
    return mask


def check_no_links(root: Path, path: Path) -> None:
    """Refuse when a folder between ``root`` (included) and ``path`` (excluded) is a symlink."""
    root, path = Path(root), Path(path)
    try:
        parts = path.relative_to(root).parts[:-1]
    except ValueError:
        return
    folder = root  # ``root`` itself is the user's --output: a link there is the user's choice
    for part in parts:
        folder = folder / part
        if folder.is_symlink():
            raise UserError(f"{folder} is a symbolic link inside the run folder; memfit never writes through links "
                            "there, so remove the link (or choose another --output).")


def _target_mode(path: Path, label: str) -> int:
    """The mode for the new file; ``UserError`` when ``path`` is a folder or a special file (or links to one)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return 0o666 & ~_umask()
    if stat.S_ISDIR(info.st_mode):
        raise UserError(f"{label} is a folder; give a file name.")
    if stat.S_ISLNK(info.st_mode):
        try:
            target = path.stat()
        except OSError:
            target = None  # a dangling link: replaced by the file
        if target is not None and not stat.S_ISREG(target.st_mode):
            raise UserError(f"{label} is a link to a folder or special file (a device, pipe or socket); give a "
                            "file name.")
        return 0o666 & ~_umask()
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{label} is not a regular file (a device, pipe or socket); give a file name.")
    return stat.S_IMODE(info.st_mode)


def write_atomic(path: Path, data: str | bytes, *, what: str = "", root: Path | None = None,
                 user_error: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``.

    Raises:
        UserError: ``path`` is a folder or a special file (device, FIFO, socket), a folder on the way under
            ``root`` is a symlink, or (``user_error``) the write fails (no space, read-only); nothing is left
            under ``path`` or beside it.
        OSError: the write failed and ``user_error`` is False (a training run: ``training.guard`` says which
            checkpoint is intact); the temporary file is removed first.
    """
    path = user_path(path)
    label = f"{what} {path}".strip()
    if root is not None:
        check_no_links(root, path)
    try:
        mode = _target_mode(path, label)
    except OSError as err:
        raise UserError(f"Could not write {label} ({err.strerror or err}); nothing was written there.") from None
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _open_temp(path)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # a symlink at ``path`` is replaced, never written through
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if not user_error:
            raise
        raise UserError(f"Could not write {label} ({err.strerror or err}); nothing was written there.") from None


def _open_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path`` (mkstemp opens with ``O_EXCL``, which never follows a link)."""
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")


def write_text_atomic(path: Path, text: str, *, what: str = "") -> None:
    """``write_atomic`` for text (UTF-8), errors as one sentence."""
    write_atomic(path, text, what=what)


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` (created if missing); never through a symlink, only to a
    regular file. ``OSError`` on a failing write (the caller knows what is saved)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link; memfit never writes through links in a run folder, so "
                            "remove the link.") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path} is not a regular file (a device, pipe or socket); remove it.")
        os.write(fd, (line + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def figure_bytes(fig, path: Path, **kwargs) -> bytes:
    """A matplotlib figure rendered in memory in the format ``path``'s suffix names (then written with
    ``write_atomic``)."""

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".").lower() or "png", **kwargs)
    return buf.getvalue()
