"""Axolotl's YAML (``axolotl train config.yml``), read from its documented schema (docs/config-reference.qmd).

How Axolotl runs a step, where it differs from memfit's own trainer:

- weights load in the training precision (``bf16: true`` loads bf16 and trains under bf16 autocast, no fp32
  master copy): memfit's pure bf16 with bf16 autocast;
- ``sample_packing`` (multipack): ``micro_batch_size`` rows of ``sequence_len`` tokens, each a bin of whole
  documents whose position ids restart (flash-attention varlen, no cross-document attention): memfit's
  ``documents`` packing at full rows;
- ``adapter: qlora`` runs PEFT's ``prepare_model_for_kbit_training`` (non-quantized weights cast to fp32),
  as memfit does.
"""

from __future__ import annotations

from typing import Any

from memfit.interop.common import (
    Keys,
    Reading,
    checkpointing_kwargs,
    flash_attention,
    lora_targets,
    model_name,
    precision,
    preference,
    trainer_optimizer,
)
from memfit.interop.emitting import OPTIMIZER_NAMES, merged
from memfit.interop.sharding import deepspeed, ray_workers

NAME = "axolotl"
#: The shardings this tool runs through DeepSpeed (``emit`` writes them as a DeepSpeed config); the others FSDP.
DEEPSPEED = frozenset({"zero3"})

#: Axolotl's own optimizers beside Trainer's (docs/optimizers.qmd).
OWN_OPTIMIZERS = ("ao_adamw_8bit", "ao_adamw_4bit", "ao_adamw_fp8", "adopt_adamw", "muon", "came_pytorch",
                  "optimi_adamw", "dion", "lion_pytorch")

NO_MEMORY = frozenset({
    "base_model_config", "model_type", "tokenizer_type", "tokenizer_config", "trust_remote_code", "datasets",
    "test_datasets", "dataset_prepared_path", "val_set_size", "output_dir", "wandb_project", "wandb_entity",
    "wandb_watch", "wandb_name", "wandb_log_model", "num_epochs", "max_steps", "lr_scheduler", "learning_rate",
    "train_on_inputs", "group_by_length", "tf32", "early_stopping_patience", "resume_from_checkpoint",
    "logging_steps", "warmup_steps", "warmup_ratio", "evals_per_epoch", "eval_steps", "saves_per_epoch",
    "save_steps", "weight_decay", "special_tokens", "tokens", "loss_watchdog_threshold", "loss_watchdog_patience",
    "eval_sample_packing", "eval_batch_size", "strict", "chat_template", "hub_model_id", "seed",
    "lora_model_dir", "lora_fan_in_fan_out", "local_rank", "debug", "eval_table_size", "eval_max_new_tokens",
    "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "cosine_min_lr_ratio", "lr_scheduler_kwargs",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor", "save_total_limit",
    "peft_use_rslora", "shuffle_merged_datasets", "default_system_message", "dataset_processes", "plugins",
    "save_safetensors", "save_strategy", "eval_strategy", "auto_resume_from_checkpoints", "gradient_checkpointing_kwargs",
    "pad_to_sequence_len", "sequence_len_overflow_handling", "remove_unused_columns", "is_llama_derived_model",
    "is_mistral_derived_model", "is_qwen_derived_model", "hub_strategy", "use_tensorboard", "xformers_attention",
    "save_first_step", "load_best_model_at_end", "dataset_exact_deduplication", "eval_causal_lm_metrics",
    # preference losses' coefficients and data: no memory of their own
    "rl_beta", "dpo_beta", "orpo_alpha", "simpo_gamma", "cpo_alpha", "dpo_loss_type", "dpo_loss_weights",
    "dpo_label_smoothing", "dpo_use_weighting", "dpo_norm_loss", "max_prompt_len", "kto_desirable_weight",
    "kto_undesirable_weight", "rpo_alpha",
    # the effective batch (gradient_accumulation_steps = batch_size / micro_batch_size): no memory of its own
    "batch_size", "eot_tokens", "processor_type", "skip_prepare_dataset", "tokenizer_use_mistral_common",
    "ddp_find_unused_parameters", "save_only_model", "cosine_constant_lr_ratio",
})

