"""memfit on one GPU: speed, MFU, measured and predicted memory, against transformers' Trainer.

For each model (default: the ``qwen2.5-0.5b`` and ``qwen2.5-1.5b`` presets, random weights built
from their configs, nothing downloaded) at seq 2048 and each configuration (fp32, AMP bf16, pure
bf16, LoRA on a bf16 base; each with and without gradient checkpointing) it reports

- tokens/s over the steps after warm-up, for memfit's training step and for ``Trainer``;
- MFU: model FLOPs per token (``memfit.planning.cost.flops_per_token`` without recompute: ``6 N`` plus
  the attention term ``12 L H Q T``; ``4 N`` + adapters for LoRA; PaLM, Chowdhery et al. 2022,
  app. B) times tokens/s, over the device's dense bf16 peak from ``presets/gpus.yaml`` (keyed by the
  CUDA device name). fp32 runs are held to the same bf16 peak, so their MFU is low by design;
- peak allocated and reserved (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``);
- the predicted peak: analytic (``memfit estimate``) and exact (``memfit estimate --exact``; traced
  on CPU in worker processes while the GPU runs).

It is meant to finish in under 8 minutes on one H100/H200 (``--budget-s`` stops starting new runs
past the budget and records them as skipped). ``--dry-run`` runs the same code on CPU with the
``tiny`` preset and short sequences, so the test suite keeps it working without a GPU.

Examples::

    python bench/gpu.py --out bench/results/gpu.json                # on the GPU machine
    python bench/gpu.py --models qwen2.5-0.5b --configs amp-bf16,lora-bf16+ckpt
    python bench/gpu.py --dry-run --out /tmp/gpu-dry.json           # CPU, ~30 s
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import _device as dev  # noqa: E402
from memfit.settings.config import RunConfig  # noqa: E402

GPU_DEFAULTS = {"models": ["qwen2.5-0.5b", "qwen2.5-1.5b"], "seq_len": 2048, "micro_batch": 4, "steps": 6,
                "warmup": 2}
#: ``models: None`` = a 2-layer checkpoint saved to a temporary folder (``_device.make_dry_run_model``).
DRY_DEFAULTS = {"models": None, "seq_len": 32, "micro_batch": 2, "steps": 2, "warmup": 1,
                "configs": ["fp32", "amp-bf16+ckpt", "pure-bf16", "lora-bf16+ckpt"]}
RUNNERS = ("memfit", "trainer")


# --- device peak and MFU ---------------------------------------------------------------------------


def device_peak_flops() -> tuple[str, float | None]:
    """(device name, dense bf16 peak FLOP/s) from memfit's GPU table; (``cpu``, None) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    from memfit.planning.gpus import match_device

    props = torch.cuda.get_device_properties(0)
    gpu = match_device(props.name, props.total_memory)
    return f"{props.name} (table: {gpu.name}{'' if gpu.listed else ', not listed'})", gpu.flops(half=True)


def model_flops_per_token(model: str, run: RunConfig) -> float:
    """Model FLOPs per trained token, recompute excluded (MFU counts the model's work, not the device's)."""
    from memfit.planning.cost import flops_per_token
    from memfit.spec.model import load_spec

    return flops_per_token(load_spec(model), run.replace(grad_checkpointing=False))


# --- the two ways to train ---------------------------------------------------------------------------


def run_memfit(model: str, run: RunConfig, steps: int, warmup: int) -> dict[str, Any]:
    """memfit's step: its builders (model, LoRA, checkpointing, optimizer, Accelerator) and its loop body."""
    return dev.real_steps(model, run, steps=steps, warmup=warmup).to_dict()


