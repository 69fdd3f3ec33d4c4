"""LLaMA-Factory's YAML (``llamafactory-cli train config.yaml``), read from its documented schema
(``src/llamafactory/hparams``: ModelArguments, DataArguments, FinetuningArguments, and Trainer's arguments).

How LLaMA-Factory runs a step, where it differs from memfit's own trainer:

- the model loads in the compute dtype (bf16 with ``bf16: true``); a full fine-tune then casts its trainable
  weights to fp32 unless ``pure_bf16`` (``cast_trainable_params_to_fp32``): fp32 weights under bf16 autocast,
  as memfit's AMP; LoRA keeps the base in bf16 and the adapters in fp32, as memfit's LoRA on a bf16 base;
- gradient checkpointing is on unless ``disable_gradient_checkpointing``;
- ``packing`` concatenates documents that then attend to the ones before them (memfit's ``concat``);
  ``neat_packing`` keeps them apart (memfit's ``documents``);
- ``quantization_bit`` runs PEFT's ``prepare_model_for_kbit_training`` (non-quantized weights in fp32), as
  memfit's QLoRA does.
"""

from __future__ import annotations

from typing import Any

from memfit.interop.common import (
    Keys,
    Reading,
    flash_attention,
    lora_targets,
    model_name,
    precision,
    preference,
    trainer_optimizer,
)
from memfit.interop.emitting import OPTIMIZER_NAMES, merged
from memfit.interop.sharding import accelerate_launch, deepspeed, fsdp, ray_workers

NAME = "llamafactory"
#: The shardings this tool runs through DeepSpeed (``emit`` writes them as a DeepSpeed config).
DEEPSPEED = frozenset({"zero2", "zero3"})
MARKERS = frozenset({"finetuning_type", "stage", "cutoff_len", "template", "lora_target", "quantization_bit"})

NO_MEMORY = frozenset({
    "trust_remote_code", "do_train", "do_eval", "dataset", "eval_dataset", "dataset_dir", "template",
    "max_samples", "overwrite_cache", "preprocessing_num_workers", "dataloader_num_workers", "output_dir",
    "logging_steps", "save_steps", "plot_loss", "overwrite_output_dir", "save_only_model", "report_to",
    "learning_rate", "num_train_epochs", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "ddp_timeout",
    "resume_from_checkpoint", "val_size", "per_device_eval_batch_size", "eval_strategy", "eval_steps",
    "weight_decay", "max_grad_norm", "max_steps", "seed", "adapter_name_or_path", "export_dir", "export_size",
    "export_device", "export_legacy_format", "run_name", "save_strategy", "save_total_limit", "streaming",
    "buffer_size", "mix_strategy", "tokenized_path", "train_on_prompt", "mask_history", "lora_rank_pattern",
    "create_new_adapter", "use_rslora", "pref_beta", "pref_ftx", "simpo_gamma", "dpo_label_smoothing", "pref_bco_weight", "media_dir", "image_max_pixels",
    "video_max_pixels", "freeze_vision_tower", "freeze_multi_modal_projector", "default_system", "enable_thinking",
    "quantization_type", "ddp_find_unused_parameters",
    "hub_model_id", "push_to_hub", "include_num_input_tokens_seen", "disable_shuffling",
})


#: ``stage`` -> memfit's method (``pt`` and ``sft``: next-token training); ``stage: dpo`` runs the loss ``pref_loss``
#: names: ``orpo`` and ``simpo`` with no reference model, the others (sigmoid, hinge, ipo, kto_pair, ...) DPO's.
STAGES = {"pt": "sft", "sft": "sft", "dpo": "dpo"}
REFUSED_STAGES = ("kto", "rm", "ppo")
NO_REFERENCE = {"orpo": "orpo", "simpo": "simpo"}


