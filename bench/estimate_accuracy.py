"""Analytic estimate vs exact trace for full-size presets: the error of every term, as a table and JSON.

    python bench/estimate_accuracy.py                                  # a few small presets, 4 regimes
    python bench/estimate_accuracy.py --models llama-2-7b --regimes amp,lora --seq-len 512 --micro-batch 1
    python bench/estimate_accuracy.py --out bench/results/estimate_accuracy.json

Both sides use device="cpu" semantics (what the trace runs: CPU kernels; no `other` term), so the
errors are on tensor bytes. Each trace also records its wall time and the process's peak RSS (fake
tensors allocate nothing, so RSS stays far below the model size). Timings are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

REGIMES = {
    "fp32": {"mixed_precision": "no", "dtype": "fp32"},
    "amp": {"mixed_precision": "bf16", "dtype": "fp32"},
    "pure-bf16": {"mixed_precision": "no", "dtype": "bf16"},
    "lora": {"mixed_precision": "no", "dtype": "bf16", "lora_r": 16},
    "amp-ckpt": {"mixed_precision": "bf16", "dtype": "fp32", "grad_checkpointing": True},
}
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporary")


def compare(model: str, regime: str, seq_len: int, micro_batch: int) -> dict:
    """Trace and estimate one configuration; the per-category bytes and relative errors."""
    from memfit.config import RunConfig
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace

    run = RunConfig(seq_len=seq_len, micro_batch=micro_batch, **REGIMES[regime])
    start = time.perf_counter()
    exact = trace(model, run, device="cpu")
    seconds = time.perf_counter() - start
    analytic = estimate(model, run, device="cpu")
    row = {"model": model, "regime": regime, "seq_len": seq_len, "micro_batch": micro_batch,
           "trace_seconds": round(seconds, 1), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "exact": exact.to_dict(), "analytic": analytic.to_dict(), "error": {}}
    for c in (*CATEGORIES, "peak_bytes"):
        a, e = getattr(analytic, c), getattr(exact, c)
        row["error"][c] = (a - e) / e if e else 0.0
    return row


def print_row(row: dict) -> None:
    from memfit.units import fmt_gib

    err = row["error"]
    terms = "  ".join(f"{c[:5]} {err[c]:+6.1%}" for c in CATEGORIES)
    print(f"{row['model']:<16}{row['regime']:<10} exact {fmt_gib(row['exact']['peak_bytes']):>10} "
          f"analytic {fmt_gib(row['analytic']['peak_bytes']):>10}  peak {err['peak_bytes']:+6.1%} "
          f"({row['exact']['phase']}/{row['analytic']['phase']})  {terms}  [{row['trace_seconds']} s]", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gpt2,qwen2.5-0.5b",
                        help="comma-separated presets (default: %(default)s)")
    parser.add_argument("--regimes", default="fp32,amp,pure-bf16,lora",
                        help=f"comma-separated, from {', '.join(REGIMES)} (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--out", default="bench/results/estimate_accuracy.json")
    args = parser.parse_args(argv)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        print(f"error: unknown regime(s) {', '.join(unknown)}; choose from {', '.join(REGIMES)}.", file=sys.stderr)
        return 2
    rows = []
    print(f"analytic vs exact, seq {args.seq_len} x micro-batch {args.micro_batch}, tensor bytes (no 'other'); "
          "errors are (analytic - exact) / exact")
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        for regime in regimes:
            rows.append(compare(model, regime, args.seq_len, args.micro_batch))
            print_row(rows[-1])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seq_len": args.seq_len, "micro_batch": args.micro_batch, "rows": rows}, indent=1))
    worst = max((abs(r["error"]["peak_bytes"]) for r in rows), default=0.0)
    print(f"worst peak error {worst:.1%}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
