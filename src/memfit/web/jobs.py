"""Long work off the request path: the exact trace takes seconds to minutes, so the page starts it as a job
and polls its state (``queued``, ``running``, ``done`` or ``error``) with the seconds it has run, which the
page shows as its progress indicator. One worker thread: a trace uses every core torch is given, and two at
once would only slow each other down."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from memfit.errors import UserError

KEPT = 32
"""Finished jobs kept for polling; older ones are forgotten (a page polls its job within seconds)."""

log = logging.getLogger(__name__)


class Jobs:
    """Jobs by id, run one at a time on a worker thread."""

    def __init__(self, field_of: Callable[[str], str]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-job")
        self._jobs: OrderedDict[str, tuple[Future, float, list[float]]] = OrderedDict()
        self._lock = threading.Lock()
        self._field_of = field_of

    def submit(self, work: Callable[[], dict[str, Any]]) -> str:
        """Queue ``work``; its id."""
        started: list[float] = []  # the time the worker took it up (empty while queued)

        def run() -> dict[str, Any]:
            started.append(time.monotonic())
            return work()

        job = uuid.uuid4().hex
        with self._lock:
            self._jobs[job] = (self._pool.submit(run), time.monotonic(), started)
            while len(self._jobs) > KEPT and next(iter(self._jobs.values()))[0].done():
                self._jobs.popitem(last=False)
        return job

    def status(self, job: str) -> dict[str, Any] | None:
        """The job's state and seconds since it started (None: no such job, or forgotten)."""
        with self._lock:
            entry = self._jobs.get(job)
        if entry is None:
            return None
        future, queued_at, started = entry
        if not future.done():
            running = bool(started)
            since = started[0] if running else queued_at
            return {"state": "running" if running else "queued", "elapsed_s": round(time.monotonic() - since, 1)}
        error = future.exception()
        if isinstance(error, UserError):
            return {"state": "error", "error": str(error), "field": self._field_of(str(error))}
        if error is not None:  # a bug, not the user's: logged with its traceback, named on the page
            log.error("job %s failed", job, exc_info=error)
            return {"state": "error", "error": f"The trace failed ({type(error).__name__}: {error}).", "field": "exact"}
        return {"state": "done", "result": future.result()}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