#: LLaMA-Factory v1's configuration (``examples/v1``: ``model``, ``model_class``, ``dist_config``, ``peft_config``),
#: another schema than the v0 one this reader reads.
V1_MARKERS = frozenset({"model_class", "dist_config", "peft_config", "kernel_config", "train_dataset"})
#: Keys that run the step on another engine than transformers' Trainer, which memfit does not price.
OTHER_ENGINES = {
    "tensor_model_parallel_size": "Megatron-Core (LLaMA-Factory's mcore adapter)",
    "pipeline_model_parallel_size": "Megatron-Core (LLaMA-Factory's mcore adapter)",
    "expert_model_parallel_size": "Megatron-Core (LLaMA-Factory's mcore adapter)",
    "use_distributed_optimizer": "Megatron-Core (LLaMA-Factory's mcore adapter)",
    "use_packed_sequences": "Megatron-Bridge",
    "use_kt": "KTransformers (the experts on the CPU)",
}
#: Optimizers LLaMA-Factory swaps in beside Trainer's ``optim`` (``use_muon``, ``use_adam_mini``), each keeping
#: less state than AdamW.
OWN_OPTIMIZERS = {"use_muon": "Muon keeps one momentum per matrix weight (AdamW's fp32 moments elsewhere)",
                  "use_adam_mini": "Adam-mini keeps one second moment per block, not per weight"}


def detect(data: dict) -> bool:
    return ("model_name_or_path" in data and bool(set(data) & MARKERS)) or (
        "model" in data and bool(set(data) & V1_MARKERS))


def _refuse_unpriced(keys: Keys) -> None:
    """One sentence naming the key where the file is no training step memfit prices: v1's schema, another engine,
    or no training at all (inference, export and prediction configs have no ``do_train: true``)."""
    v1 = sorted(set(keys.data) & V1_MARKERS)
    if v1 and not keys.has("model_name_or_path"):
        raise keys.error(v1[0], "the file is LLaMA-Factory v1's configuration (model, model_class, dist_config, "
                         "peft_config), which memfit does not read (it reads v0's: model_name_or_path, stage, "
                         "finetuning_type, ...).")
    for key, engine in OTHER_ENGINES.items():
        if keys.has(key) and keys.data[key] is not False:
            raise keys.error(key, f"the file runs its step on {engine}, whose memory memfit does not price.")
    if keys.bool("do_train", False) is not True:
        doing = next((k for k in ("infer_backend", "export_dir", "do_predict") if keys.has(k)), None)
        what = {"infer_backend": "inference", "export_dir": "an export (merge)", "do_predict": "prediction"}
        raise keys.error("do_train", f"not true, so the file configures no training ({what.get(doing, 'none')}); "
                         "memfit prices training steps.")


def read(path: str, data: dict) -> Reading:
    keys = Keys(path, NAME, data)
    _refuse_unpriced(keys)
    mixed = precision(keys)
    method = keys.choice("finetuning_type", {"lora": "lora", "full": "full", "freeze": "freeze", "oft": "oft"},
                         "lora")
    run: dict[str, Any] = {
        "seq_len": keys.int("cutoff_len", 2048),
        "micro_batch": keys.int("per_device_train_batch_size", 8),
        "grad_accum": keys.int("gradient_accumulation_steps", 1),
        "mixed_precision": mixed,
        "grad_checkpointing": not keys.bool("disable_gradient_checkpointing", False),
        "optimizer": trainer_optimizer(keys, "optim", "adamw_torch_fused"),
    }
    half = {"bf16": "bf16", "fp16": "fp16"}.get(mixed, "fp32")
    if method in ("lora", "oft"):
        run.update(_lora(keys, method), dtype=half)
    else:
        pure = keys.bool("pure_bf16", False)
        run["dtype"] = "bf16" if pure else "fp32"  # trainable weights cast to fp32 unless pure_bf16
        if method == "freeze":
            keys.not_mapped("finetuning_type", "freeze trains only the last freeze_trainable_layers layers; "
                            "priced as a full fine-tune (gradients and optimizer state of every weight: an "
                            "over-estimate).")
            keys.get("freeze_trainable_layers")
            keys.get("freeze_trainable_modules")
    run.update(_packing(keys))
    run.update(_attention(keys))
    ray_workers(keys, None)
    run.update(accelerate_launch(keys))  # the launch command's Accelerate config; the file's own keys over it
    run.update(fsdp(keys))  # Trainer's own fsdp option (LLaMA-Factory passes its Trainer arguments on)
    run.update(deepspeed(keys))
    keys.origin("fsdp" if keys.has("fsdp") else "deepspeed", "sharding")
    keys.origin("quantization_bit", "quantize")
    keys.origin("cutoff_len", "seq_len")
    keys.origin("flash_attn", "attn_implementation")
    if keys.bool("enable_liger_kernel", False):
        run["loss"] = "liger"
        keys.price("enable_liger_kernel: Liger's fused linear cross-entropy is patched in; priced as memfit's "
                   "liger loss (its layer kernels are not priced: a slight over-estimate).")
    _stage(keys, run)
    _unsloth(keys, run)
    if run["grad_checkpointing"]:
        # model_args.py L149-151 use_reentrant_gc defaults to True, passed as {"use_reentrant": ...}
        # (model_utils/checkpointing.py L46); FSDP2 turns it off (L177-182)
        fsdp2 = run.get("sharding") == "fsdp" and keys.stack.get("fsdp", 2) == 2
        keys.stack["reentrant_checkpointing"] = keys.bool("use_reentrant_gc", True) and not fsdp2
    for key in ("use_galore", "use_apollo", "use_badam", "upcast_layernorm", "upcast_lmhead_output", "use_dora",
                "pissa_init", "mixture_of_depths", "fp8"):
        if keys.get(key) not in (None, False):
            keys.not_mapped(key, "memfit has no term for it; the estimate is the run without it.")
    _asft(keys)
    for key, what in OWN_OPTIMIZERS.items():
        if keys.bool(key, False):
            keys.not_mapped(key, f"{what}; priced as {run['optimizer']} (the optimizer state is over-stated).")
    model = model_name(keys, "model_name_or_path")
    keys.leftovers(NO_MEMORY)
    return keys.reading(model, "model_name_or_path", run)


