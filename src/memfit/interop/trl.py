"""transformers ``TrainingArguments`` and TRL ``SFTConfig`` (+ TRL's ``ModelConfig``) as YAML or JSON.

Written from the documented schema: ``transformers.TrainingArguments`` (5.x) and TRL 1.x's ``SFTConfig``
and ``ModelConfig``, which ``trl sft --config FILE.yaml`` reads from one flat file. A file holding any of
SFTConfig's own keys is read with SFTConfig's defaults (``gradient_checkpointing`` and ``bf16`` on,
``max_length`` 1024); a plain ``TrainingArguments`` file with Trainer's.

How the tools run a step, where it differs from memfit's own trainer:

- ``SFTTrainer`` (TRL >= 1.14) computes the loss with its fused LM head (``add_fused_lm_head``): the full
  (B, T, V) logits are never built, but a ``min(B T, 4096) x 32768`` projection buffer is, whatever the
  vocabulary, with fp32 gradient accumulators and the entropy/top-1 metrics: memfit's ``--loss trl``
  (``memory.trl_head``).
- ``Trainer`` computes the loss in the model's forward (transformers' ``ForCausalLMLoss``, logits upcast to
  fp32): memfit's ``standard`` loss, the same code.
- PEFT's ``prepare_model_for_kbit_training`` (QLoRA) casts the non-quantized weights to fp32, as memfit does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.interop.common import (
    Keys,
    Reading,
    checkpointing_kwargs,
    comment_words,
    flash_attention,
    lora_targets,
    model_name,
    precision,
    preference,
    trainer_optimizer,
)
from memfit.interop.emitting import OPTIMIZER_NAMES, dtype_name, merged
from memfit.interop.sharding import accelerate_launch, deepspeed, fsdp

NAME = "trl"
#: The shardings this tool runs through DeepSpeed (``emit`` writes them as a DeepSpeed config); the others FSDP.
DEEPSPEED = frozenset({"zero3"})

#: Keys only SFTConfig/ModelConfig have (a file with one of them is a TRL file: SFTConfig's defaults apply).
SFT_KEYS = frozenset({
    "max_length", "max_seq_length", "packing", "padding_free", "packing_strategy", "dataset_text_field",
    "completion_only_loss", "assistant_only_loss", "model_name_or_path", "use_peft", "lora_target_modules",
    "load_in_4bit", "load_in_8bit", "model_init_kwargs", "dataset_name", "activation_offloading", "loss_type",
    "dataset_num_proc", "eos_token", "chat_template_path", "dataset_kwargs", "truncation_mode",
})
#: Keys only TRL's preference configs have (DPOConfig; ORPOConfig and CPOConfig, in ``trl.experimental`` since
#: TRL 1.0, share most of them): a file with one of them is a preference run.
PREFERENCE_KEYS = frozenset({
    "beta", "precompute_ref_log_probs", "precompute_ref_batch_size", "ref_model_init_kwargs", "max_prompt_length",
    "max_completion_length", "rpo_alpha", "reference_free", "force_use_ref_model", "sync_ref_model", "use_weighting",
    "label_smoothing", "ld_alpha", "f_divergence_type", "discopop_tau", "ref_adapter_name", "model_adapter_name",
    "simpo_gamma", "cpo_alpha", "generate_during_eval", "use_liger_loss",
})
#: TRL's trainers (its CLI commands, alignment-handbook's scripts and recipe folders) -> memfit's method; a
#: CPO run is SimPO with ``loss_type: simpo`` (else DPO's tensors), and the others are refused.
TRAINERS = {"sft": "sft", "dpo": "dpo", "orpo": "orpo", "cpo": "dpo", "simpo": "simpo"}
REFUSED_TRAINERS = ("kto", "grpo", "rloo", "ppo", "online_dpo", "xpo", "nash_md", "gkd", "prm", "reward")
#: TRL 1.x DPOConfig defaults where they differ from SFTConfig's.
PREFERENCE_DEFAULT_LENGTH = 1024
#: TrainingArguments keys that mark a Trainer file.
TRAINER_KEYS = frozenset({"per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "optim",
                          "num_train_epochs", "learning_rate", "lr_scheduler_type"})

NO_MEMORY = frozenset({
    "output_dir", "overwrite_output_dir", "do_train", "do_eval", "do_predict", "eval_strategy", "evaluation_strategy",
    "eval_steps", "per_device_eval_batch_size", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "max_grad_norm", "num_train_epochs", "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs",
    "warmup_ratio", "warmup_steps", "logging_dir", "logging_strategy", "logging_steps", "logging_first_step",
    "save_strategy", "save_steps", "save_total_limit", "save_only_model", "seed", "data_seed", "report_to",
    "run_name", "push_to_hub", "hub_model_id", "hub_strategy", "load_best_model_at_end", "metric_for_best_model",
    "greater_is_better", "dataloader_num_workers", "dataloader_pin_memory", "remove_unused_columns",
    "label_names", "disable_tqdm", "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
    "dataset_text_field", "dataset_num_proc", "dataset_kwargs", "completion_only_loss", "assistant_only_loss",
    "eos_token", "chat_template_path", "truncation_mode", "shuffle_dataset", "eval_packing", "model_revision",
    "trust_remote_code", "lora_task_type", "tf32", "group_by_length", "resume_from_checkpoint", "log_level",
    "eval_on_start", "include_num_input_tokens_seen", "average_tokens_across_devices", "ddp_find_unused_parameters",
    "lora_modules_to_save", "loss_type", "pad_to_multiple_of", "gradient_checkpointing_kwargs", "optim_args",
    # preference losses' coefficients and prompt/completion split: no memory of their own (max_length is the pair's
    # longest sequence, prompt included)
    "beta", "max_prompt_length", "max_completion_length", "rpo_alpha", "label_smoothing", "loss_weights",
    "use_weighting", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau", "sync_ref_model",
    "ref_model_mixup_alpha", "ref_model_sync_steps", "disable_dropout", "generate_during_eval", "reference_free",
    "precompute_ref_batch_size", "simpo_gamma", "cpo_alpha", "model_adapter_name", "ref_adapter_name",
    # alignment-handbook's script arguments
    "chat_template", "dataset_mixture", "hub_private_repo",
})


def detect(data: dict) -> bool:
    return bool(set(data) & (SFT_KEYS | TRAINER_KEYS | PREFERENCE_KEYS))


def trainer(path: str, data: dict) -> tuple[str, str]:
    """(TRL's trainer, what says so) of a file: the ``trl CMD`` launch command in its comments, a CPO
    ``loss_type: simpo``, the recipe's name or folder (alignment-handbook's ``recipes/MODEL/orpo/``), a key only
    the preference configs have, a key only SFTConfig has; else ``trainer`` (plain ``TrainingArguments``)."""

    words = comment_words(path)
    if "trl" in words:
        for name in (*TRAINERS, *REFUSED_TRAINERS):
            if name in words:
                return name, f"the launch command trl {name} in its comments"
    if str(data.get("loss_type", "")).lower() == "simpo":
        return "simpo", "loss_type"
    named = set(re.split(r"[^a-z0-9]+", f"{Path(path).parent.name} {Path(path).stem}".lower()))
    for name in ("orpo", "kto", "cpo", "dpo"):
        if name in named:
            return name, f"its name ({Path(path).parent.name}/{Path(path).name})"
    marked = sorted(k for k in set(data) & PREFERENCE_KEYS if data[k] is not None)
    if marked:
        return "dpo", marked[0]
    return ("sft", "") if set(data) & SFT_KEYS else ("trainer", "")


def read(path: str, data: dict) -> Reading:
    keys = Keys(path, NAME, data)
    kind, said_by = trainer(path, data)
    if kind in REFUSED_TRAINERS:
        raise UserError(f"{path}: {said_by} names TRL's {kind} trainer, which memfit does not price (TRL's sft, dpo, "
                        "orpo and cpo/simpo it does).")
    method = TRAINERS.get(kind, "sft")
    sft = kind != "trainer"  # TRL's configs (SFT and preference) default to bf16 and gradient checkpointing
    run: dict[str, Any] = {
        "micro_batch": keys.int("per_device_train_batch_size", 8),
        "grad_accum": keys.int("gradient_accumulation_steps", 1),
        "mixed_precision": precision(keys, bf16_default=sft),
        "grad_checkpointing": keys.bool("gradient_checkpointing", sft),
        "optimizer": trainer_optimizer(keys, "optim", "adamw_torch_fused"),
    }
    checkpointing_kwargs(keys)
    run.update(_sequence(keys, sft))
    run.update(_model(keys, sft))
    run.update(accelerate_launch(keys))  # the launch command's Accelerate config; the file's own keys over it
    run.update(fsdp(keys))
    run.update(deepspeed(keys))
    keys.origin("fsdp" if keys.has("fsdp") else "deepspeed", "sharding")
    if keys.bool("activation_offloading", False):
        run["offload"] = "activations"
    run["loss"] = _loss(keys, kind == "sft", method)
    if method != "sft":
        _preference(keys, run, method, said_by)
    if keys.bool("torch_compile", False):
        keys.not_mapped("torch_compile", "memfit prices the eager model; a compiled one may save fewer activations.")
    model = model_name(keys, "model_name_or_path")
    keys.leftovers(NO_MEMORY)
    return keys.reading(model, "model_name_or_path", run)


def _sequence(keys: Keys, sft: bool) -> dict[str, Any]:
    """Sequence length and packing. A TrainingArguments file has no sequence length: memfit's default."""
    out: dict[str, Any] = {}
    length = keys.int("max_length", None) or keys.int("max_seq_length", None)
    keys.origin("max_length" if keys.has("max_length") else "max_seq_length", "seq_len")
    if length is None and sft:
        length = PREFERENCE_DEFAULT_LENGTH  # SFTConfig's and DPOConfig's default (1024)
    if length is not None:
        out["seq_len"] = length
    else:
        keys.price("No sequence length (Trainer's arguments have none): priced at memfit's default unless "
                   "--seq-len is given.")
    packing = keys.bool("packing", False)
    padding_free = keys.bool("padding_free", False)
    if packing or padding_free:
        out["packing"] = "documents"  # position ids restart per document, no cross-document attention
        keys.get("packing_strategy")
    else:
        out["packing"] = "none"
        if sft:
            keys.price("No packing: each batch is padded to its longest row; priced at max_length (the upper bound).")
    return out


