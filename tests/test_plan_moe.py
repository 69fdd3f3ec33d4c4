"""The planner on mixture-of-experts models: the routing worst case is a margin in the fit check and in the
output, LoRA's parts are priced (the chosen targets and the attention only), FSDP2's split of the experts.

Models: ``_accuracy_models.moe_config`` (hidden 64, 3 layers, 4 experts of which 2 per token; Mixtral's experts
128 wide, Qwen2-MoE's 64 wide with a 128-wide shared expert and its 1-wide gate; 2 key/value heads of 16).
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from _accuracy_models import moe_config
from memfit.memory.moe import routing_margin
from memfit.settings.config import RunConfig
from memfit.spec.model import spec_from_config


@pytest.fixture(scope="module")
def mixtral():
    return spec_from_config(moe_config("mixtral"), "moe-mixtral")


def test_routing_margin_by_hand(mixtral, tiny_llama_config):
    # 2 x 64 = 128 tokens, 2 experts each: 256 pairs, balanced 64 per expert; worst case all 128 in one:
    # 64 rows more, each one expert's up-projection output and activation, 3 x 128 wide.
    run = RunConfig.of(seq_len=64, micro_batch=2)
    assert routing_margin(mixtral, run) == 64 * 3 * 128 * 4  # fp32: the eager loop, 4-byte activations
    assert routing_margin(mixtral, run.replace(mixed_precision="bf16")) == 64 * 3 * 128 * 2  # AMP: still eager
    assert routing_margin(mixtral, run.replace(dtype="bf16")) == 0  # bf16 weights: grouped_mm, all pairs at once
    assert routing_margin(spec_from_config(tiny_llama_config, "tiny"), run) == 0  # dense


def test_a_plan_that_fits_only_balanced_routing_does_not_fit(mixtral):
    from memfit.planning.gpus import gpu_by_name
    from memfit.planning.search import REFERENCE_GPU, evaluate

    run = RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw-fused")
    gpu = gpu_by_name(REFERENCE_GPU)
    plan = evaluate(mixtral, run, gpu, 1 << 40)
    assert plan.routing_bytes == 98_304 and plan.needed_bytes == plan.peak_bytes + 98_304
    assert plan.to_dict()["routing_margin_bytes"] == 98_304
    # a budget that holds the balanced peak with its 5% margin, not the worst routing's
    budget = int((plan.peak_bytes + plan.routing_bytes // 2) * 1.05)
    assert not evaluate(mixtral, run, gpu, budget).fits
    assert evaluate(mixtral, run, gpu, int((plan.peak_bytes + plan.routing_bytes) * 1.05) + 1).fits
    # what plan prints for it, and for the same run under FSDP2 on 2 processes
    from memfit.planning.moe import moe_plan_lines
    from memfit.planning.search import PlanResult

    sharded = evaluate(mixtral, run.replace(num_processes=2, sharding="fsdp"), gpu, 1 << 40)
    lines = moe_plan_lines(PlanResult(1 << 40, 0.05, [sharded], 0, "moe-mixtral", gpu, mixtral), None)
    assert lines[0].startswith("Routing: the estimate assumes balanced routing (64 of 128 tokens per expert); the "
                               "worst case (all 128 in one expert) adds 96.0 KiB, counted in the fit check")
    assert "fsdp shards each stacked expert weight by expert over 2 processes: 2 of 4 experts" in lines[-1]


def test_attention_targets_and_lora_parts_by_hand():
    from memfit.planning.moe import attention_targets

    spec = spec_from_config(moe_config("qwen2_moe"), "moe-qwen2")
    attention = attention_targets(spec)
    assert attention == ("q_proj", "k_proj", "v_proj", "o_proj")
    # r 8 x (in + out) per projection, 3 layers: q 64->64 1,024, k and v 64->32 768 each, o 1,024: 3,584 a layer;
    # all-linear adds the shared expert (gate and up 64->128, down 128->64: 1,536 each) and its gate (64->1: 520)
    assert spec.trainable_params(RunConfig.of(lora_r=8, lora_targets=attention)) == 3 * 3_584 == 10_752
    assert spec.trainable_params(RunConfig.of(lora_r=8)) == 3 * (3_584 + 3 * 1_536 + 520) == 26_136


@pytest.mark.slow  # ~35 s: a recipe of its own (LoRA under AMP) is derived
def test_plan_output_states_the_routing_margin_lora_parts_and_the_expert_split(tmp_path):
    from memfit.cli import cli

    moe_config("mixtral").save_pretrained(tmp_path)
    result = CliRunner().invoke(cli, [
        "plan", str(tmp_path), "--budget", "8GiB", "--seq-len", "64", "--batch", "4", "--num-processes", "2",
        "--micro-batch", "2", "--sharding", "fsdp", "--lora-r", "8", "--dtype", "fp32", "--mixed-precision", "bf16",
        "--no-grad-checkpointing", "--optimizer", "adamw-fused", "--loss", "standard", "--offload", "none",
        "--no-optimizer-in-backward"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    # AMP on fp32 weights: the eager loop at 2-byte activations, 64 rows of 3 x 128 more: 49,152 B
    assert "the worst case (all 128 in one expert) adds 48.0 KiB, counted in the fit check" in text
    # Mixtral's all-linear is its attention (the experts are stacked 3-D weights, not Linear modules):
    # r 8 x (64 + 64) for q and o, r 8 x (64 + 32) for k and v, 3 layers
    assert "LoRA r8 on all-linear: 10,752 trainable" in text and "the attention only" in text
    assert "the 294,912 expert parameters stay frozen" in text  # 3 layers x 4 x (256 x 64 + 64 x 128)
    assert "2 of 4 experts per MoE layer on each rank" in text
