"""``plan_nodes``: the fastest plan over node counts, for a cluster of nodes with ``gpus_per_node`` GPUs each.

Each node count ``N`` in ``node_counts`` (1, 2, 4, ... up to ``max_nodes``, those whose ``N x gpus_per_node``
ranks divide the effective batch) is planned as ``search.plan`` plans one machine, with
``num_processes = N x gpus_per_node`` and ``nodes = N``: every candidate's memory per rank (``memory.states``:
under ``hybrid`` sharded within a node) and its step time with the traffic between nodes charged
(``planning.internode``: collectives spanning nodes at the slower of the GPU link and the node's network,
``--internode-gbs``). The node count whose best plan has the most tokens/s (the planner's score) is chosen;
a tie goes to fewer nodes. The effective batch is the same for every count, so more nodes means smaller
per-rank micro-batches or less accumulation, not more tokens per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memfit.errors import NothingFitsError, UserError
from memfit.planning.gpus import DEFAULT_INTERNODE_GBS, GPU, REFERENCE_GPU, gpu_by_name
from memfit.planning.internode import internode_seconds
from memfit.planning.search import Plan, PlanResult, plan
from memfit.settings.defaults import DEMO_MICRO_BATCH

#: Node counts tried when ``max_nodes`` is not given (powers of two up to it; the batch may stop them sooner).
DEFAULT_MAX_NODES = 8


@dataclass(frozen=True)
class NodeChoice:
    """The fastest fitting plan on ``nodes`` nodes (None: nothing fits there), and what its traffic between
    nodes costs per optimizer step beyond the GPU link."""

    nodes: int
    gpus: int
    plan: Plan | None
    internode_seconds: float = 0.0
    chosen: bool = False

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "gpus": self.gpus, "fits": self.plan is not None, "chosen": self.chosen,
                **({"plan": self.plan.to_dict(), "internode_seconds": self.internode_seconds} if self.plan else {})}


@dataclass
class NodesResult:
    """Every node count tried, and the full ``PlanResult`` of the chosen one (its table, its launch)."""

    choices: list[NodeChoice]
    result: PlanResult
    gpus_per_node: int
    internode_gbs: float
    notes: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return self.result.best.config.nodes

    def to_dict(self) -> dict:
        return {"gpus_per_node": self.gpus_per_node, "internode_gbs": self.internode_gbs, "nodes": self.nodes,
                "node_counts": [c.to_dict() for c in self.choices]}


def node_counts(max_nodes: int, gpus_per_node: int, batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_nodes`` (and ``max_nodes`` itself), keeping those whose ranks divide ``batch``."""
    if max_nodes < 1 or gpus_per_node < 1:
        raise UserError(f"--max-nodes and --gpus-per-node must be positive, got {max_nodes} and {gpus_per_node}.")
    counts, n = [], 1
    while n < max_nodes:
        counts.append(n)
        n *= 2
    counts.append(max_nodes)
    usable = [n for n in counts if batch % (n * gpus_per_node) == 0]
    if not usable:
        raise UserError(f"--batch {batch} is not divisible by {gpus_per_node} GPUs per node on any node count; "
                        f"give a --batch that is a multiple of {gpus_per_node}.")
    return usable


def default_batch(gpus_per_node: int, max_nodes: int | None = None, nodes: int | None = None) -> int:
    """The effective batch when ``--batch`` is not given: ``memfit train``'s default micro-batch
    (``DEMO_MICRO_BATCH``) on every rank of the most nodes tried, so each node count can train it (the
    one-machine default, one micro-batch a step, divides over no cluster)."""
    return DEMO_MICRO_BATCH * gpus_per_node * (nodes or max_nodes or DEFAULT_MAX_NODES)


def plan_nodes(model, budget_bytes, *, gpus_per_node: int, seq_len: int, batch: int | None,
               max_nodes: int | None = None, nodes: int | None = None, internode_gbs: float | None = None,
               gpu: GPU | str | None = None, **plan_kwargs) -> NodesResult:
    """Plan ``model`` on 1 to ``max_nodes`` nodes (or exactly ``nodes``) of ``gpus_per_node`` GPUs each with
    ``budget_bytes`` per GPU; ``plan_kwargs`` go to ``search.plan`` (constraints, margin, method, ...).
    ``batch`` None: ``default_batch``, said in the chosen plan's notes.

    Raises:
        NothingFitsError: no node count has a plan that fits (the message of the largest count tried).
    """
    bandwidth = DEFAULT_INTERNODE_GBS if internode_gbs is None else float(internode_gbs)
    if not bandwidth > 0:
        raise UserError(f"--internode-gbs must be a positive bandwidth in GB/s, got {internode_gbs}.")
    device = gpu_by_name(gpu) if isinstance(gpu, str) else gpu
    device = dataclasses.replace(device or gpu_by_name(REFERENCE_GPU), internode_gbs=bandwidth)
    defaulted = batch is None
    batch = default_batch(gpus_per_node, max_nodes, nodes) if defaulted else batch
    counts = [nodes] if nodes else node_counts(max_nodes or DEFAULT_MAX_NODES, gpus_per_node, batch)
    choices, results, last_error = [], {}, None
    for n in counts:
        try:
            result = plan(model, budget_bytes, seq_len=seq_len, batch=batch, num_processes=n * gpus_per_node,
                          nodes=n, gpu=device, **plan_kwargs)
        except NothingFitsError as err:
            choices.append(NodeChoice(n, n * gpus_per_node, None))
            last_error = err
            continue
        results[n] = result
        choices.append(NodeChoice(n, n * gpus_per_node, result.best,
                                  internode_seconds(result.spec, result.best.config, device)))
    if not results:
        raise last_error
    chosen = max(results, key=lambda n: (results[n].best.score, -n))
    choices = [dataclasses.replace(c, chosen=c.nodes == chosen) for c in choices]
    if defaulted:
        results[chosen].notes.insert(0, f"--batch not given: {batch} sequences per optimizer step on every node count "
                                        f"({DEMO_MICRO_BATCH} per rank on {batch // DEMO_MICRO_BATCH} ranks, the most "
                                        "tried).")
    return NodesResult(choices, results[chosen], gpus_per_node, bandwidth)
