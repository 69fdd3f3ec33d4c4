"""Memory techniques on one GPU: predicted against measured peaks, memfit's step against transformers' Trainer.

For each case (the standard loss; ``--loss chunked``, ``liger`` and ``cce``; ``--optimizer-in-backward``;
``--offload activations``; chunked + in-backward together) on a few-layer Llama with Llama 3's 128,256-token
vocabulary (the ``llama-3.2-1b`` preset's config with 4 layers, random weights, nothing downloaded) it reports

- ``predicted``: memfit's analytic estimate (``memory.estimate.estimate``) and, unless ``--no-exact``, the exact
  trace (``memory.trace.trace``, on CPU in worker processes while the GPU runs), as tensor bytes: the peak
  without ``other`` (CUDA context, cuBLAS workspace, allocator reserve), which the allocator does not count;
- ``memfit``: ``torch.cuda.max_memory_allocated`` over the last of ``--steps`` real training steps (optimizer
  state exists) run by memfit's own builders and ``training.step.train_step`` with the case's technique
  (``_device.real_steps``), reset between cases;
- ``Trainer``: the same model, micro-batch x accumulation, sequence length and precision trained by
  ``transformers.Trainer`` (its standard loss; ``use_liger_kernel`` for the Liger case), its last step's
  ``max_memory_allocated``. Cases that share those settings share one Trainer run;
- ``error``: (predicted - measured memfit) / measured memfit; ``vs Trainer``: memfit's peak over the Trainer's.

A case the machine cannot run (Liger or Cut Cross-Entropy not installed; activation offload without CUDA)
keeps its predictions and records why it was not measured. ``--dry-run`` runs the whole pipeline on CPU with
a 2-layer, hidden-64 Llama (vocabulary 8,192, 512 tokens a step, so the logits still dominate), 2 steps, and
measures the second step's tensor peak on the live tensors (``memory.measure.StepPeak``, what ``memfit train``
reports on CPU) for memfit and for the Trainer, compared with the estimate for ``device="cpu"``.
On one H200 the default run takes about two minutes (``--budget-s`` stops starting new runs past it).

Examples::

    python bench/gpu_techniques.py --out bench/results/gpu_techniques.json     # on the GPU machine
    python bench/gpu_techniques.py --cases standard,chunked --seq-len 4096
    python bench/gpu_techniques.py --dry-run --out /tmp/techniques-dry.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
import _device as dev  # noqa: E402
from memfit.settings.config import RunConfig  # noqa: E402

#: The techniques, as ``RunConfig`` fields over the base run (a full fine-tune under bf16 autocast).
CASES: dict[str, dict[str, Any]] = {
    "standard": {},
    "chunked": {"loss": "chunked"},
    "liger": {"loss": "liger"},
    "cce": {"loss": "cce"},
    "optimizer-in-backward": {"optimizer_in_backward": True},
    "offload-activations": {"offload": "activations"},
    "chunked+in-backward": {"loss": "chunked", "optimizer_in_backward": True},
}
#: concat packing: the rows are full-length blocks without position ids, as the real steps feed them
#: (no block-causal mask), so the predictions price the attention path that is measured.
BASE = {"mixed_precision": "bf16", "dtype": "fp32", "packing": "concat", "grad_accum": 1}
GPU_DEFAULTS = {"seq_len": 2048, "micro_batch": 4, "steps": 3, "warmup": 1, "layers": 4}
DRY_DEFAULTS = {"seq_len": 256, "micro_batch": 2, "steps": 2, "warmup": 1, "layers": 2}


# --- the model: a large vocabulary, few layers, saved as a config.json (random init) ----------------------


def make_model(folder: Path, *, dry_run: bool, layers: int) -> str:
    """Write a Llama ``config.json`` and memfit's byte tokenizer into ``folder``; return the config's path.

    memfit (``training.setup``) and the estimator read a bare ``config.json`` as "this architecture, random
    weights"; the Trainer builds the same config with ``from_config``. GPU: the ``llama-3.2-1b`` preset (vocab
    128,256, hidden 2,048, tied embeddings) cut to ``layers`` layers, ~0.5 B parameters of which the
    embedding is half. Dry run: 2 layers of hidden 64 under a vocabulary of 8,192.
    """
    from transformers import LlamaConfig

    from memfit.data.dataset import byte_tokenizer

    if dry_run:
        config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        config = common.model_config("llama-3.2-1b")
        config.num_hidden_layers = layers
    config.use_cache = False
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder / "config.json")


def case_runs(names: list[str], seq_len: int, micro_batch: int, grad_accum: int) -> dict[str, RunConfig]:
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    base = {**BASE, "grad_accum": grad_accum}
    return {n: RunConfig.of(seq_len=seq_len, micro_batch=micro_batch, **{**base, **CASES[n]}) for n in names}


# --- predictions ------------------------------------------------------------------------------------------


def predict(model: str, run: RunConfig, device: str, exact: bool = False) -> dict[str, Any]:
    """The estimate (or the exact trace) for ``device`` with its tensor peak (``peak - other``), or the failure."""
    try:
        t0 = time.perf_counter()
        if exact:
            from memfit.memory.trace import trace

            breakdown = trace(model, run, device=device)
        else:
            from memfit.memory.estimate import estimate
            from memfit.spec.model import load_spec

            breakdown = estimate(load_spec(model), run, device=device)
        out = breakdown.to_dict()
        return {**out, "tensor_peak_bytes": int(out["peak_bytes"] - out["breakdown"].get("other", 0)),
                "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001 - a refused or failing predictor is a recorded result
        return dev.failure(err)


def _exact_job(args: tuple[str, dict[str, Any], str]) -> dict[str, Any]:
    model, flat, device = args
    return predict(model, RunConfig.from_flat(flat), device, exact=True)


def start_exact(model: str, runs: dict[str, RunConfig], device: str, workers: int):
    """Exact traces on CPU worker processes while the GPU measures (0 workers: inline, later)."""
    if workers <= 0:
        return None, {}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a forked child of a process that touched CUDA cannot use torch safely.
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    return pool, {name: pool.submit(_exact_job, (model, run.to_flat(), device)) for name, run in runs.items()}


# --- measurements -----------------------------------------------------------------------------------------


def why_not_runnable(run: RunConfig) -> str | None:
    """What ``memfit train`` would refuse for ``run`` on this machine (one sentence), or None."""
    from memfit.errors import UserError
    from memfit.training.setup import preflight

    try:
        preflight(run)
    except UserError as err:
        return str(err)
    return None


def run_memfit(model: str, run: RunConfig, steps: int, warmup: int) -> dict[str, Any]:
    """memfit's builders and step with the case's technique; ``peak_bytes``: the last step's CUDA max
    allocated, or (CPU) the second step's tensor peak counted on live tensors."""
    reason = why_not_runnable(run)
    if reason:
        return {"skipped": reason}
    result = dev.real_steps(model, run, steps=steps, warmup=warmup).to_dict()
    result["peak_bytes"] = result["last_step_max_allocated_bytes"] or result["cpu_tensor_peak_bytes"]
    return result


