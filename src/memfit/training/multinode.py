"""Training across nodes: how many the launcher started, and the 2-D device mesh of ``--sharding hybrid``.

The launcher owns the nodes: torchrun (which ``accelerate launch`` runs on several machines too) starts
``--nproc_per_node`` workers on each of ``--nnodes`` machines and exports ``GROUP_WORLD_SIZE`` (the number of
agents, one per node), ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; memfit reads them (``launched_nodes``) as it
reads the process count from the Accelerator, and ``--nodes`` must agree.

``--sharding hybrid`` is FSDP2's HSDP built by Accelerate's own ``ParallelismConfig``: ``dp_replicate_size`` =
nodes, ``dp_shard_size`` = processes per node; Accelerate builds the ``("dp_replicate", "dp_shard_cp")``
device mesh (``init_device_mesh``) and ``fsdp2_prepare_model`` passes it to ``fully_shard(mesh=...)``: each
parameter is sharded over the ranks of its node (``Shard(0)``) and replicated across nodes (``Replicate()``).
Ranks are numbered node by node (torchrun gives node ``r`` the ranks ``r x g`` to ``r x g + g - 1``), so the
mesh's rows are the nodes. On one node ``hybrid`` is ``fsdp``: no mesh is passed (FSDP2's default, every rank).
"""

from __future__ import annotations

import contextlib
import os
import warnings

from accelerate.parallelism_config import ParallelismConfig

from memfit.errors import UserError
from memfit.settings.config import RunConfig, Sharding


def launched_nodes(env=None) -> int:
    """Nodes the launcher started: torchrun's ``GROUP_WORLD_SIZE``, else ``WORLD_SIZE / LOCAL_WORLD_SIZE``, else 1."""
    env = os.environ if env is None else env
    if env.get("GROUP_WORLD_SIZE"):
        return int(env["GROUP_WORLD_SIZE"])
    if env.get("WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
        return max(int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"]), 1)
    return 1


def with_launched_nodes(run: RunConfig, num_processes: int, env=None) -> RunConfig:
    """``run`` on the ``num_processes`` ranks and the nodes the launcher started; ``--nodes`` given (not 1) must
    be that number."""
    nodes = launched_nodes(env)
    if run.nodes not in (1, nodes):
        raise UserError(f"--nodes is {run.nodes} but the launch started {nodes} node(s); start it with torchrun "
                        f"--nnodes {run.nodes} (or accelerate launch --num_machines {run.nodes}) on each node.")
    check_parallelism_env(run, nodes, env)
    return run.replace(num_processes=num_processes, nodes=nodes)


def check_parallelism_env(run: RunConfig, nodes: int, env=None) -> None:
    """An Accelerate config's ``parallelism_config`` (``accelerate launch`` exports it as
    ``PARALLELISM_CONFIG_*``; the Accelerator then builds it whenever memfit passes none) must agree with
    ``--sharding``: replicas = nodes under ``hybrid``, 1 otherwise, or the run would be laid out unlike its
    flags and its prediction."""
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return
    replicas = int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"))
    want = nodes if run.sharding is Sharding.HYBRID else 1
    if replicas != want:
        raise UserError(f"The Accelerate config sets parallelism_config_dp_replicate_size: {replicas} but --sharding "
                        f"{run.sharding} on {nodes} node(s) means {want}; make them agree (--sharding hybrid replicates "
                        "once per node, the others not at all).")


def hybrid_parallelism(run: RunConfig, env=None):
    """Accelerate's ``ParallelismConfig`` (replicas = nodes x shards = processes per node) for ``--sharding hybrid``
    on 2 or more nodes, or None (one node, or another sharding). The node count is the launch's."""
    nodes = launched_nodes(env)
    if run.sharding is not Sharding.HYBRID or nodes < 2:
        return None
    env = os.environ if env is None else env
    per_node = int(env.get("LOCAL_WORLD_SIZE", run.processes_per_node()))
    if per_node < 2:
        raise UserError(f"--sharding hybrid shards within a node, but {nodes} nodes of 1 process each leave nothing "
                        "to shard; run 2 or more processes per node, or use --sharding fsdp.")

    return ParallelismConfig(dp_replicate_size=nodes, dp_shard_size=per_node)


@contextlib.contextmanager
def quiet_mesh_slicing():
    """Accelerate's ``fsdp2_prepare_model`` slices the flattened ``dp_shard_cp`` dimension from the root mesh, which
    torch 2.13 warns will be deprecated: a notice to Accelerate's authors, not to the user (kept off the output)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        yield


def hybrid_mesh(run: RunConfig, device_type: str):
    """``(parallelism_config, device_mesh)`` for ``hybrid_parallelism``'s layout on ``device_type`` (Accelerate's
    ``build_device_mesh``: the ``dp_replicate`` x ``dp_shard`` mesh and its flattened ``dp_shard_cp``), or
    ``(None, None)``. A collective: every rank calls it."""
    config = hybrid_parallelism(run)
    if config is None:
        return None, None
    return config, config.build_device_mesh(device_type)


def launched_several_got_one(env) -> bool:
    """``accelerate launch --num_processes N`` (N > 1) that started a single process.

    On a machine without GPUs, Accelerate's launcher falls through to its simple launcher, which runs the
    script once; it still exports ``MASTER_ADDR``/``MASTER_PORT`` because N > 1 was asked
    (``accelerate.utils.launch.prepare_simple_launcher_cmd_env``), beside its own
    ``ACCELERATE_MIXED_PRECISION``. A real multi-process launch (torchrun, which Accelerate's multi-GPU,
    FSDP and DeepSpeed launchers use) exports ``WORLD_SIZE``.
    """
    return ("MASTER_ADDR" in env and "ACCELERATE_MIXED_PRECISION" in env
            and "WORLD_SIZE" not in env and "PMI_SIZE" not in env and "OMPI_COMM_WORLD_SIZE" not in env)


def refuse_one_of_several(num_processes: int, env: dict | None = None) -> None:
    """One sentence, before anything else about the launch, when ``accelerate launch`` was asked for several
    processes and started one (its simple launcher on a machine without GPUs)."""
    if num_processes == 1 and launched_several_got_one(os.environ if env is None else env):
        raise UserError("accelerate launch was asked for several processes but started one: on a machine without "
                        "GPUs it runs a single process unless told --multi_cpu; for CPU data parallelism use "
                        "`ACCELERATE_USE_CPU=true torchrun --nproc_per_node N -m memfit train ...`.")
