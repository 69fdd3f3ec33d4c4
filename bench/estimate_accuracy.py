"""Analytic estimate vs exact trace for full-size presets: the error of every term, as a table and JSON.

    python bench/estimate_accuracy.py                                  # a few small presets, 4 regimes
    python bench/estimate_accuracy.py --models llama-2-7b --regimes amp,lora --seq-len 512 --micro-batch 1
    python bench/estimate_accuracy.py --out bench/results/estimate_accuracy.json
    python bench/estimate_accuracy.py --families all --sizes 256x4,512x2 --regimes fp32,amp
        # the small random configs of every family of tests/_accuracy_models.py: tensor peak and
        # per-phase error, worst and median, and the time to derive a recipe and of a cached estimate

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
    "fp32-ckpt": {"mixed_precision": "no", "dtype": "fp32", "grad_checkpointing": True},
}
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "temporary")


def compare(model: str, regime: str, seq_len: int, micro_batch: int) -> dict:
    """Trace and estimate one configuration; the per-category bytes and relative errors."""
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace
    from memfit.settings.config import RunConfig

    run = RunConfig.of(seq_len=seq_len, micro_batch=micro_batch, **REGIMES[regime])
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


PHASES = ("forward", "backward", "optimizer")


def tensor_peak(b) -> int:
    return sum(getattr(b, c) for c in CATEGORIES)


def family_row(family: str, regime: str, seq_len: int, micro_batch: int) -> dict:
    """Analytic vs exact for one small random config of tests/_accuracy_models.py (``device="cpu"``)."""
    from _accuracy_models import accuracy_config
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace
    from memfit.settings.config import RunConfig
    from memfit.spec.model import spec_from_config

    config = accuracy_config(family)
    extra = {"attn_implementation": "eager"} if family == "gemma2" else {}
    run = RunConfig.of(seq_len=seq_len, micro_batch=micro_batch, **REGIMES[regime], **extra)
    exact = trace(config, run, device="cpu")
    analytic = estimate(spec_from_config(config, family), run, device="cpu")
    err = {"tensor_peak": (tensor_peak(analytic) - tensor_peak(exact)) / tensor_peak(exact)}
    for phase in PHASES:
        err[phase] = (analytic.phase_peaks[phase] - exact.phase_peaks[phase]) / exact.phase_peaks[phase]
    return {"family": family, "regime": regime, "seq_len": seq_len, "micro_batch": micro_batch,
            "recipe": analytic.recipe, "exact_tensor_peak": tensor_peak(exact), "exact_phase": exact.phase,
            "error": err}


def derive_timing(family: str = "granite") -> dict:
    """Seconds to derive ``family``'s recipe with an empty cache, then of a disk-cached and an in-memory
    cached estimate (the first is what a new process pays, the second what the planner pays per candidate)."""
    import os
    import tempfile

    from _accuracy_models import accuracy_config
    from memfit.memory import derive
    from memfit.memory.estimate import estimate
    from memfit.settings.config import RunConfig
    from memfit.spec.model import spec_from_config

    spec = spec_from_config(accuracy_config(family), family)
    run = RunConfig.of(seq_len=1024, micro_batch=4, mixed_precision="bf16")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MEMFIT_CACHE_DIR"] = cache
        derive._MEMORY.clear()
        start, cpu = time.perf_counter(), time.process_time()
        estimate(spec, run)
        derive_s, derive_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        derive._MEMORY.clear()
        start = time.perf_counter()
        estimate(spec, run)
        disk_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(100):
            estimate(spec, run.replace(seq_len=512))
        memory_s = (time.perf_counter() - start) / 100
    return {"family": family, "derive_seconds": derive_s, "derive_cpu_seconds": derive_cpu_s,
            "disk_cached_seconds": disk_s,
            "memory_cached_seconds": memory_s}


def summarize(rows: list[dict]) -> dict:
    """Worst and median |error| of the tensor peak and of each phase peak."""
    import statistics

    out = {}
    for key in ("tensor_peak", *PHASES):
        errors = [abs(r["error"][key]) for r in rows]
        out[key] = {"worst": max(errors), "median": statistics.median(errors)}
    return out


def run_families(args) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the configs the tests use
    from _accuracy_models import FAMILIES

    families = FAMILIES if args.families == "all" else tuple(f.strip() for f in args.families.split(","))
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    rows = []
    print("small random configs, tensor bytes, device=cpu semantics; errors are (analytic - exact) / exact")
    for family in families:
        for seq_len, micro_batch in sizes:
            for regime in regimes:
                row = family_row(family, regime, seq_len, micro_batch)
                rows.append(row)
                e = row["error"]
                print(f"{family:<10}{regime:<10}T{seq_len:<5}B{micro_batch:<3} peak {e['tensor_peak']:+6.2%}  "
                      f"fwd {e['forward']:+6.2%}  bwd {e['backward']:+6.2%}  opt {e['optimizer']:+6.2%}  "
                      f"({row['exact_phase']}; {row['recipe']})", flush=True)
    summary = summarize(rows)
    for key, v in summary.items():
        print(f"{key:<12} worst {v['worst']:.2%}  median {v['median']:.2%}  over {len(rows)} configurations")
    timing = derive_timing(args.derive_family)
    print(f"derive a recipe for {timing['family']} (empty cache): {timing['derive_seconds']:.1f} s wall, "
          f"{timing['derive_cpu_seconds']:.1f} s CPU; "
          f"estimate from the disk cache: {timing['disk_cached_seconds'] * 1e3:.1f} ms; "
          f"from memory: {timing['memory_cached_seconds'] * 1e3:.2f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary, "timing": timing}, indent=1))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gpt2,qwen2.5-0.5b",
                        help="comma-separated presets (default: %(default)s)")
    parser.add_argument("--regimes", default="fp32,amp,pure-bf16,lora",
                        help=f"comma-separated, from {', '.join(REGIMES)} (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--out", default="bench/results/estimate_accuracy.json")
    parser.add_argument("--families", help="'all' or comma-separated families of tests/_accuracy_models.py: "
                        "small random configs instead of presets")
    parser.add_argument("--derive-family", default="granite",
                        help="with --families: the family whose recipe derivation is timed (default: %(default)s)")
    parser.add_argument("--sizes", default="256x4,512x2", help="with --families: SEQxBATCH,... (default: %(default)s)")
    args = parser.parse_args(argv)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        print(f"error: unknown regime(s) {', '.join(unknown)}; choose from {', '.join(REGIMES)}.", file=sys.stderr)
        return 2
    if args.families:
        return run_families(args)
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
