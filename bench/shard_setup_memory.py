"""Per-rank tensor peak while a CPU FSDP run builds and shards its model (issue 13).

Under torchrun (gloo) every rank runs what ``training.session`` runs for a sharded CPU run,
``setup.build_model`` then ``sharding.shard_model``, inside memfit's tensor counter
(``memory.measure.counted``); rank 0 prints one JSON line with every rank's peak (after the build: loading; after
sharding: wrapping) and ``memory.phases``' prediction of both, the bytes of the
full model, and the largest difference between the sharded weights (gathered) and the model one process
builds with the same seed. ``--every-rank-builds`` reproduces the setup before ranks > 0 were built empty (each rank
builds the whole model, then shards it).

Example (2 shared cores)::

    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/shard_setup_memory.py --model tiny
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sharding", default="fsdp")
    parser.add_argument("--every-rank-builds", action="store_true")
    args = parser.parse_args()

    from accelerate.utils import gather_object

    from memfit.memory.measure import counted
    from memfit.settings.config import RunConfig, TrainConfig
    from memfit.spec import model as modelspec
    from memfit.spec.resolved import resolve
    from memfit.training import sharding
    from memfit.training.setup import ResolvedModel, build_accelerator, build_model

    run = RunConfig.of(seq_len=32, micro_batch=1, optimizer="adamw", sharding=args.sharding)
    config = TrainConfig.of(model=args.model, run=run)
    accelerator = build_accelerator(run, config)
    run = run.replace(num_processes=accelerator.num_processes)
    source = ResolvedModel(modelspec.resolve_config(args.model), None, True,
                           resolve(modelspec.load_spec(args.model), run))
    empty = sharding.builds_empty(accelerator, run) and not args.every_rank_builds
    with counted() as live:
        model = build_model(config, run, source, empty=empty).model
        loaded = live.peak  # the loading phase: the model built (rank 0) or built empty (the others)
        model = sharding.shard_model(model, run, accelerator)
    peaks = gather_object([live.peak])
    loading_peaks = gather_object([loaded])
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.is_main_process:
        full = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor numel is the full size
        single = build_model(config, run, source).model.state_dict()  # what one process builds (same seed)
        assert gathered.keys() == single.keys(), sorted(set(gathered) ^ set(single))
        diff = max(float((gathered[k] - single[k]).abs().max()) for k in single)
        print(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": args.model, "sharding": str(run.sharding),
                          "processes": accelerator.num_processes, "every_rank_builds": args.every_rank_builds,
                          "full_model_bytes": full, "rank0_shard_bytes": local, "setup_peak_bytes_per_rank": peaks,
                          "loading_peak_bytes_per_rank": loading_peaks, "predicted_phases": _predicted(args.model, run),
                          "max_abs_diff_vs_single_process": diff}))
    accelerator.end_training()


def _predicted(model_name: str, run) -> dict[str, int]:
    """``memory.phases``' loading and wrapping on CPU (the largest rank's: rank 0's)."""
    from memfit.memory.estimate import estimate
    from memfit.memory.phases import device_phases
    from memfit.spec.model import load_spec

    spec = load_spec(model_name)
    phases = device_phases(spec, run, estimate(spec, run, device="cpu"), "cpu")
    return {p.name: p.tensors for p in phases.phases if p.name in ("loading", "wrapping")}


if __name__ == "__main__":
    main()