#: Keys that make the run one memfit does not price, whatever else the file says (a value other than false/0/1),
#: with what the run then is (Axolotl's docs/config-reference.qmd).
UNPRICED = {
    "reward_model": "trains a reward model (a sequence-classification head scoring chosen against rejected)",
    "process_reward_model": "trains a process reward model (a token-classification head)",
    "gptq": "loads a GPTQ-quantized base (memfit prices bitsandbytes' 4-bit and 8-bit bases only)",
    "qat": "trains with fake-quantized weights and activations (quantization-aware training)",
    "context_parallel_size": "splits every sequence over that many ranks (ring attention)",
    "sequence_parallel_degree": "splits every sequence over that many ranks (ring attention)",
    "tensor_parallel_size": "splits every weight over that many ranks (tensor parallelism)",
    "expert_parallel_size": "places the experts over that many ranks (expert parallelism)",
    "dp_replicate_size": "replicates FSDP's shards over that many groups (HSDP)",
}
#: Keys memfit does not price that only save memory: the estimate is an upper bound by what they save.
SAVES_MEMORY = {
    "lora_mlp_kernel": "Axolotl's fused LoRA MLP kernel saves fewer activations than PEFT's modules",
    "lora_qkv_kernel": "Axolotl's fused LoRA QKV kernel saves fewer activations than PEFT's modules",
    "lora_o_kernel": "Axolotl's fused LoRA output-projection kernel saves fewer activations than PEFT's module",
    "tiled_mlp": "the MLP runs in sequence tiles, never holding its whole intermediate activation",
    "fp8": "float8 linears (torchao) save fp8 activations",
    "unfrozen_parameters": "only the parameters it matches train; priced as a full fine-tune (gradients and "
                           "optimizer state of every weight)",
    "lisa_n_layers": "LISA trains a few layers at a time; priced as a full fine-tune",
    "quantize_moe_experts": "the experts' weights are quantized too; priced with them in the training precision",
}

#: Axolotl's ``rl`` values memfit prices, as memfit's ``--method`` (``ipo`` is DPO with another loss: the same
#: tensors); the others (``kto``: unpaired; ``grpo``/``gdpo``/``ebft``: generation in the loop) it does not.
RL_METHODS = {"dpo": "dpo", "ipo": "dpo", "orpo": "orpo", "simpo": "simpo"}
RL_OTHERS = ("kto", "grpo", "gdpo", "ebft")

#: Axolotl's loss plugins (``plugins:``), matched by a word of their import path.
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"


def detect(data: dict) -> bool:
    return "base_model" in data and bool(set(data) & {"micro_batch_size", "sequence_len", "adapter", "datasets",
                                                        "sample_packing", "num_epochs"})


def _refuse_unpriced(keys: Keys) -> None:
    """One sentence naming the key where the file's run is one memfit does not price (``UNPRICED``); a quantized
    base Axolotl dequantizes on load (``model_quantization_config_kwargs: {dequantize: true}``) is its weights in
    the training precision."""
    for key, what in UNPRICED.items():
        value = keys.get(key)
        if value is True or (isinstance(value, dict) and value):
            raise keys.error(key, f"the file {what}, which memfit does not price.")
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise keys.error(key, f"{value} {what}, which memfit does not price.")
    config = keys.get("model_quantization_config")
    if config is not None:
        kwargs = keys.get("model_quantization_config_kwargs") or {}
        if not (isinstance(kwargs, dict) and kwargs.get("dequantize") is True):
            raise keys.error("model_quantization_config", f"{config} loads a base quantized by transformers, which "
                             "memfit does not price (it prices bitsandbytes' 4-bit and 8-bit bases).")
        keys.price(f"model_quantization_config: {config} with dequantize: true loads the weights dequantized, in "
                   "the training precision.")


def _saves_memory(keys: Keys) -> None:
    for key, what in SAVES_MEMORY.items():
        if keys.get(key) not in (None, False):
            # an entry that says what it is priced as already has its "not priced" said
            priced = "; priced " in what
            keys.not_mapped(key, f"{what}{'' if priced else '; not priced'} (the estimate is an upper bound by what "
                            "it saves).")


