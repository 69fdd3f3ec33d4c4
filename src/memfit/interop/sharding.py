"""How a file's run is spread over processes: a DeepSpeed config (its ZeRO stage and offload), Trainer's ``fsdp``
option, and the Accelerate config a launch command in the file's comments names (shared by the readers)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memfit.files import user_path
from memfit.interop.common import Keys, load_file
from memfit.settings.stack import TRAINERS
from memfit.settings.zero3 import KEYS as ZERO3_KEYS
from memfit.settings.zero3 import Coordinator


def deepspeed(keys: Keys, key: str = "deepspeed") -> dict[str, Any]:
    """Sharding and offload from a DeepSpeed config (a dict, or a JSON file beside the config or by path).

    ZeRO-1 shards only the optimizer state, which memfit has no setting for: priced as ZeRO-2 (gradients
    sharded too) would understate it, so it is priced as DDP (replicated) with a sentence."""
    value = keys.get(key)
    if value is None:
        return {}
    config = value
    if isinstance(value, str):
        found = [p for p in (Path(keys.path).parent / value, user_path(value)) if p.is_file()]
        if not found:
            named = re.search(r"z(?:ero)?[_-]?([0-3])(?![0-9])", Path(value).name.lower())  # ds_z3_config, zero2
            stage = int(named.group(1)) if named else None
            if stage is None:
                keys.not_mapped(key, f"{value} is not found here and its name gives no ZeRO stage; priced without "
                                "DeepSpeed (replicated states: an upper bound).")
                return {}
            keys.price(f"{key}: {value} is not found here; its name reads as ZeRO-{stage}, without offload.")
            config = {"zero_optimization": {"stage": stage}}
        else:
            config = load_file(found[0])
    if not isinstance(config, dict):
        raise keys.error(key, f"{value!r} is neither a DeepSpeed config file nor a mapping.")
    return deepspeed_mapping(keys, key, config)


def deepspeed_mapping(keys: Keys, key: str, config: dict) -> dict[str, Any]:
    """Sharding and offload of a DeepSpeed config's ``zero_optimization`` (``key``: where the file set it)."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise keys.error(key, f"zero_optimization.stage {stage!r} is not 0, 1, 2 or 3.")
    out: dict[str, Any] = {}
    if stage == 0:
        keys.price(f"{key}: DeepSpeed ZeRO-0 shards nothing; priced replicated (DDP).")
    if stage == 1:
        keys.not_mapped(key, "ZeRO-1 shards only the optimizer state, which memfit cannot express; priced as "
                        "replicated (DDP), an upper bound by the sharded part of the optimizer state.")
    elif stage in (2, 3):
        out["sharding"] = f"zero{stage}"
        keys.engine = "deepspeed"
        keys.price(f"{key}: DeepSpeed ZeRO-{stage}, estimated with memfit's DeepSpeed layout (flat buffers, an fp32 "
                   "master partition, buckets at Accelerate's 'auto' sizes: memory/deepspeed_layout.py).")
    if stage == 3 and TRAINERS[keys.stack.get("trainer", "memfit")].zero3_init:
        coordinator = Coordinator.of(zero) if any(name in zero for name in ZERO3_KEYS) else Coordinator()
        keys.stack["zero3"] = coordinator.as_dict()
        keys.price(f"{key}: transformers builds the model under deepspeed.zero.Init, so ZeRO-3 gathers parameters as "
                   f"they are used and keeps what its coordinator allows ({coordinator.describe()}).")
    device = lambda part: str((zero.get(part) or {}).get("device", "none")).lower()  # noqa: E731
    if device("offload_param") in ("cpu", "nvme"):
        out["offload"] = "params"
    elif device("offload_optimizer") in ("cpu", "nvme"):
        out["offload"] = "optimizer"
    return out


