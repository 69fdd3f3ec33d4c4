"""Tables for runs across nodes (rendering only): the per-rank terms of each sharding layout
(``memory.hybrid_shard.RankTerms``) and the planner's best plan per node count (``planning.nodes``)."""

from __future__ import annotations

from rich import box
from rich.table import Table

from memfit.report.fit import Col, fitted_table
from memfit.units import binary_scale


def rank_layout_table(terms: list, run, width: int = 200) -> tuple[Table, list[str]]:
    """One row per layout: shard group, replicas, what each rank holds (weights, gradients and optimizer
    shards, one gathered layer, the parameters gathered at once, the communication buffers) and the peak."""
    unit, size = binary_scale(max((t.peak_bytes for t in terms), default=0))
    cols = [Col("sharding", key=True), Col("shard over", "right", key=True), Col("replicas", "right", 1),
            Col(f"weights {unit}", "right"), Col(f"grads {unit}", "right"), Col(f"optim {unit}", "right"),
            Col(f"layer {unit}", "right", 2), Col(f"gathered {unit}", "right", 2), Col(f"comm {unit}", "right", 2),
            Col(f"peak {unit}", "right")]
    rows = [[t.sharding, f"{t.shard_group} rank{'s' if t.shard_group > 1 else ''}", str(t.replicas)]
            + [f"{getattr(t, k) / size:.2f}" for k in ("weights", "gradients", "optimizer", "gathered_unit",
                                                        "gathered_peak", "comm_buffers", "peak_bytes")]
            for t in terms]
    styles = ["bold" if t.sharding == str(run.sharding) else None for t in terms]
    title = (f"Per rank on {run.nodes} nodes x {run.processes_per_node()} processes ({run.num_processes} ranks), "
             "each sharding")
    return fitted_table(title, cols, rows, width, styles=styles, box=box.SIMPLE_HEAD, show_edge=False,
                        pad_edge=False, collapse_padding=True)


def node_count_table(rows: list, width: int = 200) -> tuple[Table, list[str]]:
    """The fastest fitting plan of each node count (``planning.nodes.NodeChoice``), the chosen one marked ``*``."""
    unit, size = binary_scale(max((r.plan.peak_bytes for r in rows if r.plan), default=0))
    cols = [Col("", "center"), Col("nodes", "right", key=True), Col("GPUs", "right", key=True),
            Col("sharding", key=True), Col("mb x acc", "right", 1), Col(f"peak {unit}", "right"),
            Col("inter-node s/step", "right", 2), Col("tokens/s", "right"), Col("per GPU", "right", 1)]
    out, styles = [], []
    for r in rows:
        if r.plan is None:
            out.append(["x", str(r.nodes), str(r.gpus), "nothing fits", "", "", "", "", ""])
            styles.append("dim")
            continue
        run = r.plan.config
        out.append(["*" if r.chosen else "", str(r.nodes), str(r.gpus), str(run.sharding),
                    f"{run.micro_batch} x {run.grad_accum}", f"{r.plan.peak_bytes / size:.2f}",
                    f"{r.internode_seconds:.3f}", f"{r.plan.tokens_per_s:,.0f}", f"{r.plan.tokens_per_s / r.gpus:,.0f}"])
        styles.append("bold green" if r.chosen else None)
    return fitted_table("Fastest plan per node count (tokens/s over all GPUs)", cols, out, width, styles=styles,
                        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