def read(path: str, data: dict) -> Reading:
    keys = Keys(path, NAME, data)
    _refuse_unpriced(keys)
    _saves_memory(keys)
    mixed = precision(keys, bf16_default=False, extra=("auto",))
    if keys.data.get("bf16") == "auto":
        keys.price("bf16: auto is bf16 on a GPU that has it (Ampere and newer); priced as bf16.")
    half = {"bf16": "bf16", "fp16": "fp16"}.get(mixed, "fp32")
    pure = next((key for key in ("bfloat16", "float16") if keys.bool(key, False)), None)
    if pure and mixed == "no":  # the weights' dtype, no autocast (docs/config-reference.qmd: "No AMP")
        half = {"bfloat16": "bf16", "float16": "fp16"}[pure]
        keys.price(f"{pure}: true loads and trains the weights in {half} without autocast; priced as pure {half}.")
    run: dict[str, Any] = {
        "seq_len": keys.int("sequence_len", 2048),
        "micro_batch": keys.int("micro_batch_size", 1),
        "grad_accum": keys.int("gradient_accumulation_steps", 1),
        "mixed_precision": mixed, "dtype": half,  # Axolotl loads the weights in the training precision
        "optimizer": trainer_optimizer(keys, "optimizer", "adamw_torch_fused", OWN_OPTIMIZERS,
                                       own={"ao_adamw_8bit": "adamw-8bit"}),
    }
    keys.origin("sequence_len", "seq_len")
    keys.origin("micro_batch_size", "micro_batch")
    run.update(_checkpointing(keys))
    run.update(_adapter(keys))
    run.update(_packing(keys))
    run.update(_attention(keys))
    activations = run.pop("offload", None)
    ray_workers(keys, "use_ray")
    run.update(_fsdp(keys))
    run.update(deepspeed(keys))
    _offload(keys, run, activations)
    run["loss"] = _loss(keys)
    _preference(keys, run)
    if keys.bool("torch_compile", False, extra=("auto",)):
        keys.not_mapped("torch_compile", "memfit prices the eager model; a compiled one may save fewer activations.")
    model = model_name(keys, "base_model")
    keys.leftovers(NO_MEMORY)
    checkpointing_kwargs(keys)
    return keys.reading(model, "base_model", run)


def _checkpointing(keys: Keys) -> dict[str, Any]:
    value = keys.bool("gradient_checkpointing", False, extra=("offload", "offload_disk"))
    out: dict[str, Any] = {"grad_checkpointing": bool(value)}
    offload = keys.bool("activation_offloading", False, extra=("legacy", "disk", "hidden_states"))
    if value in ("offload", "offload_disk") or offload:
        out["offload"] = "activations"
    return out


def _offload(keys: Keys, run: dict[str, Any], activations: str | None) -> None:
    """Activation offload (``activation_offloading``) beside the parameter/optimizer offload of the FSDP or
    DeepSpeed settings: memfit prices one offload per run, so the states' (the larger) is priced and the
    activations' is said to be left out, never claimed while the states' overwrote it."""
    if activations is None:
        return
    states = run.get("offload")
    if states is None:
        run["offload"] = activations
        keys.origin("activation_offloading", "offload")
        keys.price("activation_offloading: the tensors saved for backward go to host memory; priced as memfit's "
                   "activations offload.")
        return
    keys.not_mapped("activation_offloading", f"memfit prices one offload per run: the {states} offload of the "
                    "FSDP/DeepSpeed settings is priced, and the activations are priced on the GPU (an "
                    "over-estimate by the tensors saved for backward).")


