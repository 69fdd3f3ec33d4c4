"""How many CPU threads torch should use, and noticing when other processes slow the run down.

torch's default intra-op thread count is the number of physical cores of the machine, whatever the
process may actually use. On a machine whose cores are busy with other processes this is the worst
case for OpenMP: a parallel region waits for its slowest thread, and a thread that shares its core
with a busy process is often descheduled, so every op waits for a time slice. Measured on 2 cores
with other processes busy (issue 15): the demo took 45 min instead of 1.5 min; a 10-step run gave
11 tokens/s with torch's default and 415 tokens/s with ``OMP_NUM_THREADS=1``.

``choose_threads`` therefore counts the cores the process can really use:

1. ``--threads N`` (``TrainConfig.threads``), else ``OMP_NUM_THREADS`` when set (torchrun sets it to 1);
2. else the CPUs of the process' affinity mask (``os.sched_getaffinity``), capped by a cgroup CPU
   quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), divided among the processes
   of a local data-parallel launch (``LOCAL_WORLD_SIZE``), and capped by the cores idle right now
   (``/proc/stat`` sampled over 0.2 s, rounded down: one thread too few costs at most its share of the
   speed, one too many can cost 10-30x).

The idle-core sample is a snapshot: load that arrives later is what ``LoadWatch`` notices.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.errors import UserError

#: How long the idle-core sample watches /proc/stat.
IDLE_SAMPLE_S = 0.2


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    """torch intra-op threads this process uses."""
    cores: int
    """CPUs the process may use (affinity, cgroup quota), for all its local processes together."""
    idle: float | None
    """Cores idle when the run started (None: not sampled)."""
    source: str
    """Why: "--threads", "OMP_NUM_THREADS" or "available cores"."""

    def describe(self) -> str:
        if self.source != "available cores":
            return f"torch threads: {self.threads} (from {self.source}; {self.cores} core(s) available)"
        busy = "" if self.idle is None else f", {max(self.cores - self.idle, 0):.1f} busy with other processes"
        return (f"torch threads: {self.threads} ({self.cores} core(s) available{busy}; "
                "--threads N to choose)")


def quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup CPU quota (v2 ``cpu.max``, v1 CFS quota), or None when unlimited."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = root / "cpu" / "cpu.cfs_quota_us"
        if v1.is_file():
            quota = int(v1.read_text())
            period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def available_cores() -> int:
    """Cores the process can use: its affinity mask capped by the cgroup quota (at least 1)."""
    cores = len(affinity_cpus())
    quota = quota_cores()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(cores, 1)


def _cpu_times(cpus: list[int]) -> tuple[float, float] | None:
    """(idle, total) jiffies summed over ``cpus`` from /proc/stat, or None where there is none."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cpus}
    idle = total = 0.0
    for line in lines:
        name, *values = line.split()
        if name in wanted:
            numbers = [float(v) for v in values]
            idle += numbers[3] + (numbers[4] if len(numbers) > 4 else 0.0)  # idle + iowait
            total += sum(numbers[:8])  # user..steal; guest time is already inside user
    return (idle, total) if total else None


def idle_cores(cpus: list[int], seconds: float = IDLE_SAMPLE_S) -> float | None:
    """How many of ``cpus`` were idle over the next ``seconds`` (None where /proc/stat is missing)."""
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times(cpus)
    if after is None or after[1] <= before[1]:
        return None
    return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The thread count for this process (see the module docstring for the order of the rules)."""
    cores = available_cores()
    if requested is not None:
        if requested < 1:
            raise UserError(f"--threads must be at least 1, got {requested}.")
        return ThreadChoice(requested, cores, None, "--threads")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return ThreadChoice(int(env), cores, None, "OMP_NUM_THREADS")
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    per_process = max(1, cores // max(local_procs, 1))
    idle = idle_cores(affinity_cpus()[:cores])
    threads = per_process if idle is None else max(1, min(per_process, math.floor(idle / local_procs + 0.2)))
    return ThreadChoice(threads, cores, idle, "available cores")


def apply_threads(requested: int | None = None) -> ThreadChoice:
    """Choose the thread count and give it to torch."""

    choice = choose_threads(requested)
    torch.set_num_threads(choice.threads)
    return choice


class LoadWatch:
    """Says once when steps take far longer than the first steps promised (another process took the cores).

    The promise is the median step time of steps 2-6 (step 1 includes warm-up); afterwards the median
    of the last ``window`` steps is compared with it. Steps that ran an evaluation are left out (the
    caller says which); the median keeps a checkpoint save from triggering it.
    """

    def __init__(self, factor: float = 3.0, window: int = 5) -> None:
        self.factor, self.window = factor, window
        self.first: list[float] = []
        self.recent: list[float] = []
        self.promise: float | None = None
        self.said = False
        self._last: tuple[int, float] | None = None

    def observe(self, step: int, now: float, *, skip: bool = False) -> str | None:
        """Record that ``step`` ended at ``now`` (seconds); return the message the one time it applies."""
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0] or skip or self.said:
            return None
        per_step = (now - last[1]) / (step - last[0])
        if self.promise is None:
            if step >= 2:  # the interval ending at step 1 is not seen: warm-up is left out by construction
                self.first.append(per_step)
            if len(self.first) == self.window:
                self.promise = statistics.median(self.first)
            return None
        self.recent = (self.recent + [per_step])[-self.window:]
        if len(self.recent) < self.window:
            return None
        now_median = statistics.median(self.recent)
        if now_median <= self.factor * self.promise:
            return None
        self.said = True
        return (f"note: steps now take {now_median / self.promise:.1f}x as long as the first ones "
                f"({now_median:.2f} s vs {self.promise:.2f} s): the machine seems loaded by other processes. "
                "If it stays slow, fewer threads may help (--threads 1).")
