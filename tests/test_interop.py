"""Other tools' configurations: ``estimate --from``, ``plan --from``, ``plan --emit`` (memfit.interop).

The files under tests/data/interop are the tools' own examples (README.md there names each source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from _train_helpers import assert_one_sentence
from memfit.cli import cli
from memfit.interop import read

DATA = Path(__file__).parent / "data" / "interop"

#: What each example must read as: (format, model, the RunConfig settings that matter for it).
EXPECTED = {
    "axolotl_lora_1b.yml": ("axolotl", "llama-3.2-1b", dict(
        seq_len=2048, micro_batch=2, grad_accum=2, lora_r=16, dtype="bf16", mixed_precision="bf16",
        optimizer="adamw-8bit", packing="documents", grad_checkpointing=True, loss="standard")),
    "axolotl_qlora_1b.yml": ("axolotl", "llama-3.2-1b", dict(
        quantize="4bit", lora_r=32, lora_targets="all-linear", grad_accum=4)),
    "axolotl_fft_8b.yml": ("axolotl", "llama-3-8b", dict(
        lora_r=0, seq_len=8192, dtype="bf16", loss="liger", optimizer="adamw-8bit")),
    "llamafactory_lora_sft.yaml": ("llamafactory", "llama-3-8b", dict(
        lora_r=8, lora_alpha=16.0, lora_targets="all-linear", dtype="bf16", grad_checkpointing=True,
        micro_batch=1, grad_accum=8, packing="none")),
    "llamafactory_qlora_otfq.yaml": ("llamafactory", "llama-3-8b", dict(quantize="4bit", lora_r=8)),
    "llamafactory_full_sft.yaml": ("llamafactory", "llama-3-8b", dict(
        lora_r=0, dtype="fp32", mixed_precision="bf16", sharding="zero3")),
    "torchtune_1B_lora_single_device.yaml": ("torchtune", "llama-3.2-1b", dict(
        lora_r=64, lora_targets="q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", dtype="bf16",
        mixed_precision="no", loss="chunked", optimizer="adamw-fused", micro_batch=4, grad_accum=8)),
    "torchtune_1B_qlora_single_device.yaml": ("torchtune", "llama-3.2-1b", dict(
        quantize="4bit", seq_len=2048, grad_checkpointing=True)),
    "torchtune_1B_full_single_device.yaml": ("torchtune", "llama-3.2-1b", dict(
        lora_r=0, optimizer_in_backward=True, optimizer="adamw-8bit", packing="documents")),
    "trl_sft_lora.yaml": ("trl", "qwen2.5-0.5b", dict(
        lora_r=32, seq_len=1024, packing="documents", loss="trl", mixed_precision="bf16", dtype="fp32")),
    "trl_sft_full_packing.yaml": ("trl", "smollm2-135m", dict(
        lora_r=0, dtype="bf16", micro_batch=8, grad_accum=2, optimizer="adamw-fused")),
    "trainer_args.json": ("trl", None, dict(
        micro_batch=4, grad_accum=4, mixed_precision="bf16", grad_checkpointing=True, loss="standard")),
}


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_tools_examples_read_as_that_run(name):
    tool, model, settings = EXPECTED[name]
    reading = read(DATA / name)
    assert (reading.tool, reading.model) == (tool, model)
    flat = reading.run.to_flat()
    assert {k: flat[k] for k in settings} == settings


def test_estimate_from_names_what_it_could_not_map():
    result = _run("estimate", "--from", DATA / "torchtune_1B_lora_single_device.yaml", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["from"]["format"] == "torchtune"
    assert any(line.startswith("tokenizer.max_seq_len:") for line in payload["from"]["unmapped"])
    table = _run("estimate", "--from", DATA / "axolotl_fft_8b.yml")
    assert table.exit_code == 0, table.output
    assert "Not mapped" in table.output and "liger_rope" in table.output


def test_estimate_from_typed_flags_override_the_file():
    base = json.loads(_run("estimate", "--from", DATA / "axolotl_lora_1b.yml", "--json").output)
    shorter = json.loads(_run("estimate", "--from", DATA / "axolotl_lora_1b.yml", "--seq-len", "512",
                              "--json").output)
    assert shorter["config"]["seq_len"] == 512 and shorter["config"]["lora_r"] == 16
    assert shorter["peak_bytes"] < base["peak_bytes"]


def test_trainer_args_without_a_model_take_model_argument():
    assert_one_sentence(_run("estimate", "--from", DATA / "trainer_args.json"), "names no base model")
    result = _run("estimate", "tiny", "--from", DATA / "trainer_args.json", "--seq-len", "64", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["micro_batch"] == 4


@pytest.mark.parametrize("text, pattern", [
    ("lr: 0.1\nfoo: 1\n", "is none of the configurations memfit reads"),
    ("base_model: tiny\nmicro_batch_size: -1\n", "micro_batch_size: -1 is not a whole number"),
    ("base_model: tiny\nmicro_batch_size: 1\noptimizer: adamw_magic\n", "optimizer: 'adamw_magic' is not"),
    ("base_model: nobody/no-such-model-here\nmicro_batch_size: 1\n", "base_model:"),
    ("model:\n  _component_: torchtune.models.foo.foo_7b\nbatch_size: 1\noptimizer:\n  _component_: torch.optim.AdamW\n",
     "model._component_:"),
    ("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 1\n", "optimizer: the file names none"),
    ("model_name_or_path: tiny\ndo_train: true\nfinetuning_type: lora\nquantization_bit: 3\n", "quantization_bit: 3 is not"),
    ("- a list\n", "does not hold a mapping"),
])
def test_bad_input_is_one_sentence_naming_file_and_key(tmp_path, text, pattern):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    result = _run("estimate", "--from", path)
    assert_one_sentence(result, pattern)
    assert str(path) in result.output


@pytest.mark.parametrize("tool, source, budget", [
    ("axolotl", "axolotl_lora_1b.yml", "24GiB"), ("llamafactory", "llamafactory_lora_sft.yaml", "24GiB"),
    ("torchtune", "torchtune_1B_lora_single_device.yaml", "24GiB"), ("trl", "trl_sft_lora.yaml", "24GiB"),
    ("torchtune", "axolotl_qlora_1b.yml", "24GiB"), ("trl", "llamafactory_full_sft.yaml", "80GiB"),
    ("llamafactory", "llamafactory_lora_dpo.yaml", "24GiB"), ("torchtune", "torchtune_3B_full.yaml", "24GiB"),
])
def test_plan_emit_round_trips_to_the_same_prediction(tmp_path, tool, source, budget):
    out = tmp_path / f"emitted-{tool}.yaml"
    planned = _run("plan", "--from", DATA / source, "--budget", budget, "--seq-len", "1024", "--emit", tool, out,
                   "--json", "--top", "1")
    assert planned.exit_code == 0, planned.output
    best = json.loads(planned.output)["plans"][0]
    reading = read(out)
    assert reading.tool == tool
    assert reading.run.to_flat() == best["config"]
    estimated = json.loads(_run("estimate", "--from", out, "--json").output)
    assert estimated["peak_bytes"] == best["peak_bytes"]
    if tool == read(DATA / source).tool:  # the source's own settings (data, schedule) are kept
        source_keys = set(yaml.safe_load((DATA / source).read_text()))
        assert len(source_keys & set(yaml.safe_load(out.read_text()))) > len(source_keys) // 2


def test_plan_from_searches_only_what_the_tool_runs(tmp_path):
    """torchtune has no autocast: every plan for it stores the weights in its compute dtype."""
    result = _run("plan", "--from", DATA / "torchtune_1B_full_single_device.yaml", "--budget", "24GiB", "--json",
                  "--top", "0")
    assert result.exit_code == 0, result.output
    configs = [p["config"] for p in json.loads(result.output)["plans"]]
    assert configs and all(c["mixed_precision"] == "no" and c["lora_r"] == 0 for c in configs)


def test_deepspeed_settings_are_priced_with_memfits_deepspeed_layout(tmp_path):
    """A DeepSpeed config referenced by a TRL file (stage and offload read from the JSON beside it) is estimated
    with memfit's DeepSpeed ZeRO layout, not FSDP2's; a file named after its stage reads as that stage."""
    from memfit.memory.estimate import estimate

    (tmp_path / "ds_z3.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": "auto"}))
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: HuggingFaceTB/SmolLM2-135M\nmax_length: 512\n"
                    "per_device_train_batch_size: 2\ndeepspeed: ds_z3.json\n")
    reading = read(path)
    assert reading.engine == "deepspeed"
    assert (str(reading.run.sharding), str(reading.run.offload)) == ("zero3", "optimizer")
    payload = json.loads(_run("estimate", "--from", path, "--num-processes", "4", "--json").output)
    assert payload["from"]["engine"] == "deepspeed" and payload["breakdown"]["optimizer"] == 0
    run = reading.run.replace(num_processes=4)
    ours = estimate(reading.spec(), run, engine="deepspeed").peak_bytes
    assert payload["peak_bytes"] == ours != estimate(reading.spec(), run, engine="fsdp2").peak_bytes
    assert read(DATA / "llamafactory_full_sft.yaml").engine == "deepspeed"  # ds_z3_config.json, by its name


def test_the_process_count_is_read_where_the_file_states_it_else_assumed_in_a_sentence(tmp_path):
    source = (DATA / "torchtune_1B_lora_single_device.yaml").read_text()
    stated = tmp_path / "distributed.yaml"
    stated.write_text("# To launch on 2 devices, run the following command from root:\n"
                      "#   tune run --nproc_per_node 2 lora_finetune_distributed --config llama3_2/1B_lora\n" + source)
    reading = read(stated)
    assert reading.run.num_processes == 2 and reading.processes_stated
    assert any(line.startswith("processes: 2") for line in reading.priced)
    assert not any(line.startswith("processes:") for line in reading.unmapped_for())
    plain = json.loads(_run("estimate", "--from", DATA / "torchtune_1B_lora_single_device.yaml",
                            "--num-processes", "4", "--json").output)
    assumed = [line for line in plain["from"]["unmapped"] if line.startswith("processes:")]
    assert assumed == ["processes: the file does not say how many processes the launch starts; priced per rank on "
                       "4 (--num-processes), replicated (DDP)."]


def test_a_deepspeed_plan_emitted_for_trl_reads_back_to_the_same_prediction(tmp_path):
    """TRL runs ZeRO-3 through DeepSpeed: the planner prices that candidate with DeepSpeed's layout, as the
    emitted file's estimate does."""
    out = tmp_path / "plan.yaml"
    planned = _run("plan", "--from", DATA / "llamafactory_full_sft.yaml", "--budget", "80GiB", "--seq-len", "1024",
                   "--num-processes", "4", "--sharding", "zero3", "--emit", "trl", out, "--json", "--top", "1")
    assert planned.exit_code == 0, planned.output
    best = json.loads(planned.output)["plans"][0]
    assert best["config"]["sharding"] == "zero3" and read(out).engine == "deepspeed"
    estimated = json.loads(_run("estimate", "--from", out, "--num-processes", "4", "--json").output)
    assert estimated["peak_bytes"] == best["peak_bytes"]


