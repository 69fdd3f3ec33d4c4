"""``--compile`` on CPU (inductor's C++ backend) against eager: tensor peak measured and predicted, and speed.

One small Llama (real tensors, AdamW, fp32) is built twice from one seed: eager and ``torch.compile``'d. After
a warm-up step each (the compiled one compiles there: minutes on two busy cores), the two run interleaved
(eager, compiled, eager, compiled, ...) so that a busy machine slows both alike; tokens/s is the median
per contender and the ratio compiled / eager is reported. One step of each is counted on real tensors
(``memory.measure.counted`` for eager, ``counted_compiled`` for the compiled one: the buffers inductor's
generated code allocates included) and compared with ``memfit.trace(..., device="cpu")`` without and with
``compile`` (the partitioner's saved set, ``memory/compiled.py``).

    python bench/compile_cpu.py --out bench/results/compile_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
from memfit.settings.config import RunConfig

SHAPE = {"hidden": 128, "layers": 2, "inter": 344, "vocab": 2048, "seq": 128, "batch": 4}


def _config():
    from transformers import LlamaConfig

    s = SHAPE
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                       num_hidden_layers=s["layers"], num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, tie_word_embeddings=False)


def _contender(config, compiled: bool):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    net = torch.compile(model) if compiled else model
    ids = torch.randint(0, config.vocab_size, (SHAPE["batch"], SHAPE["seq"]), generator=torch.Generator().manual_seed(1))

    def step():
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return model, optimizer, ids, step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed steps per contender")
    parser.add_argument("--out", default="-")
    args = parser.parse_args(argv)
    from memfit.memory.measure import counted, counted_compiled, resident_tensors
    from memfit.memory.trace import trace

    config = _config()
    rows = {}
    contenders = {name: _contender(config, name == "compiled") for name in ("eager", "compiled")}
    for name, (model, optimizer, ids, step) in contenders.items():
        t0 = time.perf_counter()
        first_loss = step()
        rows[name] = {"first_step_s": time.perf_counter() - t0, "first_loss": first_loss, "step_s": []}
        count = counted_compiled if name == "compiled" else counted
        with count(resident_tensors(model, optimizer, [ids])) as live:
            step()
        rows[name]["measured_peak"] = live.peak
    for _ in range(args.rounds):
        for name, (_m, _o, _i, step) in contenders.items():
            t0 = time.perf_counter()
            step()
            rows[name]["step_s"].append(time.perf_counter() - t0)
    tokens = SHAPE["batch"] * SHAPE["seq"]
    for compiled, name in ((False, "eager"), (True, "compiled")):
        run = RunConfig.of(seq_len=SHAPE["seq"], micro_batch=SHAPE["batch"], packing="concat", compile=compiled,
                        optimizer="adamw")
        predicted = trace(config, run, device="cpu")
        row = rows[name]
        row["tokens_per_s"] = tokens / statistics.median(row["step_s"])
        row["predicted_peak"] = predicted.peak_bytes
        row["error_pct"] = round((predicted.peak_bytes - row["measured_peak"]) / row["measured_peak"] * 100, 2)
    results = {"benchmark": "compile_cpu", "shape": SHAPE, "machine": _common.machine_info(), "rows": rows,
               "speed_ratio_compiled_over_eager": rows["compiled"]["tokens_per_s"] / rows["eager"]["tokens_per_s"],
               "measured_peak_ratio_compiled_over_eager": rows["compiled"]["measured_peak"]
               / rows["eager"]["measured_peak"]}
    _common.write_json(args.out, results)
    for name, row in rows.items():
        print(f"{name:>9}: measured {row['measured_peak'] / 2**20:8.2f} MiB, predicted {row['predicted_peak'] / 2**20:8.2f}"
              f" MiB ({row['error_pct']:+.1f}%), {row['tokens_per_s']:,.0f} tokens/s, first step {row['first_step_s']:.0f} s")
    print(f"compiled / eager: speed x{results['speed_ratio_compiled_over_eager']:.2f}, "
          f"measured peak x{results['measured_peak_ratio_compiled_over_eager']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
