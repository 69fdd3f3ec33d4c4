"""Per-rank predicted vs measured tensor peak for DDP and FSDP2 (reshard / not, offload), on CPU.

Launch it under torchrun (gloo); every rank builds the model with memfit's own builders
(``training.setup`` + ``training.sharding``), runs ``--steps`` real training steps of
``training.step.train_step`` on random tokens inside torch's memory tracker (``MemTracker``;
``FSDPMemTracker`` for FSDP2 models), and rank 0 prints one JSON line: the analytic per-rank
prediction (``memory.estimate.estimate(..., device="cpu")``) and every rank's measured peak of the
bytes tensors hold (the tracker's "Total" on the CPU device; peak over all steps, so the steady
state with optimizer state is included). Error = (predicted - measured) / measured.

Examples (2 shared cores: keep it to 1-2 steps and a short sequence)::

    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/sharding_memory.py \\
        --model smollm2-135m --sharding fsdp --seq-len 32 --steps 2
    ... --sharding zero2 / --sharding ddp / --sharding zero3 --offload params

On a multi-GPU machine the same script runs under ``accelerate launch --num_processes N`` (Accelerate's
FSDP2 plugin; the tracker then counts CUDA tensors and the prediction drops its CUDA-context term);
not yet run on GPUs.

``--dry-run`` (one process, no torchrun) checks the script's plumbing on the tiny preset: it
measures an unsharded step and prints the same JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _tracker(model, optimizer, sharded: bool):
    """torch's tracker for the step; a quantized base's quantization state (absmax, codes: attributes of
    bitsandbytes' weights, neither parameters nor buffers, made before the tracker starts) is added as
    external tensors, as ``memory.measure`` does for one process (``quant_support.quant_state_tensors``)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from memfit.integrations.quant_support import quant_state_tensors

    tracker = FSDPMemTracker(model, optimizer) if sharded else MemTracker()
    tracker.track_external(*([] if sharded else [model, optimizer]), *quant_state_tensors(model))
    return tracker


def unseen_resident_bytes(model, sharded: bool) -> int:
    """Bytes of tensors resident the whole run that ``FSDPMemTracker`` leaves out of its total: a 4-bit
    base's quantization state (module attributes, not parameters; its ``track_external`` files them under
    no FSDP category). Added to the measured peak as they are (they never change size)."""
    from memfit.integrations.quant_support import quant_state_tensors

    if not sharded:
        return 0
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in quant_state_tensors(model)}
    return sum(storages.values())


class _NoTracker:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def reset_mod_stats(self):
        pass

    def get_tracker_snapshot(self, _kind):
        return {}


def build(model_name: str, sharding_flag: str, offload: str, seq_len: int, micro_batch: int, steps: int,
          lora_r: int = 0, quantize: str = "none"):
    """memfit's own builders for one rank of a ``--sharding`` run (as ``memfit train`` builds it):
    ``(accelerator, run, model, optimizer, bundle, hf_config)``, the model sharded and prepared."""
    from memfit.settings.config import RunConfig, TrainConfig
    from memfit.spec import model as modelspec
    from memfit.spec.resolved import resolve
    from memfit.training import sharding
    from memfit.training.multinode import with_launched_nodes
    from memfit.training.setup import (
        ResolvedModel,
        build_accelerator,
        build_model,
        build_optimizer,
        build_scheduler,
    )

    run = RunConfig.of(seq_len=seq_len, micro_batch=micro_batch, grad_accum=1, optimizer="adamw",
                    sharding=sharding_flag, offload=offload, lora_r=lora_r, quantize=quantize,
                    packing="concat")  # what train_steps feeds: whole rows, unpadded: no attention mask
    config = TrainConfig.of(model=model_name, run=run, max_grad_norm=0.0, lr=1e-3)  # the lr does not move memory
    accelerator = build_accelerator(run, config)
    run = with_launched_nodes(run, accelerator.num_processes)  # torchrun --nnodes N: hybrid shards within a node
    hf_config = modelspec.resolve_config(model_name)
    hf_config.use_cache = False
    resolved = resolve(modelspec.load_spec(model_name), run)  # what build_model builds (attention, optimizer row)
    bundle = build_model(config, run, ResolvedModel(hf_config, None, True, resolved))
    model = sharding.shard_model(bundle.model, run, accelerator)
    optimizer = build_optimizer(model, run, config)
    scheduler = build_scheduler(optimizer, config, steps)
    model, optimizer, _ = sharding.prepare(accelerator, run, model, optimizer, scheduler)
    return accelerator, run, model, optimizer, bundle, hf_config