def _adapter(keys: Keys) -> dict[str, Any]:
    adapter = keys.choice("adapter", {"lora": "lora", "qlora": "qlora"})
    four, eight = keys.bool("load_in_4bit", False), keys.bool("load_in_8bit", False)
    if adapter is None:
        if four or eight:
            keys.price("load_in_4bit/load_in_8bit without an adapter: Axolotl trains no quantized full model; "
                       "priced as a full fine-tune.")
        ignored = [key for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                                   "lora_target_linear", "lora_target_parameters") if keys.has(key)]
        for key in ignored:
            keys.get(key)
        if ignored:
            keys.price(f"{', '.join(ignored)}: ignored, as adapter is not set (Axolotl trains the full model).")
        return {}
    if adapter == "qlora" and not four:
        raise keys.error("adapter", "qlora needs load_in_4bit: true.")
    keys.origin("adapter", "lora_r")
    keys.origin("load_in_4bit" if four else "load_in_8bit", "quantize")
    out: dict[str, Any] = {"lora_r": keys.int("lora_r", 8), "lora_alpha": keys.float("lora_alpha", 16.0),
                           "lora_dropout": keys.float("lora_dropout", 0.0)}
    linear = keys.bool("lora_target_linear", False)
    if linear:
        keys.origin("lora_target_linear", "lora_targets")
    out["lora_targets"] = ("all-linear",) if linear else lora_targets(keys, "lora_target_modules")
    if linear and keys.has("lora_target_modules"):
        keys.get("lora_target_modules")
        keys.price("lora_target_linear: true wraps every linear; lora_target_modules adds nothing to it.")
    out["quantize"] = "4bit" if four else "8bit" if eight else "none"
    saved = keys.get("lora_modules_to_save")
    if saved:
        keys.not_mapped("lora_modules_to_save", f"{saved} train in full beside the adapters (their weights, "
                        "gradients and optimizer state); memfit prices adapters only, so the estimate is low by them.")
    if keys.get("lora_target_parameters"):  # PEFT's target_parameters: adapters on MoE experts' 3-D weights
        keys.not_mapped("lora_target_parameters", "adapters on the experts' parameters are not priced (the "
                        "estimate is low by their weights, gradients, optimizer state and activations).")
    if keys.bool("peft_use_dora", False):
        keys.not_mapped("peft_use_dora", "DoRA's weight norms per adapted linear are not priced (estimate low).")
    return out


def _packing(keys: Keys) -> dict[str, Any]:
    if keys.bool("sample_packing", False):
        keys.price("sample_packing (multipack): micro_batch_size rows of sequence_len tokens of whole documents, "
                   "position ids restarting per document; priced as memfit's documents packing at full rows.")
        return {"packing": "documents"}
    return {"packing": "none"}


def _attention(keys: Keys) -> dict[str, Any]:
    for key in ("flash_attention", "sdp_attention", "eager_attention", "attn_implementation"):
        if keys.data.get(key) not in (None, False):
            keys.origin(key, "attn_implementation")
    if keys.bool("flash_attention", False):
        return {"attn_implementation": flash_attention(keys, "flash_attention")}
    if keys.bool("sdp_attention", False):
        return {"attn_implementation": "sdpa"}
    if keys.bool("eager_attention", False):
        return {"attn_implementation": "eager"}
    value = keys.get("attn_implementation")
    if value is not None:
        found = {"flash_attention_2": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}.get(str(value))
        if found == "flash_attention_2":
            return {"attn_implementation": flash_attention(keys, "attn_implementation")}
        if found:
            return {"attn_implementation": found}
        keys.not_mapped("attn_implementation", f"{value} is priced as the attention transformers picks.")
    return {}