def _asft(keys: Keys) -> None:
    """``use_asft_loss``: LLaMA-Factory loads a frozen reference model (``train/sft/workflow.py``, ``create_ref_model``)
    and runs it every step for a KL term on its logits (``train/sft/trainer.py``, ``compute_loss``), which memfit's
    next-token run has no term for."""
    if keys.bool("use_asft_loss", False):
        keys.get("asft_alpha")
        keys.not_mapped("use_asft_loss", "ASFT loads a frozen reference model beside the trained one and computes "
                        "its logits every step for a KL term; neither is priced (the estimate is low by a copy of the "
                        "model's weights and a (B, T, vocabulary) logits tensor).")


def _unsloth(keys: Keys, run: dict[str, Any]) -> None:
    """``use_unsloth``: Unsloth loads the model and its LoRA (LLaMA-Factory's ``model/model_utils/unsloth.py``:
    ``FastLanguageModel.from_pretrained`` / ``get_peft_model``), always with Unsloth's offloaded checkpointing
    (``_get_unsloth_kwargs`` and ``get_unsloth_peft_model`` pass ``use_gradient_checkpointing="unsloth"``): priced on
    the unsloth stack (``memory.unsloth_layer``, read off Unsloth 2024.12; transformers' layers where its kernels do
    not run, said by the estimate). ``use_unsloth_gc`` alone: LLaMA-Factory's copy of that checkpointing on
    transformers' layers (each checkpointed layer's input copied to the host, "no need to install unsloth"). Either
    way the checkpoints live on the host: ``--offload activations`` with checkpointing."""
    unsloth, offloaded = keys.bool("use_unsloth", False), keys.bool("use_unsloth_gc", False)
    if unsloth:
        keys.stack["trainer"] = "unsloth"
        keys.price("use_unsloth: Unsloth's layers, LoRA kernels and loss, priced as Unsloth 2024.12 runs them "
                   "(memory/unsloth_layer.py); its checkpointing offloads each layer's input to the host.")
    if unsloth and not run.get("grad_checkpointing"):  # Unsloth's get_peft_model turns its checkpointing on
        run["grad_checkpointing"] = True
        keys.price("disable_gradient_checkpointing: Unsloth checkpoints anyway (LLaMA-Factory passes "
                   "use_gradient_checkpointing=\"unsloth\" to it); priced with checkpointing.")
    if not (unsloth or offloaded):
        return
    if not run.get("grad_checkpointing"):
        keys.not_mapped("use_unsloth_gc", "gradient checkpointing is off (disable_gradient_checkpointing), so no "
                        "checkpoint is offloaded.")
    elif run.get("offload") in (None, "none"):
        run["offload"] = "activations"
        if offloaded and not unsloth:
            keys.price("use_unsloth_gc: each checkpointed layer's input is copied to the host (Unsloth's "
                       "checkpointing on transformers' layers): priced as --offload activations.")


