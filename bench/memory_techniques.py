"""Measured on CPU: what chunked cross-entropy and optimizer-in-backward save, next to what memfit predicts.

Each contender trains real tensors for two steps (the first creates the optimizer state); the second is
measured with torch's ``MemTracker`` on real tensors (every tensor's bytes, not RSS), and compared with
``memfit.estimate(..., device="cpu")``, which models the same CPU kernels. Reported per case: measured
tensor peak, predicted peak, bytes saved (measured vs predicted), tokens/s of the measured step.

1. ``--loss chunked`` vs standard on a 2-layer Llama (hidden 128, 512 tokens, SGD) at vocabularies 32K,
   128K, 256K: the logits term (12 bytes x B x T x V at backward start) is most of the step.
2. ``--optimizer-in-backward`` vs a plain foreach AdamW step on a ~134 M-parameter Llama (12 layers,
   hidden 768, vocab 32K): the plain step holds every gradient plus a foreach temporary.

    python bench/memory_techniques.py --out bench/results/memory_techniques.json
    python bench/memory_techniques.py --quick --out /tmp/mt.json     # CI: tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import time
import warnings

import _common  # noqa: F401 - puts bench/ on sys.path for running from a checkout
from memfit.settings.config import RunConfig, TrainConfig


def _llama(vocab: int, hidden: int, layers: int, inter: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                       max_position_embeddings=4096, tie_word_embeddings=False)


def measure(config, run: RunConfig, seed: int = 0) -> dict:
    """Train two real steps of ``run``; the second's tensor peak (MemTracker) and its tokens/s."""
    import torch

    from memfit.memory.trace import _private_api
    from memfit.training.setup import build_optimizer
    from memfit.training.step import micro_loss

    torch.manual_seed(seed)
    model = _common.build_model(config, seed=seed)
    model.train()
    optimizer = build_optimizer(model, run, TrainConfig.of(run=run, lr=1e-3))
    ids = _common.token_blocks(config.vocab_size, run.micro_batch, run.seq_len, seed)  # (B, T)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    n = torch.tensor(ids.numel())

    def step():
        loss = micro_loss(model, batch, n, True, config.vocab_size, run.loss)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on (the steady state memfit estimates)
    start = time.perf_counter()
    step()  # timed without the tracker, whose per-operator bookkeeping would dominate
    seconds = time.perf_counter() - start
    tracker = _private_api()["MemTracker"]()
    tracker.track_external(model, optimizer)
    if run.optimizer_in_backward:
        optimizer.install_hooks()  # after MemTracker's gradient hooks, which read .grad before it is freed
    with tracker, warnings.catch_warnings():
        # in backward: MemTracker installs its gradient hooks at the first forward, after the step hooks, and
        # warns when they find the gradient already freed; the bytes it counts are unaffected.
        warnings.simplefilter("ignore", UserWarning)
        tracker.reset_mod_stats()
        step()
    peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    return {"measured_peak": peak, "seconds": seconds, "tokens_per_s": ids.numel() / seconds}


def case(name: str, config, base: RunConfig, variant: RunConfig) -> dict:
    """Measure and predict ``base`` and ``variant``; savings side by side."""
    from memfit.memory.estimate import estimate
    from memfit.spec.model import spec_from_config

    spec = spec_from_config(config, name)
    out = {"case": name, "params": spec.params, "vocab": config.vocab_size,
           "tokens": base.micro_batch * base.seq_len}
    for label, run in (("base", base), ("variant", variant)):
        m = measure(config, run)
        predicted = estimate(spec, run, device="cpu")
        out[label] = {**m, "predicted_peak": predicted.peak_bytes, "phase": predicted.phase,
                      "run": {k: v for k, v in run.to_flat().items() if k in ("loss", "optimizer_in_backward")}}
    saved = out["base"]["measured_peak"] - out["variant"]["measured_peak"]
    predicted_saved = out["base"]["predicted_peak"] - out["variant"]["predicted_peak"]
    out["saved_measured"], out["saved_predicted"] = saved, predicted_saved
    out["saved_error"] = predicted_saved / saved - 1 if saved else float("nan")
    out["speed_ratio"] = out["variant"]["tokens_per_s"] / out["base"]["tokens_per_s"]
    if base.loss.value == "standard" and variant.loss.value == "chunked":
        logits = 12 * out["tokens"] * config.vocab_size  # standard backward-start logits term (fp32)
        out["logits_term"], out["drop_over_logits"] = logits, saved / logits
    return out


