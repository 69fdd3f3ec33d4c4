"""The run folder: whose it is, who is writing it, and what memfit may write or remove there.

Rules (issue 14):

- memfit writes only into a folder it created as a run folder (it holds ``.memfit-run``, or an older
  run's ``run.json``/``metrics.jsonl``/``checkpoints``), into an empty folder, or, with ``--overwrite``,
  into a folder holding other files; it never writes into the input model, tokenizer or data folder,
  even with ``--overwrite``.
- ``--overwrite`` removes only what the run's own manifest (``ledger``: ``.memfit-files.json``) says memfit
  wrote, never anything else there; a file memfit would replace but did not write is refused.
- While a run writes a folder it holds an exclusive ``fcntl.flock`` on ``.memfit-run``; a second run
  into the folder is refused in one sentence. The kernel drops the lock when the process dies, so a
  lock left by a killed run is never in the way. An existing folder is locked before anything in it is
  read, created or removed (``lock_existing``, the first thing a run does), so a refused run touches
  nothing, and a resume reads its checkpoint only while it holds the lock.
- Staging folders (``checkpoints/.tmp-step-N-<pid>-<random>``, ``.tmp-export-<pid>-<random>``) are named
  for the run that made them; leftovers are removed only by the process that holds the lock, and only once
  it owns the folder (``open`` passed every check): a run refused after taking the lock (a folder that
  already holds a run, a resume that does not match) changes nothing, not even a dead run's leftovers.
- The names a run or its export writes (``ledger.RUN_FILES``, ``EXPORT_FILES``, ``EXPORT_FOLDERS``) are checked
  by ``open`` before the first step: one that is someone else's, or of another kind than memfit writes there
  (a folder named ``config.json``), is refused then, not after training.
- A run that fails before its first optimizer step removes the folder again if it created it, and the parent
  folders it created for it (``--output a/b/c`` with no ``a``), never one it did not create.
- Without ``--output`` the run claims a fresh ``runs/<model>-<time>`` with an exclusive ``mkdir``
  (``claim_fresh``), so two runs started in the same second get two folders.
- Nothing in the folder is written through a symlink (``memfit.files``): a link at a file's name is
  replaced, a link on the way (``checkpoints -> elsewhere``) or as the lock file is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path

from memfit.errors import UserError
from memfit.files import check_no_links, user_path
from memfit.settings.validate import check_writable_target
from memfit.training.runfolder import ledger

MARKER = ".memfit-run"
LEGACY_MARKERS = ("run.json", "metrics.jsonl", "checkpoints")
STAGING = (".tmp-step-*", ".tmp-export*")


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
    source = config.source
    for label, value in (("--model", source.model), ("--tokenizer", source.tokenizer), ("--data", config.data)):
        if not value:
            continue
        path = user_path(value)
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
        self.tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        """Names this run's staging folders (the main process's, shared with the other ranks)."""
        self.ledger: dict | None = None
        """The run's own manifest (``ledger``), kept by the main process."""
        self._made_marker = False
        self.made_parents: list[Path] = []
        """Folders above ``output`` this run created for it (deepest first): removed with it after an early failure."""
        self.claimed = False
        """Made by ``claim_fresh`` (before ``open``): this run's from the start, locked or not."""
        self.owned = False
        """Set once ``open`` passed every check: from then on the run may clean up the folder's staging leftovers."""

    @classmethod
    def claim_fresh(cls, base: Path) -> RunFolder:
        """A new, empty folder at ``base``, else ``base-2``, ``base-3``, ...: each made with an exclusive
        ``mkdir``, so two runs that chose the same name in the same second never share it."""
        parents = _missing_folders(base.parent)
        base.parent.mkdir(parents=True, exist_ok=True)
        n = 1
        while True:
            candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                candidate.mkdir()
            except FileExistsError:
                n += 1
                continue
            folder = cls(candidate)
            folder.created = folder.claimed = True
            folder.made_parents = parents
            return folder

    @property
    def holds_lock(self) -> bool:
        return self._lock_fd is not None

    def lock_existing(self, config, *, is_main: bool) -> None:
        """Lock ``--output`` when it already holds a run (or ``--resume`` continues one), before anything
        there is read; a folder that is not a run yet is locked by ``open`` once it is checked."""
        output = user_path(self.output)
        if is_main and not self.holds_lock and output.is_dir() and (config.folder.resume or is_run_folder(output)):
            self._lock()

    def open(self, config, *, is_main: bool, run_id: str | None = None, data: dict | None = None) -> RunFolder:
        """Check the folder against the rules above, create it if needed, lock it and write its ledger (main
        process); ``run_id`` and ``data``: the run's id and data fingerprint (``ledger``)."""
        output = self.output
        check_writable_target(output, flag_name="--output", is_dir=True)
        for label, folder, whole_tree in input_folders(config):
            if _same_or_inside(output, folder) if whole_tree else output.resolve() == folder.resolve():
                raise UserError(f"--output {output} is the {label} folder {folder} (or inside it); memfit never writes "
                                "into its inputs, so choose another --output.")
        if not is_main:  # the main process decides (and creates the marker the others would then see)
            return self
        if config.folder.resume:
            self._lock()  # held already when ``lock_existing`` ran: then a no-op
            self.ledger = ledger.read(output) or {"version": 1, "run_id": run_id or ledger.new_run_id(),
                                                  "files": ledger.legacy_files(output)}
            self._check_replaceable(self.ledger["files"], "this run")
            self.owned = True
            self.remove_partial_writes()  # a killed earlier part's staging: nobody else's while the lock is held
            self.ledger["data"] = data
            self.ledger["files"] = list(dict.fromkeys([*self.ledger["files"], *ledger.RUN_FILES]))
            ledger.write(output, self.ledger)
            return self
        exists = output.is_dir()
        foreign = exists and any(p.name != MARKER for p in output.iterdir()) and not is_run_folder(output)
        if foreign and not config.folder.overwrite:
            raise UserError(f"{output} holds files that are not a memfit run; pass --overwrite to write the run "
                            "there anyway (memfit replaces only its own files), or choose another --output.")
        if exists and is_run_folder(output) and not config.folder.overwrite:
            raise UserError(f"{output} already holds a training run; pass --overwrite to replace it, "
                            "--resume to continue it, or choose another --output.")
        if not exists:
            self.made_parents = _missing_folders(output.parent)
            output.parent.mkdir(parents=True, exist_ok=True)
            try:
                output.mkdir()
                self.created = True
            except FileExistsError:  # another run made it a moment ago: the lock decides which of the two goes on
                pass
        self._lock()
        if config.folder.overwrite:
            self._remove_own()
        self.owned = True
        self.ledger = {"version": 1, "run_id": run_id or ledger.new_run_id(), "data": data,
                       "files": list(ledger.RUN_FILES)}
        ledger.write(output, self.ledger)
        return self

    def _remove_own(self) -> None:
        """``--overwrite``: remove what the ledger lists (or an older memfit's files), after checking that
        nothing this run will replace is someone else's."""
        doc = ledger.read(self.output)
        own = doc["files"] if doc else ledger.legacy_files(self.output)
        self._check_replaceable(own, "memfit, and --overwrite replaces only memfit's own files")
        for name in own:
            check_no_links(self.output, self.output / name)
        self.owned = True  # every check passed: from here on this run changes the folder
        for name in own:
            remove_entry(self.output / name)
        self.remove_partial_writes()
        checkpoints = self.output / "checkpoints"
        if checkpoints.is_dir() and not checkpoints.is_symlink() and not any(checkpoints.iterdir()):
            checkpoints.rmdir()

    def _check_replaceable(self, own: list[str], writer: str) -> None:
        """Refuse, before anything is removed or trained, a name this run would write (its own files, the
        export's) that is held by something ``own`` does not list, or by a file where memfit writes a folder
        or the reverse (a folder named ``config.json``: the export could only fail there, after training).
        ``writer``: who may have written it, as the sentence says."""
        for name in (*ledger.RUN_FILES, *ledger.EXPORT_FILES, *ledger.EXPORT_FOLDERS):
            path = self.output / name
            if not (path.exists() or path.is_symlink()):
                continue
            if name not in own:
                raise UserError(f"{path} was not written by {writer}; move it away, or choose another --output.")
            folder = name in ledger.EXPORT_FOLDERS
            if not path.is_symlink() and path.is_dir() != folder:  # a link at the name is replaced, never followed
                raise UserError(f"{path} is a {'file' if folder else 'folder'}, where memfit writes a "
                                f"{'folder' if folder else 'file'}; move it away, or choose another --output.")

    def record(self, *names: str) -> None:
        """Add ``names`` (relative to the folder) to what memfit wrote here (main process)."""
        if self.holds_lock:
            ledger.add(self.output, self.ledger, *names)

    def remove_partial_writes(self) -> None:
        """Remove staging folders (every run's: only the lock holder that owns the folder does, so none is in use;
        a run refused after taking the lock removes nothing)."""
        if not self.holds_lock or not self.owned or not self.output.is_dir():
            return
        checkpoints = self.output / "checkpoints"
        found = list(self.output.glob(STAGING[1]))
        if checkpoints.is_dir() and not checkpoints.is_symlink():
            found += list(checkpoints.glob(STAGING[0]))
        for leftover in found:
            remove_entry(leftover)

    def _lock(self) -> None:
        if self.holds_lock:
            return
        path = self.output / MARKER
        if path.is_symlink() or (path.exists() and not path.is_file()):
            kind = "a symbolic link" if path.is_symlink() else "a folder or special file"
            raise UserError(f"{path} is {kind}, not memfit's lock file; remove it (memfit recreates it), or choose "
                            "another --output.")
        self._made_marker = not path.exists()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR):
                raise UserError(f"{path} is not memfit's lock file; remove it, or choose another --output.") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"Another memfit run (pid {read_holder(path)}) is writing to {self.output}; wait for it "
                            "to end or choose another --output.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def close(self, *, failed: bool) -> None:
        """Release the lock; after a failure before the first step, remove the folder if this run made it (and
        the parent folders it made for it)."""
        held = self.holds_lock
        if failed and held and not self.started and self._made_marker and not self.created:
            (self.output / MARKER).unlink(missing_ok=True)  # a refused run leaves the folder as it found it
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
        if not failed or not self.created or self.started:
            return
        if held:
            shutil.rmtree(self.output, ignore_errors=True)
        elif self.claimed:  # claimed, never locked: still empty, unless someone else writes there now
            _remove_if_empty([self.output])
        _remove_if_empty(self.made_parents)  # deepest first; one that holds something now is kept


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def check_not_a_run_file(path: Path, *, flag_name: str) -> None:
    """Refuse a file another command would write (``memfit plan --output``) at a name a training run writes in
    its folder (``runs/x/run.json`` while ``train`` writes ``runs/x``): that file is the run's, not the plan's."""
    path = user_path(path)
    own = {MARKER, ledger.LEDGER, *ledger.RUN_FILES, *ledger.EXPORT_FILES}
    if is_run_folder(path.parent) and path.name in own:
        raise UserError(f"{flag_name} {path} is a file of the memfit run in {path.parent}; write it elsewhere "
                        "(beside the run folder, say).")


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and the folders above it that do not exist yet, deepest first."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    return missing


def read_holder(path: Path) -> str:
    """The pid in a lock file, validated (digits only; whatever else is there is not echoed)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(32).decode("ascii", errors="replace")
    except OSError:
        return "unknown"
    match = re.fullmatch(r"\s*(\d{1,10})\s*", text)
    return match.group(1) if match else "unknown"


def remove_entry(path: Path) -> None:
    """Remove a file, a link (the link itself, never what it points to) or a folder."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