def train_steps(accelerator, run, model, optimizer, bundle, hf_config, steps: int, tracker=None,
                step_times: list | None = None) -> int:
    """``steps`` real ``memfit train`` steps on random tokens (inside ``tracker``, if any); the tokens run.
    ``step_times``, if given, receives each step's ``(wall, cpu)`` seconds of this process (CPU time is what
    the step cost this rank whatever else the machine runs; wall time includes waiting for a core).
    memfit train keeps one rollback snapshot for the whole run (training/session.py): host buffers,
    which on CPU are the device, so they count in the measured peak and in the prediction."""
    from memfit.training.rollback import OptimizerSnapshot
    from memfit.training.step import TokenLoss, train_step

    gen = torch.Generator().manual_seed(accelerator.process_index)
    tracker = tracker or _NoTracker()
    snapshot = OptimizerSnapshot()
    tokens = 0
    with tracker:
        for _ in range(steps):
            ids = torch.randint(3, hf_config.vocab_size, (run.micro_batch, run.seq_len), generator=gen)
            ids = ids.to(accelerator.device)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
            tracker.reset_mod_stats()  # MemTracker refuses a second forward of the root otherwise
            wall, cpu = time.perf_counter(), time.process_time()
            tokens += train_step(accelerator, model, optimizer, [batch],
                                 TokenLoss(bundle.uses_model_loss, hf_config.vocab_size), max_grad_norm=0.0,
                                 snapshot=snapshot).tokens
            if step_times is not None:
                step_times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return tokens


def predicted_tensor_peak(model_name: str, run, device: str):
    """memfit's per-rank prediction of the bytes tensors hold at the peak on ``device`` (``cpu``/``cuda``):
    the estimate as the device holds it (``memory.snapshot.device_estimate``: on CPU the rollback snapshot
    and offloaded state count), without the CUDA context (``other``),
    which no tensor tracker or ``max_memory_allocated`` sees. ``(bytes, breakdown)``."""
    from memfit.memory.snapshot import device_estimate
    from memfit.spec import model as modelspec

    predicted = device_estimate(modelspec.load_spec(model_name), run, device)
    return predicted.peak_bytes - predicted.other, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sharding", default="fsdp")
    parser.add_argument("--offload", default="none")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--quantize", default="none", help="none, 4bit or 8bit (QLoRA; with --lora-r)")
    parser.add_argument("--no-track", action="store_true",
                        help="Time the steps without the tracker (its dispatch hooks slow every op): tokens/s only.")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()

    from accelerate.utils import gather_object

    from memfit.spec import engines

    model_name = "tiny" if args.dry_run else args.model
    accelerator, run, model, optimizer, bundle, hf_config = build(
        model_name, "ddp" if args.dry_run else args.sharding, args.offload, args.seq_len, args.micro_batch, args.steps,
        args.lora_r, args.quantize)
    tracker = _tracker(accelerator.unwrap_model(model), getattr(optimizer, "optimizer", optimizer),
                       engines.is_sharded(run)) if not args.no_track else _NoTracker()
    t0 = time.perf_counter()
    step_times: list = []
    tokens = train_steps(accelerator, run, model, optimizer, bundle, hf_config, args.steps, tracker, step_times)
    seconds = time.perf_counter() - t0
    all_step_times = gather_object([step_times])
    peaks = tracker.get_tracker_snapshot("peak")
    device = accelerator.device.type  # on GPUs (accelerate launch) the same script checks CUDA tensors
    measured = int(sum(v.get("Total", 0) for d, v in peaks.items() if torch.device(d).type == device))
    measured += unseen_resident_bytes(accelerator.unwrap_model(model), engines.is_sharded(run))
    all_measured = gather_object([measured])
    # what the tensors at rank 0's peak were (the tracker's categories: Parameter, Gradient, Optstate, ...)
    at_peak = {str(k): int(v) for d, cats in peaks.items() if torch.device(d).type == device
               for k, v in cats.items() if k != "Total"}
    tensors_peak, predicted = predicted_tensor_peak(model_name, run, "cpu" if device == "cpu" else "cuda")
    if accelerator.is_main_process:
        worst = max(abs(tensors_peak - m) / m for m in all_measured) if all(all_measured) else None
        print(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "model": model_name, "params": bundle.params,
            "processes": accelerator.num_processes, "nodes": run.nodes, "sharding": str(run.sharding),
            "offload": str(run.offload),
            "lora_r": run.lora.r, "quantize": str(run.quantize),
            "seq_len": run.seq_len, "micro_batch": run.micro_batch, "steps": args.steps,
            "device": device, "predicted_peak_bytes": tensors_peak, "predicted_phase": predicted.phase,
            "measured_peak_bytes_per_rank": all_measured, "worst_error": worst,
            "predicted_phase_peaks": predicted.phase_peaks, "measured_at_peak_rank0": at_peak,
            # train_step's tokens are already every rank's (all-reduced for the token normalisation);
            # multiplying them by the process count again was round 2's "super-linear" 1 -> 2 -> 4 scaling
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            # per rank, per step: (wall s, this process's CPU s); the first step allocates the optimizer state
            "step_seconds_per_rank": [[[round(w, 3), round(c, 3)] for w, c in rank] for rank in all_step_times],
            "steady_tokens_per_s": (tokens / args.steps * (args.steps - 1)
                                    / max(sum(w for w, _ in rank[1:]) for rank in all_step_times))
            if args.steps > 1 else None}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
