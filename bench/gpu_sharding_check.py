"""Per-rank predicted against measured GPU memory for sharded training: DDP, FSDP, ZeRO-2, FSDP + offload.

The driver launches one ``torchrun --nproc_per_node N`` per configuration (this same script with
``--worker``). Every rank builds the model with memfit's own builders (``bench/sharding_memory.py``'s
``build``: ``training.setup`` + ``training.sharding``, i.e. Accelerate's FSDP2 plugin on GPUs), runs
``--steps`` real ``memfit train`` steps (``training.step.train_step``) on random tokens and reports
``torch.cuda.max_memory_allocated`` over them (the optimizer state exists from the second step on:
the steady state is included); rank 0 gathers every rank's peak and compares it with memfit's
per-rank prediction (``estimate(..., device="cuda")`` without ``other``, the CUDA context and
allocator reserve the allocator's counter does not see). Error = (predicted - measured) / measured.

Examples::

    python bench/gpu_sharding_check.py --nproc 2 --out bench/results/gpu_sharding_check.json   # 2+ GPUs
    python bench/gpu_sharding_check.py --nproc 4 --model qwen2.5-0.5b --seq-len 1024 --configs fsdp,zero2
    python bench/gpu_sharding_check.py --dry-run --out /tmp/sharding-dry.json   # CPU, gloo, 2 processes

``--dry-run`` checks the plumbing on CPU: 2 gloo processes (``ACCELERATE_USE_CPU=true``), the tiny
preset, a short sequence, 3 steps (the steady state: the rollback snapshot holds optimizer state from
the second), and torch's CPU tensor tracker (``MemTracker``/``FSDPMemTracker``) in place
of ``max_memory_allocated``; its numbers are CPU numbers (the rollback snapshot counts there).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: name -> (--sharding, --offload)
CONFIGS = {"ddp": ("ddp", "none"), "fsdp": ("fsdp", "none"), "zero2": ("zero2", "none"),
           "fsdp+offload": ("fsdp", "params")}
GPU_DEFAULTS = {"model": "qwen2.5-0.5b", "seq_len": 512, "micro_batch": 2, "steps": 3}
DRY_DEFAULTS = {"model": "tiny", "seq_len": 32, "micro_batch": 1, "steps": 3}  # 3: the steady state


def relative_error(predicted: int, measured: int) -> float | None:
    return (predicted - measured) / measured if measured else None


def worker(args) -> None:
    """One rank of one configuration: build, train ``--steps``, print rank 0's JSON line."""
    import torch
    from accelerate.utils import gather_object

    import sharding_memory as sm
    from memfit.spec import engines

    flag, offload = CONFIGS[args.config]
    accelerator, run, model, optimizer, bundle, hf_config = sm.build(
        args.model, flag, offload, args.seq_len, args.micro_batch, args.steps)
    cuda = accelerator.device.type == "cuda"
    tracker = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:  # dry run: torch's tensor tracker on CPU tensors
        tracker = sm._tracker(accelerator.unwrap_model(model), getattr(optimizer, "optimizer", optimizer),
                              engines.is_sharded(run))
    t0 = time.perf_counter()
    tokens = sm.train_steps(accelerator, run, model, optimizer, bundle, hf_config, args.steps, tracker)
    if cuda:
        torch.cuda.synchronize()
        measured = int(torch.cuda.max_memory_allocated())
    else:
        peaks = tracker.get_tracker_snapshot("peak")
        measured = int(sum(v.get("Total", 0) for d, v in peaks.items() if torch.device(d).type == "cpu"))
    seconds = time.perf_counter() - t0
    per_rank = [int(m) for m in gather_object([measured])]
    predicted, breakdown = sm.predicted_tensor_peak(args.model, run, "cuda" if cuda else "cpu")
    if accelerator.is_main_process:
        errors = [relative_error(predicted, m) for m in per_rank]
        print(json.dumps({
            "config": args.config, "sharding": str(run.sharding), "offload": str(run.offload),
            "processes": accelerator.num_processes, "device": accelerator.device.type,
            "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
            "predicted_peak_bytes": int(predicted), "predicted_phase": breakdown.phase,
            "measured_peak_bytes_per_rank": per_rank, "errors": errors,
            "worst_error": max((e for e in errors if e is not None), key=abs, default=None),
            "tokens_per_s": tokens * accelerator.num_processes / seconds}))
    accelerator.end_training()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config: str, args) -> dict[str, Any]:
    """One ``torchrun`` of ``config``; rank 0's JSON line, or the error it ended with."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.dry_run:
        env["ACCELERATE_USE_CPU"] = "true"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), str(Path(__file__).resolve()), "--worker",
           "--config", config, "--model", args.model, "--seq-len", str(args.seq_len),
           "--micro-batch", str(args.micro_batch), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"config": config, "error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1])


def print_table(results: dict[str, Any]) -> None:
    print(f"{results['model']}, seq {results['seq_len']} x micro-batch {results['micro_batch']}, "
          f"{results['nproc']} processes, {results['device']}")
    print(f"{'config':<14}{'predicted':>14}{'measured (per rank)':>36}{'worst':>9}")
    for row in results["rows"]:
        if "error" in row:
            print(f"{row['config']:<14}  failed: {row['error'].strip().splitlines()[-1][:80]}")
            continue
        measured = ", ".join(f"{m / 2**30:.3f}" for m in row["measured_peak_bytes_per_rank"])
        worst = row["worst_error"]
        print(f"{row['config']:<14}{row['predicted_peak_bytes'] / 2**30:>10.3f} GiB{measured:>32} GiB"
              f"{'' if worst is None else f'{worst:+.1%}':>9}")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, 2 processes, the tiny preset")
    parser.add_argument("--nproc", type=int, default=2, help="Processes (GPUs) per configuration.")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"Comma-separated, of {', '.join(CONFIGS)}.")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--timeout-s", type=int, default=600, help="Per configuration.")
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dry_run:
        args.nproc = 2
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import _common as common

    if common.cuda_missing(args.dry_run):
        return 2
    rows = [launch(config, args) for config in args.configs.split(",")]
    errors = [row["worst_error"] for row in rows if row.get("worst_error") is not None]
    device = rows[0].get("device_name", "?") if rows else "?"
    results = {"benchmark": "gpu_sharding_check", "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d"),
               "machine": common.machine_info(), "device": device, "model": args.model, "nproc": args.nproc,
               "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps, "rows": rows,
               "worst_error": max(errors, key=abs) if errors else None}
    print_table(results)
    common.write_json(args.out, results)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
