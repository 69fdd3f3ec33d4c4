"""Predicted against measured GPU memory: the analytic estimate, the exact trace and the real step.

For a grid of models (three architecture families), configurations (fp32, AMP bf16, pure bf16,
LoRA on a bf16 base; each with and without gradient checkpointing) and sequence lengths it runs
memfit's real training step (``memfit.training.setup`` builders + ``memfit.training.step.train_step``) and
reads ``torch.cuda.max_memory_allocated`` over the last step (optimizer state present: the steady
state), and compares it with

- ``analytic``: ``memfit estimate`` (``memory.estimate.estimate``),
- ``exact``:    ``memfit estimate --exact`` (``memory.trace.trace``, run on CPU in worker processes
  while the GPU measures).

Then every item of docs/exact.md's "What only a GPU can check" (``bench/cuda_kernel_items.py``: the CUDA
kernels' saved tensors the exact trace substitutes, and what it leaves out), in ``kernel_items``.

Both predictors add an ``other`` term (CUDA context, cuBLAS workspace, allocator reserve) that
``max_memory_allocated`` does not see, so the error is computed on ``peak_bytes - other``: the
bytes tensors hold at the peak, which is what the allocator counts. Error = (predicted - measured)
/ measured. The grid fits in 8 minutes on one H100/H200 (``--budget-s`` guards it).

Examples::

    python bench/gpu_memory_check.py --out bench/results/gpu_memory_check.json   # on the GPU machine
    python bench/gpu_memory_check.py --models qwen2.5-0.5b --seq-lens 1024
    python bench/gpu_memory_check.py --dry-run --out /tmp/check-dry.json       # CPU, no measurement
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import _device as dev  # noqa: E402
import cuda_kernel_items  # noqa: E402
from gpu import start_traces  # noqa: E402
from memfit.settings.config import RunConfig  # noqa: E402

#: Llama (GQA, untied), Qwen2 (tied embeddings, qkv bias), GPT-2 (learned positions, Conv1D, tied).
GPU_DEFAULTS = {"models": ["qwen2.5-0.5b", "llama-3.2-1b", "gpt2"], "seq_lens": [512, 1024], "micro_batch": 2,
                "steps": 3}
DRY_DEFAULTS = {"models": None, "seq_lens": [32], "micro_batch": 2, "steps": 2,
                "configs": ["fp32", "amp-bf16+ckpt", "lora-bf16"]}


def tensor_peak(prediction: dict[str, Any]) -> int | None:
    """Predicted bytes held by tensors at the peak: the peak without ``other`` (what the allocator counts)."""
    if "peak_bytes" not in prediction:
        return None
    return int(prediction["peak_bytes"] - prediction["breakdown"].get("other", 0))


def relative_error(predicted: int | None, measured: int | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def check_one(model: str, name: str, run: RunConfig, steps: int, t_start: float, budget_s: float) -> dict[str, Any]:
    """The analytic prediction and the real step's measurement for one grid point."""
    row: dict[str, Any] = {"model": model, "config": name, "seq_len": run.seq_len, "run": run.to_flat(),
                           "analytic": dev.predict_analytic(model, run)}
    if time.perf_counter() - t_start > budget_s:
        row["measured"] = {"skipped": f"time budget of {budget_s:.0f} s spent"}
        return row
    try:
        row["measured"] = dev.real_steps(model, run, steps=steps, warmup=min(1, steps - 1)).to_dict()
    except Exception as err:  # noqa: BLE001 - an OOM in one grid point is a result, not the end of the check
        common.reset_accelerate_state()
        dev.free_memory()
        row["measured"] = dev.failure(err)
    return row


