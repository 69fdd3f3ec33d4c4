"""What keeps a run's saved work safe while it runs: Ctrl-C, non-finite numbers, failing writes.

``RunGuard`` wraps one training run (``with RunGuard() as guard: ...``):

- **Ctrl-C** (SIGINT): before the first step (tokenizing, building the model) it stops at once, and what
  the run created is removed (exit 130). Once training, the first asks for a stop at the next optimizer-step boundary, where the loop
  saves a checkpoint and stops with one sentence saying where it is and the command that resumes it
  (exit 130); a second Ctrl-C stops at once and says which checkpoint is the newest.
- **Non-finite numbers**: after every step ``check_finite`` stops the run, naming the step, when the
  loss or the gradient norm is NaN/inf (a step the fp16 loss scaler skipped is not an error: the
  scaler did not apply it). With clipping off there is no gradient norm, so the trained weights' norm
  is checked instead. Nothing from that step on is saved, so the newest checkpoint stays the last good one.
- **Failing writes** (full disk, quota, read-only or vanished file system): one sentence naming what
  failed and what is saved and intact, with the command to resume; the half-written temporary folders
  are removed (final names only ever hold complete files: see ``checkpoint`` and ``manifest``).
- On any failure it releases the run folder's lock and, if the run failed before its first step,
  removes the folder it created (``runfolder``).
"""

from __future__ import annotations

import errno
import math
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list

from memfit.errors import UserError
from memfit.training.runfolder.checkpoint import default_output
from memfit.training.runfolder.folder import RunFolder
from memfit.training.runfolder.layout import step_folders
from memfit.training.runfolder.manifest import has_manifest

WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


class Interrupted(UserError):
    """Stopped by Ctrl-C (exit status 130, the shell's convention for SIGINT)."""

    exit_code = 130