def _model(keys: Keys, sft: bool) -> dict[str, Any]:
    """TRL's ModelConfig: weight dtype, attention, PEFT (LoRA/QLoRA)."""
    out: dict[str, Any] = {}
    init = keys.get("model_init_kwargs") or {}
    if not isinstance(init, dict):
        raise keys.error("model_init_kwargs", f"{init!r} is not a mapping of from_pretrained arguments.")
    dtype = keys.get("dtype") or keys.get("torch_dtype") or init.get("dtype") or init.get("torch_dtype")
    table = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16",
             "fp16": "fp16"}
    if dtype is not None and str(dtype).lower() != "auto":
        if str(dtype).lower() not in table:
            raise keys.error("dtype", f"{dtype!r} is not one of float32, bfloat16, float16, auto.")
        out["dtype"] = table[str(dtype).lower()]
    elif dtype is not None:
        keys.not_mapped("dtype", "auto loads the checkpoint's own dtype, which a config alone does not say; "
                        "priced with fp32 weights (bf16 checkpoints take half the weight bytes).")
    attention = keys.get("attn_implementation")
    if attention is not None:
        keys.origin("attn_implementation", "attn_implementation")
        out["attn_implementation"] = {"flash_attention_2": "flash_attention_2", "sdpa": "sdpa", "eager": "eager",
                                      "kernels-community/flash-attn": "flash_attention_2",
                                      "kernels-community/vllm-flash-attn3": "flash_attention_2"}.get(
            str(attention).lower(), "auto")
        if out["attn_implementation"] == "flash_attention_2":
            out["attn_implementation"] = flash_attention(keys, "attn_implementation")
        if out["attn_implementation"] == "auto":
            keys.not_mapped("attn_implementation", f"{attention} is priced as the attention transformers picks.")
    if keys.bool("use_peft", False):
        out.update(lora_r=keys.int("lora_r", 16), lora_alpha=keys.float("lora_alpha", 32.0),
                   lora_dropout=keys.float("lora_dropout", 0.05),
                   lora_targets=lora_targets(keys, "lora_target_modules"))
        keys.origin("use_peft", "lora_r")
        if keys.bool("load_in_4bit", False):
            out["quantize"] = "4bit"
            keys.origin("load_in_4bit", "quantize")
        elif keys.bool("load_in_8bit", False):
            out["quantize"] = "8bit"
            keys.origin("load_in_8bit", "quantize")
        if keys.bool("use_bnb_nested_quant", False):
            keys.not_mapped("use_bnb_nested_quant", "double quantization saves ~0.4 bit per base weight; priced "
                            "without it (a slight over-estimate).")
        if keys.bool("use_dora", False):
            keys.not_mapped("use_dora", "DoRA keeps a magnitude vector and a weight-norm per adapted linear that "
                            "memfit does not price; the estimate is low by those activations.")
        keys.get("use_rslora")  # a scale, not a size
    else:
        for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit"):
            if keys.has(key):
                keys.get(key)
                keys.price(f"{key} is ignored: use_peft is off, so TRL trains the full model.")
    return out


