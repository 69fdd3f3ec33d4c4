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
granularity; the presets (100 MiB to 26 GiB of tensors) by split blocks. The summary prints the fit
``memory.fragmentation`` uses: the overhead as ``a x optimizer state + b x logits + floor`` (the step's optimizer
state and logits at its peak, from the exact breakdown), the spread of the replays around it, and the spread with
each large point left out of the fit.
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
    "full-bf16-ckpt": {"mixed_precision": "no", "dtype": "bf16", "grad_checkpointing": True},
    "lora64-ckpt": {"mixed_precision": "no", "dtype": "bf16", "lora_r": 64, "grad_checkpointing": True},
    "qlora": {"mixed_precision": "no", "dtype": "bf16", "lora_r": 16, "quantize": "4bit"},
    "qlora-ckpt": {"mixed_precision": "no", "dtype": "bf16", "lora_r": 64, "quantize": "4bit", "grad_checkpointing": True},
}

#: (model, regime, seq_len, micro_batch): full-size presets, where split blocks rather than segment sizes decide.
PRESET_GRID = (
    ("smollm2-135m", "amp", 512, 4), ("smollm2-135m", "lora", 1024, 2), ("smollm2-135m", "fp32", 256, 8),
    ("gpt2-medium", "amp", 1024, 4), ("gpt2-medium", "pure-bf16", 512, 8), ("gpt2-medium", "amp-ckpt", 1024, 8),
    ("qwen2.5-0.5b", "amp", 512, 2), ("qwen2.5-0.5b", "lora", 1024, 2), ("qwen2.5-0.5b", "amp-ckpt", 2048, 2),
    ("llama-3.2-1b", "lora-ckpt", 2048, 2), ("llama-3.2-1b", "pure-bf16", 512, 2),
    ("llama-2-7b", "lora-ckpt", 512, 2), ("llama-2-7b", "lora", 2048, 1),
    # added 2026-12-06 (round 16): 4-bit bases, rank-64 adapters and a checkpointed full bf16 run, the regimes the
    # first grid lacked, where the overhead share ran to 40% (the optimizer state and the logits, not the tensor peak)
    ("llama-2-7b", "qlora-ckpt", 2048, 1), ("llama-2-7b", "qlora-ckpt", 2048, 4), ("llama-2-7b", "qlora-ckpt", 512, 1),
    ("llama-2-7b", "lora64-ckpt", 2048, 4), ("llama-3-8b", "qlora-ckpt", 1024, 2), ("llama-3.2-1b", "qlora", 512, 2),
    ("qwen2.5-0.5b", "qlora-ckpt", 2048, 2), ("mistral-7b", "qlora", 512, 1),
    ("llama-3.2-1b", "full-bf16-ckpt", 2048, 2), ("tinyllama-1.1b", "amp", 1024, 4),
)

#: (family, regime, seq_len, micro_batch): the small random configs of tests/_accuracy_models.py.
FAMILY_GRID = tuple((family, regime, seq_len, batch)
                    for family in ("llama-mha", "qwen2", "gpt2", "gemma2", "phi3")
                    for regime in ("fp32", "amp", "lora")
                    for seq_len, batch in ((256, 4), (512, 2)))

QUICK_GRID = (("llama-mha", "amp", 256, 4), ("qwen2", "lora", 512, 2))


def replay_row(model: str, regime: str, seq_len: int, micro_batch: int) -> dict:
    """Trace one grid point on a CUDA target (the replay comes with it) and what the analytic estimate says."""
    from memfit.memory.device_terms import CUBLAS_STEP_BYTES
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
    overhead = exact.reserved - tensors - CUBLAS_STEP_BYTES
    return {"model": model, "regime": regime, "seq_len": seq_len, "micro_batch": micro_batch,
            "tensor_peak": tensors, "reserved": exact.reserved, "allocated": exact.reserved_allocated,
            "overhead": overhead, "overhead_share": overhead / tensors,
            "optimizer": exact.optimizer, "logits": exact.logits, "weights": exact.weights,
            "analytic_tensor_peak": analytic.peak_bytes - analytic.other, "seconds": round(seconds, 1)}


def _solve(rows: list[dict]) -> tuple[float, float]:
    """Least squares of the overhead on ``(optimizer, logits)``, each row weighted by ``1 / R`` (its relative error
    is what is minimised), through the origin: the 2 x 2 normal equations solved by hand."""
    a = b = c = u = v = 0.0
    for r in rows:
        w = 1.0 / r["reserved"] ** 2
        o, g, y = r["optimizer"], r["logits"], r["overhead"]
        a, b, c, u, v = a + w * o * o, b + w * o * g, c + w * g * g, u + w * o * y, v + w * g * y
    det = a * c - b * b
    return (c * u - b * v) / det, (a * v - b * u) / det


def _overhead(r: dict, fraction: float, per_optimizer: float, per_logit: float) -> float:
    """``memory.fragmentation.overhead`` without its floor: the larger of the two fitted descriptions."""
    return max(fraction * r["tensor_peak"], per_optimizer * r["optimizer"] + per_logit * r["logits"])