def test_llamafactory_use_unsloth_is_priced_on_unsloths_stack_with_its_offloaded_checkpoints(tmp_path):
    """LLaMA-Factory's ``use_unsloth`` loads the model through Unsloth with ``use_gradient_checkpointing="unsloth"``
    (model_utils/unsloth.py): the unsloth stack and each checkpoint on the host; ``use_unsloth_gc`` alone is that
    checkpointing on transformers' layers (LLaMA-Factory's stack). Without either the run is priced as written."""
    from memfit.memory.estimate import estimate

    source = (DATA / "llamafactory_lora_sft.yaml").read_text()
    plain, unsloth, gc_only = (tmp_path / name for name in ("plain.yaml", "unsloth.yaml", "gc.yaml"))
    plain.write_text(source)
    unsloth.write_text(source + "use_unsloth: true\n")
    gc_only.write_text(source + "use_unsloth_gc: true\n")
    read_plain, read_unsloth, read_gc = read(plain), read(unsloth), read(gc_only)
    assert (read_plain.stack.trainer, str(read_plain.run.offload)) == ("llamafactory", "none")
    assert (read_unsloth.stack.trainer, str(read_unsloth.run.offload)) == ("unsloth", "activations")
    assert (read_gc.stack.trainer, str(read_gc.run.offload)) == ("llamafactory", "activations")
    assert any(line.startswith("use_unsloth:") for line in read_unsloth.priced)
    assert not any("use_unsloth" in line for line in read_unsloth.unmapped)  # no longer "no term for it"
    spec = read_plain.spec()
    # the reading's stack is what estimate prices: Unsloth's own terms differ from transformers' for the same flags
    ours = estimate(spec, read_unsloth.run, stack=read_unsloth.stack).peak_bytes
    assert ours != estimate(spec, read_unsloth.run, stack=read_gc.stack).peak_bytes


