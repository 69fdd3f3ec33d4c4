"""What the sweep of ``plan --from FILE --emit`` over every shipped config found (tests/data/interop, README.md
there names each source): the emitted file reads back as the plan, with only the keys the plan decided changed."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from memfit.cli import cli
from memfit.interop import emit, read

DATA = Path(__file__).parent / "data" / "interop"


def _emitted(tmp_path, name: str, **changes):
    """(source reading, plan, emitted data, emitted reading): ``name``'s run with ``changes`` written over it."""
    reading = read(DATA / name)
    plan = reading.run.replace(**changes)
    out = tmp_path / f"emitted{Path(name).suffix}"
    emit(reading.tool, out, reading.model, plan, reading)
    return reading, plan, yaml.safe_load(out.read_text()), read(out)


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _changed(before: dict, after: dict) -> set[str]:
    return {k for k in set(before) | set(after) if before.get(k, "absent") != after.get(k, "absent")}


def test_axolotl_fsdp_kept_keeps_the_files_fsdp_settings_and_turns_its_checkpointing_off(tmp_path):
    """GLM-4.7's FSDP2 LoRA (its version, wrap policy and activation checkpointing in fsdp_config): a plan that keeps
    FSDP but turns checkpointing off rewrote fsdp_config as two keys (the wrap policy gone), and one that keeps
    checkpointing lost FSDP's own; the file's fsdp_config stays, with only what the plan chose in it."""
    source, plan, data, back = _emitted(tmp_path, "axolotl_glm47_lora_fsdp2_ac.yaml", grad_checkpointing=False,
                                        micro_batch=1, grad_accum=8)
    assert back.run == plan
    assert data["fsdp_config"] == {**source.data["fsdp_config"], "activation_checkpointing": False}
    assert _changed(source.data, data) <= {"fsdp_config", "micro_batch_size", "gradient_accumulation_steps",
                                           "gradient_checkpointing"}
    _, plan, data, back = _emitted(tmp_path, "axolotl_glm47_lora_fsdp2_ac.yaml", sharding="zero2")
    assert back.run == plan and back.run.grad_checkpointing
    assert data["fsdp_config"] == {**source.data["fsdp_config"], "reshard_after_forward": False,
                                   "sharding_strategy": "SHARD_GRAD_OP"}


def test_axolotl_fsdp_dropped_keeps_the_checkpointing_fsdp_gave(tmp_path):
    """Falcon-E's FSDP2 full fine-tune on one process checkpoints through fsdp_config.activation_checkpointing; a plan
    on one unsharded process dropped fsdp_config and with it the checkpointing the plan was priced with (the
    emitted file read back 4x higher)."""
    source, plan, data, back = _emitted(tmp_path, "axolotl_glm47_lora_fsdp2_ac.yaml", sharding="ddp")
    assert "gradient_checkpointing" not in source.data and source.run.grad_checkpointing
    assert back.run == plan and data["gradient_checkpointing"] is True and "fsdp_config" not in data


def test_axolotl_activation_offloading_beside_a_parameter_offload_is_turned_off_with_it(tmp_path):
    """gpt-oss 120B offloads parameters (priced) and activations (said, not priced: one offload per run); a plan
    without offload left ``activation_offloading: true`` standing, which read back as the activations offload."""
    source, plan, data, back = _emitted(tmp_path, "axolotl_gptoss_120b_fsdp2_offload.yaml", offload="none")
    assert str(source.run.offload) == "params" and source.data["activation_offloading"] is True
    assert back.run == plan
    assert data["activation_offloading"] is False
    assert data["fsdp_config"] == {**source.data["fsdp_config"], "offload_params": False}


