"""Every configuration the four tools ship (tests/data/interop, README.md there names each source) reads as the
run that tool starts: preference runs as memfit's preference methods, distributed recipes sharded on their
process count, or a one-sentence refusal naming the file's own keys; ``plan --emit`` changes only what the plan
chose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from _train_helpers import assert_one_sentence
from memfit.cli import cli
from memfit.errors import UserError
from memfit.interop import emit, read

DATA = Path(__file__).parent / "data" / "interop"

#: What decides the memory of each shipped run: its objective (memfit's --method, DPO's reference), its sharding
#: and process count, and the method of training (LoRA rank, quantized base). Read from each file by hand.
SHIPPED = {
    # Axolotl: rl: dpo with an 8-bit LoRA base; rl: dpo full (a frozen reference copy); ORPO on a 4-bit base
    "axolotl_dpo_lora_8b.yml": dict(method="dpo", lora_r=32, quantize="8bit", sharding="ddp", num_processes=1),
    "axolotl_dpo_lora_1b.yml": dict(method="dpo", lora_r=32, quantize="8bit", sharding="ddp", num_processes=1),
    "axolotl_dpo_full_qwen.yaml": dict(method="dpo", lora_r=0, quantize="none", sharding="ddp", num_processes=1),
    "axolotl_dpo_qlora_mistral.yml": dict(method="dpo", lora_r=8, quantize="4bit", sharding="ddp", num_processes=1),
    "axolotl_orpo_qlora_mistral.yml": dict(method="orpo", lora_r=32, quantize="4bit", sharding="ddp",
                                           num_processes=1),
    "axolotl_lora_1b.yml": dict(method="sft", lora_r=16, quantize="none", sharding="ddp", num_processes=1),
    "axolotl_qlora_1b.yml": dict(method="sft", lora_r=32, quantize="4bit", sharding="ddp", num_processes=1),
    "axolotl_fft_8b.yml": dict(method="sft", lora_r=0, quantize="none", sharding="ddp", num_processes=1),
    "axolotl_fft_8b_liger_fsdp.yaml": dict(method="sft", lora_r=0, sharding="fsdp", offload="params", loss="liger"),
    "axolotl_qlora_fsdp_llama2.yml": dict(method="sft", lora_r=32, quantize="4bit", sharding="fsdp"),
    "axolotl_qlora_fsdp_70b.yaml": dict(method="sft", lora_r=8, quantize="4bit", sharding="fsdp"),
    # LLaMA-Factory: stage dpo + pref_loss sigmoid (DPO, LoRA: the adapter-off reference); DeepSpeed ZeRO-3
    "llamafactory_lora_dpo.yaml": dict(method="dpo", lora_r=8, quantize="none", precompute_reference=False),
    "llamafactory_lora_sft.yaml": dict(method="sft", lora_r=8, quantize="none", sharding="ddp"),
    "llamafactory_lora_sft_ds3.yaml": dict(method="sft", lora_r=8, sharding="zero3"),
    "llamafactory_lora_pretrain.yaml": dict(method="sft", lora_r=8, packing="concat"),
    "llamafactory_qlora_otfq.yaml": dict(method="sft", lora_r=8, quantize="4bit"),
    "llamafactory_fsdp_qlora.yaml": dict(method="sft", lora_r=8, quantize="4bit"),
    "llamafactory_full_sft.yaml": dict(method="sft", lora_r=0, sharding="zero3"),
    # torchtune: the launch command in the comments names the recipe and its --nproc_per_node
    "torchtune_3B_full.yaml": dict(method="sft", lora_r=0, sharding="fsdp", num_processes=4),
    "torchtune_llama3_8B_full.yaml": dict(method="sft", lora_r=0, sharding="fsdp", num_processes=4),
    "torchtune_qwen0.5B_full.yaml": dict(method="sft", lora_r=0, sharding="fsdp", num_processes=2),
    "torchtune_8B_lora.yaml": dict(method="sft", lora_r=8, sharding="fsdp", num_processes=2),
    "torchtune_8B_full_dpo.yaml": dict(method="dpo", lora_r=0, sharding="fsdp", num_processes=4, seq_len=1024),
    "torchtune_8B_lora_dpo.yaml": dict(method="dpo", lora_r=8, sharding="fsdp", num_processes=2),
    "torchtune_8B_lora_dpo_single_device.yaml": dict(method="dpo", lora_r=8, sharding="ddp", num_processes=1),
    "torchtune_1B_lora_single_device.yaml": dict(method="sft", lora_r=64, sharding="ddp", num_processes=1),
    "torchtune_1B_qlora_single_device.yaml": dict(method="sft", quantize="4bit", sharding="ddp"),
    "torchtune_llama2_70B_qlora.yaml": dict(method="sft", lora_r=16, quantize="4bit", sharding="fsdp", num_processes=8),
    "torchtune_1B_full_single_device.yaml": dict(method="sft", lora_r=0, sharding="ddp", optimizer_in_backward=True),
    # TRL / alignment-handbook: torch_dtype read; DPO recipes by their DPOConfig keys, ORPO by its recipe folder
    "handbook_zephyr_dpo_full.yaml": dict(method="dpo", lora_r=0, loss="standard", seq_len=1024),
    "handbook_zephyr_dpo_qlora.yaml": dict(method="dpo", lora_r=128, quantize="4bit", dtype="bf16"),
    "handbook_smollm2_dpo.yaml": dict(method="dpo", lora_r=0, dtype="bf16", micro_batch=2, grad_accum=8),
    "handbook_orpo_full.yaml": dict(method="orpo", lora_r=0, dtype="bf16", optimizer="adamw-8bit", seq_len=2048),
    "handbook_zephyr_sft_full.yaml": dict(method="sft", lora_r=0, dtype="bf16", loss="trl"),
    "handbook_zephyr_sft_qlora.yaml": dict(method="sft", lora_r=16, quantize="4bit", dtype="bf16"),
    "handbook_smollm2_sft.yaml": dict(method="sft", lora_r=0, dtype="bf16", seq_len=8192),
    "trl_sft_lora.yaml": dict(method="sft", lora_r=32),
    "trl_sft_full_packing.yaml": dict(method="sft", lora_r=0, packing="documents"),
    "trainer_args.json": dict(method="sft", loss="standard"),
    # issue #35's sweep of every shipped config (bench/interop_sweep.py): a string lora_target_modules is PEFT's
    # regular expression (the projections it spells out); Trainer's fsdp option in a LLaMA-Factory file; the
    # Accelerate config a launch command in the comments names (examples/accelerate/fsdp2_config.yaml beside the
    # file: FSDP2 on 2 processes); torchtune's Gemma 2 attention materializes its soft-capped scores (eager);
    # torchtune's separate q/k/v and gate/up adapters on transformers' fused Phi-3 projections
    "axolotl_llava_lora_regex.yaml": dict(method="sft", lora_r=32,
                                          lora_targets="up_proj,down_proj,gate_proj,q_proj,k_proj,v_proj,o_proj"),
    # dp_shard_size 16 is the world (FSDP2, parameters offloaded); float16: true is pure fp16 (no AMP)
    "axolotl_gptoss_120b_fsdp2_offload.yaml": dict(method="sft", sharding="fsdp", num_processes=16, offload="params"),
    "axolotl_openllama_3b_float16.yml": dict(method="sft", lora_r=0, dtype="fp16", mixed_precision="no"),
    "llamafactory_fp8_fsdp.yaml": dict(method="sft", lora_r=0, sharding="fsdp"),
    "llamafactory_ascend_full_sft_fsdp2.yaml": dict(method="sft", lora_r=0, sharding="fsdp", num_processes=2),
    "torchtune_gemma2_2B_lora.yaml": dict(method="sft", lora_r=64, sharding="fsdp", num_processes=4,
                                          attn_implementation="eager"),
    "axolotl_lora_1b_ray.yml": dict(method="sft", lora_r=16, sharding="zero3", num_processes=4),  # ray_num_workers
    "llamafactory_qlora_bnb_npu.yaml": dict(method="sft", lora_r=8, quantize="4bit"),
    "torchtune_8B_qdora_single_device.yaml": dict(method="sft", lora_r=8, quantize="4bit"),  # quantize_base
    "torchtune_phi3_mini_lora.yaml": dict(method="sft", lora_r=8, sharding="fsdp", num_processes=2,
                                          lora_targets="qkv_proj,o_proj,gate_up_proj,down_proj"),
    # the second sweep: FSDP's own activation checkpointing (fsdp_config) recomputes every decoder layer, as
    # gradient_checkpointing does (FSDP (1)'s fsdp_ spelling and FSDP2's); ASFT is next-token training (its
    # reference model is said, tests below)
    "axolotl_magistral_fsdp_qlora_ac.yaml": dict(method="sft", lora_r=32, quantize="4bit", sharding="fsdp",
                                                 grad_checkpointing=True),
    "axolotl_glm47_lora_fsdp2_ac.yaml": dict(method="sft", lora_r=32, quantize="8bit", sharding="fsdp",
                                             grad_checkpointing=True),
    "llamafactory_llama2_full_asft.yaml": dict(method="sft", lora_r=0, sharding="ddp"),
    # the sweep of plan --emit (tests/test_interop_emit_sweep.py): freeze tuning is priced as a full fine-tune
    "llamafactory_llama_pro_freeze_sft.yaml": dict(method="sft", lora_r=0, dtype="fp32", sharding="ddp"),
}

#: Shipped runs memfit does not price: the sentence names the file's key and value.
REFUSED = {
    "axolotl_kto_qlora_1b.yaml": "rl: kto is not a preference method memfit prices",
    "llamafactory_lora_kto.yaml": "stage: kto is not a training memfit prices",
    "llamafactory_lora_reward.yaml": "stage: rm is not a training memfit prices",
    # issue #35's sweep: reward models, quantized bases memfit has no layout for, parallelisms beside FSDP, other
    # engines and recipes, and files that configure no training step at all
    "axolotl_reward_model_qwen2.yaml": "reward_model: the file trains a reward model",
    "axolotl_prm_qwen2.yaml": "process_reward_model: the file trains a process reward model",
    "axolotl_gptq_lora_llama2.yml": "gptq: the file loads a GPTQ-quantized base",
    "axolotl_alst_fsdp2.yaml": "context_parallel_size: 8 splits every sequence over that many ranks",
    "axolotl_qat_fsdp2.yaml": "qat: the file trains with fake-quantized weights and activations",
    "llamafactory_inference.yaml": "do_train: not true, so the file configures no training (inference)",
    "llamafactory_merge_lora.yaml": "do_train: not true, so the file configures no training (an export (merge))",
    "llamafactory_v1_lora_sft.yaml": "dist_config: the file is LLaMA-Factory v1's configuration",
    "llamafactory_megatron_moe.yaml": "tensor_model_parallel_size: the file runs its step on Megatron-Core",
    "llamafactory_kt_lora.yaml": "use_kt: the file runs its step on KTransformers",
    "llamafactory_lora_sft_gptq.yaml": "model_name_or_path: TechxGenus/Meta-Llama-3-8B-Instruct-GPTQ names a "
                                       "checkpoint quantized with GPTQ",
    "torchtune_1B_full_ppo.yaml": "policy_model: the file configures PPO",
    "torchtune_3B_full_grpo.yaml": "grpo_samples: the file configures GRPO",
    "torchtune_KD_lora_distributed.yaml": "teacher_model: the file configures knowledge distillation",
    "torchtune_evaluation.yaml": "optimizer: the file names none, so it configures no training step",
    "torchtune_scout_full_tp.yaml": "tensor_parallel_dim: 2 splits every weight over that many ranks",
    # the second sweep: a builder memfit has no preset for (MODEL given over the file prices it: tests below); the
    # asynchronous GRPO recipe, whose optimizer is under training: (not "no training step")
    "torchtune_qwen3_8B_full.yaml": "model._component_: 'torchtune.models.qwen3.qwen3_8b_instruct' is a model "
                                    "builder memfit has no architecture for",
    "torchtune_qwen3B_async_grpo.yaml": "reward_functions: the file configures GRPO",
}


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_the_collection_holds_at_least_30_shipped_configs_of_every_kind():
    files = sorted(p.name for p in DATA.iterdir() if p.suffix in (".yml", ".yaml", ".json"))
    assert sorted([*SHIPPED, *REFUSED]) == files
    runs = {name: read(DATA / name).run for name in SHIPPED}
    assert len(files) >= 30
    assert sum(str(r.method) != "sft" for r in runs.values()) >= 8  # preference
    assert sum(str(r.quantize) == "4bit" for r in runs.values()) >= 5  # QLoRA
    assert sum(not r.is_lora() for r in runs.values()) >= 8  # full fine-tunes
    assert sum(r.num_processes > 1 for r in runs.values()) >= 5  # multi-process launches the files state


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_config_reads_as_the_run_its_tool_starts(name):
    reading = read(DATA / name)
    flat = reading.run.to_flat()
    assert {k: flat[k] for k in SHIPPED[name]} == SHIPPED[name]
    if flat["method"] != "sft":  # B pairs: one forward of 2B sequences, the loss on the full logits
        assert reading.run.forward_sequences() == 2 * reading.run.micro_batch and flat["loss"] == "standard"
        assert any(flat["method"] in line and "pairs" in line for line in reading.priced)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_shipped_run_memfit_cannot_price_is_one_sentence_naming_the_files_key(name):
    assert_one_sentence(_run("estimate", "--from", DATA / name), REFUSED[name])


def test_dpo_reference_follows_the_tool():
    """Full DPO keeps a frozen copy of the base, LoRA DPO switches the adapter off, precomputed log-probabilities
    need neither (memory.preference_terms.reference_policy reads these fields)."""
    from memfit.memory.preference_terms import reference_policy

    assert reference_policy(read(DATA / "torchtune_8B_full_dpo.yaml").run) == "copy"
    assert reference_policy(read(DATA / "llamafactory_lora_dpo.yaml").run) == "adapter-off"
    assert reference_policy(read(DATA / "handbook_orpo_full.yaml").run) is None


def _axolotl(tmp_path, text: str, name: str = "run.yml") -> Path:
    path = tmp_path / name
    path.write_text("base_model: meta-llama/Llama-3.2-1B\nmicro_batch_size: 1\nsequence_len: 512\n" + text)
    return path


@pytest.mark.parametrize("text, loss", [
    ("plugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n", "cce"),
    ("plugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\ncut_cross_entropy: false\n",
     "standard"),
    ("plugins:\n  - axolotl.integrations.liger.LigerPlugin\nliger_fused_linear_cross_entropy: true\n", "liger"),
    ("precompute_ref_log_probs: true\nrl: dpo\nadapter: lora\nlora_r: 8\n", "standard"),
])
def test_axolotl_plugins_set_the_loss(tmp_path, text, loss):
    run = read(_axolotl(tmp_path, text)).run
    assert str(run.loss) == loss
    assert run.precompute_reference == ("precompute_ref_log_probs" in text)


def test_axolotl_activation_offload_is_not_claimed_when_deepspeed_offloads_the_parameters(tmp_path):
    ds = tmp_path / "zero3_offload.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    reading = read(_axolotl(tmp_path, f"activation_offloading: true\ndeepspeed: {ds}\n"))
    assert str(reading.run.offload) == "params" and str(reading.run.sharding) == "zero3"
    assert not any("activations offload" in line for line in reading.priced)
    assert any(line.startswith("activation_offloading:") for line in reading.unmapped)
    alone = read(_axolotl(tmp_path, "activation_offloading: true\n", "alone.yml"))
    assert str(alone.run.offload) == "activations"


def test_a_refusal_names_the_files_keys_not_memfit_flags():
    """Axolotl's QLoRA-FSDP example offloads the 4-bit base's parameters, which needs FSDP over 2+ processes; the
    file states no process count: the sentence names its keys, not --offload/--quantize."""
    result = _run("estimate", "--from", DATA / "axolotl_qlora_fsdp_llama2.yml")
    assert_one_sentence(result, "fsdp_config.fsdp_offload_params offloads the parameters of a load_in_4bit base")
    assert "--offload" not in result.output and "--quantize" not in result.output


@pytest.mark.slow  # two analytic estimates of Qwen2.5 0.5B
def test_a_preference_file_is_priced_as_memfits_own_preference_run():
    """``estimate --from`` an Axolotl DPO file gives the number ``estimate`` gives for the same run typed as
    memfit's own flags (--method dpo ...), whichever recipe computes it."""
    from memfit.settings.config import RunConfig

    flat, default = read(DATA / "axolotl_dpo_full_qwen.yaml").run.to_flat(), RunConfig().to_flat()
    typed = ["qwen2.5-0.5b", "--json"]
    for key in (k for k in flat if flat[k] != default[k]):  # the file's run as memfit's own flags
        flag = "--" + key.replace("_", "-")
        typed += [flag] if flat[key] is True else [flag, flat[key]]
    assert "--method" in typed
    own = json.loads(_run("estimate", *typed).output)
    from_file = json.loads(_run("estimate", "--from", DATA / "axolotl_dpo_full_qwen.yaml", "--json").output)
    assert from_file["config"]["method"] == "dpo"
    assert from_file["peak_bytes"] == own["peak_bytes"]