def _stage(keys: Keys, run: dict[str, Any]) -> None:
    """``stage``: next-token training, or ``dpo`` with ``pref_loss`` as memfit's preference method; reward
    modelling, PPO and KTO refused (memfit prices none of them)."""
    stage = str(keys.get("stage", "sft")).lower()
    if stage in REFUSED_STAGES:
        raise keys.error("stage", f"{stage} is not a training memfit prices (stage: pt, sft and dpo with pref_loss "
                         "sigmoid, ipo, hinge, orpo or simpo are).")
    if stage not in STAGES:
        raise keys.error("stage", f"{stage!r} is not one of {', '.join([*STAGES, *REFUSED_STAGES])}.")
    loss = str(keys.get("pref_loss", "sigmoid")).lower()
    if STAGES[stage] == "sft":
        return
    if loss == "kto_pair":
        keys.price("pref_loss: kto_pair is DPO's pair loss with another formula; priced as DPO (the same tensors).")
    if keys.get("ref_model") is not None:
        keys.not_mapped("ref_model", "a separate reference model is priced as memfit's reference policy (the base "
                        "with the adapter off for LoRA, a copy of the base otherwise).")
    preference(keys, run, NO_REFERENCE.get(loss, "dpo"), "stage")


def _lora(keys: Keys, method: str) -> dict[str, Any]:
    if method == "oft":
        keys.not_mapped("finetuning_type", "OFT's orthogonal blocks are priced as LoRA adapters of the same rank.")
    rank = keys.int("lora_rank", 8)
    out: dict[str, Any] = {"lora_r": rank, "lora_alpha": keys.float("lora_alpha", None) or 2.0 * rank,
                           "lora_dropout": keys.float("lora_dropout", 0.0),
                           "lora_targets": lora_targets(keys, "oft_target" if method == "oft" else "lora_target")}
    if method == "oft":
        keys.get("oft_block_size")  # the blocks' size, whose parameters the rank's adapters stand for
    bits = keys.choice("quantization_bit", {"4": "4bit", "8": "8bit"})
    if bits:
        out["quantize"] = bits
        _quantization_method(keys)
    extra = keys.get("additional_target")
    if extra:
        keys.not_mapped("additional_target", f"{extra} train in full beside the adapters; their gradients and "
                        "optimizer state are not priced (the estimate is low by them).")
    return out


def _quantization_method(keys: Keys) -> None:
    """``quantization_method`` (``ModelArguments``: bnb, hqq, eetq; bitsandbytes by default): memfit prices
    bitsandbytes' bases, NF4 with double quantization (``double_quantization``, on by default), only."""
    method = str(keys.get("quantization_method", "bnb")).lower()
    if method not in ("bnb", "bitsandbytes"):
        raise keys.error("quantization_method", f"{method} quantizes the base with another layout than bitsandbytes', "
                         "which memfit does not price (quantization_method: bnb it does).")
    if keys.bool("double_quantization", True) is False:
        keys.not_mapped("double_quantization", "false keeps each 64-weight block's scale in fp32, not 8 bits: about "
                        "0.4 bit per base weight more than the NF4 base memfit prices (an under-estimate).")


def _packing(keys: Keys) -> dict[str, Any]:
    if keys.bool("neat_packing", False):
        return {"packing": "documents"}
    packing = keys.get("packing")
    if packing is None:  # LLaMA-Factory packs pre-training (stage pt) only, by default
        packing = keys.data.get("stage") == "pt"
    elif not isinstance(packing, bool):
        raise keys.error("packing", f"{packing!r} is not true or false.")
    return {"packing": "concat" if packing else "none"}


def _attention(keys: Keys) -> dict[str, Any]:
    value = keys.choice("flash_attn", {"auto": "auto", "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2",
                                       "fa3": "flash_attention_2"}, "auto")
    if value == "flash_attention_2":
        value = flash_attention(keys, "flash_attn")
    return {"attn_implementation": value}


