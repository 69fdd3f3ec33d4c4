"""Predicted reserved memory against the GPU's: the caching allocator model (issue 36) on real steps.

For a grid of models, configurations and ``PYTORCH_ALLOC_CONF`` settings it runs memfit's real training step
(``_device.real_steps``: memfit's builders and ``training.step.train_step``) in a fresh process per grid
point (torch reads ``PYTORCH_ALLOC_CONF`` once, at the first CUDA allocation, and a fresh process starts
with nothing cached), and reads

- ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the whole run (weights loaded, then
  ``--steps`` steps: what the allocator model replays: loading, the first step, the steady one);
- nvidia-smi's memory of the process (``--query-compute-apps``), polled every 0.2 s while it runs, at its
  highest: the reserved memory plus the CUDA context;

and compares them with ``memfit estimate --exact`` run on CPU in a process with the same
``PYTORCH_ALLOC_CONF``: ``allocator.reserved_bytes`` (predicted ``max_memory_reserved``),
``allocator.allocated_bytes`` (``max_memory_allocated`` of the replay) and reserved + the CUDA context
constant (``memory.device_terms.CUDA_CONTEXT_BYTES``) for nvidia-smi; and with what ``plan``'s fit rule reads, the
analytic estimate's phases (``memory.phases``: the worst phase's reserved memory, the fitted allocator term of
``memory/fragmentation.py`` and loading's replay; + context for nvidia-smi). Error = (predicted - measured) /
measured.

Known gaps, by design of the comparison: the trace's ``max_memory_allocated`` counts the reported step after a
peak reset, and the real one the whole run (both include the first step's optimizer-state creation);
``real_steps`` clips gradients (``max_grad_norm`` 1.0), which the trace does not run.

Examples::

    python bench/gpu_allocator_check.py --out bench/results/gpu_allocator_check.json     # on the GPU machine
    python bench/gpu_allocator_check.py --models qwen2.5-0.5b --confs ,expandable_segments:True
    python bench/gpu_allocator_check.py --dry-run             # CPU: lists the grid, runs one tiny point
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import _device as dev  # noqa: E402
from memfit.memory.device_terms import CUDA_CONTEXT_BYTES  # noqa: E402
from memfit.settings.config import RunConfig  # noqa: E402

DEFAULTS = {"models": ["qwen2.5-0.5b", "llama-3.2-1b"], "configs": ["amp-bf16", "lora-bf16+ckpt", "pure-bf16+ckpt"],
            "seq_len": 1024, "micro_batch": 2, "steps": 3, "confs": ["", "expandable_segments:True"]}
#: One worker of each kind per grid point: a fresh process, so PYTORCH_ALLOC_CONF and the cache are its own.
WORKER_TIMEOUT_S = 300


def grid(args) -> list[dict[str, Any]]:
    """Every (model, configuration, allocator setting) point, with its ``RunConfig`` flattened."""
    points = []
    for model in args.models:
        for name, flags in dev.config_grid(args.configs).items():
            run = RunConfig.of(seq_len=args.seq_len, micro_batch=args.micro_batch, **flags)
            for conf in args.confs:
                points.append({"model": model, "config": name, "alloc_conf": conf, "run": run.to_flat()})
    return points


class SmiPoller:
    """The highest memory nvidia-smi reports for this process, polled on a thread (None without nvidia-smi)."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(period_s,), daemon=True)

    def _poll(self, period_s: float) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in out.splitlines():
                pid, _, used = line.partition(",")
                if pid.strip() == str(os.getpid()) and used.strip().isdigit():
                    self.peak = max(self.peak or 0, int(used) * 2**20)  # nvidia-smi's MiB
            self._stop.wait(period_s)

    def __enter__(self) -> SmiPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def measure(point: dict[str, Any], steps: int) -> dict[str, Any]:
    """Worker: real steps of ``point`` on this process' device (``PYTORCH_ALLOC_CONF`` set by the parent)."""
    run = RunConfig.from_flat(point["run"])
    with SmiPoller() as smi:
        result = dev.real_steps(point["model"], run, steps=steps, warmup=min(1, steps - 1))
    return {**result.to_dict(), "nvidia_smi_bytes": smi.peak}


def predict(point: dict[str, Any]) -> dict[str, Any]:
    """Worker: ``memfit estimate --exact`` of ``point`` (the allocator replay under this process' settings), and the
    analytic estimate's phases (``memory.phases``: the fitted allocator term, loading's replay), as plan reads them."""
    from memfit.memory.estimate import estimate
    from memfit.memory.phases import device_phases
    from memfit.spec.model import load_spec

    run = RunConfig.from_flat(point["run"])
    out = dev.predict_exact(point["model"], run)
    try:
        spec = load_spec(point["model"])
        out["analytic_phases"] = device_phases(spec, run, estimate(spec, run, device="cuda")).to_dict()
    except Exception as err:  # noqa: BLE001 - the exact prediction still counts
        out["analytic_phases"] = dev.failure(err)
    return out


