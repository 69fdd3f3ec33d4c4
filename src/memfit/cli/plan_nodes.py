"""``memfit plan`` across nodes: its flags read into ``memfit.plan_nodes``'s arguments, and what it prints
(the node counts tried, the chosen count, each node's launch). Rendering only; the search is ``planning.nodes``."""

from __future__ import annotations

import click
from rich.console import Console

import memfit
from memfit.errors import UserError
from memfit.report.node_tables import node_count_table
from memfit.report.runs import shell_lines


def cluster_shape(nodes: int, num_processes: int, gpus_per_node: int | None, max_nodes: int | None,
                  internode_gbs: float | None, maximize: str | None) -> dict | None:
    """``memfit.plan_nodes``'s keyword arguments, or None to plan one machine as before: with
    ``--gpus-per-node`` (node counts searched, or exactly ``--nodes``), or ``--nodes N`` > 1 with
    ``--num-processes`` counting the ranks of all N."""
    if not gpus_per_node and nodes == 1:
        if max_nodes or internode_gbs is not None:
            raise UserError("--max-nodes and --internode-gbs plan across nodes; add --gpus-per-node (or --nodes).")
        return None
    if maximize:
        raise UserError("--maximize plans one machine; drop --gpus-per-node/--nodes, or --maximize.")
    if not gpus_per_node:
        if num_processes % nodes:
            raise UserError(f"--num-processes {num_processes} is not a multiple of --nodes {nodes}: each node runs "
                            "the same number of processes.")
        gpus_per_node = num_processes // nodes
    return {"gpus_per_node": gpus_per_node, "max_nodes": max_nodes, "nodes": nodes if nodes > 1 else None,
            "internode_gbs": internode_gbs}


def node_payload(across, model: str, revision: str | None) -> dict:
    """``--json``'s additions: every node count tried, and each node's Accelerate config and torchrun line."""

    run = across.result.best.config
    return {"nodes": across.to_dict(),
            "launch_per_node": [{"machine_rank": r, "accelerate_config": memfit.accelerate_config(run, r),
                                 "torchrun": memfit.torchrun_command(model, run, r, revision=revision)}
                                for r in range(run.nodes)]}


def print_nodes(across) -> None:
    """The table of node counts and the sentence that answers "how many nodes"."""
    console = Console()
    if len(across.choices) > 1:
        table, _ = node_count_table(across.choices, console.width)
        console.print(table)
    run = across.result.best.config
    console.print(f"Nodes: the fastest plan needs {run.nodes} node(s) of {run.processes_per_node()} GPUs "
                  f"({run.num_processes} GPUs, {run.sharding}); traffic between nodes charged at "
                  f"{across.internode_gbs:g} GB/s per node (--internode-gbs).", highlight=False)


def print_node_launch(across, model: str, revision: str | None) -> None:
    """Each node's torchrun line (the alternative to ``accelerate launch`` with its per-node config)."""

    run = across.result.best.config
    if run.nodes < 2:
        return
    click.echo(f"Or with torchrun on each of the {run.nodes} nodes, NODE_RANK 0 on the first\n"
               f"(its address replaces {memfit.MAIN_HOST}):")
    click.echo(shell_lines(memfit.torchrun_command(model, run, "${NODE_RANK}", revision=revision)))