def speed(config, base: RunConfig, variant: RunConfig, repeats: int, seed: int = 0) -> dict:
    """Tokens/s of ``base`` and ``variant`` in interleaved pairs (base, variant, base, ...) on one model, so
    a load change on a shared machine hits both; the ratio is taken per pair and its median reported."""
    import torch

    from memfit.training.setup import build_optimizer
    from memfit.training.step import micro_loss

    model = _common.build_model(config, seed=seed)
    model.train()
    ids = _common.token_blocks(config.vocab_size, base.micro_batch, base.seq_len, seed)  # (B, T)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    n = torch.tensor(ids.numel())

    def timed(run: RunConfig) -> float:
        optimizer = build_optimizer(model, run, TrainConfig.of(run=run, lr=1e-3))
        start = time.perf_counter()
        loss = micro_loss(model, batch, n, True, config.vocab_size, run.loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return ids.numel() / (time.perf_counter() - start)

    timed(base), timed(variant)  # warm-up: first-call allocations and kernel selection
    pairs = [(timed(base), timed(variant)) for _ in range(repeats)]
    ratios = sorted(v / b for b, v in pairs)
    return {"vocab": config.vocab_size, "hidden": config.hidden_size, "tokens": ids.numel(),
            "base": str(base.loss), "variant": str(variant.loss), "pairs": pairs,
            "median_ratio": ratios[len(ratios) // 2], "min_ratio": ratios[0], "max_ratio": ratios[-1]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI): seconds, same code path")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speed", type=int, metavar="PAIRS", default=0,
                    help="only tokens/s of chunked vs standard CE at vocab 128,256 (hidden 256, 512 tokens), "
                         "PAIRS interleaved runs")
    args = ap.parse_args(argv)
    _common.set_threads(args.threads)
    if args.speed:
        run = RunConfig.of(seq_len=512, micro_batch=1, optimizer="sgd")
        result = speed(_llama(128_256, 256, 2, 688), run, run.replace(loss="chunked"), args.speed)
        print(f"vocab {result['vocab']:,}, hidden {result['hidden']}, {result['tokens']} tokens: chunked/standard "
              f"tokens/s median x{result['median_ratio']:.2f} (min {result['min_ratio']:.2f}, max "
              f"{result['max_ratio']:.2f}) over {args.speed} interleaved pairs", flush=True)
        data = {"bench": "memory_techniques.speed", "machine": _common.machine_info(), **result}
        _common.write_json(args.out, data)
        return data
    results = []
    if args.quick:
        vocabs, ce = (4096,), dict(hidden=64, layers=2, inter=128, seq=256, batch=2)
        big = dict(hidden=64, layers=2, inter=128, vocab=512, seq=16)
    else:
        vocabs, ce = (32_000, 128_256, 256_000), dict(hidden=128, layers=2, inter=344, seq=512, batch=1)
        big = dict(hidden=768, layers=12, inter=2048, vocab=32_000, seq=64)
    # SGD (no state, no step temporaries): the step's peak is in forward/backward, where the logits are
    base = RunConfig.of(seq_len=ce["seq"], micro_batch=ce["batch"], optimizer="sgd")
    for vocab in vocabs:
        config = _llama(vocab, ce["hidden"], ce["layers"], ce["inter"])
        results.append(case(f"chunked-ce-v{vocab}", config, base, base.replace(loss="chunked")))
        _print(results[-1])
    config = _llama(big["vocab"], big["hidden"], big["layers"], big["inter"])
    plain = RunConfig.of(seq_len=big["seq"], micro_batch=1, optimizer="adamw-foreach")
    results.append(case("optimizer-in-backward", config, plain, plain.replace(optimizer_in_backward=True)))
    _print(results[-1])
    data = {"bench": "memory_techniques", "quick": args.quick, "machine": _common.machine_info(), "cases": results}
    _common.write_json(args.out, data)
    return data


def _print(r: dict) -> None:
    print(f"{r['case']:<24} params {r['params'] / 1e6:7.1f} M  peak {r['base']['measured_peak'] / 2**20:8.1f} -> "
          f"{r['variant']['measured_peak'] / 2**20:8.1f} MiB  saved {r['saved_measured'] / 2**20:7.1f} MiB "
          f"(predicted {r['saved_predicted'] / 2**20:7.1f}, {r['saved_error']:+.1%})  "
          f"speed x{r['speed_ratio']:.2f}" + (f"  drop/logits {r['drop_over_logits']:.0%}"
                                              if "drop_over_logits" in r else ""), flush=True)


if __name__ == "__main__":
    main()
