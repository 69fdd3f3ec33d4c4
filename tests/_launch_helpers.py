"""Multi-process launches for the tests: torchrun on CPU (gloo), the way users run ``accelerate launch``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for torchrun's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gloo_launch(*target: str, nproc: int = 2, timeout: int = 400, env: dict | None = None,
                **run_kwargs) -> subprocess.CompletedProcess:
    """Run ``target`` (a script path and its arguments, or ``-m module ...``) on ``nproc`` CPU processes under
    torchrun (plain ``python`` for one process), one torch thread each; output captured as text. ``env``:
    more environment variables (e.g. the ``ACCELERATE_*`` ones ``accelerate launch`` sets from a config)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                   "--master_port", str(free_port())]
    # in a session of its own, so that an ended test session can stop it with its workers (stop_launches)
    with subprocess.Popen([*launch, *target], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **run_kwargs) as proc:
        RUNNING.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise
        finally:
            RUNNING.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def node_launch(*target: str, nodes: int = 2, nproc_per_node: int = 2, timeout: int = 600,
                env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``target`` as ``nodes`` "nodes" on this host: one torchrun launcher per node (``--nnodes``,
    ``--node_rank``, static rendezvous at ``--rdzv-endpoint 127.0.0.1:PORT``), ``nproc_per_node`` CPU (gloo)
    workers each, as ``memfit plan`` prints the launch for a cluster. Every launcher's output, node 0 first."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in range(nodes):
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node",
                  str(nproc_per_node), "--node_rank", str(rank), "--rdzv-backend", "static", "--rdzv-endpoint",
                  endpoint, *target]
        proc = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        RUNNING.add(proc)
        procs.append(proc)
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                _stop(proc)
            RUNNING.discard(proc)
    return done


#: Launches under way (background ones included: ``conftest.gloo_runs``).
RUNNING: set[subprocess.Popen] = set()


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop_launches() -> None:
    """Stop every launch still running (the test session ended before it did), its workers included."""
    for proc in list(RUNNING):
        _stop(proc)


def last_json_line(stdout: str) -> dict:
    """The last line of ``stdout`` that is a JSON object (what the bench scripts print last)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1])


class CaseRun:
    """One case of a shared launch (``launch_cases``): its exit code on every rank (``None`` where it never
    ran because an earlier case failed), rank 0's stdout and stderr (memfit prints on the main process),
    and the inputs its builder wrote (``paths``)."""

    def __init__(self, name: str, folder: Path, nproc: int, paths: dict, launch: subprocess.CompletedProcess):
        self.name, self.paths = name, paths
        codes = [json.loads(p.read_text()) if p.exists() else {}
                 for p in (folder / f"codes.rank{r}.json" for r in range(nproc))]
        self.codes = [c.get(name) for c in codes]
        self.texts = [tuple((folder / f"{name}.rank{r}.{s}").read_text()
                            if (folder / f"{name}.rank{r}.{s}").exists() else "" for s in ("out", "err"))
                      for r in range(nproc)]
        self.stdout, self.stderr = self.texts[0]
        self._launch = launch

    @property
    def returncode(self) -> int | None:
        """0 when every rank finished the case; else the first rank's non-zero code (``None``: not run)."""
        return next((c for c in self.codes if c != 0), 0)

    def failure(self) -> str:
        """What to show when the case failed: every rank's stderr tail, and the launch's own."""
        parts = [f"--- rank {r} stderr\n{err[-2500:]}" for r, (_, err) in enumerate(self.texts) if err.strip()]
        parts.append(f"--- launch (case {self.name}, codes {self.codes})\n{self._launch.stderr[-2000:]}")
        return "\n".join(parts)


DRIVER = Path(__file__).resolve().parent / "_launch_driver.py"



def case_json(gloo_runs, case: str) -> dict:
    """The last JSON line a shared-launch ``case`` printed (``gloo_runs``), once it exited 0."""
    proc = gloo_runs[case]
    assert proc.returncode == 0, proc.failure()
    return last_json_line(proc.stdout)

def launch_cases(cases: list[dict], folder: Path, *, nproc: int = 2, env: dict | None = None,
                 timeout_per_case: int = 400) -> dict[str, CaseRun]:
    """Run ``cases`` (``{"name", "kind": "memfit"|"script", "argv", "script"?, "env"?, "paths"?}``) one after
    the other in ONE ``nproc``-process torchrun (``_launch_driver.py``): ``{name: CaseRun}``."""
    folder.mkdir(parents=True, exist_ok=True)
    cases_file = folder / "cases.json"
    cases_file.write_text(json.dumps([{k: v for k, v in c.items() if k != "paths"} for c in cases]))
    proc = gloo_launch(str(DRIVER), str(cases_file), nproc=nproc, env=env,
                       timeout=timeout_per_case * max(1, len(cases)))
    return {c["name"]: CaseRun(c["name"], folder, nproc, c.get("paths", {}), proc) for c in cases}
