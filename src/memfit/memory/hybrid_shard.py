"""What one rank holds when the ranks span several nodes: the per-rank terms that the layout changes,
written out for each way of splitting the model states (``RankTerms``, ``rank_layouts``).

Across nodes the layouts differ only in *who shards with whom*:

- ``ddp``: nothing sharded; every rank keeps the whole weights, optimizer state and its gradient buckets
  (``states.ddp_bucket_bytes``), the same on 1 node as on many.
- ``fsdp`` / ``zero3`` / ``zero2`` (FSDP2 over one flat mesh, or DeepSpeed ZeRO): every state sharded over
  all ``num_processes`` ranks, on every node: a 16-rank run holds 1/16 per rank whether it is 1 node of 16
  or 2 of 8. The gathered units (a decoder layer, the [norm, head] tail) are whole on every rank while they
  compute, whatever the world size.
- ``hybrid`` (FSDP2's HSDP: ``fully_shard(mesh=init_device_mesh(..., (nodes, processes_per_node)))``, a 2-D
  mesh of replicas x shards; PyTorch FSDP paper, Zhao et al. 2023, sec. 3.2.2 "Hybrid Sharding"): states
  sharded over the ``processes_per_node`` ranks of one node and replicated across nodes, so a rank holds
  ``nodes`` times more than under full sharding (1/8 instead of 1/16 above), in exchange for gradients
  crossing nodes once per step, already sharded (an all-reduce of each unit's reduce-scatter output over
  the replica group), instead of every all-gather and reduce-scatter spanning the nodes.

The communication buffers a rank holds: DDP's buckets (resident, the size of all gradients); FSDP2's
reduce-scatter input, one unit's full-size gradients while it is reduced (``states.fsdp2_gathered``'s
``reducing``); under ``hybrid`` the cross-node all-reduce runs in place on the reduce-scatter *output*,
the unit's gradient shard, which then becomes the sharded gradient itself (torch 2.13
``_fsdp_collectives.foreach_reduce``: ``dist.all_reduce(reduce_output, group=all_reduce_group)``), so it adds
no bytes where the reduce dtype is the gradient dtype (memfit sets no separate ``reduce_dtype``).

Known error: the same as the full-shard terms of ``memory.states`` with the shard group in place of the world
(``tests/test_multinode_memory.py`` measures 2 "nodes" of CPU processes against it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memfit.memory.estimate import estimate
from memfit.memory.states import gathered_layer_bytes, model_states
from memfit.settings.config import RunConfig, Sharding
from memfit.spec.engines import replica_count, shard_group_size
from memfit.spec.model import ModelSpec

#: The layouts compared across nodes, in the order a table shows them (no offload: what the layout alone changes).
LAYOUTS = (Sharding.DDP, Sharding.FSDP, Sharding.HYBRID, Sharding.ZERO2, Sharding.ZERO3)


@dataclass(frozen=True)
class RankTerms:
    """One layout's per-rank bytes (``rank_layouts``); ``peak_bytes`` is the estimate's step peak."""

    sharding: str
    shard_group: int
    """Ranks each state is sharded over (``engines.shard_group_size``)."""
    replicas: int
    """Full copies of the states across all ranks (``engines.replica_count``)."""
    weights: int
    gradients: int
    optimizer: int
    gathered_unit: int
    """One decoder layer's parameters, whole while it computes (0 unsharded: nothing is gathered)."""
    gathered_peak: int
    """Unsharded parameters alive at once while the step computes (``ModelStates.gathered``)."""
    comm_buffers: int
    """DDP's gradient buckets, or FSDP2's reduce-scatter input beyond the gathered layers (``reducing``)."""
    peak_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def rank_terms(spec: ModelSpec, run: RunConfig, device: str = "cuda", engine: str = "fsdp2") -> RankTerms:
    """The per-rank terms of ``run`` as it is laid out (its ``sharding`` over ``num_processes`` on ``nodes``)."""
    states = model_states(spec, run, device, engine)
    sharded = run.num_processes > 1 and run.sharding is not Sharding.DDP
    peak = estimate(spec, run, device=device, engine=engine).peak_bytes
    return RankTerms(str(run.sharding), shard_group_size(run), replica_count(run), states.weights,
                     states.gradients, states.optimizer, gathered_layer_bytes(spec, run) if sharded else 0,
                     states.gathered, states.buckets or states.reducing, int(peak))


def rank_layouts(spec: ModelSpec, run: RunConfig, device: str = "cuda", engine: str = "fsdp2") -> list[RankTerms]:
    """``rank_terms`` of ``run`` under each of ``LAYOUTS`` (``hybrid`` only where it runs: 2+ nodes of 2+ ranks),
    so that full and hybrid sharding compare rank for rank on the same nodes."""
    out = []
    for sharding in LAYOUTS:
        if sharding is Sharding.HYBRID and (run.nodes < 2 or run.processes_per_node() < 2):
            continue
        out.append(rank_terms(spec, run.replace(sharding=sharding), device, engine))
    return out