def run_trainer(model: str, run: RunConfig, steps: int, warmup: int) -> dict[str, Any]:
    """The same configuration as a Trainer user would write it: from_config, PEFT, TrainingArguments."""
    import torch
    from transformers import Trainer, TrainingArguments

    dev.free_memory()
    config = common.model_config(model)
    config.use_cache = False
    hf_model = common.build_model(config, seed=0, dtype=str(run.dtype), device=dev.device_type())
    if run.is_lora():
        from peft import LoraConfig, get_peft_model

        hf_model = get_peft_model(hf_model, LoraConfig(r=run.lora.r, lora_alpha=run.lora.alpha,
                                                       target_modules="all-linear", task_type="CAUSAL_LM"))
    blocks = common.token_blocks(config.vocab_size, steps * run.micro_batch, run.seq_len, 0)
    dataset = [{"input_ids": row, "labels": row} for row in blocks]
    timer = common.trainer_step_timer()

    common.reset_accelerate_state()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=run.micro_batch,
            bf16=str(run.mixed_precision) == "bf16", gradient_checkpointing=run.grad_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False}, optim="adamw_torch", learning_rate=1e-4,
            lr_scheduler_type="constant", max_grad_norm=1.0, logging_strategy="no", save_strategy="no",
            eval_strategy="no", report_to="none", seed=0, dataloader_num_workers=0, disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=hf_model, args=args, train_dataset=dataset, callbacks=[timer])
        trainer.train()
    peaks = dev.cuda_peaks()
    result = {"tokens_per_s": common.steady_tokens_per_s(timer.ends, timer.start, run.micro_batch * run.seq_len, warmup),
              **peaks, "params": sum(p.numel() for p in hf_model.parameters()),
              "trainable_params": sum(p.numel() for p in hf_model.parameters() if p.requires_grad)}
    del trainer, hf_model, dataset
    common.reset_accelerate_state()
    dev.free_memory()
    return result


TRAINERS = {"memfit": run_memfit, "trainer": run_trainer}


# --- orchestration -----------------------------------------------------------------------------------


def start_traces(jobs: list[tuple[str, str, RunConfig]], workers: int) -> tuple[Any, dict]:
    """Exact traces run on CPU, so they go to worker processes while the GPU trains (0 workers: later, inline)."""
    if workers <= 0:
        return None, {}
    import multiprocessing as mp

    # spawn: a forked child of a process that touched CUDA cannot use torch safely.
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    futures = {(m, name): pool.submit(dev.predict_exact_flat, (m, run.to_flat())) for m, name, run in jobs}
    return pool, futures


def one_row(model: str, name: str, run: RunConfig, args, peak_flops: float | None, t_start: float) -> dict[str, Any]:
    """All figures of one (model, configuration): predictions, then each runner unless over budget."""
    row: dict[str, Any] = {"model": model, "config": name, "run": run.to_flat(),
                           "analytic": dev.predict_analytic(model, run)}
    try:
        flops_tok = model_flops_per_token(model, run)
    except Exception as err:  # noqa: BLE001
        flops_tok, row["flops_error"] = None, dev.failure(err)["error"]
    row["model_flops_per_token"] = flops_tok
    for runner in args.runners:
        if time.perf_counter() - t_start > args.budget_s:
            row[runner] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
            continue
        try:
            result = TRAINERS[runner](model, run, args.steps, args.warmup)
        except Exception as err:  # noqa: BLE001 - an OOM or a bug in one configuration must not stop the rest
            common.reset_accelerate_state()
            dev.free_memory()
            result = dev.failure(err)
        if "tokens_per_s" in result and flops_tok and peak_flops:
            result["mfu"] = result["tokens_per_s"] * flops_tok / peak_flops
        row[runner] = result
        print(f"  {model} {name} {runner}: {_short(result)}", file=sys.stderr)
    return row


def _short(result: dict[str, Any]) -> str:
    if "tokens_per_s" in result:
        mfu = f", MFU {result['mfu']:.1%}" if result.get("mfu") is not None else ""
        return f"{result['tokens_per_s']:.0f} tokens/s{mfu}"
    return result.get("error") or result.get("skipped", "?")