def test_axolotl_fsdp1_file_stays_fsdp1_in_its_own_spelling(tmp_path):
    """Llama 3.1 8B on FSDP (1) (``fsdp:`` words and ``fsdp_``-prefixed fsdp_config keys): the plan is priced on
    FSDP (1), so the emitted file keeps that version (no ``fsdp_version: 2``) and says the strategy and the offload
    in the file's own keys."""
    source, plan, data, back = _emitted(tmp_path, "axolotl_fft_8b_liger_fsdp.yaml", sharding="zero2",
                                        offload="none")
    assert source.stack.fsdp == 1 and "fsdp_version" not in data
    assert back.run == plan and back.stack == source.stack
    assert data["fsdp"] == ["shard_grad_op", "auto_wrap"]
    assert data["fsdp_config"] == {**source.data["fsdp_config"], "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                                   "fsdp_offload_params": False, "fsdp_reshard_after_forward": False}


def test_llamafactory_freeze_run_planned_in_pure_bf16_stays_a_freeze_run(tmp_path):
    """LLaMA Pro's freeze fine-tune (finetuning_type: freeze, priced as a full one): a plan in pure bf16 wrote
    pure_bf16 with the method's keys, so the file became ``finetuning_type: full`` without its freeze_ keys."""
    source, plan, data, back = _emitted(tmp_path, "llamafactory_llama_pro_freeze_sft.yaml", dtype="bf16")
    assert back.run == plan and data["pure_bf16"] is True
    assert _changed(source.data, data) == {"pure_bf16"}


def test_llamafactory_trainer_fsdp_is_dropped_with_the_sharding(tmp_path):
    """The FP8 example shards with Trainer's ``fsdp: [full_shard, auto_wrap]``; a plan on one unsharded process (LLaMA-
    Factory's plans shard through DeepSpeed) left it standing, so the emitted file read back sharded."""
    source, plan, data, back = _emitted(tmp_path, "llamafactory_fp8_fsdp.yaml", sharding="ddp")
    assert str(source.run.sharding) == "fsdp"
    assert back.run == plan
    assert _changed(source.data, data) == {"fsdp", "fsdp_transformer_layer_cls_to_wrap"}


def test_torchtune_gemma2_is_planned_with_the_eager_attention_it_is_priced_with(tmp_path):
    """torchtune's Gemma 2 attention materializes its soft-capped scores (read as eager); the planner's candidates
    were forced to SDPA, which Gemma 2 cannot run, so ``plan --from`` every Gemma 2 recipe refused in memfit's flags
    (--attn-implementation sdpa) what ``estimate --from`` priced. The plan written back prices to its number."""
    out = tmp_path / "gemma2.yaml"
    result = _run("plan", "--from", DATA / "torchtune_gemma2_2B_lora.yaml", "--budget", "60GiB", "--emit",
                  "torchtune", out, "--json")
    assert result.exit_code == 0, result.output
    best = json.loads(result.output)["plans"][0]
    assert best["config"]["attn_implementation"] == "eager"
    back = json.loads(_run("estimate", "--from", out, "--json").output)
    assert back["config"] == best["config"] and back["phases"]["needed_bytes"] == best["needed_bytes"]


def test_torchtune_builder_without_a_preset_stays_the_files_when_model_is_given_over_it(tmp_path):
    """qwen3/8B_full.yaml names torchtune's Qwen3 builder, which memfit has no preset for, so MODEL is given over the
    file as one of the same architecture; ``plan --emit`` then refused ("qwen2.5-7b has no torchtune builder memfit
    knows", after planning) or swapped the file's builder for the stand-in's. The file's builder stays."""
    source = read(DATA / "torchtune_qwen3_8B_full.yaml")
    out = tmp_path / "qwen3.yaml"
    result = _run("plan", "qwen2.5-7b", "--from", DATA / "torchtune_qwen3_8B_full.yaml", "--budget", "60GiB", "--emit",
                  "torchtune", out, "--json")
    assert result.exit_code == 0, result.output
    best = json.loads(result.output)["plans"][0]
    data = yaml.safe_load(out.read_text())
    assert data["model"] == source.data["model"]
    back = json.loads(_run("estimate", "qwen2.5-7b", "--from", out, "--json").output)
    assert back["config"] == best["config"] and back["phases"]["needed_bytes"] == best["needed_bytes"]


def test_the_plans_need_is_what_estimate_prices_on_the_emitted_file(tmp_path):
    """torchtune's distributed QLoRA (llama2/70B_qlora): torchtune builds its NF4 base with torchao, one layer at a
    time, which decides its loading and wrapping phases. The planner priced those phases on memfit's own stack
    (the whole base loaded: its worst phase), so at 40 GiB it chose a plan of 39.4 GB that the emitted file read
    back at 20.9 GB; now both price them on the file's stack, to the byte."""
    out = tmp_path / "planned.yaml"
    planned = _run("plan", "--from", DATA / "torchtune_llama2_70B_qlora.yaml", "--budget", "40GiB", "--json",
                   "--emit", "torchtune", out)
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.output[planned.output.index("{"):])
    estimated = _run("estimate", "--from", out, "--json")
    assert estimated.exit_code == 0, estimated.output
    needed = json.loads(estimated.output[estimated.output.index("{"):])["phases"]["needed_bytes"]
    assert plan["plans"][plan["chosen"]]["needed_bytes"] == needed