def worker(kind: str, point: dict[str, Any], steps: int, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Run ``measure`` or ``predict`` in a fresh process whose ``PYTORCH_ALLOC_CONF`` is the point's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    if point["alloc_conf"]:
        env["PYTORCH_ALLOC_CONF"] = point["alloc_conf"]
    cmd = [sys.executable, __file__, "--worker", kind, "--point", json.dumps(point), "--steps", str(steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"{kind} worker ran past {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]}
    return json.loads(lines[-1])


def compare(row: dict[str, Any]) -> None:
    """Add the relative errors of reserved, allocated and nvidia-smi to ``row``."""
    allocator = row["predicted"].get("allocator") or {}
    measured = row["measured"]

    def err(predicted, actual):
        return (predicted - actual) / actual if predicted and actual else None

    reserved = allocator.get("reserved_bytes")
    phases = row["predicted"].get("analytic_phases") or {}
    worst = (phases.get("phases") or {}).get(phases.get("worst"), {}).get("reserved_bytes")
    row["errors"] = {
        "reserved": err(reserved, measured.get("max_reserved_bytes")),
        "allocated": err(allocator.get("allocated_bytes"), measured.get("max_allocated_bytes")),
        "nvidia_smi": err(reserved + CUDA_CONTEXT_BYTES if reserved else None, measured.get("nvidia_smi_bytes")),
        # what plan's fit rule reads: the analytic estimate's worst phase (memory/phases.py), and + context
        "reserved_analytic": err(worst, measured.get("max_reserved_bytes")),
        "nvidia_smi_analytic": err(phases.get("needed_bytes"), measured.get("nvidia_smi_bytes")),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<16}{'config':<18}{'PYTORCH_ALLOC_CONF':<28}{'reserved GiB pred/meas':>24}{'err':>8}"
          f"{'smi err':>9}{'analytic':>10}{'smi':>8}")
    for row in rows:
        alloc = row["predicted"].get("allocator") or {}
        meas = row["measured"]
        errors = row.get("errors", {})
        pct = {k: "-" if v is None else f"{v:+.1%}" for k, v in errors.items()}
        pair = f"{(alloc.get('reserved_bytes') or 0) / 2**30:.2f} / {(meas.get('max_reserved_bytes') or 0) / 2**30:.2f}"
        print(f"{Path(row['model']).name[:15]:<16}{row['config']:<18}{row['alloc_conf'] or '(unset)':<28}{pair:>24}"
              f"{pct.get('reserved', '-'):>8}{pct.get('nvidia_smi', '-'):>9}{pct.get('reserved_analytic', '-'):>10}"
              f"{pct.get('nvidia_smi_analytic', '-'):>8}")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU: list the grid, then run one tiny point")
    parser.add_argument("--models", help="comma-separated presets (default: qwen2.5-0.5b,llama-3.2-1b)")
    parser.add_argument("--configs", help="comma-separated subset of: " + ", ".join(dev.config_grid()))
    parser.add_argument("--confs", help="comma-separated PYTORCH_ALLOC_CONF values, ';' between settings of one "
                        "(empty: unset; default: unset and expandable_segments:True)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no new grid point after this")
    parser.add_argument("--out", default="-", help="JSON file (- for stdout)")
    parser.add_argument("--worker", choices=("measure", "predict"), help=argparse.SUPPRESS)
    parser.add_argument("--point", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.confs is not None:
        args.confs = [c.replace(";", ",") for c in args.confs.split(",")]
    for key in ("models", "configs"):
        value = getattr(args, key)
        setattr(args, key, value.split(",") if value else None)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def run_grid(points: list[dict[str, Any]], steps: int, budget_s: float) -> list[dict[str, Any]]:
    """Predictions on CPU beside the measurements (one process each), the measurements one after another."""
    from concurrent.futures import ThreadPoolExecutor

    t_start, rows = time.perf_counter(), []
    with ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) // 4))) as pool:
        predictions = [pool.submit(worker, "predict", p, steps) for p in points]
        for point, prediction in zip(points, predictions, strict=True):
            late = time.perf_counter() - t_start > budget_s
            measured = {"skipped": f"time budget of {budget_s:.0f} s spent"} if late else worker("measure", point, steps)
            row = {**point, "measured": measured, "predicted": prediction.result()}
            compare(row)
            rows.append(row)
            print(f"[{len(rows)}/{len(points)}] {point['model']} {point['config']} {point['alloc_conf'] or '(unset)'}: "
                  f"reserved error {row['errors']['reserved']}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:  # one grid point in this fresh process; its JSON is the last line of stdout
        point = json.loads(args.point)
        print(json.dumps(measure(point, args.steps) if args.worker == "measure" else predict(point)))
        return 0
    if common.cuda_missing(args.dry_run):
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run:
            print("grid (run on a GPU without --dry-run):")
            for point in grid(args):
                print(f"  {point['model']:<16} {point['config']:<18} PYTORCH_ALLOC_CONF={point['alloc_conf'] or '(unset)'}")
            args.models, args.configs, args.confs = [dev.make_dry_run_model(Path(tmp) / "dry-run-model")], \
                ["lora-bf16+ckpt"], [""]
            args.seq_len, args.micro_batch, args.steps = 32, 2, 2
        points = grid(args)
        rows = run_grid(points, args.steps, args.budget_s)
    results = {"dry_run": args.dry_run, "device": dev.device_type(), "machine": common.machine_info(), "rows": rows}
    common.write_json(None if args.out == "-" else args.out, results)
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
