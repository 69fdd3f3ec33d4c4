"""Per-rank predicted vs measured tensor peak of a step under FSDP (1), torch's ``FullyShardedDataParallel``, on CPU.

memfit trains with FSDP2; other stacks (Accelerate's FSDP plugin before ``fsdp_version: 2``, Answer.AI's fsdp_qlora,
PEFT's FSDP examples) shard with FSDP (1)'s flat parameters, which ``estimate`` prices under ``Stack(fsdp=1)``
(``memory.flat_params``). Launched under torchrun (gloo), every rank builds the model from its transformers config,
wraps each decoder layer as a unit (``transformer_auto_wrap_policy``, as Accelerate's ``TRANSFORMER_BASED_WRAP`` and
fsdp_qlora's policy do; the root keeps the embedding, the final norm and the head) with FSDP (1)'s defaults
(``FULL_SHARD``, ``BACKWARD_PRE``, ``limit_all_gathers``, ``use_orig_params=False``; ``--no-shard``:
``ShardingStrategy.NO_SHARD``, which memfit spells ``--sharding ddp`` under ``Stack(fsdp=1)``), runs ``--steps`` steps of
``loss = model(input_ids, labels=...).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()`` on random
tokens, and counts the last step's tensor peak with memfit's own counter (``memory.measure.counted``). Rank 0
prints one JSON line: every rank's measured peak and ``estimate(..., device="cpu", stack=Stack(fsdp=1))``'s.

    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/fsdp1_memory.py --model DIR
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json

import torch


def build(model_name: str, seq_len: int, micro_batch: int, lora_r: int = 0, no_shard: bool = False,
          orig_params: bool = False, accumulate: int = 1):
    """The run, its spec and the model wrapped by FSDP (1) on this rank (CPU, gloo): ``(run, spec, model)``.
    ``lora_r``: LoRA adapters put on by memfit's own builder (``builder.parts.adapt``) and wrapped with PEFT's
    ``fsdp_auto_wrap_policy`` (each trainable LoRA matrix a unit of its own, as PEFT's FSDP examples and fsdp_qlora).
    ``no_shard``: ``ShardingStrategy.NO_SHARD`` (fsdp_qlora's ``--sharding_strategy no_shard``).
    ``orig_params``: the adapters stay inside their layer's unit, wrapped with ``use_orig_params=True`` (Lightning
    Fabric's ``FSDPStrategy`` default with litgpt's ``auto_wrap_policy={Block}``). ``accumulate``: micro-batches per
    step (the run's ``grad_accum``)."""
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM

    from memfit.builder.parts import adapt
    from memfit.settings.config import RunConfig
    from memfit.spec import model as modelspec
    from memfit.spec.resolved import resolve

    run = RunConfig.of(seq_len=seq_len, micro_batch=micro_batch, grad_accum=accumulate, optimizer="adamw",
                       sharding="ddp" if no_shard else "fsdp",
                       num_processes=torch.distributed.get_world_size(), packing="concat", lora_r=lora_r)
    spec = modelspec.load_spec(model_name)
    resolved = resolve(spec, run, "cpu")  # the attention estimate prices, so the step runs that one
    config = modelspec.resolve_config(model_name)
    config.use_cache = False
    torch.manual_seed(0)  # every rank starts from the same weights
    model = AutoModelForCausalLM.from_config(config, attn_implementation=resolved.attention)
    layer_classes = {type(layer) for layer in model.model.layers}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes)
    if lora_r:
        model = adapt(model, resolved.run, resolved.lora.names)
        if not orig_params:
            policy = fsdp_auto_wrap_policy(model)
    strategy = ShardingStrategy.NO_SHARD if no_shard else ShardingStrategy.FULL_SHARD
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, sharding_strategy=strategy,
                                       device_id=torch.device("cpu"), use_orig_params=orig_params)
    return resolved.run, spec, wrapped


def measured_peaks(model, vocab_size: int, run, steps: int) -> list[int]:
    # ``run.grad_accum`` micro-batches a step, all but the last under ``no_sync`` (as Accelerate's ``accumulate``,
    # Lightning Fabric's ``no_backward_sync`` and litgpt's loop run them)
    """The tensor peak of each step from the third on (the first creates AdamW's state), counted by memfit's counter
    from what is resident when it starts (the flat shards, the optimizer state, the batch).

    On gloo a step's peak is not always the same: the process group's worker thread may let go of a unit's
    reduce-scatter input only after the next unit's gradient is made (seen: the first layer's flat gradient, 726,016
    B, still counted at the root's concatenation on one rank in some steps). On CUDA the caching allocator counts a
    freed tensor free at once (``record_stream`` only delays its reuse), so the smallest steady step is the figure
    the estimate's tensor peak stands for; every step's is printed."""
    from memfit.memory.measure import counted, resident_tensors

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # on CPU: torch's single-tensor loop
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    peaks = []
    for _ in range(steps):
        batches = []
        for _ in range(run.grad_accum):
            ids = torch.randint(3, vocab_size, (run.micro_batch, run.seq_len), generator=gen)
            batches.append({"input_ids": ids, "labels": ids.clone()})  # whole rows, no mask: packing concat
        held = [t for batch in batches for t in batch.values()]
        with counted(resident_tensors(model, optimizer, held)) as live:
            for i, batch in enumerate(batches):
                with model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                    model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks.append(live.peak)
    return peaks[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a preset, or a folder with a transformers config.json")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--no-shard", action="store_true", help="ShardingStrategy.NO_SHARD (default: FULL_SHARD)")
    parser.add_argument("--orig-params", action="store_true",
                        help="LoRA inside each layer's unit with use_orig_params=True (litgpt's Fabric FSDP)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches a step, the first ones under no_sync")
    args = parser.parse_args()

    import torch.distributed as dist
    from accelerate import PartialState

    from memfit.memory.estimate import estimate
    from memfit.settings.stack import Stack

    state = PartialState()  # the process group (gloo under ACCELERATE_USE_CPU), as the other benches start it
    run, spec, model = build(args.model, args.seq_len, args.micro_batch, args.lora_r, args.no_shard, args.orig_params,
                             args.accumulate)
    measured = measured_peaks(model, spec.vocab_size, run, args.steps)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, measured)
    if dist.get_rank() == 0:
        predicted = estimate(spec, run, device="cpu", stack=Stack(fsdp=1, lora_in_layer_units=args.orig_params))
        fsdp2 = estimate(spec, run, device="cpu")
        print(json.dumps({"model": args.model, "processes": dist.get_world_size(), "seq_len": run.seq_len,
                          "micro_batch": run.micro_batch, "steps": args.steps,
                          "measured_peak_bytes_per_rank": [min(rank) for rank in everyone],
                          "measured_step_peaks_per_rank": everyone, "predicted_peak_bytes": predicted.peak_bytes,
                          "predicted_phase": predicted.phase, "predicted_phase_peaks": predicted.phase_peaks,
                          "fsdp2_predicted_peak_bytes": fsdp2.peak_bytes}))
    state.destroy_process_group()


if __name__ == "__main__":
    main()