class RunGuard:
    def __init__(self) -> None:
        self.folder = None
        """The ``runfolder.RunFolder`` once opened."""
        self.output: Path | None = None
        self.stop_requested = False
        self._interrupts = 0
        self._previous_handler = None
        self.last_checkpoint: Path | None = None

    # ---------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> RunGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._previous_handler is not None:  # a Ctrl-C during the clean-up is counted, not raised inside it
            signal.signal(signal.SIGINT, self._count_only)
        try:
            if self.folder is not None:
                if exc is not None:
                    self.folder.remove_partial_writes()  # only once the run owns the folder: a refused run removes nothing
                self.folder.close(failed=exc is not None)
        finally:
            if self._previous_handler is not None:
                signal.signal(signal.SIGINT, self._previous_handler)
        if isinstance(exc, KeyboardInterrupt) and self._interrupts and not self._started():
            raise Interrupted("Interrupted by Ctrl-C before the first step; nothing was trained or saved, and "
                              "nothing this run created is left.") from None
        if exc is None or self.output is None:
            return False
        exc = _as_write_error(exc, self.output)
        if isinstance(exc, KeyboardInterrupt) and self._interrupts:
            raise Interrupted(f"Stopped at once by a second Ctrl-C; {self.saved_sentence()}") from None
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS and not isinstance(exc, FileNotFoundError):
            what = Path(exc.filename).name if exc.filename else "a file"
            reason = exc.strerror or errno.errorcode.get(exc.errno, "write failed")
            raise UserError(f"Writing {what} under {self.output} failed ({reason}), so the run stopped; "
                            f"{self.saved_sentence()}") from None
        return False

    def lock_existing(self, config, *, is_main: bool) -> None:
        """Lock ``--output`` if it already holds a run, before anything there is read (``RunFolder.lock_existing``)."""
        if config.folder.output:
            self.folder = RunFolder(Path(config.folder.output))
            self.folder.lock_existing(config, is_main=is_main)

    def claim_default(self, model: str) -> Path:
        """A fresh ``runs/<model>-<time>`` for a run without ``--output``, made now (``RunFolder.claim_fresh``), so
        a run started in the same second cannot take it; removed again if the run fails before its first step."""
        self.folder = RunFolder.claim_fresh(default_output(model))
        return self.folder.output

    def open_folder(self, config, accelerator=None, *, is_main: bool, run_id: str | None = None,
                    data: dict | None = None):
        """Check, create and lock ``config.folder.output`` (``runfolder.RunFolder.open``); the staging tag is the main
        process's on every rank."""
        if self.folder is None or self.folder.output != Path(config.folder.output):
            self.folder = RunFolder(Path(config.folder.output))
        self.folder.open(config, is_main=is_main, run_id=run_id, data=data)
        self.output = Path(config.folder.output)  # from here on a failure names the run's checkpoints
        if accelerator is not None and accelerator.num_processes > 1:
            shared = [self.folder.tag]
            broadcast_object_list(shared)
            self.folder.tag = shared[0]
        return self.folder

    def lineage(self) -> dict:
        """The run id and data fingerprint each checkpoint records (``ledger``; main process)."""
        doc = self.folder.ledger if self.folder is not None else None
        return {"run_id": doc["run_id"], "data_fingerprint": doc.get("data")} if doc else {}

    @property
    def tag(self) -> str | None:
        return self.folder.tag if self.folder is not None else None

    def record(self, *names: str) -> None:
        """Add ``names`` to what memfit wrote in the run folder (``ledger``)."""
        if self.folder is not None:
            self.folder.record(*names)

    def _started(self) -> bool:
        return self.folder is not None and bool(getattr(self.folder, "started", False))

    def _count_only(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self._interrupts += 1

    def _on_sigint(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self._interrupts += 1
        if not self._started():  # tokenizing, building: nothing to save, so stop now (__exit__ cleans up)
            raise KeyboardInterrupt
        self.stop_requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the second Ctrl-C raises at once

        print("\nCtrl-C: saving a checkpoint at the end of this step (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    # ---------------------------------------------------------------------------------- per step
    def check_finite(self, step: int, result, model=None) -> None:
        """Stop with one sentence when step ``step`` produced a non-finite loss or gradient norm."""
        if self.folder is not None:
            self.folder.started = True
        if getattr(result, "skipped", False):
            return  # fp16: the scaler found inf/NaN gradients and did not apply them
        bad = None
        if not math.isfinite(result.loss):
            bad = f"the loss became {result.loss}"
        elif result.grad_norm is not None and not math.isfinite(result.grad_norm):
            bad = f"the gradient norm became {result.grad_norm}"
        elif result.grad_norm is None and model is not None and not _weights_finite(model):
            bad = "the weights became NaN/inf"
        if bad:
            raise UserError(f"At step {step} {bad}, so the run stopped without saving that step (lower --lr or "
                            f"check the data); {self.saved_sentence()}")

    def should_stop(self, accelerator) -> bool:
        """Whether a Ctrl-C asked to stop (on any process: all stop at the same step)."""
        if accelerator.num_processes == 1:
            return self.stop_requested

        flag = torch.tensor(float(self.stop_requested), device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)

    def stop(self, step: int) -> None:
        """After the checkpoint the Ctrl-C asked for: stop with where it is and how to continue."""
        raise Interrupted(f"Interrupted at step {step}; {self.saved_sentence()}")

    # ---------------------------------------------------------------------------------- wording
    def saved_sentence(self) -> str:
        newest = self.last_checkpoint
        if newest is None and self.output is not None:
            newest = next((p for _, p in step_folders(self.output) if p.is_dir() and has_manifest(p)), None)
        if newest is None:
            return "no checkpoint was saved yet."
        return (f"the newest complete checkpoint is {newest} (continue with: memfit train --output {self.output} "
                "--resume).")



def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _as_write_error(exc: BaseException, output: Path) -> BaseException:
    """A failed write that a library reports as something else (torch's ``RuntimeError: ... file write
    failed``, safetensors' own error), as the ``OSError`` it is when the disk under ``output`` is full."""
    if isinstance(exc, OSError) or isinstance(exc, UserError) or not isinstance(exc, Exception):
        return exc
    try:  # torch's writer says only "unexpected pos 433984 vs 433876" (seen on a full 20 MB tmpfs)
        full = free_bytes(output) < (1 << 20)
    except OSError:
        full = False
    if full or "no space left" in str(exc).lower():
        return OSError(errno.ENOSPC, "No space left on device", None)
    return exc


def _weights_finite(model) -> bool:
    """Whether every trainable weight is finite (one reduction: the norm of all of them)."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    if not params:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(params)).item())