def trainer_key(run: RunConfig) -> tuple:
    """What the Trainer run depends on: cases equal in these share one Trainer run."""
    return (run.seq_len, run.micro_batch, run.grad_accum, str(run.mixed_precision), str(run.dtype),
            run.grad_checkpointing, str(run.loss) == "liger")


def _last_step_peak(steps: int):
    """A ``TrainerCallback`` measuring the Trainer's last step as ``real_steps`` measures memfit's: CUDA max
    allocated reset at the last step's start; on CPU the second step's live tensor bytes (``StepPeak``)."""
    import torch
    from transformers import TrainerCallback

    from memfit.memory.measure import StepPeak

    cuda = torch.cuda.is_available()

    class LastStepPeak(TrainerCallback):
        def __init__(self) -> None:
            self.counter = StepPeak("cuda" if cuda else "cpu", steps)
            self.watching = None
            self.cuda_last: int | None = None

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if cuda and state.global_step == steps - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.watching = self.counter.watch(state.global_step + 1, model, optimizer, [])
            self.watching.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            self.watching.__exit__(None, None, None)
            if cuda and state.global_step == steps:
                torch.cuda.synchronize()
                self.cuda_last = int(torch.cuda.max_memory_allocated())

        @property
        def peak_bytes(self) -> int | None:
            return self.cuda_last if cuda else (self.counter.peak_bytes or None)

    return LastStepPeak()


