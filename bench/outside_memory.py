"""Peaks outside the training step, per rank: predicted (``memory.outside``) vs measured on real tensors.

Launch it under torchrun (gloo) for DDP/FSDP, or as a plain script for one process. Every rank builds
the model with memfit's own builders (``bench/sharding_memory.build``), runs ``--steps`` real training
steps (``training.step.train_step`` with the rollback snapshot ``memfit train`` keeps: on CPU its host
buffers are device memory), then counts with memfit's tensor counter (``memory.measure.counted``: every
live storage, the step's resident state included) the peak of each piece of work ``memfit train`` does
outside the step, with the same functions it calls:

- ``evaluation``: ``training.step.evaluate`` over ``micro_batch`` x ranks held-out rows of ``--seq-len``
  tokens (one batch per rank);
- ``checkpoint_full``: a ``--state-dict full`` checkpoint, ``sharding.state_saver(..., "full")`` (the
  full model and optimizer state gathered on rank 0 and written; an unsharded run: Accelerate's
  ``save_state``);
- ``export``: ``sharding.gathered_model`` (rank 0: the gathered full weights loaded into a plain copy)
  and ``checkpoint.export`` (``save_pretrained``), as ``training.finish`` runs them;
- ``generation``: ``training.samples.generate_samples`` on rank 0's model (the plain copy when sharded,
  alive from the export on, as in ``finish``), 2 samples of up to ``MAX_NEW_TOKENS``.

Rank 0 prints one JSON line: each rank's measured peak per piece, the prediction (``outside_step(spec,
run, device)``), the worst error (predicted - measured) / measured, and ``memory.phases``' figure of each phase
(``predicted_phases``: the largest rank's, as ``memfit train``'s summary shows it).

Examples (2 shared cores)::

    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/outside_memory.py \\
        --model tiny --sharding fsdp --seq-len 64 --micro-batch 2
    OMP_NUM_THREADS=1 python bench/outside_memory.py --model tiny --sharding ddp     # one process
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


class _Tokenizer:
    """What ``generate_samples`` asks of a tokenizer, over the model's vocabulary (no files needed)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) % 200) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)

    def save_pretrained(self, folder):
        pass


