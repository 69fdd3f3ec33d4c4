"""The documented ``memfit train`` runs that run in a process of their own, in the background.

The README demo trains 300 steps (about 220 s of CPU time) and its output shows what a fresh process prints
(its thread line, its RSS): it runs in a process of its own (``scripts/doc_outputs.py --print``). The other
documented train commands (error messages, a 2-step budget run, the equivalence check) run in-process as
every other documented command does (``doc_outputs.run``), which spares each an interpreter start with
torch, transformers and PEFT (~9 s of CPU time each).

On one process ``conftest.py`` starts these runs as soon as collection ends and moves their doc tests to the
end of the session, so they overlap with the other tests; on pytest-xdist workers the run starts when its
test asks (scheduled first), and the other worker overlaps it. ``tests/test_docs.py`` takes each output from
here. A run that the session does not reach is stopped when the session ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The documented train commands run in a process of their own (the module docstring says why).
OWN_PROCESS = {("train", "--output", "runs/demo")}


class TrainOutputs:
    def __init__(self) -> None:
        self._futures: dict[tuple[str, ...], Future] = {}
        self._running: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, argvs: list[list[str]]) -> None:
        """Run each argv (once) in the background, in order, in the environment of now: a test that sets a
        variable for itself (``monkeypatch.setenv``) while a run starts must not reach the run."""
        env = dict(os.environ)
        todo = []
        for argv in argvs:
            key = tuple(argv)
            if key not in self._futures:
                self._futures[key] = Future()
                todo.append(key)
        if todo:
            self._thread = threading.Thread(target=self._work, args=(todo, env), daemon=True, name="doc-train-runs")
            self._thread.start()

    def _work(self, keys: list[tuple[str, ...]], env: dict[str, str]) -> None:
        for key in keys:
            future = self._futures[key]
            if self._stop.is_set():
                future.set_exception(RuntimeError("the session ended before this documented run"))
                continue
            try:
                future.set_result(self._run(list(key), env))
            except BaseException as exc:  # noqa: BLE001 - handed to the test that reads this output
                future.set_exception(exc)

    def _run(self, argv: list[str], env: dict[str, str]) -> str:
        self._running = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "doc_outputs.py"), "--print", json.dumps(argv)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        out, err = self._running.communicate()
        code, self._running = self._running.returncode, None
        if code != 0:
            raise RuntimeError(f"memfit {' '.join(argv)} (scripts/doc_outputs.py --print) exited {code}: {err[-2000:]}")
        return out

    def output(self, argv: list[str]) -> str:
        """The run's output, started now if it was not started in the background."""
        key = tuple(argv)
        if key not in self._futures:
            self.start([argv])
        return self._futures[key].result()

    def stop(self) -> None:
        self._stop.set()
        running = self._running
        if running is not None and running.poll() is None:
            running.kill()
        if self._thread is not None:
            self._thread.join(timeout=30)


TRAIN_OUTPUTS = TrainOutputs()