def _preference(keys: Keys, run: dict[str, Any], method: str, said_by: str) -> None:
    """A DPO/ORPO/CPO config as memfit's preference method (``common.preference``)."""
    precompute = keys.bool("precompute_ref_log_probs", False)
    if keys.bool("force_use_ref_model", False) and run.get("lora_r"):
        keys.not_mapped("force_use_ref_model", "a separate reference model beside the LoRA model is priced as the "
                        "base with the adapter off (low by one copy of the base weights).")
    keys.get("ref_model_init_kwargs")
    preference(keys, run, method, said_by or "the file's trainer", precompute=precompute and method == "dpo")


def _loss(keys: Keys, sft: bool, method: str = "sft") -> str:
    liger = keys.bool("use_liger_kernel", False) or keys.bool("use_liger_loss", False)
    if method != "sft":
        if liger:
            keys.not_mapped("use_liger_kernel", "Liger's fused preference loss never builds the full logits; "
                            "priced with them (an over-estimate by the logits and their gradient).")
        return "standard"
    if sft:
        keys.price("SFTTrainer's loss: TRL's fused LM head (log-probabilities, entropy and top-1 per token, in "
                   "tiles of up to 4,096 tokens x 32,768 vocabulary columns, never the full logits); priced as "
                   "memfit's --loss trl.")
        if liger:
            keys.price("use_liger_kernel: TRL applies Liger's layer kernels only (not its fused cross-entropy); "
                       "priced without them.")
        return "trl"
    if liger:
        keys.price("use_liger_kernel: Trainer patches Liger's fused linear cross-entropy in; priced as memfit's "
                   "liger loss.")
        return "liger"
    return "standard"