def _fsdp(keys: Keys) -> dict[str, Any]:
    value = keys.get("fsdp")
    config = keys.get("fsdp_config") or {}
    version = keys.get("fsdp_version") or config.get("fsdp_version")
    if not value and not config:
        return {}
    if str(version) != "2":  # Axolotl hands FSDP to Accelerate, whose plugin is FSDP (1) unless told 2
        keys.stack["fsdp"] = 1
        # Accelerate exports FSDP_CPU_RAM_EFFICIENT_LOADING (utils/dataclasses.py L1856), which transformers reads
        # (distributed/fsdp.py L45-51): rank 0 loads into host memory, the others on meta (settings.stack)
        if config.get("cpu_ram_efficient_loading", config.get("fsdp_cpu_ram_efficient_loading")) is True:
            keys.stack["low_memory_loading"] = True
    words = " ".join(value if isinstance(value, list) else [str(value or "")]).lower()
    strategy = str(config.get("fsdp_sharding_strategy") or config.get("sharding_strategy") or "").lower()
    reshard = config.get("reshard_after_forward", config.get("fsdp_reshard_after_forward", True))
    sharding = "zero2" if "shard_grad_op" in words + strategy or reshard is False else "fsdp"
    if "no_shard" in words + strategy and keys.stack.get("fsdp") == 1:
        sharding = "ddp"  # FSDP (1)'s NO_SHARD: whole flat parameters, priced by memory.flat_params under ddp
    out: dict[str, Any] = {"sharding": sharding}
    keys.origin("fsdp_config" if config else "fsdp", "sharding")
    shards = keys.get("dp_shard_size")
    if isinstance(shards, int) and shards > 1:  # 1 (or absent): Axolotl infers it from the world size
        keys.processes_from(shards, "dp_shard_size (FSDP's shard group: the whole world, as no other parallel "
                            "dimension is set)")
    offload = next((k for k in ("offload_params", "fsdp_offload_params") if config.get(k)), None)
    if offload or "offload" in words:
        out["offload"] = "params"
        keys.origin(f"fsdp_config.{offload}" if offload else "fsdp", "offload")
    # Accelerate wraps every decoder layer in torch's checkpoint_wrapper (non-reentrant) before sharding
    # (Axolotl's monkeypatch/accelerate/fsdp2.py L587-602; FSDP_ACTIVATION_CHECKPOINTING for FSDP (1),
    # utils/trainer.py L597): the layer-by-layer recomputation gradient_checkpointing runs, so it is priced as that
    checkpointing = next((k for k in ("activation_checkpointing", "fsdp_activation_checkpointing")
                          if config.get(k) is True), None)
    if checkpointing:
        out["grad_checkpointing"] = True
        keys.origin(f"fsdp_config.{checkpointing}", "grad_checkpointing")
        keys.price(f"fsdp_config.{checkpointing}: FSDP recomputes each decoder layer in backward; priced as "
                   "gradient checkpointing.")
    return out


def _loss(keys: Keys) -> str:
    """The loss: Cut Cross-Entropy (its plugin listed: ``cut_cross_entropy`` defaults to true there), Liger's
    fused linear cross-entropy (its plugin, with ``liger_fused_linear_cross_entropy: true``), Axolotl's chunked
    loss, else transformers' own."""
    plugins = keys.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise keys.error("plugins", f"{plugins!r} is not a list of plugin import paths.")
    cce_plugin = any("cut_cross_entropy" in p for p in plugins)
    for key in ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm"):
        if keys.bool(key, False):
            keys.not_mapped(key, "Liger's layer kernel saves fewer activations than the module it replaces; "
                            "priced without it (a slight over-estimate).")
    if keys.bool("cut_cross_entropy", cce_plugin):
        keys.origin("plugins" if cce_plugin else "cut_cross_entropy", "loss")
        return "cce"
    if keys.bool("liger_fused_linear_cross_entropy", False):
        keys.origin("liger_fused_linear_cross_entropy", "loss")
        return "liger"
    if keys.bool("chunked_cross_entropy", False):
        keys.price("chunked_cross_entropy: Axolotl's chunked loss never holds the full fp32 logits; priced as "
                   "memfit's chunked loss.")
        keys.get("chunked_cross_entropy_num_chunks")
        return "chunked"
    return "standard"


def _preference(keys: Keys, run: dict[str, Any]) -> None:
    """``rl:``: DPO (and IPO), ORPO, SimPO as memfit's preference methods; the other RL trainers refused."""
    value = keys.get("rl")
    if value is None or value is False:
        return
    name = str(value).lower()
    if name in RL_OTHERS:
        raise keys.error("rl", f"{value} is not a preference method memfit prices (rl: dpo, ipo, orpo and simpo "
                         "are); memfit cannot estimate this run.")
    if name not in RL_METHODS:
        raise keys.error("rl", f"{value!r} is not one of {', '.join([*RL_METHODS, *RL_OTHERS])}.")
    precompute = keys.bool("precompute_ref_log_probs", False)
    if keys.bool("dpo_use_liger_kernel", False):
        keys.not_mapped("dpo_use_liger_kernel", "Liger's fused DPO loss never builds the full logits; priced with "
                        "them (an over-estimate by the logits and their gradient).")
    if keys.bool("dpo_padding_free", False):
        keys.not_mapped("dpo_padding_free", "priced with padded pairs (an upper bound).")
    preference(keys, run, RL_METHODS[name], "rl", precompute=precompute and RL_METHODS[name] == "dpo")