def print_table(results: dict[str, Any]) -> None:
    """One rich table: per row, tokens/s and MFU of each runner, measured and predicted peaks."""
    from rich.console import Console
    from rich.table import Table

    from memfit.units import fmt_gib

    def gib(x):
        return fmt_gib(x) if isinstance(x, (int, float)) else "-"

    table = Table(title=f"memfit vs Trainer on {results['device']} (seq {results['seq_len']}, "
                        f"micro-batch {results['micro_batch']})")
    for col in ("model", "config", "memfit tok/s", "MFU", "Trainer tok/s", "MFU ", "max alloc", "reserved",
                "Trainer alloc", "analytic", "exact"):
        table.add_column(col, justify="left" if col in ("model", "config") else "right")
    for row in results["rows"]:
        mem, trn = row.get("memfit", {}), row.get("trainer", {})
        table.add_row(
            Path(row["model"]).name, row["config"],
            f"{mem['tokens_per_s']:.0f}" if "tokens_per_s" in mem else _short(mem)[:24],
            f"{mem['mfu']:.1%}" if mem.get("mfu") is not None else "-",
            f"{trn['tokens_per_s']:.0f}" if "tokens_per_s" in trn else _short(trn)[:24],
            f"{trn['mfu']:.1%}" if trn.get("mfu") is not None else "-",
            gib(mem.get("max_allocated_bytes")), gib(mem.get("max_reserved_bytes")),
            gib(trn.get("max_allocated_bytes")),
            gib(row["analytic"].get("peak_bytes")), gib(row.get("exact", {}).get("peak_bytes")),
        )
    Console(stderr=True, width=160).print(table)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, short sequences: checks the code")
    parser.add_argument("--models", help="comma-separated presets (default: qwen2.5-0.5b,qwen2.5-1.5b)")
    parser.add_argument("--configs", help="comma-separated subset of: " + ", ".join(dev.config_grid()))
    parser.add_argument("--runners", default=",".join(RUNNERS), help="memfit, trainer")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int, help="optimizer steps per run (warm-up included)")
    parser.add_argument("--warmup", type=int, help="steps left out of tokens/s")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new run after this many seconds")
    parser.add_argument("--trace-workers", type=int, default=None, help="CPU processes for exact traces (0: inline)")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact traces")
    parser.add_argument("--out", default="-", help="JSON file (- for stdout)")
    args = parser.parse_args(argv)
    common.fill_defaults(args, DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS,
                         ("seq_len", "micro_batch", "steps", "warmup"), trace_workers=6)
    args.runners = [r for r in args.runners.split(",") if r]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if common.cuda_missing(args.dry_run):
        return 1
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        common.dry_run_models(args, tmp)
        results = run_all(args, t_start)
    common.write_json(args.out, results)
    print_table(results)
    return 0


def run_all(args, t_start: float) -> dict[str, Any]:
    """Predict and run every (model, configuration); exact traces in worker processes meanwhile."""
    device, peak_flops = device_peak_flops()
    grid = dev.config_grid(args.configs)
    runs = {name: RunConfig.of(seq_len=args.seq_len, micro_batch=args.micro_batch, **flags) for name, flags in grid.items()}
    jobs = [(m, name, run) for m in args.models for name, run in runs.items()]
    pool, futures = (None, {}) if args.no_exact else start_traces(jobs, args.trace_workers)
    rows = [one_row(m, name, run, args, peak_flops, t_start) for m, name, run in jobs]
    for row, (m, name, run) in zip(rows, jobs, strict=True):
        if args.no_exact:
            continue
        row["exact"] = futures[(m, name)].result() if pool else dev.predict_exact(m, run)
    if pool:
        pool.shutdown()
    return {"benchmark": "gpu", "dry_run": args.dry_run, "machine": common.machine_info(), "device": device,
            "peak_bf16_flops": peak_flops, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "steps": args.steps, "warmup": args.warmup, "seconds": time.perf_counter() - t_start, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