# -- emit: only what the plan chose ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kept", [
    ("llamafactory_lora_dpo.yaml", {"model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct", "stage": "dpo",
                                    "pref_loss": "sigmoid"}),
    ("axolotl_dpo_lora_8b.yml", {"base_model": "meta-llama/Meta-Llama-3-8B-Instruct", "rl": "dpo",
                                 "attn_implementation": "flash_attention_2", "load_in_8bit": True}),
    ("torchtune_3B_full.yaml", {"tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                                              "path": "/tmp/Llama-3.2-3B-Instruct/original/tokenizer.model",
                                              "max_seq_len": None}}),
    ("handbook_orpo_full.yaml", {"model_name_or_path": "mistralai/Mistral-7B-v0.1", "torch_dtype": "bfloat16",
                                 "attn_implementation": "flash_attention_2", "max_prompt_length": 1792}),
])
def test_emit_changes_only_what_the_plan_chose(tmp_path, name, kept):
    """A plan that changes the micro-batch and accumulation (the same tokens per step) rewrites those two keys
    and nothing else the file says: model id, stage, attention, a null sequence length stay as written, no
    quantization is added, and the file reads back as the plan."""
    reading = read(DATA / name)
    plan = reading.run.replace(micro_batch=reading.run.micro_batch * 2 if reading.run.grad_accum % 2 else 1,
                               grad_accum=reading.run.grad_accum // 2 or 1)
    out = tmp_path / f"emitted{Path(name).suffix}"
    emit(reading.tool, out, reading.model, plan, reading)
    written = yaml.safe_load(out.read_text())
    assert {k: written.get(k) for k in kept} == kept
    assert "quantization_bit" not in written or "quantization_bit" in reading.data
    changed = {k for k in written if written[k] != reading.data.get(k)} | (set(reading.data) - set(written))
    assert changed <= {"batch_size", "micro_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps"}
    assert read(out).run == plan


@pytest.mark.parametrize("name, sharding", [
    ("axolotl_lora_1b.yml", "fsdp"), ("llamafactory_lora_sft.yaml", "zero3"),
    ("torchtune_1B_lora_single_device.yaml", "fsdp"), ("trl_sft_lora.yaml", "fsdp"),
    ("llamafactory_lora_dpo.yaml", "zero3"), ("handbook_orpo_full.yaml", "zero3"),
])
def test_emit_writes_the_plans_processes_and_sharding_in_the_tools_own_terms(tmp_path, name, sharding):
    """A plan over 4 processes, sharded, reads back on 4 processes with the same sharding (the launch command in
    the emitted file's comments says the count; torchtune's names the distributed recipe), so ``estimate --from``
    the emitted file prices the plan; the method (ORPO, DPO) survives the trip too."""
    reading = read(DATA / name)
    plan = reading.run.replace(num_processes=4, sharding=sharding)
    out = tmp_path / "emitted.yaml"
    emit(reading.tool, out, reading.model, plan, reading)
    back = read(out)
    assert back.processes_stated and back.run == plan


def test_emit_to_another_tool_names_the_hub_model_not_a_memfit_preset(tmp_path):
    reading = read(DATA / "torchtune_8B_lora_dpo.yaml")
    for tool in ("axolotl", "llamafactory", "trl"):
        out = tmp_path / f"{tool}.yaml"
        emit(tool, out, reading.model, reading.run, reading)
        written = yaml.safe_load(out.read_text())
        assert written.get("base_model", written.get("model_name_or_path")) == "meta-llama/Meta-Llama-3-8B"
        back = read(out)
        assert (back.model, str(back.run.method), back.run.num_processes) == ("llama-3-8b", "dpo", 2)


def test_torchtune_dpo_recipe_without_preference_loss_is_refused(tmp_path):
    path = tmp_path / "dpo.yaml"
    path.write_text("# tune run lora_dpo_single_device --config dpo\nmodel:\n  _component_: "
                    "torchtune.models.llama3_2.lora_llama3_2_1b\nloss:\n  _component_: torch.nn.CrossEntropyLoss\n"
                    "optimizer:\n  _component_: torch.optim.AdamW\n")
    with pytest.raises(UserError, match="loss: torch.nn.CrossEntropyLoss is no preference loss"):
        read(path)


@pytest.mark.parametrize("tool", ["axolotl", "trl"])
def test_an_sft_run_written_for_another_tool_reads_back_as_sft(tmp_path, tool):
    """No key the plan leaves unset is written (a null preference key made a TRL file read as DPO)."""
    reading = read(DATA / "llamafactory_full_sft.yaml")
    out = tmp_path / f"{tool}.yaml"
    emit(tool, out, reading.model, reading.run.replace(loss="standard"), reading)
    assert None not in yaml.safe_load(out.read_text()).values()
    assert str(read(out).run.method) == "sft"


def test_llamafactory_quantization_method_other_than_bitsandbytes_is_refused_and_single_scales_are_said(tmp_path):
    """``quantization_method: hqq|eetq`` (the choices LLaMA-Factory's QLoRA example lists) quantizes with a layout
    memfit has none for; ``double_quantization: false`` (its NPU example) keeps fp32 block scales: said, as the
    NF4 base memfit prices is double-quantized."""
    shipped = (DATA / "llamafactory_qlora_bnb_npu.yaml").read_text()
    assert any(line.startswith("double_quantization: false")
               for line in read(DATA / "llamafactory_qlora_bnb_npu.yaml").unmapped)
    hqq = tmp_path / "hqq.yaml"
    hqq.write_text(shipped.replace("quantization_method: bnb", "quantization_method: hqq"))
    assert_one_sentence(_run("estimate", "--from", hqq), "quantization_method: hqq quantizes the base with another")


@pytest.mark.parametrize("model, text, typed, said", [
    ("Llama-3.2-1B", "adapter: lora\nlora_target_modules:\n  - c_fc\n", [],
     "lora_target_modules c_fc matches no projection"),
    ("Llama-2-7b-hf", "sequence_len: 8192\n", [], "sequence_len 8192 is beyond the model's 4096 positions"),
    ("Llama-2-7b-hf", "sequence_len: 512\n", ["--seq-len", "8192"], "--seq-len 8192 is beyond the model's"),
])
def test_what_the_model_cannot_run_is_refused_in_the_files_keys(tmp_path, model, text, typed, said):
    """A refusal the model's architecture makes (LoRA targets, length) names the file's key where the file set the
    setting, and memfit's flag where the user typed it over the file; so it does with a MODEL given over the file's
    (here the preset of the same model: the sweep of the shipped configs found memfit's flags named there)."""
    path = tmp_path / "run.yml"
    path.write_text(f"base_model: meta-llama/{model}\nmicro_batch_size: 1\n" + text)
    assert_one_sentence(_run("estimate", "--from", path, *typed), said)
    preset = {"Llama-3.2-1B": "llama-3.2-1b", "Llama-2-7b-hf": "llama-2-7b"}[model]
    assert_one_sentence(_run("estimate", preset, "--from", path, *typed), said)


def test_a_torchtune_dev_recipe_that_runs_a_known_step_is_read_as_that_recipe(tmp_path):
    """dev/11B_lora_multi_dataset.yaml launches ``dev/lora_finetune_distributed_multi_dataset`` on 2 processes: the
    sweep of the shipped configs found it read as a single-device run. That recipe is lora_finetune_distributed's
    loop over interleaved datasets, so it is sharded with FSDP2 on the launch's process count."""
    shipped = (DATA / "torchtune_8B_lora.yaml").read_text()
    path = tmp_path / "8B_lora_multi.yaml"
    path.write_text(shipped.replace("lora_finetune_distributed --config llama3_1/8B_lora",
                                    "dev/lora_finetune_distributed_multi_dataset --config dev/8B_lora_multi"))
    assert "multi_dataset --config dev/8B_lora_multi" in path.read_text()
    run = read(path).run
    assert (str(run.sharding), run.num_processes) == ("fsdp", 2)


def test_a_torchtune_builder_without_a_preset_is_priced_on_the_model_given_over_the_file():
    """qwen3/8B_full.yaml names torchtune's Qwen3 builder, which memfit has no preset for: without MODEL the sentence
    says to give one; with it, the file's run (full_finetune_distributed on 4 processes) is priced on that model."""
    path = DATA / "torchtune_qwen3_8B_full.yaml"
    assert_one_sentence(_run("estimate", "--from", path), "give MODEL (a preset or Hub id of the same architecture)")
    result = _run("estimate", "qwen2.5-7b", "--from", path, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["model"] == "qwen2.5-7b"
    assert {k: payload["config"][k] for k in ("sharding", "num_processes", "lora_r", "dtype")} == {
        "sharding": "fsdp", "num_processes": 4, "lora_r": 0, "dtype": "bf16"}
    assert payload["from"]["model"] == "torchtune.models.qwen3.qwen3_8b_instruct"


def test_llamafactory_asft_says_its_reference_model_is_not_priced():
    """use_asft_loss loads a frozen reference model (LLaMA-Factory's train/sft/workflow.py create_ref_model) and
    computes its logits every step: the reading says the estimate is low by them, not "a setting memfit does not
    know"."""
    reading = read(DATA / "llamafactory_llama2_full_asft.yaml")
    said = [line for line in reading.unmapped if line.startswith("use_asft_loss:")]
    assert len(said) == 1 and "frozen reference model" in said[0] and "low by a copy of the model's weights" in said[0]
    assert not any("asft_alpha" in line for line in reading.unmapped)


def test_fsdp_activation_checkpointing_in_a_launch_commands_accelerate_config_is_priced(tmp_path):
    """Accelerate's fsdp_activation_checkpointing wraps every decoder layer in torch's checkpoint wrapper: a
    LLaMA-Factory file that turns its own checkpointing off is priced with it when the launch's config turns it on."""
    (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
                                        "  fsdp_activation_checkpointing: true\n")
    path = tmp_path / "run.yaml"
    path.write_text("# accelerate launch --config_file fsdp.yaml src/train.py run.yaml\n"
                    "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: sft\ndo_train: true\n"
                    "finetuning_type: full\ndisable_gradient_checkpointing: true\n")
    reading = read(path)
    assert (reading.run.grad_checkpointing, str(reading.run.sharding), reading.run.num_processes) == (True, "fsdp", 2)
    assert any("fsdp_activation_checkpointing" in line for line in reading.priced)


def test_flash_attention_priced_as_sdpa_on_a_model_without_sdpa_names_the_files_key(tmp_path):
    """Without the flash-attn package a file's flash-attention is priced as SDPA, which Gemma 2 cannot run: the
    sentence names the file's key and why SDPA was tried, not an "attn_implementation sdpa" the file never wrote."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed: the file's flash-attention is priced as it is")
    path = tmp_path / "run.yml"
    path.write_text("base_model: google/gemma-2-2b\nmicro_batch_size: 1\nsequence_len: 512\nbf16: true\n"
                    "flash_attention: true\n")
    assert_one_sentence(_run("estimate", "--from", path), "flash_attention asks for flash-attention, which memfit "
                        "prices as SDPA as flash-attn is not installed here, and gemma-2-2b cannot run SDPA")


def test_axolotl_memory_savers_say_priced_or_not_once(tmp_path):
    """Axolotl keys that save memory memfit does not price are said; one that says what it is priced as
    (``unfrozen_parameters``: a full fine-tune) is not also called "not priced" (the sweep found both at once)."""
    path = tmp_path / "run.yml"
    path.write_text("base_model: meta-llama/Llama-3.2-1B\nmicro_batch_size: 1\nlora_mlp_kernel: true\n"
                    "unfrozen_parameters:\n  - model.layers.0.*\n")
    said = {line.split(":", 1)[0]: line for line in read(path).unmapped}
    assert "not priced" in said["lora_mlp_kernel"]
    assert "priced as a full fine-tune" in said["unfrozen_parameters"] and "not priced" not in said["unfrozen_parameters"]


def test_plan_from_a_preference_file_plans_its_method_unless_one_is_typed(tmp_path):
    """``plan --from`` an Axolotl ``rl: dpo`` file plans DPO (the sweep of the shipped configs found --method's
    default, sft, written over the file's method, and the emitted file without ``rl: dpo``); a typed --method wins."""
    path = DATA / "axolotl_dpo_lora_1b.yml"
    out = tmp_path / "planned.yml"
    result = _run("plan", "--from", path, "--budget", "40GiB", "--json", "--emit", "axolotl", out)
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output[result.output.index("{"):])
    assert planned["plans"][planned["chosen"]]["config"]["method"] == "dpo"
    assert yaml.safe_load(out.read_text())["rl"] == "dpo"
    typed = _run("plan", "--from", path, "--budget", "40GiB", "--json", "--method", "sft")
    assert typed.exit_code == 0, typed.output
    planned = json.loads(typed.output[typed.output.index("{"):])
    assert planned["plans"][planned["chosen"]]["config"]["method"] == "sft"