def _predicted(r: dict, fraction: float, per_optimizer: float, per_logit: float, floor: float) -> int:
    from memfit.memory.device_terms import CUBLAS_STEP_BYTES

    return int(r["tensor_peak"] + CUBLAS_STEP_BYTES + _overhead(r, fraction, per_optimizer, per_logit) + floor)


def _terms(large: list[dict]) -> tuple[float, float, float]:
    """``fraction`` (the median share of the tensor peak) and the least-squares ``(per_optimizer, per_logit)``."""
    per_optimizer, per_logit = _solve(large)
    return statistics.median(r["overhead_share"] for r in large), max(per_optimizer, 0.0), max(per_logit, 0.0)


def fit(rows: list[dict]) -> dict:
    """The overhead as ``max(fraction x T, a x optimizer + b x logits) + floor`` (``memory.fragmentation``) over the
    rows whose tensors reach 1 GiB (where segment granularity is negligible): ``fraction`` their median share of the
    tensor peak, ``a`` and ``b`` by least squares (``_solve``); ``floor`` the median remainder over the other rows
    (a few segments' worth). The spread: each row's ``(predicted R - R) / R``; and the same with each large row left
    out of the fit in turn (``loo_*``: the spread on a step the fit did not see)."""
    from memfit.units import GiB

    large = [r for r in rows if r["tensor_peak"] >= GiB] or rows
    small = [r for r in rows if r["tensor_peak"] < GiB] or rows
    fraction, per_optimizer, per_logit = _terms(large)
    floor = max(statistics.median(r["overhead"] - _overhead(r, fraction, per_optimizer, per_logit) for r in small), 0)
    for r in rows:
        r["fit_error"] = (_predicted(r, fraction, per_optimizer, per_logit, floor) - r["reserved"]) / r["reserved"]
    loo = [(_predicted(r, *_terms([o for o in large if o is not r]), floor) - r["reserved"]) / r["reserved"]
           for r in large]
    errors, big = [r["fit_error"] for r in rows], [r["fit_error"] for r in large]
    return {"fraction": fraction, "per_optimizer": per_optimizer, "per_logit": per_logit, "floor_bytes": int(floor),
            "rows": len(rows), "large_rows": len(large), "error_min": min(errors), "error_max": max(errors),
            "large_error_min": min(big), "large_error_max": max(big), "large_under": sum(e < 0 for e in big),
            "error_median_abs": statistics.median(abs(e) for e in errors), "loo_min": min(loo), "loo_max": max(loo),
            "loo_median_abs": statistics.median(abs(e) for e in loo)}


def _earlier_rows(parser: argparse.ArgumentParser, path: str) -> list[dict]:
    """The rows of an earlier ``--out`` file; a missing or malformed one ends in one sentence (``parser.error``)."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--refit {path}: not an allocator_replays.py --out file ({exc.__class__.__name__}).")
    keys = ("tensor_peak", "reserved", "overhead", "overhead_share", "optimizer", "logits")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and all(k in r for k in keys)
                                                        for r in rows):
        parser.error(f"--refit {path}: its rows lack {', '.join(keys)} (written before round 16? trace again).")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small configs only")
    parser.add_argument("--no-presets", action="store_true", help="the small random configs only")
    parser.add_argument("--out", help="write the rows and the fit as JSON here")
    parser.add_argument("--refit", help="fit the rows of an earlier --out file again instead of tracing the grid")
    args = parser.parse_args(argv)
    from memfit.units import fmt_bytes

    grid = QUICK_GRID if args.quick else FAMILY_GRID + (() if args.no_presets else PRESET_GRID)
    earlier = _earlier_rows(parser, args.refit) if args.refit else None
    rows = []
    print("model          regime     T x B      tensor peak    reserved      overhead (share of T)")
    for row in earlier if earlier is not None else (replay_row(*point) for point in grid):
        rows.append(row)
        print(f"{row['model']:<15}{row['regime']:<11}{row['seq_len']:>5} x {row['micro_batch']:<3}"
              f"{fmt_bytes(row['tensor_peak']):>12}{fmt_bytes(row['reserved']):>12}"
              f"{fmt_bytes(row['overhead']):>12} ({row['overhead_share']:+.1%})  [{row['seconds']} s]", flush=True)
    result = fit(rows)
    print(f"\nfit: overhead = max({result['fraction']:.2%} x tensor peak, {result['per_optimizer']:.2%} x optimizer "
          f"state + {result['per_logit']:.2%} x logits) + {fmt_bytes(result['floor_bytes'])}; reserved predicted from the exact tensor peak within {result['error_min']:+.1%} .. "
          f"{result['error_max']:+.1%} of the replay (median |error| {result['error_median_abs']:.1%}) over "
          f"{result['rows']} grid points; {result['large_error_min']:+.1%} .. {result['large_error_max']:+.1%} over "
          f"the {result['large_rows']} with tensors >= 1 GiB ({result['large_under']} under); each of those left out "
          f"of the fit: {result['loo_min']:+.1%} .. {result['loo_max']:+.1%} (median |error| {result['loo_median_abs']:.1%})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "fit": result}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
