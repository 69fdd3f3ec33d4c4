"""How to launch a plan: the Accelerate config file and the exact ``accelerate launch`` command.

The config file is Accelerate's own YAML format (``accelerate config`` writes the same keys):
``distributed_type`` NO / MULTI_GPU / FSDP and, for FSDP, the ``fsdp_config`` that
``training.sharding`` checks against the flags (``fsdp_version: 2``, ``fsdp_reshard_after_forward``
from the sharding, ``fsdp_offload_params`` from ``--offload params``), so the file and the flags
printed with it always agree.
"""

from __future__ import annotations

from pathlib import Path

from memfit.files import write_text_atomic
from memfit.settings.config import Offload, RunConfig, Sharding

#: The config file name the printed command uses unless the user names another.
DEFAULT_CONFIG_FILE = "accelerate_config.yaml"


def accelerate_config(run: RunConfig) -> dict:
    """Accelerate's config for ``run`` on one machine with ``run.num_processes`` GPUs."""
    from memfit.spec.engines import reshard_after_forward

    n = run.num_processes
    distributed = "FSDP" if run.sharding is not Sharding.DDP else ("MULTI_GPU" if n > 1 else "NO")
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": distributed,
              "mixed_precision": str(run.mixed_precision), "num_machines": 1, "machine_rank": 0,
              "num_processes": n, "use_cpu": False}
    if distributed == "FSDP":
        config["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": reshard_after_forward(run),
            "fsdp_offload_params": run.offload is Offload.PARAMS,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False}
    return config


def train_flags(model: str, run: RunConfig, revision: str | None = None) -> list[str]:
    """``memfit train`` flags that reproduce ``run`` exactly (every field of ``RunConfig.to_flat``)."""
    flags = ["--model", model] + (["--revision", revision] if revision else [])
    for key, value in run.to_flat().items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [name, str(value)]
    return flags


def launch_command(model: str, run: RunConfig, config_file: str = DEFAULT_CONFIG_FILE, *,
                   revision: str | None = None) -> str:
    """The shell command that runs ``run``: ``accelerate launch --config_file FILE -m memfit train ...``
    (plain ``memfit train`` for one process without sharding). ``--data`` is the user's to add."""
    import shlex

    train = " ".join(shlex.quote(f) for f in train_flags(model, run, revision))
    if run.num_processes == 1 and run.sharding is Sharding.DDP:
        return f"memfit train {train} --data DATA"
    return f"accelerate launch --config_file {shlex.quote(config_file)} -m memfit train {train} --data DATA"


def write_accelerate_config(run: RunConfig, path: Path) -> None:
    """Write ``accelerate_config(run)`` as YAML, atomically."""
    import yaml

    text = "# Written by memfit plan; launch with the command it printed.\n"
    write_text_atomic(path, text + yaml.safe_dump(accelerate_config(run), sort_keys=False),
                      what="--accelerate-config")
