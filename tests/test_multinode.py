"""Runs across nodes (issue 39): the per-rank terms of each sharding on several nodes, the inter-node cost model,
the plan over node counts with its per-node launch, and (slow) two torchrun "nodes" on this host training the
demo under FSDP2 hybrid (HSDP) and full sharding, resumed on one node, per-rank tensor peaks against the
prediction. Golden numbers are worked out next to each test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from _gloo_cases import TRAIN_ARGS
from _launch_helpers import gloo_launch, last_json_line, node_launch
from _train_helpers import max_diff, metrics, tiny_config, write_qa
from memfit.cli import cli
from memfit.errors import UserError
from memfit.memory.hybrid_shard import rank_layouts
from memfit.memory.states import model_states
from memfit.planning import launch
from memfit.planning.gpus import gpu_by_name
from memfit.planning.internode import comm_seconds, step_traffic
from memfit.planning.nodes import node_counts, plan_nodes
from memfit.settings.config import RunConfig
from memfit.spec.engines import refusal
from memfit.spec.model import load_spec
from memfit.training import multinode, sharding
from memfit.training.loop import run_training

SEVENTY_B = 70_553_706_496  # llama-3.1-70b's parameters (presets/architectures.yaml, checked by test_modelspec)


def _run(**kw) -> RunConfig:
    return RunConfig.of(seq_len=1024, micro_batch=1, dtype="bf16", grad_checkpointing=True, **kw)


# --- the per-rank terms ----------------------------------------------------------------------------------------
def test_hybrid_shards_over_one_node_and_full_shard_over_all_nodes():
    spec = load_spec("llama-3.1-70b")
    run = _run(num_processes=16, nodes=2)
    terms = {t.sharding: t for t in rank_layouts(spec, run)}
    assert list(terms) == ["ddp", "fsdp", "hybrid", "zero2", "zero3"]
    # pure bf16 full fine-tune: 2 B of weights per parameter (and the fp32 rotary buffer), sharded over 16 or 8
    assert terms["fsdp"].weights == (2 * SEVENTY_B + spec.buffer_bytes) // 16 and terms["fsdp"].shard_group == 16
    assert terms["hybrid"].weights == (2 * SEVENTY_B + spec.buffer_bytes) // 8 and terms["hybrid"].shard_group == 8
    assert (terms["hybrid"].replicas, terms["fsdp"].replicas, terms["ddp"].replicas) == (2, 1, 16)
    assert terms["hybrid"].optimizer == 2 * terms["fsdp"].optimizer  # a node holds a whole copy: twice the shard
    # the gathered unit is one decoder layer whole, whatever the shard group: (70,553,706,496 - 2 x 128,256 x 8,192
    # embedding and head) // 80 layers = 855,654,502 parameters (855,654,400 of a layer and 102 of the final
    # norm, which memory.states spreads over the layers) x 2 B
    assert terms["hybrid"].gathered_unit == terms["fsdp"].gathered_unit == 855_654_502 * 2
    assert terms["ddp"].comm_buffers == 2 * SEVENTY_B  # DDP's buckets: all the bf16 gradients
    assert terms["hybrid"].peak_bytes > terms["fsdp"].peak_bytes


def test_full_sharding_per_rank_is_the_same_on_two_nodes_of_8_as_on_one_node_of_16():
    spec = load_spec("llama-3.1-70b")
    for sharding_name in ("fsdp", "zero2", "zero3"):
        one, two = (model_states(spec, _run(num_processes=16, nodes=n, sharding=sharding_name)) for n in (1, 2))
        assert one == two


def test_hybrid_on_one_node_is_full_shard():
    spec = load_spec("llama-3.1-70b")
    assert model_states(spec, _run(num_processes=8, sharding="hybrid")) == model_states(
        spec, _run(num_processes=8, sharding="fsdp"))


def test_hybrid_needs_two_processes_per_node_and_nodes_divide_the_processes():
    assert "leave nothing to shard" in refusal(_run(num_processes=2, nodes=2, sharding="hybrid"), cuda=True)
    assert refusal(_run(num_processes=4, nodes=2, sharding="hybrid"), cuda=True) is None
    with pytest.raises(UserError, match="is not a multiple of --nodes 2"):
        _run(num_processes=3, nodes=2)


# --- the cost model --------------------------------------------------------------------------------------------
def test_inter_node_traffic_by_hand():
    spec = load_spec("llama-3.1-70b")
    bf16_weights = 2 * SEVENTY_B  # W: the weights at the compute dtype; G (gradients) the same here
    full = step_traffic(spec, _run(num_processes=16, nodes=2, sharding="fsdp"), 2)
    # fsdp over 16 ranks on 2 nodes: per micro-batch 2 all-gathers of W and 1 reduce-scatter of G, 15/16 each
    assert full.spanning == pytest.approx(15 / 16 * 3 * bf16_weights) and full.local == full.cross == 0
    hybrid = step_traffic(spec, _run(num_processes=16, nodes=2, sharding="hybrid"), 2)
    # hybrid: the same within a node of 8 (7/8), and an all-reduce of the gradients across 2 replicas: 2 x 1/2 x G
    assert hybrid.local == pytest.approx(7 / 8 * 3 * bf16_weights)
    assert hybrid.cross == pytest.approx(bf16_weights) and hybrid.spanning == 0
    gpu = gpu_by_name("h100-sxm")
    # across nodes the slower network decides: at 50 GB/s (x 0.8) fsdp's 3 x 15/16 x 141.1 GB take 9.92 s per
    # micro-batch, hybrid's 141.1 GB across nodes 3.53 s plus its 3 x 7/8 x 141.1 GB over NVLink (450 GB/s) 0.82 s
    assert comm_seconds(spec, _run(num_processes=16, nodes=2, sharding="fsdp"), gpu, 2) == pytest.approx(
        15 / 16 * 3 * bf16_weights / 40e9)
    assert comm_seconds(spec, _run(num_processes=16, nodes=2, sharding="hybrid"), gpu, 2) == pytest.approx(
        bf16_weights / 40e9 + 7 / 8 * 3 * bf16_weights / (gpu.link_gbs * 0.8e9))


def test_node_counts_keep_the_batch_exact():
    assert node_counts(8, 8, 64) == [1, 2, 4, 8]
    assert node_counts(8, 8, 16) == [1, 2]  # 4 x 8 ranks cannot split 16 sequences
    with pytest.raises(UserError, match="not divisible by 8 GPUs per node"):
        node_counts(4, 8, 12)


def test_plan_answers_a_node_count_for_a_70b_full_fine_tune():
    from memfit.planning.space import Constraints

    result = plan_nodes("llama-3.1-70b", "80GiB", gpus_per_node=8, seq_len=1024, batch=64,
                        constraints=Constraints(full=True, allow_offload=False))
    counts = {c.nodes: c for c in result.choices}
    assert list(counts) == [1, 2, 4, 8]
    best = result.result.best.config
    # the chosen count is the fastest plan's (tokens/s over all GPUs), and it is not one node: one node fits
    # (pure bf16 + 8-bit AdamW, 6 B/param = 52.9 GB per GPU of 8) but runs 8 GPUs, not 16 or more
    assert result.result.best.score == max(c.plan.score for c in result.choices if c.plan)
    assert counts[1].plan is not None and result.nodes > 1
    assert best.nodes == result.nodes and best.num_processes == 8 * best.nodes
    assert sum(c.chosen for c in result.choices) == 1 and counts[result.nodes].chosen
    assert all(c.plan.fits for c in result.choices if c.plan)
    # on 2+ nodes the traffic between them is charged: more than nothing
    assert all(c.internode_seconds > 0 for c in result.choices if c.plan and c.nodes > 1)


def test_plan_cli_prints_the_node_count_and_each_nodes_launch(tmp_path):
    config = tmp_path / "acc.yaml"
    out = CliRunner().invoke(cli, ["plan", "llama-3.1-70b", "--budget", "80GiB", "--gpus-per-node", "8", "--full",
                                    "--batch", "64", "--seq-len", "1024", "--no-offload", "--accelerate-config", str(config),
                                    "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output)
    nodes = payload["nodes"]["nodes"]
    assert nodes >= 2
    per_node = payload["launch_per_node"]
    assert [p["machine_rank"] for p in per_node] == list(range(nodes))
    assert all(p["accelerate_config"]["num_machines"] == nodes for p in per_node)
    assert f"--nnodes {nodes} --nproc_per_node 8 --node_rank 1 " in per_node[1]["torchrun"]
    assert "--rdzv-endpoint MAIN_NODE_IP:29500" in per_node[1]["torchrun"]
    # accelerate launch: the same line on every node, each reading its own file
    assert payload["launch"].startswith(f'accelerate launch --config_file "{tmp_path}/acc.node${{NODE_RANK}}.yaml" -m ')
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == [f"acc.node{r}.yaml" for r in range(nodes)]


def test_accelerate_config_per_node_holds_the_rendezvous_and_the_hybrid_mesh():
    run = _run(num_processes=16, nodes=2, sharding="hybrid")
    config = launch.accelerate_config(run, machine_rank=1, main_ip="10.0.0.1", port=29600)
    assert (config["num_machines"], config["machine_rank"], config["num_processes"]) == (2, 1, 16)
    assert (config["main_process_ip"], config["main_process_port"]) == ("10.0.0.1", 29600)
    assert config["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                            "parallelism_config_dp_shard_size": 8}
    assert "main_process_ip" not in launch.accelerate_config(_run(num_processes=8))


def test_estimate_prints_per_rank_memory_of_full_and_hybrid_sharding_across_nodes():
    out = CliRunner().invoke(cli, ["estimate", "llama-3.1-70b", "--num-processes", "16", "--nodes", "2",
                                    "--sharding", "hybrid", "--dtype", "bf16", "--grad-checkpointing",
                                    "--micro-batch", "1", "--seq-len", "1024"], terminal_width=160)
    assert out.exit_code == 0, out.output
    assert "Per rank on 2 nodes x 8 processes (16 ranks)" in out.output
    for row in ("fsdp ", "hybrid ", "8 ranks", "16 ranks"):
        assert row in out.output


def test_no_tool_config_is_written_for_hybrid_sharding():
    from memfit.interop import realize

    run = _run(num_processes=16, nodes=2, sharding="hybrid", lora_r=16)
    assert realize("trl")(run) is None and realize("trl")(run.replace(sharding="fsdp")) is not None


# --- the launch's nodes ----------------------------------------------------------------------------------------
def test_nodes_come_from_the_launch():
    env = {"GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert multinode.launched_nodes(env) == 2
    assert multinode.launched_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}) == 4
    assert multinode.launched_nodes({}) == 1
    run = multinode.with_launched_nodes(RunConfig.of(sharding="hybrid"), 4, env)
    assert (run.num_processes, run.nodes, run.processes_per_node()) == (4, 2, 2)
    with pytest.raises(UserError, match="--nodes is 4 but the launch started 2 node"):
        multinode.with_launched_nodes(RunConfig.of(nodes=4), 4, env)


def test_an_accelerate_parallelism_config_must_agree_with_the_sharding():
    # what `accelerate launch` exports from a config written for --sharding hybrid on 2 nodes of 2
    env = {"GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}
    assert multinode.with_launched_nodes(RunConfig.of(sharding="hybrid"), 4, env).nodes == 2
    with pytest.raises(UserError, match="dp_replicate_size: 2 but --sharding fsdp on 2 node"):
        multinode.with_launched_nodes(RunConfig.of(sharding="fsdp"), 4, env)
    config = multinode.hybrid_parallelism(RunConfig.of(sharding="hybrid", num_processes=4, nodes=2), env)
    assert (config.dp_replicate_size, config.dp_shard_size) == (2, 2)
    assert multinode.hybrid_parallelism(RunConfig.of(sharding="fsdp"), env) is None


# --- two "nodes" on this host (slow: 4 CPU processes, ~40-80 s each launch on 2 shared cores) -------------------
ARGS = [*TRAIN_ARGS[:TRAIN_ARGS.index("--grad-accum")], "--grad-accum", "1",
        *TRAIN_ARGS[TRAIN_ARGS.index("--grad-accum") + 2:]]  # 4 ranks x 1 x 1: the reference's effective batch 4


def _reference(tmp_path, data: str):
    common = dict(data=data, max_steps=6, lr=1e-2, warmup_steps=2)
    return run_training(tiny_config(tmp_path / "one", run={"optimizer": "adamw"}, **common), show=False)


def _check(procs) -> None:
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_hybrid_on_two_nodes_matches_one_process_and_resumes_on_one_node(tmp_path):
    data = write_qa(tmp_path, n=22)
    one = _reference(tmp_path, data)
    two = tiny_config(tmp_path / "two", data=data)
    train = ["-m", "memfit", "train", "--model", two.source.model, "--data", data, *ARGS, "--sharding", "hybrid",
             "--save-every", "3", "--output", two.folder.output]
    _check(node_launch(*train, "--nodes", "2", nodes=2, nproc_per_node=2))
    losses = [m["loss"] for m in metrics(one.summary.output)]
    assert [m["loss"] for m in metrics(two.folder.output)] == pytest.approx(losses, abs=1e-5)
    step3 = Path(two.folder.output) / "checkpoints/step-3"
    meta_reader = __import__("torch.distributed.checkpoint", fromlist=["FileSystemReader"]).FileSystemReader
    meta = meta_reader(str(step3 / sharding.DCP_DIR)).read_metadata()
    q_proj = meta.state_dict_metadata["app.model.model.layers.0.self_attn.q_proj.weight"]
    # HSDP: 64 x 64 sharded over the 2 ranks of a node and replicated across nodes, so DCP keeps 2 row halves
    # (full sharding over 4 ranks would have written 4 quarters of 16 x 64)
    assert sorted(tuple(c.sizes) for c in q_proj.chunks) == [(32, 64), (32, 64)]
    # resumed on ONE node of 2 processes from step 3: DCP reshards the (2 x 2) mesh's state onto 2 ranks
    shutil.rmtree(Path(two.folder.output) / "checkpoints" / "step-6")
    resumed = gloo_launch("-m", "memfit", "train", "--model", two.source.model, "--data", data, *TRAIN_ARGS,
                          "--sharding", "hybrid", "--save-every", "3", "--resume",  # 2 ranks x accumulation 2
                          "--output", two.folder.output, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    assert max_diff(one.model, AutoModelForCausalLM.from_pretrained(two.folder.output)) < 1e-5


@pytest.mark.slow
def test_full_shard_on_two_nodes_matches_one_process(tmp_path):
    data = write_qa(tmp_path, n=22)
    one = _reference(tmp_path, data)
    two = tiny_config(tmp_path / "two", data=data)
    _check(node_launch("-m", "memfit", "train", "--model", two.source.model, "--data", data, *ARGS,
                       "--sharding", "fsdp", "--output", two.folder.output, nodes=2, nproc_per_node=2))
    losses = [m["loss"] for m in metrics(one.summary.output)]
    assert [m["loss"] for m in metrics(two.folder.output)] == pytest.approx(losses, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("sharding_name", ["hybrid", "fsdp", "zero2", "ddp"])
def test_per_rank_tensor_peak_on_two_nodes_is_within_3_percent(sharding_name):
    # hybrid shards over a node's 2 ranks; fsdp and zero2 over all 4 (ZeRO-2: every layer kept gathered);
    # ddp shards nothing and keeps its gradient buckets. Measured 2026-12-06: hybrid -0.6%, fsdp -1.3%, zero2 +1.6%,
    # ddp -0.3%; with hybrid priced as sharded over all 4 ranks (broken on purpose) -44%.
    bench = Path(__file__).resolve().parents[1] / "bench" / "sharding_memory.py"
    procs = node_launch(str(bench), "--model", "tiny", "--seq-len", "32", "--steps", "3", "--sharding", sharding_name,
                        nodes=2, nproc_per_node=2)
    _check(procs)
    got = last_json_line(procs[0].stdout)
    assert (got["processes"], got["nodes"], got["sharding"]) == (4, 2, sharding_name)
    for measured in got["measured_peak_bytes_per_rank"]:
        error = (got["predicted_peak_bytes"] - measured) / measured
        assert abs(error) <= 0.03, f"{sharding_name}: predicted {got['predicted_peak_bytes']:,} B vs {measured:,} B"


def test_plan_across_nodes_without_batch_trains_train_s_micro_batch_on_every_rank():
    """Issue 39's command as a user types it, no --batch: the one-machine default (4 sequences a step) divides
    over no cluster of 8-GPU nodes, so the batch is 4 per rank on the most ranks tried (8 nodes x 8 = 256),
    the same for every node count, and the plan says so."""
    out = CliRunner().invoke(cli, ["plan", "llama-3.1-70b", "--budget", "80GiB", "--gpus-per-node", "8", "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output)
    assert payload["nodes"]["nodes"] >= 1
    run = payload["plans"][0]["config"]
    assert run["micro_batch"] * run["grad_accum"] * run["num_processes"] == 4 * 8 * 8
    assert any("--batch not given: 256 sequences" in n for n in payload["notes"])
