"""Multi-process launches for the tests: torchrun on CPU (gloo), the way users run ``accelerate launch``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


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
    return subprocess.run([*launch, *target], env=env, capture_output=True, text=True, timeout=timeout,
                          **run_kwargs)


def last_json_line(stdout: str) -> dict:
    """The last line of ``stdout`` that is a JSON object (what the bench scripts print last)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1])
