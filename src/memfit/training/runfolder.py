"""The run folder: whose it is, who is writing it, and what memfit may write or remove there.

Rules (issue 14):

- memfit writes only into a folder it created as a run folder (it holds ``.memfit-run``, or an older
  run's ``run.json``/``metrics.jsonl``/``checkpoints``), into an empty folder, or, with ``--overwrite``,
  into a folder holding other files; it never writes into the input model, tokenizer or data folder,
  even with ``--overwrite``.
- ``--overwrite`` removes only files memfit writes itself (``OWN_FILES``), never anything else there.
- While a run writes a folder it holds an exclusive ``fcntl.flock`` on ``.memfit-run``; a second run
  into the folder is refused in one sentence. The kernel drops the lock when the process dies, so a
  lock left by a killed run is never in the way.
- A run that fails before its first optimizer step removes the folder again if it created it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from memfit.errors import UserError
from memfit.settings.validate import check_writable_target

MARKER = ".memfit-run"
LEGACY_MARKERS = ("run.json", "metrics.jsonl", "checkpoints")
#: What a memfit run writes at the top of its folder (the model export's files are replaced, not removed).
OWN_FILES = ("checkpoints", "metrics.jsonl", "run.json", "loss.png", "memfit", ".tmp-export")


def is_run_folder(path: Path) -> bool:
    return any((path / name).exists() for name in (MARKER, *LEGACY_MARKERS))


def _same_or_inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def input_folders(config) -> list[tuple[str, Path, bool]]:
    """The folders the run reads from (model, tokenizer, data) and whether a folder was given (then
    nothing below it may be the output either) or a file (then only its own folder is off limits)."""
    found = []
    for label, value in (("--model", config.model), ("--tokenizer", config.tokenizer), ("--data", config.data)):
        if not value:
            continue
        path = Path(value).expanduser()
        if path.is_file():
            found.append((label, path.parent, False))
        elif path.is_dir():
            found.append((label, path, True))
    return found


class RunFolder:
    """The output folder of one run, checked, created and locked by ``open``; released by ``close``."""

    def __init__(self, output: Path) -> None:
        self.output = Path(output)
        self.created = False
        self.started = False
        """Set once the first optimizer step ran: from then on the folder holds work worth keeping."""
        self._lock_fd: int | None = None

    def open(self, config, *, is_main: bool) -> RunFolder:
        """Check the folder against the rules above, create it if needed, and lock it (main process)."""
        output = self.output
        check_writable_target(output, flag_name="--output", is_dir=True)
        for label, folder, whole_tree in input_folders(config):
            if _same_or_inside(output, folder) if whole_tree else output.resolve() == folder.resolve():
                raise UserError(f"--output {output} is the {label} folder {folder} (or inside it); memfit never writes "
                                "into its inputs, so choose another --output.")
        if not is_main:  # the main process decides (and creates the marker the others would then see)
            return self
        if config.resume:
            self._lock()
            return self
        exists = output.is_dir()
        foreign = exists and any(p.name != MARKER for p in output.iterdir()) and not is_run_folder(output)
        if foreign and not config.overwrite:
            raise UserError(f"{output} holds files that are not a memfit run; pass --overwrite to write the run "
                            "there anyway (memfit replaces only its own files), or choose another --output.")
        if exists and is_run_folder(output) and not config.overwrite:
            raise UserError(f"{output} already holds a training run; pass --overwrite to replace it, "
                            "--resume to continue it, or choose another --output.")
        if not exists:
            output.mkdir(parents=True)
            self.created = True
        self._lock()
        if config.overwrite:
            for name in OWN_FILES:
                target = output / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        return self

    def _lock(self) -> None:
        import fcntl

        path = self.output / MARKER
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"Another memfit run (pid {holder}) is writing to {self.output}; wait for it to end or "
                            "choose another --output.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def close(self, *, failed: bool) -> None:
        """Release the lock; after a failure before the first step, remove the folder if this run made it."""
        if self._lock_fd is not None:
            import fcntl

            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
        if failed and self.created and not self.started:
            shutil.rmtree(self.output, ignore_errors=True)
