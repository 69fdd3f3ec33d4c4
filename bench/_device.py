"""What ``gpu.py`` and ``gpu_memory_check.py`` share: the configuration grid, predictions, real steps.

Every function here runs on CPU as well (``--dry-run``), so the test suite keeps the GPU scripts
from rotting on a machine without a GPU; only the figures differ.
"""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as common
from memfit.settings.config import RunConfig

#: The memory/speed configurations issue 7 asks for; each also runs with gradient checkpointing.
#: LoRA is the usual recipe: a frozen bf16 base, adapters trained under bf16 autocast.
BASE_CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"mixed_precision": "no", "dtype": "fp32"},
    "amp-bf16": {"mixed_precision": "bf16", "dtype": "fp32"},
    "pure-bf16": {"mixed_precision": "no", "dtype": "bf16"},
    "lora-bf16": {"mixed_precision": "bf16", "dtype": "bf16", "lora_r": 16, "lora_alpha": 32.0},
}


def config_grid(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{"fp32": {...}, "fp32+ckpt": {..., grad_checkpointing: True}, ...}``, optionally a subset by name."""
    grid = {}
    for name, flags in BASE_CONFIGS.items():
        grid[name] = dict(flags)
        grid[f"{name}+ckpt"] = {**flags, "grad_checkpointing": True}
    if names:
        unknown = [n for n in names if n not in grid]
        if unknown:
            raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(grid)}")
        grid = {n: grid[n] for n in names}
    return grid


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def free_memory() -> None:
    """Drop what the previous run left so the next one's peak is its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def cuda_peaks() -> dict[str, int | None]:
    """Peak allocated/reserved since the last reset (None on CPU, where no allocator keeps them)."""
    import torch

    if not torch.cuda.is_available():
        return {"max_allocated_bytes": None, "max_reserved_bytes": None}
    return {"max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved())}


def failure(err: BaseException) -> dict[str, str]:
    """A run's failure as data: the benchmark records it and goes on with the next configuration."""
    last = traceback.format_exception_only(type(err), err)[-1].strip()
    return {"error": last[:400]}


# --- predictions -------------------------------------------------------------------------------------


def predict_analytic(model: str, run: RunConfig) -> dict[str, Any]:
    """memfit's analytic estimate (``memfit estimate``) with the time it took."""
    try:
        from memfit.memory.estimate import estimate
        from memfit.spec.model import load_spec

        t0 = time.perf_counter()
        breakdown = estimate(load_spec(model), run)
        return {**breakdown.to_dict(), "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001 - a missing or failing predictor is a recorded result
        return failure(err)


def predict_exact(model: str, run: RunConfig) -> dict[str, Any]:
    """memfit's exact trace (``memfit estimate --exact``) with the time it took."""
    try:
        from memfit.memory.trace import trace

        t0 = time.perf_counter()
        breakdown = trace(model, run)
        return {**breakdown.to_dict(), "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001
        return failure(err)


def predict_exact_flat(args: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """``predict_exact`` taking picklable arguments, for a process pool (traces run on CPU beside the GPU)."""
    model, flat = args
    return predict_exact(model, RunConfig.from_flat(flat))


# --- a real training step, built by memfit's own builders ----------------------------------------------


@dataclass
class StepResult:
    tokens_per_s: float
    max_allocated_bytes: int | None
    max_reserved_bytes: int | None
    last_step_max_allocated_bytes: int | None
    """Peak of the last step alone (optimizer state exists): what the trace's second step predicts."""
    params: int
    trainable_params: int
    loss: float
    cpu_tensor_peak_bytes: int | None = None
    """CPU: tensor peak of the second step, counted on live tensors (``memory.measure.StepPeak``); None on CUDA."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def real_steps(model: str, run: RunConfig, *, steps: int, warmup: int, seed: int = 0) -> StepResult:
    """Train ``steps`` optimizer steps on random tokens exactly as ``memfit train`` runs them.

    Model, LoRA, checkpointing, optimizer and Accelerator come from ``memfit.training.setup``, and each
    step is ``memfit.training.step.train_step`` (forward under Accelerate's autocast, loss normalised by
    target tokens, backward, clipping, optimizer step, zero_grad to None): the sequence
    ``memfit estimate --exact`` simulates. The CUDA peak is reset before the last step, so
    ``last_step_max_allocated_bytes`` is the steady state that the trace's second step predicts.
    ``run``'s memory techniques are passed to the step as ``memfit train`` passes them (``--loss``,
    ``--optimizer-in-backward``, which cannot clip, and ``--offload activations``); each step holds
    ``run.grad_accum`` micro-batches. On CPU the second step's tensor peak is counted on the live tensors
    (``memory.measure.StepPeak``, as ``memfit train`` does on CPU).
    """
    import torch

    from memfit.data.dataset import collate
    from memfit.memory.measure import StepPeak
    from memfit.settings.config import Offload, TrainConfig
    from memfit.training import setup
    from memfit.training.step import TokenLoss, train_step

    cfg = TrainConfig.of(model=model, run=run, seed=seed, lr=1e-4, output="/tmp/memfit-bench-unused")
    free_memory()
    accelerator = setup.build_accelerator(run, cfg)
    bundle = setup.build_model(cfg, run)
    optimizer = setup.build_optimizer(bundle.model, run, cfg)
    net, optimizer = accelerator.prepare(bundle.model, optimizer)
    net.train()
    vocab = bundle.model.config.vocab_size
    micro = run.micro_batch
    blocks = common.token_blocks(vocab, steps * micro * run.grad_accum, run.seq_len, seed)  # (steps * k * B, T)
    rows = [{"input_ids": ids, "labels": ids} for ids in blocks.tolist()]
    tokens_per_step = micro * run.grad_accum * run.seq_len
    tensor_peak = StepPeak(accelerator.device.type, steps)
    step_loss = TokenLoss(bundle.uses_model_loss, vocab, run.loss, activations_on_cpu=run.offload is Offload.ACTIVATIONS)
    in_backward = optimizer if run.optimizer_in_backward else None
    ends, start, earlier = [], time.perf_counter(), cuda_peaks()
    for step in range(steps):
        if step == steps - 1 and torch.cuda.is_available():
            torch.cuda.synchronize()
            earlier = cuda_peaks()  # the steps before the last one
            torch.cuda.reset_peak_memory_stats()
        first = step * run.grad_accum
        batches = [collate(rows[(first + i) * micro:(first + i + 1) * micro], pad_id=0) for i in range(run.grad_accum)]
        batches = [{k: v.to(accelerator.device) for k, v in b.items()} for b in batches]
        with tensor_peak.watch(step + 1, net, optimizer, batches):
            stepped = train_step(accelerator, net, optimizer, batches, step_loss,
                                 max_grad_norm=0.0 if run.optimizer_in_backward else 1.0, in_backward=in_backward)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    last = cuda_peaks()
    peaks = {k: (max(last[k], earlier[k] or 0) if last[k] is not None else None) for k in last}
    result = StepResult(
        tokens_per_s=common.steady_tokens_per_s(ends, start, tokens_per_step, warmup),
        max_allocated_bytes=peaks["max_allocated_bytes"], max_reserved_bytes=peaks["max_reserved_bytes"],
        last_step_max_allocated_bytes=last["max_allocated_bytes"], params=bundle.params,
        trainable_params=bundle.trainable_params, loss=stepped.loss,
        cpu_tensor_peak_bytes=tensor_peak.peak_bytes or None,
    )
    if hasattr(optimizer, "optimizer") and hasattr(optimizer.optimizer, "remove_hooks"):
        optimizer.optimizer.remove_hooks()  # optimizer-in-backward: the next run's model must not step this one
    del net, optimizer, bundle, accelerator, batches, in_backward
    free_memory()
    return result


def make_dry_run_model(folder: str | Path) -> str:
    """Save a 2-layer, hidden-64 Llama (GQA, vocab 384) with memfit's byte tokenizer into ``folder``.

    ``--dry-run`` trains and traces this instead of the GPU presets: it is a real checkpoint folder,
    so it goes through exactly the code paths a user's local model does, in seconds on one CPU core.
    """
    from transformers import LlamaConfig

    from memfit.data.dataset import byte_tokenizer

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = Path(folder)
    common.build_model(config, seed=0).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)
