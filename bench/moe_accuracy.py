"""Mixture-of-experts families: analytic estimate (a recipe derived from traces) vs ``--exact``.

    python bench/moe_accuracy.py                                   # six families x fp32, AMP, bf16, AMP+ckpt, LoRA
    python bench/moe_accuracy.py --families mixtral,gpt_oss --regimes fp32,amp --out bench/results/moe.json

The small random configs of ``tests/_accuracy_models.py`` (``moe_config``: hidden 64, 3 layers, 4 experts,
2 per token). Both sides on ``device="cpu"`` (tensor bytes, no ``other``): the tensor peak and every
phase's peak, with the experts kernel each ran (``memfit.spec.resolved.experts``). tests/test_moe.py checks
two families in CI; this covers the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REGIMES = {"fp32": {}, "amp": {"mixed_precision": "bf16"}, "bf16": {"dtype": "bf16"},
           "amp-ckpt": {"mixed_precision": "bf16", "grad_checkpointing": True},
           "lora": {"dtype": "bf16", "lora_r": 8}}


def compare(family: str, regime: str, seq_len: int, micro_batch: int) -> dict:
    from _accuracy_models import moe_config
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace
    from memfit.settings.config import RunConfig
    from memfit.spec.model import spec_from_config

    spec = spec_from_config(moe_config(family), f"moe-{family}")
    run = RunConfig.of(seq_len=seq_len, micro_batch=micro_batch, **REGIMES[regime])
    start = time.perf_counter()
    analytic, exact = estimate(spec, run, device="cpu"), trace(spec, run, device="cpu")
    errors = {"peak": (analytic.peak_bytes - exact.peak_bytes) / exact.peak_bytes}
    errors.update({p: (analytic.phase_peaks[p] - b) / b for p, b in exact.phase_peaks.items()})
    return {"family": family, "regime": regime, "seq_len": seq_len, "micro_batch": micro_batch,
            "experts": analytic.experts_implementation, "analytic_peak": analytic.peak_bytes,
            "exact_peak": exact.peak_bytes, "error": errors, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the configs the tests use
    from _accuracy_models import MOE_FAMILIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="all", help="'all' or comma-separated (tests/_accuracy_models.py)")
    parser.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated of {', '.join(REGIMES)}")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--out", help="write the rows as JSON here ('-': stdout)")
    args = parser.parse_args(argv)
    families = MOE_FAMILIES if args.families == "all" else args.families.split(",")
    rows, worst = [], 0.0
    for family in families:
        for regime in args.regimes.split(","):
            row = compare(family, regime, args.seq_len, args.micro_batch)
            rows.append(row)
            worst = max(worst, *(abs(v) for v in row["error"].values()))
            print(f"{family:<12}{regime:<9}{row['experts']:<11}"
                  + "  ".join(f"{k} {v:+.2%}" for k, v in row["error"].items()) + f"  [{row['seconds']} s]", flush=True)
    print(f"worst |error| over tensor peak and phases: {worst:.2%}")
    if args.out:
        text = json.dumps(rows, indent=1)
        print(text) if args.out == "-" else Path(args.out).write_text(text)
    return 0 if worst <= 0.03 else 1


if __name__ == "__main__":
    raise SystemExit(main())