def run_trainer(model: str, run: RunConfig, steps: int, warmup: int) -> dict[str, Any]:
    """The same workload as a Trainer user writes it: from_config, TrainingArguments, its own loss."""
    import torch
    from transformers import Trainer, TrainingArguments

    liger = str(run.loss) == "liger"
    if liger and not torch.cuda.is_available():
        return {"skipped": "the Trainer's use_liger_kernel needs a CUDA GPU."}
    if liger and importlib.util.find_spec("liger_kernel") is None:
        return {"skipped": "the Trainer's use_liger_kernel needs the liger_kernel package."}
    dev.free_memory()
    config = common.model_config(model)
    config.use_cache = False
    hf_model = common.build_model(config, seed=0, dtype=str(run.dtype), device=dev.device_type())
    blocks = common.token_blocks(config.vocab_size, steps * run.micro_batch * run.grad_accum, run.seq_len, 0)
    dataset = [{"input_ids": row, "labels": row} for row in blocks]
    timer, peak = common.trainer_step_timer(), _last_step_peak(steps)
    common.reset_accelerate_state()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=run.micro_batch,
            gradient_accumulation_steps=run.grad_accum, bf16=str(run.mixed_precision) == "bf16",
            gradient_checkpointing=run.grad_checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
            use_liger_kernel=liger, optim="adamw_torch", learning_rate=1e-4, lr_scheduler_type="constant",
            max_grad_norm=1.0, logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
            seed=0, dataloader_num_workers=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=hf_model, args=args, train_dataset=dataset, callbacks=[timer, peak])
        trainer.train()
    tokens_per_step = run.micro_batch * run.grad_accum * run.seq_len
    result = {"tokens_per_s": common.steady_tokens_per_s(timer.ends, timer.start, tokens_per_step, warmup),
              "peak_bytes": peak.peak_bytes, **dev.cuda_peaks()}
    del trainer, hf_model, dataset
    common.reset_accelerate_state()
    dev.free_memory()
    return result


def _guarded(fn, *args) -> dict[str, Any]:
    """One measurement; an out-of-memory error or a bug in one case is a result, not the end of the bench."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001
        common.reset_accelerate_state()
        dev.free_memory()
        return dev.failure(err)


# --- the whole bench --------------------------------------------------------------------------------------


def relative_error(predicted: int | None, measured: int | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def add_figures(row: dict[str, Any]) -> None:
    """Errors of each predictor against memfit's measured peak, and memfit's peak over the Trainer's."""
    measured = row["memfit"].get("peak_bytes")
    for key in ("analytic", "exact"):
        row[f"{key}_error"] = relative_error(row.get(key, {}).get("tensor_peak_bytes"), measured)
    trainer = row["trainer"].get("peak_bytes")
    row["memfit_over_trainer"] = measured / trainer if measured and trainer else None


def run_cases(model: str, runs: dict[str, RunConfig], args, t_start: float) -> list[dict[str, Any]]:
    device = "cuda" if dev.device_type() == "cuda" else "cpu"
    pool, futures = (None, {}) if args.no_exact else start_exact(model, runs, device, args.trace_workers)
    rows, trainers = [], {}
    for name, run in runs.items():
        row = {"case": name, "run": run.to_flat(), "analytic": predict(model, run, device)}
        over = time.perf_counter() - t_start > args.budget_s
        skipped = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
        row["memfit"] = skipped if over else _guarded(run_memfit, model, run, args.steps, args.warmup)
        key = trainer_key(run)
        if key not in trainers:
            trainers[key] = skipped if over else _guarded(run_trainer, model, run, args.steps, args.warmup)
        row["trainer"] = trainers[key]
        print(f"  {name}: memfit {_short(row['memfit'])}, Trainer {_short(row['trainer'])}", file=sys.stderr)
        rows.append(row)
    for row in rows:
        if not args.no_exact:
            row["exact"] = futures[row["case"]].result() if pool else predict(model, runs[row["case"]], device, True)
        add_figures(row)
    if pool:
        pool.shutdown()
    return rows


