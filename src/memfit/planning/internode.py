"""Collective traffic of one optimizer step and its seconds, on one node or across several (``comm_seconds``).

**Volumes** (per rank, ring algorithms: a reduce-scatter or an all-gather of ``S`` bytes over ``n`` ranks sends
``(n-1)/n x S`` from each rank, an all-reduce twice that; Patarasuk & Yuan 2009, the ring all-reduce NCCL
runs; ``W`` the weights at the compute dtype, ``G`` the trainable gradients, ``k`` micro-batches per step):

- ``ddp``: one all-reduce of ``G`` per step over all ranks (Accelerate's ``accumulate`` skips the sync in between);
- ``zero2``: a reduce-scatter of ``G`` per micro-batch and an all-gather of ``W`` after the step, over all ranks;
- ``fsdp`` / ``zero3``: per micro-batch, ``W`` all-gathered for forward and again for backward and ``G``
  reduce-scattered, over all ranks;
- ``hybrid`` (FSDP2's HSDP): the ``fsdp`` collectives over the ranks of one node only, plus per micro-batch an
  all-reduce across nodes of each rank's gradient shard ``G / g`` over the ``nodes`` replicas (PyTorch FSDP
  paper, Zhao et al. 2023, sec. 3.2.2; torch 2.13 ``_fsdp_collectives.foreach_reduce``).

**Bandwidths.** Within a node a collective runs at the GPU-to-GPU link (``GPU.link_gbs``). Across nodes,
NCCL runs one ring per channel and each ring crosses every node boundary once, so a node's network
interfaces together carry what one rank sends to its ring neighbour: a collective over ranks on several
nodes takes ``volume / min(link, node)`` with ``node`` the node's aggregate inter-node bandwidth (NCCL's
"bus bandwidth", nccl-tests ``doc/PERFORMANCE.md``: measured across nodes it approaches the node's
network bandwidth). HSDP's cross-node all-reduce: the node's ``g`` ranks each all-reduce their own shard
at once over the same interfaces, ``g x 2 (R-1)/R x G/g = 2 (R-1)/R x G`` per node, at ``node``.

Ignored: latency (``alpha`` terms: a few microseconds per collective hop, noticeable only for tiny
messages), overlap of communication with compute (FSDP2 prefetches: the real step hides part of it, so
these seconds are an upper bound), SHARP/NVLS in-network reduction. Known error: untested against a
multi-node run here; it ranks layouts, and the ranking follows the volume and the slower link.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.planning.gpus import GPU
from memfit.settings.config import RunConfig, Sharding
from memfit.units import GB, dtype_bytes

#: Fraction of a link's datasheet bandwidth that large ring collectives reach (NCCL's bus bandwidth in nccl-tests
#: is typically 75-90% of it for messages of hundreds of MB: the layers' all-gathers and reduce-scatters here).
COLLECTIVE_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Traffic:
    """Bytes per rank per optimizer step, by where they travel."""

    local: float
    """Collectives within one node (the GPU link)."""
    spanning: float
    """Collectives over ranks on several nodes (the slower of the GPU link and the node's network)."""
    cross: float
    """HSDP's all-reduce across nodes, per node (the node's network)."""


def gradient_bytes(run: RunConfig) -> int:
    """Bytes per gradient element: the weights' dtype, fp32 for LoRA adapters (PEFT's default)."""
    return 4 if run.is_lora() else dtype_bytes(run.dtype)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_traffic(spec, run: RunConfig, grad_bytes: float) -> Traffic:
    """The per-rank collective volumes of one optimizer step (the module docstring's list)."""
    n, k = run.num_processes, run.grad_accum
    grads = spec.trainable_params(run) * grad_bytes
    weights = spec.params * (2 if run.compute_dtype() in ("bf16", "fp16") else 4)
    if run.sharding is Sharding.DDP:
        moved = 2 * _ring(n) * grads
    elif run.sharding is Sharding.ZERO2:
        moved = k * _ring(n) * grads + _ring(n) * weights
    elif run.sharding is Sharding.HYBRID and run.nodes > 1:
        g, replicas = run.processes_per_node(), run.nodes
        local = k * _ring(g) * (2 * weights + grads)
        return Traffic(local=local, spanning=0.0, cross=k * 2 * _ring(replicas) * grads)
    else:  # fsdp / zero3 (and hybrid on one node, which is fsdp)
        moved = k * _ring(n) * (2 * weights + grads)
    return Traffic(0.0, moved, 0.0) if run.nodes > 1 else Traffic(moved, 0.0, 0.0)


def internode_bytes_per_s(gpu: GPU) -> float:
    return gpu.internode_gbs * GB * COLLECTIVE_EFFICIENCY


def comm_seconds(spec, run: RunConfig, gpu: GPU, grad_bytes: float) -> float:
    """Collective seconds per optimizer step (0 for one process): ``step_traffic`` over its bandwidths."""
    if run.num_processes == 1:
        return 0.0
    t = step_traffic(spec, run, grad_bytes)
    link = gpu.bytes_per_s("link") * COLLECTIVE_EFFICIENCY
    node = internode_bytes_per_s(gpu)
    return t.local / link + t.spanning / min(link, node) + t.cross / node


def internode_seconds(spec, run: RunConfig, gpu: GPU) -> float:
    """Of ``comm_seconds``, what the traffic between nodes costs beyond the GPU link (0 on one node): the
    spanning collectives' time at the node's network less their time at the link, plus HSDP's cross-node all-reduce."""
    if run.nodes < 2:
        return 0.0
    t = step_traffic(spec, run, gradient_bytes(run))
    link = gpu.bytes_per_s("link") * COLLECTIVE_EFFICIENCY
    node = internode_bytes_per_s(gpu)
    return t.spanning / min(link, node) - t.spanning / link + t.cross / node
