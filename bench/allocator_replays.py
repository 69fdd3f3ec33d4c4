"""The caching allocator's replay (``estimate --exact`` on a CUDA target) over the accuracy grid: how much the
predicted ``max_memory_reserved`` exceeds the tensor peak, the table ``memory/fragmentation.py``'s analytic
term is fitted to.

    python bench/allocator_replays.py                         # presets and small random configs, the table
    python bench/allocator_replays.py --out bench/results/allocator_replays.json
    python bench/allocator_replays.py --quick                 # a few small configs only (seconds)

Per grid point (architecture, sequence length x micro-batch, regime): the exact trace's tensor peak ``T``
(``max_memory_allocated`` of the second step, on fake tensors), the replay's reserved peak ``R``
(``memory/alloc_stream.py``: weights, cuBLAS's workspace ``W``, two steps, through ``memory/allocator.py`` under
torch's default allocator settings) and the overhead share ``(R - T - W) / T``: rounding to 512 B blocks, whole
segments (2 MiB small-pool, 20 MiB under 10 MiB, 2 MiB-rounded above) and cached blocks that no later request
fits. The small random configs of ``tests/_accuracy_models.py`` (a few MiB of tensors) are dominated by segment
granularity; the presets (100 MiB to 13 GiB of tensors) by split blocks. The summary prints the fit
``memory.fragmentation`` uses: the overhead as ``max(fraction x T, floor)`` and the spread of the replays around it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the grid's small configs

REGIMES = {
    "fp32": {"mixed_precision": "no", "dtype": "fp32"},
    "amp": {"mixed_precision": "bf16", "dtype": "fp32"},
    "pure-bf16": {"mixed_precision": "no", "dtype": "bf16"},
    "lora": {"mixed_precision": "no", "dtype": "bf16", "lora_r": 16},
    "lora-ckpt": {"mixed_precision": "no", "dtype": "bf16", "lora_r": 8, "grad_checkpointing": True},
    "amp-ckpt": {"mixed_precision": "bf16", "dtype": "fp32", "grad_checkpointing": True},
}

#: (model, regime, seq_len, micro_batch): full-size presets, where split blocks rather than segment sizes decide.
PRESET_GRID = (
    ("smollm2-135m", "amp", 512, 4), ("smollm2-135m", "lora", 1024, 2), ("smollm2-135m", "fp32", 256, 8),
    ("gpt2-medium", "amp", 1024, 4), ("gpt2-medium", "pure-bf16", 512, 8), ("gpt2-medium", "amp-ckpt", 1024, 8),
    ("qwen2.5-0.5b", "amp", 512, 2), ("qwen2.5-0.5b", "lora", 1024, 2), ("qwen2.5-0.5b", "amp-ckpt", 2048, 2),
    ("llama-3.2-1b", "lora-ckpt", 2048, 2), ("llama-3.2-1b", "pure-bf16", 512, 2),
    ("llama-2-7b", "lora-ckpt", 512, 2), ("llama-2-7b", "lora", 2048, 1),
)

#: (family, regime, seq_len, micro_batch): the small random configs of tests/_accuracy_models.py.
FAMILY_GRID = tuple((family, regime, seq_len, batch)
                    for family in ("llama-mha", "qwen2", "gpt2", "gemma2", "phi3")
                    for regime in ("fp32", "amp", "lora")
                    for seq_len, batch in ((256, 4), (512, 2)))

QUICK_GRID = (("llama-mha", "amp", 256, 4), ("qwen2", "lora", 512, 2))


def replay_row(model: str, regime: str, seq_len: int, micro_batch: int) -> dict:
    """Trace one grid point on a CUDA target (the replay comes with it) and what the analytic estimate says."""
    from memfit.memory.device_terms import CUBLAS_WORKSPACE_BYTES
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace
    from memfit.settings.config import RunConfig
    from memfit.spec.model import spec_from_config

    extra = {"attn_implementation": "eager"} if model == "gemma2" else {}
    run = RunConfig.of(seq_len=seq_len, micro_batch=micro_batch, **REGIMES[regime], **extra)
    source = model
    from _accuracy_models import FAMILIES, accuracy_config

    if model in FAMILIES:  # a small random config of tests/_accuracy_models.py, not a preset

        config = accuracy_config(model)
        source, spec = config, spec_from_config(config, model)
    else:
        spec = model
    start = time.perf_counter()
    exact = trace(source, run, device="cuda")
    seconds = time.perf_counter() - start
    analytic = estimate(spec, run, device="cuda")
    tensors = exact.peak_bytes - exact.other
    overhead = exact.reserved - tensors - CUBLAS_WORKSPACE_BYTES
    return {"model": model, "regime": regime, "seq_len": seq_len, "micro_batch": micro_batch,
            "tensor_peak": tensors, "reserved": exact.reserved, "allocated": exact.reserved_allocated,
            "overhead": overhead, "overhead_share": overhead / tensors,
            "analytic_tensor_peak": analytic.peak_bytes - analytic.other, "seconds": round(seconds, 1)}


def fit(rows: list[dict]) -> dict:
    """The overhead as ``fraction x T + floor``: ``fraction`` the median share over the rows whose tensors reach
    1 GiB (where segment granularity is negligible), ``floor`` the median of ``overhead - fraction x T`` over the
    others (a few segments' worth); the spread: each row's ``(predicted R - R) / R`` with
    ``predicted R = T + W + fraction x T + floor``."""
    from memfit.memory.device_terms import CUBLAS_WORKSPACE_BYTES
    from memfit.units import GiB

    large = [r for r in rows if r["tensor_peak"] >= GiB] or rows
    small = [r for r in rows if r["tensor_peak"] < GiB] or rows
    fraction = statistics.median(r["overhead_share"] for r in large)
    floor = max(statistics.median(r["overhead"] - fraction * r["tensor_peak"] for r in small), 0)
    errors = []
    for r in rows:
        predicted = r["tensor_peak"] * (1 + fraction) + CUBLAS_WORKSPACE_BYTES + floor
        r["fit_error"] = (predicted - r["reserved"]) / r["reserved"]
        errors.append(r["fit_error"])
    big = [r["fit_error"] for r in large]
    return {"fraction": fraction, "floor_bytes": int(floor), "rows": len(rows), "large_rows": len(large),
            "error_min": min(errors), "error_max": max(errors), "large_error_min": min(big),
            "large_error_max": max(big), "error_median_abs": statistics.median(abs(e) for e in errors)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small configs only")
    parser.add_argument("--no-presets", action="store_true", help="the small random configs only")
    parser.add_argument("--out", help="write the rows and the fit as JSON here")
    args = parser.parse_args(argv)
    from memfit.units import fmt_bytes

    grid = QUICK_GRID if args.quick else FAMILY_GRID + (() if args.no_presets else PRESET_GRID)
    rows = []
    print("model          regime     T x B      tensor peak    reserved      overhead (share of T)")
    for point in grid:
        row = replay_row(*point)
        rows.append(row)
        print(f"{row['model']:<15}{row['regime']:<11}{row['seq_len']:>5} x {row['micro_batch']:<3}"
              f"{fmt_bytes(row['tensor_peak']):>12}{fmt_bytes(row['reserved']):>12}"
              f"{fmt_bytes(row['overhead']):>12} ({row['overhead_share']:+.1%})  [{row['seconds']} s]", flush=True)
    result = fit(rows)
    print(f"\nfit: overhead = {result['fraction']:.2%} x tensor peak + {fmt_bytes(result['floor_bytes'])}; "
          f"reserved predicted from the exact tensor peak within {result['error_min']:+.1%} .. "
          f"{result['error_max']:+.1%} of the replay (median |error| {result['error_median_abs']:.1%}) over "
          f"{result['rows']} grid points; {result['large_error_min']:+.1%} .. {result['large_error_max']:+.1%} over "
          f"the {result['large_rows']} with tensors >= 1 GiB")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "fit": result}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