#: Axolotl keys written together, and the source's keys they replace (``emitting.changed_only``).
GROUPS = (
    (("fsdp_version", "fsdp_config", "deepspeed"), ("fsdp",)),
    (("flash_attention", "sdp_attention"), ("attn_implementation", "eager_attention", "xformers_attention")),
    (("cut_cross_entropy", "liger_fused_linear_cross_entropy", "chunked_cross_entropy", "plugins"), ()),
    (("adapter", "load_in_4bit", "load_in_8bit", "lora_target_linear", "lora_target_modules"), ()),
    (("rl", "precompute_ref_log_probs"), ()),
)


def emit(model: str, run, source: Reading | None = None) -> dict[str, Any]:
    """``run`` as an Axolotl YAML: a source Axolotl file with only what the plan changed (``emitting``)."""

    same = source is not None and source.tool == NAME
    kept = [p for p in (source.data.get("plugins") or []) if isinstance(p, str) and "cut_cross_entropy" not in p
            and "liger" not in p] if same else []
    out = merged(source, NAME, "base_model", model, run, lambda r: _settings(r, kept), GROUPS)
    if same:
        _fsdp_as_written(out, source, run)
        _checkpointing_and_offload_as_planned(out, run)
    return out


def _fsdp_as_written(out: dict[str, Any], source: Reading, run) -> None:
    """A plan that keeps FSDP keeps the source's FSDP settings (its version, wrap policy, state dict, FSDP's own
    activation checkpointing), with only the resharding and parameter offload the plan chose, in the source's
    spelling: the writer's two-key ``fsdp_config`` dropped them, and the FSDP version the plan was priced on."""
    config, words = source.data.get("fsdp_config"), source.data.get("fsdp")
    if str(run.sharding) not in ("fsdp", "zero2") or str(source.run.sharding) not in ("fsdp", "zero2"):
        return
    if not isinstance(config, dict) and not words:
        return
    config = dict(config) if isinstance(config, dict) else {}
    full, offload = str(run.sharding) == "fsdp", str(run.offload) == "params"
    for key in ("fsdp", "fsdp_version"):
        if key in source.data:
            out[key] = source.data[key]
        else:
            out.pop(key, None)
    if words:  # FSDP (1)'s option words: the strategy and "offload" among them
        listed = words if isinstance(words, list) else str(words).split()
        listed = [w for w in listed if str(w).lower() not in ("full_shard", "shard_grad_op", "offload")]
        listed = ["full_shard" if full else "shard_grad_op", *listed, *(["offload"] if offload else [])]
        out["fsdp"] = listed if isinstance(words, list) else " ".join(listed)
    version2 = str(source.data.get("fsdp_version") or config.get("fsdp_version")) == "2"
    prefix = "" if version2 else "fsdp_"
    for key in ("sharding_strategy", "fsdp_sharding_strategy"):
        if key in config:
            config[key] = "FULL_SHARD" if full else "SHARD_GRAD_OP"
    reshard = next((k for k in ("reshard_after_forward", "fsdp_reshard_after_forward") if k in config), None)
    if reshard or not full:
        config[reshard or f"{prefix}reshard_after_forward"] = full
    spelled = next((k for k in ("offload_params", "fsdp_offload_params") if k in config), None)
    if spelled or offload:
        config[spelled or f"{prefix}offload_params"] = offload
    out["fsdp_config"] = config