@pytest.mark.parametrize("extra, sharding", [
    ("", "fsdp"), ("fsdp_reshard_after_forward: false\n", "zero2"), ("tensor_parallel_dim: 1\n", "fsdp"),
])
def test_torchtune_distributed_recipe_reshards_as_the_file_says(tmp_path, extra, sharding):
    """torchtune's distributed recipes shard with FSDP2; ``fsdp_reshard_after_forward: false`` keeps the gathered
    parameters to backward (memfit's zero2); a tensor-parallel degree of 1 is no tensor parallelism."""
    path = tmp_path / "8B_full.yaml"
    path.write_text("# tune run --nproc_per_node 4 full_finetune_distributed --config llama3/8B_full\nmodel:\n"
                    "  _component_: torchtune.models.llama3.llama3_8b\noptimizer:\n  _component_: torch.optim.AdamW\n"
                    + extra)
    run = read(path).run
    assert (str(run.sharding), run.num_processes) == (sharding, 4)


@pytest.mark.parametrize("text, optimizer", [
    ("optimizer: adamw_torch_8bit\n", "adamw-8bit"),  # transformers' name for torchao's AdamW8bit
    ("optimizer: ao_adamw_8bit\n", "adamw-8bit"),  # Axolotl's own name for it
    ("optimizer: adamw_torch_4bit\n", "adamw"),  # no row: AdamW, said
])
def test_torchaos_8bit_adamw_is_priced_as_the_8bit_adamw(tmp_path, text, optimizer):
    path = tmp_path / "run.yml"
    path.write_text("base_model: meta-llama/Llama-3.2-1B\nmicro_batch_size: 1\n" + text)
    reading = read(path)
    assert str(reading.run.optimizer) == optimizer
    assert any("torchao's AdamW8bit" in line for line in reading.priced) == (optimizer == "adamw-8bit")