def _rows(hf_config, run, count: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, hf_config.vocab_size, (run.seq_len,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def measure(model_name: str, sharding_flag: str, seq_len: int, micro_batch: int, steps: int) -> dict:
    """Every rank's measured peaks outside the step, and rank 0's record (``{}`` on other ranks)."""
    from accelerate.utils import broadcast_object_list, gather_object

    from memfit.data.dataset import Example, collate
    from memfit.memory.measure import counted, resident_tensors
    from memfit.memory.outside import outside_step
    from memfit.spec import engines
    from memfit.spec.model import load_spec
    from memfit.training import sharding
    from memfit.training.rollback import OptimizerSnapshot
    from memfit.training.runfolder import checkpoint
    from memfit.training.samples import generate_samples
    from memfit.training.step import TokenLoss, evaluate, train_step
    from sharding_memory import build

    accelerator, run, model, optimizer, bundle, hf_config = build(model_name, sharding_flag, "none", seq_len,
                                                                  micro_batch, steps)
    snapshot = OptimizerSnapshot()  # kept for the run, as training.session does
    buckets = _ddp_buckets(optimizer, accelerator.num_processes > 1 and not engines.is_sharded(run))
    for batch_rows in (_rows(hf_config, run, run.micro_batch, 100 * s + accelerator.process_index)
                       for s in range(steps)):
        batch = {k: v.to(accelerator.device) for k, v in collate(batch_rows, 0).items()}
        train_step(accelerator, model, optimizer, [batch], TokenLoss(bundle.uses_model_loss, hf_config.vocab_size),
                   max_grad_norm=0.0, snapshot=snapshot)
    net = accelerator.unwrap_model(model)

    def resident(*extra):
        return resident_tensors(net, optimizer, [*snapshot.buffers(), *buckets, *extra])

    peaks = {}
    rows = _rows(hf_config, run, run.micro_batch * accelerator.num_processes, 7)
    with counted(resident()) as live:
        peaks["resident"] = live.current
        evaluate(accelerator, model, rows, pad_id=0, batch_size=run.micro_batch, vocab_size=hf_config.vocab_size)
    peaks["evaluation"] = live.peak
    with tempfile.TemporaryDirectory() as tmp:
        where = broadcast_object_list([tmp])[0]  # one folder for all ranks: rank 0's
        save = sharding.state_saver(accelerator, run, model, optimizer, _NoScheduler(), "full")
        with counted(resident()) as live:
            (save or accelerator.save_state)(f"{where}/ckpt")
        peaks["checkpoint_full"] = live.peak
        accelerator.wait_for_everyone()
        with counted(resident()) as live:
            plain = sharding.gathered_model(accelerator, run, model, lambda: _plain(model_name, run)) or net
            checkpoint.export(accelerator, plain, _Tokenizer(), Path(where) / "export", merge=False, base_is_preset=True)
        peaks["export"] = live.peak
        accelerator.wait_for_everyone()
    peaks["generation"] = 0
    if accelerator.is_main_process:
        held = [] if plain is net else list(plain.parameters()) + list(plain.buffers())
        prompts = [Example(text="Once upon a time there was"), Example(text="The little dog ran home")]
        with counted(resident(*held)) as live:
            generate_samples(accelerator, plain, _Tokenizer(), prompts, count=2, seed=0,
                             max_positions=hf_config.max_position_embeddings)
        peaks["generation"] = live.peak
    per_rank = gather_object([peaks])
    if not accelerator.is_main_process:
        return {}
    spec = load_spec(model_name)
    predicted = outside_step(spec, run, device=accelerator.device.type)
    record = {"date": time.strftime("%Y-%m-%d"), "model": model_name, "params": bundle.params,
              "processes": accelerator.num_processes, "sharding": str(run.sharding), "seq_len": run.seq_len,
              "micro_batch": run.micro_batch, "steps": steps, "device": accelerator.device.type,
              "measured_per_rank": per_rank, "predicted_per_rank": predicted.per_rank(accelerator.num_processes)}
    errors = {}
    for piece in ("evaluation", "checkpoint_full", "export", "generation"):
        for rank, measured in enumerate(per_rank):
            want = record["predicted_per_rank"][rank][piece]
            if measured[piece]:
                errors[f"{piece}/rank{rank}"] = (want - measured[piece]) / measured[piece]
    record["errors"] = errors
    record["predicted_phases"] = _predicted_phases(spec, run, accelerator.device.type)
    record["worst_error"] = max((abs(e) for e in errors.values()), default=None)
    accelerator.end_training()
    return record


def _predicted_phases(spec, run, device: str) -> dict[str, int]:
    """``memory.phases``' tensor peak of each phase (the largest rank's), as ``memfit train``'s summary shows them."""
    from memfit.memory.estimate import estimate
    from memfit.memory.phases import device_phases

    phases = device_phases(spec, run, estimate(spec, run, device=device), device)
    return {p.name: int(p.tensors) for p in phases.phases}


def _ddp_buckets(optimizer, ddp: bool) -> list:
    """DDP's gradient buckets, which stay allocated in its C++ reducer between steps where no Python
    object reaches them: with ``gradient_as_bucket_view`` every ``param.grad`` is a view into a bucket, so
    the views taken just before ``zero_grad`` drops them name the buckets' storages (kept alive by the
    reducer anyway: holding them adds nothing)."""
    held: list = []
    if not ddp:
        return held
    original = optimizer.zero_grad

    def zero_grad(*args, **kwargs):
        held[:] = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return original(*args, **kwargs)

    optimizer.zero_grad = zero_grad
    return held


class _NoScheduler:
    """The full checkpoint writes a scheduler; this bench has none worth saving."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _plain(model_name: str, run):
    """The plain copy ``training.finish`` builds on rank 0: ``build_model`` of the same run."""
    from memfit.settings.config import TrainConfig
    from memfit.spec import model as modelspec
    from memfit.spec.resolved import resolve
    from memfit.training.setup import ResolvedModel, build_model

    hf_config = modelspec.resolve_config(model_name)
    source = ResolvedModel(hf_config, None, True, resolve(modelspec.load_spec(model_name), run))
    return build_model(TrainConfig.of(model=model_name, run=run), run, source).model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sharding", default="fsdp")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    record = measure(args.model, args.sharding, args.seq_len, args.micro_batch, args.steps)
    if record:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