def add_errors(row: dict[str, Any]) -> None:
    """Per predictor: tensor peak, signed relative error against the measured last step, and the time taken."""
    measured = row["measured"].get("last_step_max_allocated_bytes")
    for key in ("analytic", "exact"):
        pred = row.get(key, {})
        row[f"{key}_tensor_peak_bytes"] = tensor_peak(pred)
        row[f"{key}_error"] = relative_error(tensor_peak(pred), measured)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in ("analytic", "exact"):
        errors = [r[f"{key}_error"] for r in rows if r.get(f"{key}_error") is not None]
        out[key] = {"points": len(errors), "max_abs_error": max((abs(e) for e in errors), default=None),
                    "mean_error": sum(errors) / len(errors) if errors else None}
    return out


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from memfit.units import fmt_gib

    def gib(x):
        return fmt_gib(x) if isinstance(x, (int, float)) else "-"

    def pct(x):
        return f"{x:+.1%}" if isinstance(x, float) else "-"

    table = Table(title=f"predicted vs measured peak (tensors) on {results['device']}")
    for col in ("model", "config", "seq", "measured", "analytic", "err", "exact", "err "):
        table.add_column(col, justify="left" if col in ("model", "config") else "right")
    for r in results["rows"]:
        m = r["measured"]
        shown = gib(m.get("last_step_max_allocated_bytes")) if "error" not in m else m["error"][:30]
        table.add_row(Path(r["model"]).name, r["config"], str(r["seq_len"]), shown,
                      gib(r["analytic_tensor_peak_bytes"]), pct(r["analytic_error"]),
                      gib(r["exact_tensor_peak_bytes"]), pct(r["exact_error"]))
    Console(stderr=True, width=140).print(table)
    print(f"summary: {results['summary']}", file=sys.stderr)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, a 2-layer model: checks the code, measures nothing")
    parser.add_argument("--models", help="comma-separated presets (default: qwen2.5-0.5b,llama-3.2-1b,gpt2)")
    parser.add_argument("--configs", help="comma-separated subset of: " + ", ".join(dev.config_grid()))
    parser.add_argument("--seq-lens", help="comma-separated sequence lengths (default: 512,1024; gpt2 has 1024 positions)")
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int, help="steps per grid point; the last one is measured")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new measurement after this")
    parser.add_argument("--trace-workers", type=int, default=None, help="CPU processes for traces (0: inline)")
    parser.add_argument("--out", default="-", help="JSON file (- for stdout)")
    args = parser.parse_args(argv)
    defaults = DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS
    args.seq_lens = [int(s) for s in args.seq_lens.split(",")] if args.seq_lens else defaults["seq_lens"]
    common.fill_defaults(args, defaults, ("micro_batch", "steps"), trace_workers=8)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if common.cuda_missing(args.dry_run):
        return 1
    import torch

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        common.dry_run_models(args, tmp)
        grid = dev.config_grid(args.configs)
        jobs = [(m, f"{name}@{seq}", RunConfig.of(seq_len=seq, micro_batch=args.micro_batch, **flags))
                for m in args.models for seq in args.seq_lens for name, flags in grid.items()]
        pool, futures = start_traces(jobs, args.trace_workers)
        rows = []
        for m, key, run in jobs:
            rows.append(check_one(m, key.split("@")[0], run, args.steps, t_start, args.budget_s))
            print(f"  {Path(m).name} {key}: {rows[-1]['measured'].get('last_step_max_allocated_bytes')}",
                  file=sys.stderr)
        for row, (m, key, run) in zip(rows, jobs, strict=True):
            row["exact"] = futures[(m, key)].result() if pool else dev.predict_exact(m, run)
            add_errors(row)
        if pool:
            pool.shutdown()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (dry run: nothing measured)"
    results = {"benchmark": "gpu_memory_check", "dry_run": args.dry_run, "machine": common.machine_info(),
               "device": device, "micro_batch": args.micro_batch, "steps": args.steps,
               "seconds": time.perf_counter() - t_start, "rows": rows, "summary": summary(rows),
               # docs/exact.md "What only a GPU can check": each item, measured (GPU) vs memfit
               "kernel_items": cuda_kernel_items.run_all(torch.cuda.is_available() and not args.dry_run)}
    common.write_json(args.out, results)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
