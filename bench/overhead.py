"""What memfit's training loop costs against what users would run instead.

The same model, data, seed, optimizer and number of steps are trained by

  (a) ``plain``:       a plain PyTorch loop (DataLoader, forward, backward, clip, AdamW step),
  (b) ``accelerate``:  the same loop on a bare ``accelerate.Accelerator``,
  (c) ``memfit``:      ``memfit.training.loop.train`` (what ``memfit train`` runs),
  (d) ``trainer``:     transformers' ``Trainer`` with the same optimizer and a constant learning rate,

each run in a fresh subprocess (so each has its own peak RSS), interleaved a,b,c,d,a,b,c,d,... so that
slow drift of a shared machine hits every contender alike. Reported per contender: median tokens/s
over the steps after warm-up, median peak RSS (and peak CUDA allocation on a GPU), and their ratio to
the plain loop.

Examples::

    python bench/overhead.py --quick                       # smoke run, ~1 minute
    python bench/overhead.py --repeats 3 --out bench/results/overhead.json --plot bench/results/overhead.png
    python bench/overhead.py --sizes tiny --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

METHODS = ("plain", "accelerate", "memfit", "trainer")

#: Candidate presets for the ~100 M-parameter size, first one present wins.
HUNDRED_M_PRESETS = ("smollm2-135m", "gpt2")

#: Sizes chosen so one run takes well under a minute on 1-2 CPU cores.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"model": "tiny", "seq_len": 128, "micro_batch": 4, "steps": 20, "warmup": 4},
    # ~135 M parameters x 128 tokens x 6 is about 0.1 TFLOP a step: a few seconds on one CPU core.
    "100m": {"model": None, "seq_len": 64, "micro_batch": 2, "steps": 6, "warmup": 2},
}
QUICK: dict[str, Any] = {"model": "tiny", "seq_len": 64, "micro_batch": 4, "steps": 6, "warmup": 2}

LR = 1e-4
MAX_GRAD_NORM = 1.0
SEED = 0


def pick_100m_preset() -> str:
    from memfit.spec.model import is_preset

    for name in HUNDRED_M_PRESETS:
        if is_preset(name):
            return name
    raise SystemExit(f"None of the ~100 M presets {HUNDRED_M_PRESETS} is defined in architectures.yaml.")


# --- the contenders (each runs inside a child process) ------------------------------------------


def _setup_data(setup: dict[str, Any]):
    """Model config, the token blocks and a DataLoader over them, the same for every contender."""
    import torch

    config = common.model_config(setup["model"])
    n_blocks = setup["steps"] * setup["micro_batch"]
    blocks = common.token_blocks(config.vocab_size, n_blocks, setup["seq_len"], SEED)
    dataset = torch.utils.data.TensorDataset(blocks)
    loader = torch.utils.data.DataLoader(dataset, batch_size=setup["micro_batch"], shuffle=False)
    return config, blocks, loader


def run_plain(setup: dict[str, Any]) -> dict[str, Any]:
    """(a) The loop a user writes by hand: nothing but torch."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config, _, loader = _setup_data(setup)
    model = common.build_model(config, seed=SEED, device=device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ends, start = [], time.perf_counter()
    for (input_ids,) in loader:
        input_ids = input_ids.to(device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        ends.append(time.perf_counter())
    return {"step_ends": ends, "start": start, "final_loss": float(loss)}


def run_accelerate(setup: dict[str, Any]) -> dict[str, Any]:
    """(b) The same loop on a bare Accelerator (device placement, backward, clipping through it)."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    config, _, loader = _setup_data(setup)
    model = common.build_model(config, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    ends, start = [], time.perf_counter()
    for (input_ids,) in loader:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        ends.append(time.perf_counter())
    return {"step_ends": ends, "start": start, "final_loss": float(loss)}


def run_trainer(setup: dict[str, Any]) -> dict[str, Any]:
    """(d) transformers' Trainer, told to do the same: AdamW (torch), constant LR, clip 1.0, no logging."""
    import torch
    from transformers import Trainer, TrainingArguments

    config, blocks, _ = _setup_data(setup)
    model = common.build_model(config, seed=SEED)
    dataset = [{"input_ids": row, "labels": row} for row in blocks]
    timer = common.trainer_step_timer()

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=setup["steps"], per_device_train_batch_size=setup["micro_batch"],
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            optim="adamw_torch", max_grad_norm=MAX_GRAD_NORM, logging_strategy="no", save_strategy="no",
            eval_strategy="no", report_to="none", seed=SEED, data_seed=SEED, dataloader_num_workers=0,
            disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[timer])
        trainer.train()
    return {"step_ends": timer.ends, "start": timer.start, "final_loss": None}


def run_memfit(setup: dict[str, Any]) -> dict[str, Any]:
    """(c) memfit's own loop through its library function (what ``memfit train`` calls).

    ``log_every=1`` makes the loop write one metrics record per step, whose ``elapsed_s`` (taken after
    the step's logging, progress bar and checks) gives the step end times: memfit is timed on its
    whole loop body, not only on the forward/backward it reports as ``train_s``. No held-out set,
    no samples; the final export happens after the last timed step.
    """
    from memfit.settings.config import RunConfig, TrainConfig
    from memfit.training.loop import train

    with tempfile.TemporaryDirectory() as out:
        data = Path(out) / "data.txt"
        data.write_text(_text_for(setup))
        cfg = TrainConfig.of(
            model=setup["model"], data=str(data),
            run=RunConfig.of(seq_len=setup["seq_len"], micro_batch=setup["micro_batch"], optimizer="adamw"),
            lr=LR, weight_decay=0.0, warmup_steps=0, max_steps=setup["steps"], seed=SEED,
            packing=True, eval_every=0, eval_fraction=0.0, save_every=None, log_every=1,
            max_grad_norm=MAX_GRAD_NORM, output=str(Path(out) / "run"), overwrite=True, samples=0,
        )
        t0 = time.perf_counter()
        summary = train(cfg)
        records = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    # elapsed_s counts from train()'s own start; shifting by t0 puts it on this process's clock.
    ends = [t0 + r["elapsed_s"] for r in records if "elapsed_s" in r]
    return {"step_ends": ends, "start": t0, "final_loss": summary.get("final_train_loss"),
            "memfit_reported_tokens_per_s": summary.get("tokens_per_s")}


def _text_for(setup: dict[str, Any]) -> str:
    """Enough plain text that packing fills every step's blocks (byte-level tokenizer: one token a byte)."""
    need = setup["steps"] * setup["micro_batch"] * setup["seq_len"] * 3
    line = "The quick brown fox jumps over the lazy dog while memfit counts every byte.\n"
    return line * (need // len(line) + 1)


def _sync() -> None:
    """Wait for queued GPU work so step times are real (no-op on CPU, where kernels are synchronous)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


RUNNERS = {"plain": run_plain, "accelerate": run_accelerate, "memfit": run_memfit, "trainer": run_trainer}


def child_main(method: str, setup: dict[str, Any]) -> None:
    """Entry point of one measured run: prints one JSON line on stdout."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    common.set_threads(setup["threads"])
    import torch

    wall0 = time.perf_counter()
    result = RUNNERS[method](setup)
    tokens_per_step = setup["micro_batch"] * setup["seq_len"]
    record = {
        "method": method,
        "steps_timed": len(result["step_ends"]),
        "tokens_per_s": common.steady_tokens_per_s(result["step_ends"], result["start"], tokens_per_step,
                                                   setup["warmup"]),
        "wall_s": time.perf_counter() - wall0,
        "peak_rss_bytes": common.peak_rss_bytes(),
        "final_loss": result["final_loss"],
    }
    if "memfit_reported_tokens_per_s" in result:
        record["memfit_reported_tokens_per_s"] = result["memfit_reported_tokens_per_s"]
    if torch.cuda.is_available():
        record["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    print("RESULT " + json.dumps(record))


# --- the parent: interleave, summarise, plot ------------------------------------------------------


def run_one(method: str, setup: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One contender's run in a fresh interpreter; its failure is recorded, not raised."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, "--setup", json.dumps(setup)]
    env = dict(os.environ, OMP_NUM_THREADS=str(setup["threads"]), TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"method": method, "error": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"method": method, "error": f"exit {proc.returncode}: {tail}"}


def summarise(runs: list[dict[str, Any]], methods: tuple[str, ...]) -> dict[str, Any]:
    """Medians per contender and their ratio to the plain loop (tokens/s and peak memory)."""
    out: dict[str, Any] = {}
    for method in methods:
        ok = [r for r in runs if r["method"] == method and "error" not in r]
        errors = [r["error"] for r in runs if r["method"] == method and "error" in r]
        out[method] = {
            "runs": len(ok),
            "errors": errors,
            "tokens_per_s": common.median([r["tokens_per_s"] for r in ok]),
            "tokens_per_s_all": [round(r["tokens_per_s"], 1) for r in ok],
            "peak_rss_bytes": common.median([r["peak_rss_bytes"] for r in ok]),
            "wall_s": common.median([r["wall_s"] for r in ok]),
        }
        if ok and "cuda_max_allocated_bytes" in ok[0]:
            out[method]["cuda_max_allocated_bytes"] = common.median([r["cuda_max_allocated_bytes"] for r in ok])
    base = out.get("plain", {})
    for row in out.values():
        for key in ("tokens_per_s", "peak_rss_bytes", "cuda_max_allocated_bytes"):
            if key in row and base.get(key):
                row[f"{key}_vs_plain"] = row[key] / base[key]
    return out


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """The goals of issue 7, checked on the medians: within 3% of plain, no slower than Trainer."""
    mem, plain, trainer = (summary.get(m, {}) for m in ("memfit", "plain", "trainer"))
    if not mem.get("runs") or not plain.get("runs"):
        return {"memfit_within_3pct_of_plain": None, "memfit_not_slower_than_trainer": None}
    return {
        "memfit_within_3pct_of_plain": mem["tokens_per_s"] >= 0.97 * plain["tokens_per_s"],
        "memfit_not_slower_than_trainer": (mem["tokens_per_s"] >= trainer["tokens_per_s"]
                                           if trainer.get("runs") else None),
    }


def plot(results: dict[str, Any], path: str) -> None:
    """Two panels: tokens/s and peak RSS of each contender relative to the plain loop, per model size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["sizes"])
    methods = results["methods"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(methods)
    for ax, key, title in ((axes[0], "tokens_per_s_vs_plain", "tokens/s vs plain PyTorch"),
                           (axes[1], "peak_rss_bytes_vs_plain", "peak RSS vs plain PyTorch")):
        for i, method in enumerate(methods):
            values = [results["sizes"][s]["summary"][method].get(key, 0.0) for s in sizes]
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(sizes))]
            ax.bar(xs, values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(sizes)), [f"{s}\n({results['sizes'][s]['setup']['model']})" for s in sizes])
        ax.set_title(title)
        ax.set_ylabel("ratio (1.0 = plain loop)")
    axes[1].legend(loc="lower right")
    fig.suptitle(f"memfit overhead, {results['machine']['cpu_count']} CPU cores, "
                 f"{results['threads']} thread(s), medians of {results['repeats']} runs")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(results: dict[str, Any]) -> None:
    from memfit.units import fmt_bytes

    for size, block in results["sizes"].items():
        s = block["setup"]
        print(f"\n{size}: {s['model']}, seq {s['seq_len']} x micro-batch {s['micro_batch']}, "
              f"{s['steps']} steps ({s['warmup']} warm-up), {results['threads']} thread(s)")
        print(f"{'method':<11} {'tokens/s':>10} {'vs plain':>9} {'peak RSS':>11} {'vs plain':>9} {'wall':>8}")
        for method, row in block["summary"].items():
            if not row["runs"]:
                print(f"{method:<11} failed: {row['errors'][:1]}")
                continue
            print(f"{method:<11} {row['tokens_per_s']:>10.1f} {row.get('tokens_per_s_vs_plain', 0):>9.3f} "
                  f"{fmt_bytes(row['peak_rss_bytes']):>11} {row.get('peak_rss_bytes_vs_plain', 0):>9.3f} "
                  f"{row['wall_s']:>7.1f}s")
        print(f"verdict: {block['verdict']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration, one repeat")
    parser.add_argument("--sizes", default="tiny,100m", help="comma-separated: tiny, 100m")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median over them)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every run")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before one run is abandoned")
    parser.add_argument("--out", default="-", help="JSON output file (- for stdout)")
    parser.add_argument("--plot", default=None, help="PNG file for the ratio plot")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, json.loads(args.setup))
        return 0

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if args.quick:
        setups = {"quick": dict(QUICK)}
        args.repeats = 1
    else:
        setups = {s.strip(): dict(SIZES[s.strip()]) for s in args.sizes.split(",") if s.strip()}
        if "100m" in setups:
            setups["100m"]["model"] = pick_100m_preset()
    results: dict[str, Any] = {"benchmark": "overhead", "machine": common.machine_info(), "methods": list(methods),
                               "repeats": args.repeats, "threads": args.threads, "sizes": {}}
    for size, setup in setups.items():
        setup["threads"] = args.threads
        runs = []
        for rep in range(args.repeats):
            for method in methods:  # interleaved: a, b, c, d, a, b, c, d, ...
                record = run_one(method, setup, args.timeout)
                record["repeat"] = rep
                runs.append(record)
                shown = record.get("error") or f"{record['tokens_per_s']:.1f} tokens/s"
                print(f"[{size} {rep + 1}/{args.repeats}] {method}: {shown}", file=sys.stderr)
        summary = summarise(runs, methods)
        results["sizes"][size] = {"setup": setup, "runs": runs, "summary": summary, "verdict": verdict(summary)}
        if args.out != "-":  # after each size, so a long run stopped midway keeps what it measured
            common.write_json(args.out, results)
    common.write_json(args.out, results)
    if args.out != "-":
        print_table(results)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
