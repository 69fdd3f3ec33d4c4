"""How to launch a plan: the Accelerate config file and the exact ``accelerate launch`` command; on several
nodes one config per machine (``machine_rank``) and the torchrun line of each node (``torchrun_command``).

The config file is Accelerate's own YAML format (``accelerate config`` writes the same keys):
``distributed_type`` NO / MULTI_GPU / FSDP and, for FSDP, the ``fsdp_config`` that
``training.sharding`` checks against the flags (``fsdp_version: 2``, ``fsdp_reshard_after_forward``
from the sharding, ``fsdp_offload_params`` from ``--offload params``), so the file and the flags
printed with it always agree.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from memfit.files import write_text_atomic
from memfit.settings.config import Offload, RunConfig, Sharding
from memfit.spec.engines import reshard_after_forward

#: The config file name the printed command uses unless the user names another.
DEFAULT_CONFIG_FILE = "accelerate_config.yaml"


#: The rendezvous port the printed multi-node launches use (torchrun's and Accelerate's default).
DEFAULT_PORT = 29500
#: Stands for the first node's address in a printed multi-node launch (the user's to fill in).
MAIN_HOST = "MAIN_NODE_IP"


def accelerate_config(run: RunConfig, machine_rank: int = 0, main_ip: str = MAIN_HOST,
                      port: int = DEFAULT_PORT) -> dict:
    """Accelerate's config for ``run``: ``run.num_processes`` GPUs over ``run.nodes`` machines (Accelerate's
    ``num_processes`` counts all of them); on several, the one for ``machine_rank``, with the first machine's
    address and port as the rendezvous (``main_process_ip``/``main_process_port``, static rendezvous: machine
    ranks as given). ``--sharding hybrid`` adds Accelerate's ``parallelism_config`` (replicas x shards)."""

    n = run.num_processes
    distributed = "FSDP" if run.sharding is not Sharding.DDP else ("MULTI_GPU" if n > 1 else "NO")
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": distributed,
              "mixed_precision": str(run.mixed_precision), "num_machines": run.nodes, "machine_rank": machine_rank,
              "num_processes": n, "use_cpu": False}
    if run.nodes > 1:
        config.update(main_process_ip=main_ip, main_process_port=port, rdzv_backend="static", same_network=True)
    if run.sharding is Sharding.HYBRID and run.nodes > 1:
        config["parallelism_config"] = {"parallelism_config_dp_replicate_size": run.nodes,
                                        "parallelism_config_dp_shard_size": run.processes_per_node()}
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

    train = " ".join(shlex.quote(f) for f in train_flags(model, run, revision))
    if run.num_processes == 1 and run.sharding is Sharding.DDP:
        return f"memfit train {train} --data DATA"
    if run.nodes > 1:  # one config per machine (write_accelerate_config): the same command on each, its own file
        config_file = str(node_config_file(Path(config_file), 0, run.nodes)).replace(".node0", ".node${NODE_RANK}")
        return f'accelerate launch --config_file "{config_file}" -m memfit train {train} --data DATA'  # "": $ expands
    return f"accelerate launch --config_file {shlex.quote(config_file)} -m memfit train {train} --data DATA"


def torchrun_command(model: str, run: RunConfig, node_rank: int | str, *, main_ip: str = MAIN_HOST,
                     port: int = DEFAULT_PORT, revision: str | None = None) -> str:
    """The same run under plain torchrun on node ``node_rank`` (``--nnodes``, ``--nproc_per_node``,
    ``--node_rank``, static rendezvous at ``--rdzv-endpoint`` on the first node): memfit builds the FSDP2
    plugin (and hybrid's device mesh) from its own flags, so no Accelerate config is needed."""

    train = " ".join(shlex.quote(f) for f in train_flags(model, run, revision))
    return (f"torchrun --nnodes {run.nodes} --nproc_per_node {run.processes_per_node()} --node_rank {node_rank} "
            f"--rdzv-backend static --rdzv-endpoint {main_ip}:{port} -m memfit train {train} --data DATA")


def node_config_file(path: Path, machine_rank: int, nodes: int) -> Path:
    """Where machine ``machine_rank``'s config goes: ``path`` on one node, ``NAME.nodeR.yaml`` beside it on several."""
    return path if nodes == 1 else path.with_name(f"{path.stem}.node{machine_rank}{path.suffix or '.yaml'}")


def write_accelerate_config(run: RunConfig, path: Path) -> list[Path]:
    """Write ``accelerate_config(run)`` as YAML, atomically: one file, or one per node (``node_config_file``)."""

    text = "# Written by memfit plan; launch with the command it printed.\n"
    written = []
    for rank in range(run.nodes):
        target = node_config_file(path, rank, run.nodes)
        write_text_atomic(target, text + yaml.safe_dump(accelerate_config(run, rank), sort_keys=False),
                          what="--accelerate-config")
        written.append(target)
    return written
