"""Training-step speed on this CPU in fp32, pure bf16 and bf16 autocast: why ``memfit train --budget`` plans
fp32 first on a CPU (``memfit.training.budget.CPU_PRECISION``).

The planner ranks plans by a GPU's speeds, where bf16 is the faster. A CPU without bf16 matrix units
(AVX512-BF16, AMX) runs torch's bf16 matmuls emulated. Here one model (the ``tiny`` preset's config by default:
memfit's demo model, random weights) is built once per precision from one seed; after a warm-up step each,
the three take steps interleaved (fp32, bf16, autocast, fp32, ...), so a busy machine slows all alike, and the
best step time of each is reported with the ratios to fp32. One thread by default (``--threads``).

    python bench/cpu_precision.py --out bench/results/cpu_precision.json
"""

from __future__ import annotations

import argparse
import time

import _common

CONTENDERS = {"fp32": ("fp32", False), "pure-bf16": ("bf16", False), "bf16-autocast": ("fp32", True)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="preset or config folder (default: tiny)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed steps per contender")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="-")
    args = parser.parse_args(argv)
    _common.set_threads(args.threads)
    import torch

    config = _common.model_config(args.model)
    ids = torch.randint(3, config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    steps = {}
    for name, (dtype, autocast) in CONTENDERS.items():
        model = _common.build_model(config, seed=0, dtype=dtype)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer, autocast=autocast):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up
        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq_len
    rows = {name: {"best_step_s": min(ts), "step_s": ts, "tokens_per_s": tokens / min(ts)} for name, ts in times.items()}
    for row in rows.values():
        row["over_fp32"] = row["best_step_s"] / rows["fp32"]["best_step_s"]
    results = {"benchmark": "cpu_precision", "model": args.model, "batch": args.batch, "seq_len": args.seq_len,
               "threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "machine": _common.machine_info(), "rows": rows}
    _common.write_json(args.out, results)
    for name, row in rows.items():
        print(f"{name:>13}: {row['best_step_s']:7.3f} s/step, {row['tokens_per_s']:8,.0f} tokens/s, "
              f"x{row['over_fp32']:.1f} fp32's time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