def accelerate_launch(keys: Keys) -> dict[str, Any]:
    """Sharding and offload from the Accelerate config that a launch command in the file's comments names
    (``accelerate launch --config_file examples/accelerate/fsdp2_config.yaml src/train.py THIS_FILE``, resolved
    beside the file or from the working folder, as the tools' READMEs run it from their repository's root): its
    ``distributed_type`` (FSDP, DeepSpeed or DDP), ``fsdp_config`` and ``num_processes`` (Accelerate's
    ``utils/dataclasses.py`` ``FullyShardedDataParallelPlugin`` reads the same keys)."""
    try:
        text = user_path(keys.path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    comments = " ".join(line.split("#", 1)[1] for line in text.splitlines() if line.lstrip().startswith("#"))
    named = re.search(r"\baccelerate launch\b.*?--config[_-]file[ =]+(\S+\.ya?ml)", comments)
    found = [p for p in (Path(keys.path).parent / named.group(1), user_path(named.group(1))) if p.is_file()] if named \
        else []
    if not found:
        return {}
    config, where = load_file(found[0]), named.group(1)
    keys.processes_from(config.get("num_processes"), f"{where} (the Accelerate config its launch command names)")
    kind = str(config.get("distributed_type", "")).upper()
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        zero = {"stage": ds.get("zero_stage", 0),
                "offload_param": {"device": ds.get("offload_param_device", "none")},
                "offload_optimizer": {"device": ds.get("offload_optimizer_device", "none")}}
        return deepspeed_mapping(keys, where, {"zero_optimization": zero})
    if kind != "FSDP":
        return {}
    fsdp_config = config.get("fsdp_config") or {}
    version = int(fsdp_config.get("fsdp_version", 1))
    if version == 1:
        keys.stack["fsdp"] = 1
        if fsdp_config.get("fsdp_cpu_ram_efficient_loading") is True:
            keys.stack["low_memory_loading"] = True
    strategy = str(fsdp_config.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    reshard = fsdp_config.get("fsdp_reshard_after_forward", True)
    out: dict[str, Any] = {"sharding": "zero2" if "SHARD_GRAD_OP" in strategy or strategy == "2" or reshard is False
                           else "ddp" if "NO_SHARD" in strategy else "fsdp"}
    if fsdp_config.get("fsdp_offload_params") is True:
        out["offload"] = "params"
    if fsdp_config.get("fsdp_activation_checkpointing") is True:  # every decoder layer recomputed in backward
        out["grad_checkpointing"] = True
        keys.price(f"{where}: fsdp_activation_checkpointing recomputes each decoder layer in backward; priced as "
                   "gradient checkpointing.")
    keys.price(f"{where}: the launch command's Accelerate config runs FSDP{' (1)' if version == 1 else '2'}, "
               f"priced as memfit's {out['sharding']}{' with the parameters offloaded' if 'offload' in out else ''}.")
    return out


def fsdp(keys: Keys, key: str = "fsdp") -> dict[str, Any]:
    """Sharding and offload from Trainer's ``fsdp`` option string/list (``full_shard auto_wrap offload``)."""
    value = keys.get(key)
    if not value:
        return {}
    words = value.split() if isinstance(value, str) else value if isinstance(value, list) else None
    if words is None or not all(isinstance(w, str) for w in words):
        raise keys.error(key, f"{value!r} is not a list of FSDP options (full_shard, shard_grad_op, offload, ...).")
    words = [w.lower() for w in words]
    out: dict[str, Any] = {}
    if "full_shard" in words or "hybrid_shard" in words:
        out["sharding"] = "fsdp"
    elif "shard_grad_op" in words or "hybrid_shard_zero2" in words:
        out["sharding"] = "zero2"
    else:
        keys.not_mapped(key, f"{value!r} names no sharding strategy memfit knows; priced replicated (DDP).")
    if "offload" in words:
        out["offload"] = "params"
    return out


def ray_workers(keys: Keys, switch: str | None) -> None:
    """``ray_num_workers``: the training workers Ray starts, one GPU each (Axolotl with ``use_ray: true``;
    LLaMA-Factory's Ray launch, ``switch`` None, reads it whenever the file sets it)."""
    if switch is not None and not keys.bool(switch, False):
        return
    keys.processes_from(keys.get("ray_num_workers"), "ray_num_workers (Ray's training workers, one GPU each)")