#: LLaMA-Factory keys written together, and the source's keys they replace (``emitting.changed_only``).
GROUPS = (
    # pure_bf16 is not among them: a plan that changes the precision of a freeze (or full) run keeps its method
    (("finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "quantization_bit"),
     ("freeze_trainable_layers", "freeze_trainable_modules", "additional_target")),
    # Trainer's fsdp option and its settings go with the sharding the plan chose
    (("fsdp", "deepspeed"), ("fsdp_config", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params")),
    (("packing", "neat_packing"), ()),
    (("stage", "pref_loss"), ()),
)


def emit(model: str, run, source: Reading | None = None) -> dict[str, Any]:
    """``run`` as a LLaMA-Factory training YAML: a source LLaMA-Factory file with only what the plan changed."""

    return merged(source, NAME, "model_name_or_path", model, run, _settings, GROUPS)


def _settings(run) -> dict[str, Any]:
    """LLaMA-Factory's keys for ``run``."""

    method = str(run.method)
    out: dict[str, Any] = {
        "stage": "sft" if method == "sft" else "dpo", "pref_loss": {"orpo": "orpo", "simpo": "simpo"}.get(method),
        "do_train": True, "finetuning_type": "lora" if run.is_lora() else "full",
        "cutoff_len": run.seq_len, "per_device_train_batch_size": run.micro_batch,
        "gradient_accumulation_steps": run.grad_accum,
        "bf16": str(run.mixed_precision) == "bf16", "fp16": str(run.mixed_precision) == "fp16",
        "disable_gradient_checkpointing": not run.grad_checkpointing,
        "optim": OPTIMIZER_NAMES[str(run.optimizer)],
        "packing": str(run.packing) == "concat", "neat_packing": str(run.packing) == "documents",
        "flash_attn": {"auto": "auto", "eager": "disabled", "sdpa": "sdpa",
                       "flash_attention_2": "fa2"}[str(run.attn_implementation)],
        "enable_liger_kernel": str(run.loss) == "liger",
        "deepspeed": f"examples/deepspeed/ds_z{str(run.sharding)[-1]}_config.json"
        if str(run.sharding) in ("zero2", "zero3") else None,
        # Trainer's own FSDP option (read by ``sharding.fsdp``), so that a file sharded with it and planned without
        # FSDP loses it
        "fsdp": "full_shard auto_wrap" if str(run.sharding) == "fsdp" else None,
    }
    if run.is_lora():
        out.update(lora_rank=run.lora.r, lora_alpha=run.lora.alpha, lora_dropout=run.lora.dropout,
                   lora_target="all" if run.lora.targets == ("all-linear",) else ",".join(run.lora.targets),
                   quantization_bit=int(str(run.quantize)[0]) if str(run.quantize) != "none" else None)
    elif str(run.dtype) == "bf16":
        out["pure_bf16"] = True
    return out


def launch(run) -> str | None:
    """LLaMA-Factory's launch with the run's process count (``NPROC_PER_NODE``, read back by
    ``common.stated_processes``)."""
    if run.num_processes > 1:
        return f"FORCE_TORCHRUN=1 NPROC_PER_NODE={run.num_processes} llamafactory-cli train THIS_FILE"
    return None


def realize(run):
    """A planner candidate as LLaMA-Factory runs it (None: it cannot): the weight dtype follows the method
    (full: fp32 under autocast, or pure bf16 with bf16 autocast; LoRA: the base in the compute dtype), the loss
    is transformers' (or Liger's), the optimizer steps after backward, nothing offloaded outside DeepSpeed."""
    if run.optimizer_in_backward or str(run.offload) != "none" or str(run.loss) in ("chunked", "cce"):
        return None
    if run.precompute_reference:  # LLaMA-Factory computes the reference during training only
        return None
    if str(run.sharding) == "fsdp":
        return None
    half = {"bf16": "bf16", "fp16": "fp16"}.get(str(run.mixed_precision))
    if run.is_lora():
        return run.replace(dtype=half) if half else None
    if str(run.dtype) == "bf16":  # pure_bf16: bf16 weights under bf16 autocast
        return run.replace(mixed_precision="bf16")
    return run