#: TRL keys written together, and the source's keys they replace (``emitting.changed_only``).
GROUPS = (
    (("fsdp", "deepspeed"), ()),
    (("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit"), ()),
    (("dtype",), ("torch_dtype",)),
    (("max_length",), ("max_seq_length",)),
    (("packing", "padding_free"), ()),
    (("precompute_ref_log_probs", "loss_type"), ()),
    (("use_liger_kernel",), ("use_liger_loss",)),
)


def emit(model: str, run, source: Reading | None = None) -> dict[str, Any]:
    """``run`` as a TRL config (``trl sft|dpo|orpo --config``): a source TRL file with only what the plan changed."""

    return merged(source, NAME, "model_name_or_path", model, run, _settings, GROUPS)


def _settings(run) -> dict[str, Any]:
    """TRL's keys for ``run`` (SFTConfig or DPOConfig, with ModelConfig's)."""

    out: dict[str, Any] = {
        "dtype": dtype_name(run.dtype),
        "per_device_train_batch_size": run.micro_batch, "gradient_accumulation_steps": run.grad_accum,
        "max_length": run.seq_len, "packing": str(run.packing) == "documents",
        "padding_free": False, "bf16": str(run.mixed_precision) == "bf16",
        "fp16": str(run.mixed_precision) == "fp16", "gradient_checkpointing": run.grad_checkpointing,
        "optim": OPTIMIZER_NAMES[str(run.optimizer)],
        "use_peft": run.is_lora(), "activation_offloading": str(run.offload) == "activations",
        "precompute_ref_log_probs": run.precompute_reference if str(run.method) == "dpo" else None,
        "loss_type": "simpo" if str(run.method) == "simpo" else None,
        "use_liger_kernel": True if str(run.loss) == "liger" else None,
        "attn_implementation": None if str(run.attn_implementation) == "auto" else str(run.attn_implementation),
        "fsdp": None, "deepspeed": None,
    }
    if run.is_lora():
        out.update(lora_r=run.lora.r, lora_alpha=run.lora.alpha, lora_dropout=run.lora.dropout,
                   lora_target_modules=list(run.lora.targets),
                   load_in_4bit=str(run.quantize) == "4bit", load_in_8bit=str(run.quantize) == "8bit")
    if str(run.sharding) in ("fsdp", "zero2"):
        words = ["full_shard" if str(run.sharding) == "fsdp" else "shard_grad_op", "auto_wrap"]
        out["fsdp"] = " ".join(words + (["offload"] if str(run.offload) == "params" else []))
    elif str(run.sharding) == "zero3":
        out["deepspeed"] = {"zero_optimization": {"stage": 3}}
    return out


def launch(run) -> str | None:
    """TRL's launch command, naming its trainer and the process count (read back by ``trainer`` and
    ``common.stated_processes``)."""
    command = {"sft": "sft", "dpo": "dpo", "orpo": "orpo", "simpo": "cpo"}[str(run.method)]
    if command == "sft" and run.num_processes == 1:
        return None
    processes = f" --num_processes {run.num_processes}" if run.num_processes > 1 else ""
    return f"trl {command}{processes} --config THIS_FILE"


def realize(run):
    """A planner candidate as SFTTrainer runs it (None: it cannot): its own fused LM head always, the optimizer
    stepped after backward, optimizer-state offload only through DeepSpeed (not emitted)."""
    if run.optimizer_in_backward or str(run.offload) in ("optimizer",) or str(run.loss) in ("liger", "cce"):
        return None
    if str(run.offload) == "params" and str(run.sharding) not in ("fsdp", "zero2"):
        return None
    return run.replace(loss="trl") if str(run.method) == "sft" else run