def _short(result: dict[str, Any]) -> str:
    if result.get("peak_bytes"):
        from memfit.units import fmt_bytes

        return fmt_bytes(result["peak_bytes"])
    return (result.get("error") or result.get("skipped") or "?")[:80]


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from memfit.units import fmt_bytes

    def size(x):
        return fmt_bytes(x) if isinstance(x, (int, float)) and x else "-"

    def pct(x):
        return f"{x:+.1%}" if isinstance(x, float) else "-"

    table = Table(title=f"memory techniques on {results['device']}: {results['model_note']}, seq {results['seq_len']} "
                        f"x micro-batch {results['micro_batch']} x accumulation {results['grad_accum']}")
    for col in ("case", "predicted", "exact", "measured memfit", "error", "error exact", "measured Trainer",
                "memfit/Trainer", "memfit tok/s"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in results["rows"]:
        mem, trn = r["memfit"], r["trainer"]
        ratio = r.get("memfit_over_trainer")
        table.add_row(r["case"], size(r["analytic"].get("tensor_peak_bytes")),
                      size(r.get("exact", {}).get("tensor_peak_bytes")),
                      size(mem.get("peak_bytes")) if mem.get("peak_bytes") else _short(mem)[:28],
                      pct(r["analytic_error"]), pct(r["exact_error"]),
                      size(trn.get("peak_bytes")) if trn.get("peak_bytes") else _short(trn)[:28],
                      f"{ratio:.2f}" if ratio else "-",
                      f"{mem['tokens_per_s']:.0f}" if mem.get("tokens_per_s") else "-")
    Console(stderr=True, width=170).print(table)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, a 2-layer model: the whole pipeline, seconds")
    parser.add_argument("--cases", help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per step (the in-backward cases need 1; they are skipped otherwise)")
    parser.add_argument("--layers", type=int, help="decoder layers of the model (default 4; dry run 2)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run; the last one is measured")
    parser.add_argument("--warmup", type=int, help="steps left out of tokens/s")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new measurement after this")
    parser.add_argument("--trace-workers", type=int, default=None, help="CPU processes for exact traces (0: inline)")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact traces")
    parser.add_argument("--out", default="-", help="JSON file (- for stdout)")
    args = parser.parse_args(argv)
    common.fill_defaults(args, DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS,
                         ("seq_len", "micro_batch", "steps", "warmup", "layers"), trace_workers=6)
    args.cases = args.cases.split(",") if args.cases else list(CASES)
    if args.grad_accum > 1:
        args.cases = [c for c in args.cases if not CASES.get(c, {}).get("optimizer_in_backward")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if common.cuda_missing(args.dry_run):
        return 1
    import torch

    t_start = time.perf_counter()
    runs = case_runs(args.cases, args.seq_len, args.micro_batch, args.grad_accum)
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run:
            common.set_threads(1)  # the test machine is small and shared
        model = make_model(Path(tmp) / "model", dry_run=args.dry_run, layers=args.layers)
        config = common.model_config(model)
        rows = run_cases(model, runs, args, t_start)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = {"benchmark": "gpu_techniques", "dry_run": args.dry_run, "machine": common.machine_info(),
               "device": device, "model_note": f"Llama, {config.num_hidden_layers} layers, hidden "
                                               f"{config.hidden_size}, vocab {config.vocab_size:,}",
               "seq_len": args.seq_len, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
               "steps": args.steps, "seconds": time.perf_counter() - t_start, "rows": rows}
    common.write_json(args.out, results)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
