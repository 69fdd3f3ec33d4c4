"""How long memfit takes to answer: one analytic estimate, a full plan search, and an exact trace.

For three model sizes (default: ``gpt2`` 124 M, ``qwen2.5-1.5b``, ``llama-2-7b``) it times

- ``spec_s``:      building the ``ModelSpec`` once (a meta-device model build; cached afterwards),
- ``estimate_s``:  one ``memory.estimate.estimate(spec, run)`` (median of ``--repeats`` calls),
- ``plan_s``:      one ``plan.search.plan(model, budget, ...)`` over the whole candidate grid (median of 3),
- ``trace_s``:     one ``memory.trace.trace(model, run)`` (two training steps on fake tensors), once,
- ``peak_rss_bytes`` after the trace: the process's peak RSS so far (sizes run smallest first, so
  each figure is what the largest trace so far needed, imports included).

Run: AMP bf16, full fine-tune, AdamW, micro-batch 1, seq 512 (issue 4's "7 B at seq 512 in under
2 minutes on 2 cores, under 2 GiB of RAM" is the trace figure to read).

Examples::

    python bench/estimator_speed.py --out bench/results/estimator_speed.json
    python bench/estimator_speed.py --quick                 # tiny preset only, seconds
    python bench/estimator_speed.py --models gpt2 --no-trace
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
from memfit.settings.config import RunConfig  # noqa: E402

DEFAULT_MODELS = ["gpt2", "qwen2.5-1.5b", "llama-2-7b"]
RUN = RunConfig.of(seq_len=512, micro_batch=1, mixed_precision="bf16", dtype="fp32")
PLAN_BUDGET = "24GiB"
PLAN_BATCH = 8


def timed(fn, repeats: int) -> tuple[float, Any]:
    """Median wall seconds of ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return common.median(times), result


def measure_model(model: str, repeats: int, do_plan: bool, do_trace: bool) -> dict[str, Any]:
    """All timings for one model; a failing part is recorded as an error and the rest still runs."""
    from memfit.memory.estimate import estimate
    from memfit.spec.model import load_spec

    row: dict[str, Any] = {"model": model}
    t0 = time.perf_counter()
    spec = load_spec(model)
    row["spec_s"] = time.perf_counter() - t0
    row["params"] = spec.params
    row["estimate_s"], breakdown = timed(lambda: estimate(spec, RUN), repeats)
    row["estimate_peak_bytes"] = breakdown.peak_bytes
    if do_plan:
        try:
            from memfit.planning.search import plan

            row["plan_s"], result = timed(lambda: plan(spec, PLAN_BUDGET, seq_len=RUN.seq_len, batch=PLAN_BATCH), 3)
            row["plan_candidates"] = _count_candidates(result)
        except Exception as err:  # noqa: BLE001 - NothingFitsError for a big model is a result too
            row["plan_error"] = str(err)[:300]
    if do_trace:
        try:
            from memfit.memory.trace import trace

            row["trace_s"], traced = timed(lambda: trace(model, RUN), 1)
            row["trace_peak_bytes"] = traced.peak_bytes
        except Exception as err:  # noqa: BLE001
            row["trace_error"] = str(err)[:300]
        row["peak_rss_bytes"] = common.peak_rss_bytes()
    return row


def _count_candidates(result: Any) -> int | None:
    """How many configurations the search weighed (attribute names per plan/search.py's PlanResult)."""
    for name in ("evaluated", "candidates", "plans"):
        value = getattr(result, name, None)
        if value is not None:
            return value if isinstance(value, int) else len(value)
    return None


def print_table(results: dict[str, Any]) -> None:
    from memfit.units import fmt_bytes, fmt_count

    print(f"{'model':<14} {'params':>9} {'spec':>8} {'estimate':>10} {'plan':>9} {'trace':>9} {'peak RSS':>11}")
    for r in results["rows"]:
        def sec(key, unit=1.0, fmt="{:.2f} s", r=r):
            return fmt.format(r[key] * unit) if key in r else ("error" if f"{key[:-2]}_error" in r else "-")

        print(f"{r['model']:<14} {fmt_count(r['params']):>9} {sec('spec_s'):>8} "
              f"{sec('estimate_s', 1e6, '{:.0f} us'):>10} {sec('plan_s'):>9} {sec('trace_s', 1, '{:.1f} s'):>9} "
              f"{fmt_bytes(r['peak_rss_bytes']) if 'peak_rss_bytes' in r else '-':>11}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated presets, smallest first (default: gpt2,qwen2.5-1.5b,llama-2-7b)")
    parser.add_argument("--quick", action="store_true", help="the tiny preset only, few repeats")
    parser.add_argument("--repeats", type=int, default=200, help="estimate calls per model (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--no-plan", action="store_true")
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--out", default="-", help="JSON file (- for stdout)")
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    # Import the model classes first, so spec_s of the first model is not mostly transformers' import time.
    from transformers import AutoModelForCausalLM  # noqa: F401

    import memfit.memory.estimate  # noqa: F401
    models = ["tiny"] if args.quick else (args.models.split(",") if args.models else DEFAULT_MODELS)
    repeats = 20 if args.quick else args.repeats
    rows = []
    for model in models:
        rows.append(measure_model(model, repeats, not args.no_plan, not args.no_trace))
        print(f"  {rows[-1]}", file=sys.stderr)
    results = {"benchmark": "estimator_speed", "machine": common.machine_info(), "threads": args.threads,
               "run": RUN.to_flat(), "plan_budget": PLAN_BUDGET, "plan_batch": PLAN_BATCH, "rows": rows}
    common.write_json(args.out, results)
    if args.out != "-":
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