def _checkpointing_and_offload_as_planned(out: dict[str, Any], run) -> None:
    """Checkpointing and activation offload as the plan chose them, where the source said them with keys the plan's
    keys leave standing or take away: FSDP's own ``activation_checkpointing`` (kept with FSDP, gone without it),
    ``activation_offloading`` beside a parameter offload (read as one only while no states are offloaded), and
    ``gradient_checkpointing: offload``."""
    config = out.get("fsdp_config") if isinstance(out.get("fsdp_config"), dict) else {}
    fsdp_recomputes = [k for k in ("activation_checkpointing", "fsdp_activation_checkpointing") if config.get(k) is True]
    if not run.grad_checkpointing and fsdp_recomputes:
        out["fsdp_config"] = {**config, **dict.fromkeys(fsdp_recomputes, False)}
    elif run.grad_checkpointing and not fsdp_recomputes and out.get("gradient_checkpointing") in (None, False):
        out["gradient_checkpointing"] = True
    activations = str(run.offload) == "activations"
    if not activations and out.get("gradient_checkpointing") in ("offload", "offload_disk"):
        out["gradient_checkpointing"] = run.grad_checkpointing
    if str(run.offload) == "none" and out.get("activation_offloading") not in (None, False):
        out["activation_offloading"] = False


def _settings(run, plugins: list[str]) -> dict[str, Any]:
    """Axolotl's keys for ``run`` (``plugins``: the source's plugins other than the loss's)."""

    loss_plugin = {"cce": [CCE_PLUGIN], "liger": [LIGER_PLUGIN]}.get(str(run.loss), [])
    out: dict[str, Any] = {
        "sequence_len": run.seq_len, "micro_batch_size": run.micro_batch,
        "gradient_accumulation_steps": run.grad_accum, "sample_packing": str(run.packing) == "documents",
        "bf16": str(run.mixed_precision) == "bf16", "fp16": str(run.mixed_precision) == "fp16",
        "gradient_checkpointing": run.grad_checkpointing, "optimizer": OPTIMIZER_NAMES[str(run.optimizer)],
        "activation_offloading": str(run.offload) == "activations",
        "adapter": ("qlora" if str(run.quantize) == "4bit" else "lora") if run.is_lora() else None,
        "load_in_4bit": str(run.quantize) == "4bit", "load_in_8bit": str(run.quantize) == "8bit",
        "flash_attention": str(run.attn_implementation) == "flash_attention_2",
        "sdp_attention": str(run.attn_implementation) == "sdpa",
        "chunked_cross_entropy": str(run.loss) == "chunked", "cut_cross_entropy": str(run.loss) == "cce",
        "liger_fused_linear_cross_entropy": str(run.loss) == "liger", "plugins": (plugins + loss_plugin) or None,
        "rl": None if str(run.method) == "sft" else str(run.method),
        "precompute_ref_log_probs": run.precompute_reference or None,
    }
    if run.is_lora():
        linear = run.lora.targets == ("all-linear",)
        out.update(lora_r=run.lora.r, lora_alpha=run.lora.alpha, lora_dropout=run.lora.dropout,
                   lora_target_linear=linear, lora_target_modules=None if linear else list(run.lora.targets))
    if str(run.sharding) in ("fsdp", "zero2"):
        out["fsdp_version"] = 2
        out["fsdp_config"] = {"reshard_after_forward": str(run.sharding) == "fsdp",
                              "offload_params": str(run.offload) == "params"}
    elif str(run.sharding) == "zero3":
        out["deepspeed"] = "deepspeed_configs/zero3_bf16.json"
    return out


def launch(run) -> str | None:
    """The launch command that states the run's process count (read back by ``common.stated_processes``)."""
    if run.num_processes > 1:
        return f"accelerate launch --num_processes {run.num_processes} -m axolotl.cli.train THIS_FILE"
    return None


def realize(run):
    """A planner candidate as Axolotl runs it (None: it cannot): the weights load in the training precision
    (fp32 weights under bf16 autocast become bf16 weights), the optimizer steps after backward, optimizer-state
    offload only through DeepSpeed (not emitted)."""
    if run.optimizer_in_backward or str(run.offload) == "optimizer":
        return None
    if str(run.offload) == "params" and str(run.sharding) not in ("fsdp", "zero2"):
        return None
    half = {"bf16": "bf16", "fp16": "fp16"}.get(str(run.mixed_precision))
    if half is None and str(run.dtype) != "fp32":
        return run.replace(mixed_precision=str(run.dtype))
    return run.replace(dtype=half or "fp32")
