"""torchtune's recipe YAML (``tune run RECIPE --config FILE``), read from its documented schema (the configs
under ``recipes/configs/``: ``model._component_`` builders, ``batch_size``, ``dtype``, ``optimizer``, ``loss``).

How torchtune runs a step, where it differs from memfit's own trainer:

- no autocast: ``dtype: bf16`` stores and computes everything in bf16 (memfit's pure bf16), LoRA adapters
  included (memfit's LoRA keeps PEFT's fp32 adapters: a few MB more);
- ``LinearCrossEntropyLoss`` (the default) projects and scores the hidden states in chunks, never the full
  logits: priced as memfit's chunked loss; ``CEWithChunkedOutputLoss`` makes every chunk of the logits and keeps
  each for backward (``Stack.chunked_output_loss``, ``memory.stack_terms.chunked_output_logits``);
- the model builder names the architecture; a ``checkpointer.checkpoint_dir`` holding a Hugging Face
  config.json is read instead where it exists (the exact model).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.files import user_path
from memfit.interop.common import Keys, Reading, comment_words, preference
from memfit.interop.emitting import changed_only

NAME = "torchtune"
#: No sharding of this tool runs through DeepSpeed (its distributed recipes are FSDP2).
DEEPSPEED = frozenset()

#: torchtune builder (its name without the lora_/qlora_ prefix) -> memfit preset of the same architecture.
BUILDERS = {
    "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "llama-3.2-3b", "llama3_8b": "llama-3-8b",
    "llama3_1_8b": "llama-3-8b", "llama2_7b": "llama-2-7b", "llama2_13b": "llama-2-13b",
    "llama2_70b": "llama-2-70b", "mistral_7b": "mistral-7b", "gemma2_2b": "gemma-2-2b",
    "qwen2_5_0_5b": "qwen2.5-0.5b", "qwen2_5_1_5b_base": "qwen2.5-1.5b", "qwen2_5_1_5b_instruct": "qwen2.5-1.5b",
    "qwen2_5_7b_base": "qwen2.5-7b", "qwen2_5_7b_instruct": "qwen2.5-7b", "phi3_mini": "phi-3-mini",
    # Llama 3, 3.1 and 3.3 70B share every shape (3.1 adds the RoPE scaling for 128K positions)
    "llama3_70b": "llama-3.1-70b", "llama3_1_70b": "llama-3.1-70b", "llama3_3_70b": "llama-3.1-70b",
    "llama3_1_405b": "llama-3.1-405b",
}
#: Builders whose attention torchtune computes by hand, scores materialized (``torchtune/models/gemma2/
#: _attention.py`` L24, L313-334: "scaled_dot_product_attention does [not] allow soft capping"): eager attention.
EAGER_ATTENTION = ("gemma2_",)
#: torchtune's module names -> transformers' (Llama-style models).
MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP = ("gate_proj", "up_proj", "down_proj")
#: transformers' Phi-3 fuses q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``), which torchtune's phi3 builders keep
#: apart: the adapted modules as transformers names them.
FUSED = {"phi3_": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                   "up_proj": "gate_up_proj"}}

#: torchtune's recipes memfit prices (``recipes/*.py``); a config names its recipe in the launch command of its
#: comments (``tune run --nproc_per_node 4 full_finetune_distributed --config ...``).
RECIPES = frozenset({f"{kind}_{job}_{where}" for kind in ("full", "lora") for job in ("finetune", "dpo")
                     for where in ("single_device", "distributed")})
#: Recipes under ``recipes/dev`` that run one of ``RECIPES``' steps: ``lora_finetune_distributed_multi_dataset``
#: mixes several datasets (TorchData, weighted) into lora_finetune_distributed's loop (torchtune bd2a0fc
#: ``recipes/dev/lora_finetune_distributed_multi_dataset.py``), one batch a step as before.
RECIPE_ALIASES = {"lora_finetune_distributed_multi_dataset": "lora_finetune_distributed"}
REFUSED_RECIPES = ("ppo_full_finetune_single_device", "knowledge_distillation_single_device",
                   "knowledge_distillation_distributed", "qat_distributed", "qat_lora_finetune_distributed",
                   "qat_single_device")
#: torchtune's preference losses (``torchtune.rlhf.loss``) -> memfit's method: DPO's and RSO's (a hinge on the
#: same log-ratios) with a reference policy.
PREFERENCE_LOSSES = {"DPOLoss": "dpo", "RSOLoss": "dpo", "IPOLoss": "dpo", "SimPOLoss": "simpo"}

NO_MEMORY = frozenset({
    "output_dir", "tokenizer", "checkpointer", "resume_from_checkpoint", "save_adapter_weights_only", "dataset",
    "seed", "shuffle", "lr_scheduler", "epochs", "max_steps_per_epoch", "clip_grad_norm", "device", "metric_logger",
    "log_every_n_steps", "log_peak_memory_stats", "log_level", "profiler", "run_val_every_n_steps",
    "dataset_val", "batch_size_val", "custom_sharded_layers", "fsdp_reshard_after_forward", "cudnn_deterministic_mode",
    "ac_mode", "ac_option", "tensor_parallel_plan", "data_parallel_shard_dim", "gradient_accumulation_steps",
    "ref_checkpointer", "low_cpu_ram",
})
#: Parallelisms beside FSDP's data-parallel sharding (``recipes/full_finetune_distributed.py``'s device mesh): each
#: splits the weights or the sequence over its ranks, which memfit does not price; a value above 1 is refused.
OTHER_PARALLEL = {"tensor_parallel_dim": "splits every weight over that many ranks (tensor parallelism)",
                  "context_parallel_dim": "splits every sequence over that many ranks (context parallelism)",
                  "data_parallel_replicate_dim": "replicates FSDP's shards over that many groups (HSDP)"}
#: Top-level keys only the configs of recipes memfit does not price hold (``recipes/``: PPO, knowledge
#: distillation, GRPO), with what the recipe does.
OTHER_JOBS = {"policy_model": "PPO (policy, reference, reward and value models, with generation)",
              "reward_and_value_model": "PPO (policy, reference, reward and value models, with generation)",
              "teacher_model": "knowledge distillation (a frozen teacher model beside the student)",
              "grpo_samples": "GRPO (generation in the loop, a reference model)",
              # dev/async_grpo_full_finetune_distributed: its optimizer sits under training:, not at the top
              "reward_functions": "GRPO (generation in the loop, a reference model)"}


def detect(data: dict) -> bool:
    """A ``model`` component, or a torchtune component under another recipe's key (PPO's ``policy_model``)."""
    model = data.get("model")
    if isinstance(model, dict) and "_component_" in model:
        return True
    return any(isinstance(v, dict) and str(v.get("_component_", "")).startswith("torchtune.") for v in data.values())


def _component(keys: Keys, key: str) -> tuple[str, dict]:
    value = keys.get(key) or {}
    if not isinstance(value, dict) or not isinstance(value.get("_component_", ""), str):
        raise keys.error(key, f"{value!r} is not a component (a mapping with _component_).")
    return value.get("_component_", ""), value


def _refuse_other_jobs(keys: Keys) -> None:
    """One sentence naming the key where the file is no training step memfit prices: another recipe (PPO,
    distillation, GRPO), no optimizer (generation, evaluation, quantization configs), or a parallelism beside
    FSDP."""
    for key, job in OTHER_JOBS.items():
        if keys.has(key):
            raise keys.error(key, f"the file configures {job}, a recipe memfit does not price (it prices full/lora "
                             "finetune and dpo).")
    if not keys.has("optimizer"):
        raise keys.error("optimizer", "the file names none, so it configures no training step (a generation, "
                         "evaluation or quantization recipe's config); memfit prices training steps.")
    for key, what in OTHER_PARALLEL.items():
        value = keys.get(key)
        if value is not None and value != 1:
            raise keys.error(key, f"{value} {what}, which memfit does not price (it prices FSDP's sharding alone).")


def read(path: str, data: dict) -> Reading:
    keys = Keys(path, NAME, data)
    _refuse_other_jobs(keys)
    builder, model_args = _component(keys, "model")
    run: dict[str, Any] = {
        "micro_batch": keys.int("batch_size", 2),
        "grad_accum": keys.int("gradient_accumulation_steps", 1),
        "mixed_precision": "no",
        "dtype": keys.choice("dtype", {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}, "bf16"),
        "grad_checkpointing": keys.bool("enable_activation_checkpointing", False),
        "optimizer_in_backward": keys.bool("optimizer_in_bwd", False),
        "attn_implementation": "sdpa",  # torchtune's attention is torch's scaled_dot_product_attention
    }
    if keys.bool("enable_activation_offloading", False):
        run["offload"] = "activations"
    keys.origin("model._component_", "attn_implementation")  # torchtune's builder owns its attention
    model = _model(keys, builder, model_args, run)
    run.update(_sequence(keys))
    run["optimizer"] = _optimizer(keys)
    run["loss"] = _loss(keys)
    if keys.bool("compile", False):
        keys.not_mapped("compile", "memfit prices the eager model; torch.compile may save fewer activations.")
        if keys.stack.get("chunked_output_loss"):  # training.compile_loss: its compute_cross_entropy compiled
            keys.stack["compiled_loss"] = True
    if re.sub(r"^(q?lora)_", "", builder.rsplit(".", 1)[-1]).startswith(EAGER_ATTENTION):
        run["attn_implementation"] = "eager"
        keys.price(f"model {builder}: torchtune's own attention materializes the scores to soft-cap them "
                   "(torchtune/models/gemma2/_attention.py); priced as eager attention.")
    recipe = _recipe(keys, builder)
    if recipe.endswith("_distributed"):
        run["sharding"] = "fsdp"
        if keys.get("fsdp_reshard_after_forward") is False:  # the parameters stay gathered from forward to backward
            run["sharding"] = "zero2"
            keys.price("fsdp_reshard_after_forward: false keeps each layer's gathered parameters from forward to "
                       "backward; priced as memfit's zero2 (FSDP2 without resharding).")
        keys.origin(recipe, "sharding")
        if keys.bool("fsdp_cpu_offload", False):
            run["offload"] = "params"
            keys.origin("fsdp_cpu_offload", "offload")
        on = (f"{keys.stated_processes} processes, as its launch command says" if keys.stated_processes else
              "--num-processes ranks (1 unless given: the file's comments give no --nproc_per_node)")
        keys.price(f"{recipe}: torchtune's distributed recipes always shard with FSDP2 (full shard); per rank, "
                   f"on {on}.")
    _dpo(keys, run, recipe)
    keys.leftovers(NO_MEMORY)
    return keys.reading(model, "model._component_", run)


def _recipe(keys: Keys, builder: str) -> str:
    """The recipe that runs the config: the one its launch command names, else (a config without one) a
    distributed recipe where FSDP keys are set, else the single-device one; LoRA or full from the builder,
    fine-tuning or DPO from the loss."""
    named = _launched_recipes(keys.path)
    if len(set(named)) == 1:
        if named[0] in REFUSED_RECIPES:
            raise keys.error("model", f"the launch command in the file's comments runs {named[0]}, a recipe memfit "
                             "does not price (it prices full/lora finetune and dpo, single_device or distributed).")
        return named[0]
    kind = "lora" if re.search(r"\.q?lora_", builder) else "full"
    loss = str((keys.data.get("loss") or {}).get("_component_", "")).rsplit(".", 1)[-1]
    job = "dpo" if loss in PREFERENCE_LOSSES else "finetune"
    where = "distributed" if any(k.startswith("fsdp") for k in keys.data) else "single_device"
    return f"{kind}_{job}_{where}"


def _launched_recipes(path: str) -> list[str]:
    """The recipes the launch commands in the file's comments run: those whose ``--config`` is this file where any
    is (a comment may first run another recipe to prepare a checkpoint), else every recipe named."""
    words = [RECIPE_ALIASES.get(w, w) for w in comment_words(path)]
    known = [w for w in words if w in RECIPES or w in REFUSED_RECIPES]
    try:
        text = user_path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return known
    stem = re.escape(Path(path).stem)
    launch = rf"^\s*#.*\btune run\b.*?\b(?:dev/)?([a-z0-9_]+)\s+--config\s+(?:\S*/)?{stem}(?:\.yaml)?(?:\s|$)"
    this = [RECIPE_ALIASES.get(r, r) for r in re.findall(launch, text, flags=re.MULTILINE)]
    return [r for r in this if r in RECIPES or r in REFUSED_RECIPES] or known


def _dpo(keys: Keys, run: dict[str, Any], recipe: str) -> None:
    """A DPO recipe (its loss ``torchtune.rlhf.loss.DPOLoss``) as memfit's preference run: LoRA recipes take the
    reference from the base with the adapters off, full ones load ``ref_checkpointer``'s weights as a frozen
    copy; torchtune computes the full logits of both sides."""
    component = str((keys.data.get("loss") or {}).get("_component_", ""))
    method = PREFERENCE_LOSSES.get(component.rsplit(".", 1)[-1])
    if method is None:
        if "_dpo_" in recipe:
            raise keys.error("loss", f"{component or 'none'} is no preference loss, but {recipe} trains one "
                             f"({', '.join(PREFERENCE_LOSSES)}).")
        return
    if run.get("lora_r") is None and keys.data.get("ref_checkpointer") is None:
        keys.not_mapped("ref_checkpointer", "a full DPO recipe loads its reference from ref_checkpointer, which the "
                        "file does not set; priced with the frozen copy it would load.")
    if recipe.endswith("_distributed") and run.get("lora_r") is None:
        keys.not_mapped("ref_checkpointer", "full_dpo_distributed shards the reference model with FSDP2 too; "
                        "memfit prices a whole frozen copy per rank (an over-estimate by its unsharded part).")
    run["loss"] = "standard"  # the recipe's loss is on log-probabilities it reads from the full logits
    preference(keys, run, method, "loss")


def _model(keys: Keys, builder: str, args: dict, run: dict[str, Any]) -> str:
    """The model: the checkpointer's local Hugging Face folder where it exists, else the builder's preset; a builder
    memfit has no preset for is kept as named, with the sentence ``check_model`` raises unless MODEL is given over the
    file (the rest of the file is read, so MODEL prices its run on that architecture)."""
    name = builder.rsplit(".", 1)[-1]
    base = re.sub(r"^(q?lora)_", "", name)
    if name.startswith(("lora_", "qlora_")):
        rank = args.get("lora_rank", 8)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise keys.error("model.lora_rank", f"{rank!r} is not a whole number >= 1.")
        attn = args.get("lora_attn_modules", ["q_proj", "v_proj"])
        if not isinstance(attn, list) or any(m not in MODULES for m in attn):
            raise keys.error("model.lora_attn_modules", f"{attn!r} is not a list of {', '.join(MODULES)}.")
        targets = [MODULES[m] for m in attn] + (list(MLP) if args.get("apply_lora_to_mlp") else [])
        keys.origin("model.lora_attn_modules", "lora_targets")
        if set(targets) == set(MODULES.values()) | set(MLP):
            targets = ["all-linear"]  # every linear of the decoder, PEFT's shorthand
        fused = next((table for prefix, table in FUSED.items() if base.startswith(prefix)), None)
        if fused and targets != ["all-linear"]:
            targets = list(dict.fromkeys(fused.get(t, t) for t in targets))
            keys.price(f"model.lora_attn_modules: {builder} splits the projections transformers' model fuses; "
                       f"priced as adapters on {', '.join(targets)} (one adapter per fused projection).")
        run.update(lora_r=rank, lora_alpha=float(args.get("lora_alpha", 16)),
                   lora_dropout=float(args.get("lora_dropout", 0.0)), lora_targets=tuple(targets))
        if args.get("apply_lora_to_output"):
            keys.not_mapped("model.apply_lora_to_output", "an adapter on the output projection is not priced "
                            "(its activations and state are small beside the head's).")
        if args.get("use_dora") is True:
            keys.not_mapped("model.use_dora", "DoRA's magnitude vector and the weight norm it computes per adapted "
                            "linear are not priced (the estimate is low by them).")
        if name.startswith("qlora_") or args.get("quantize_base") is True:  # qdora: lora_ builder, quantize_base
            run["quantize"] = "4bit"
            keys.origin("model.quantize_base" if args.get("quantize_base") else "model._component_", "quantize")
            keys.price("QLoRA: torchtune's NF4 base (torchao) is priced as bitsandbytes' 4-bit NF4 base "
                       "(the same 4-bit blocks and scales).")
    checkpoint = (keys.data.get("checkpointer") or {}).get("checkpoint_dir")
    if checkpoint and (user_path(str(checkpoint)) / "config.json").is_file():
        return str(checkpoint)
    if base not in BUILDERS:
        keys.unknown_model = str(keys.error(
            "model._component_", f"{builder!r} is a model builder memfit has no architecture for "
            f"({', '.join(sorted(BUILDERS))}), and checkpointer.checkpoint_dir holds no config.json; give MODEL (a "
            "preset or Hub id of the same architecture) before --from."))
        return builder
    return BUILDERS[base]


def _sequence(keys: Keys) -> dict[str, Any]:
    tokenizer, dataset = keys.get("tokenizer") or {}, keys.get("dataset") or {}
    length = tokenizer.get("max_seq_len") if isinstance(tokenizer, dict) else None
    out: dict[str, Any] = {}
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise keys.error("tokenizer.max_seq_len", f"{length!r} is not a whole number >= 1.")
        out["seq_len"] = length
        keys.origin("tokenizer.max_seq_len", "seq_len")
    else:
        keys.not_mapped("tokenizer.max_seq_len", "null: samples are not truncated, so the longest one sets the "
                        "peak; priced at memfit's default length unless --seq-len is given.")
    packed = isinstance(dataset, dict) and dataset.get("packed") is True
    out["packing"] = "documents" if packed else "none"
    return out


def _optimizer(keys: Keys) -> str:
    component, args = _component(keys, "optimizer")
    name = component.rsplit(".", 1)[-1].lower()
    if name == "adamw":
        if "bitsandbytes" in component or "torchao" in component:
            return "adamw-8bit"
        return "adamw-fused" if args.get("fused") else "adamw-foreach" if args.get("foreach") else "adamw"
    table = {"adamw8bit": "adamw-8bit", "pagedadamw8bit": "adamw-8bit", "sgd": "sgd", "adafactor": "adafactor"}
    if name in table:
        return table[name]
    keys.not_mapped("optimizer", f"{component} has no row in memfit's optimizer table; priced as AdamW (two fp32 "
                    "moments per trained parameter).")
    return "adamw"


def _loss(keys: Keys) -> str:
    component, args = _component(keys, "loss")
    name = component.rsplit(".", 1)[-1]
    if name in PREFERENCE_LOSSES:  # a DPO recipe's: read by _dpo
        return "standard"
    if name == "LinearCrossEntropyLoss":
        keys.price(f"loss {name}: never the full logits; priced as memfit's chunked loss (chunk sizes differ).")
        return "chunked"
    if name == "CEWithChunkedOutputLoss":  # every chunk of the head's output kept to the loss (memory.stack_terms)
        keys.stack["chunked_output_loss"] = True
        keys.price(f"loss {name}: the head's output in chunks, each kept for backward (fp32 log-probabilities, or the "
                   "chunk itself where compile is on: training.compile_loss); priced as torchtune runs it.")
        return "chunked"
    if name == "CrossEntropyLoss" or not component:
        return "standard"
    keys.not_mapped("loss", f"{component} is priced as transformers' standard loss (full logits).")
    return "standard"


#: torchtune keys written together, and the source's keys they replace (``emitting.changed_only``).
GROUPS = ((("model",), ()), (("loss",), ()))


def emit(model: str, run, source: Reading | None = None) -> dict[str, Any]:
    """``run`` as a torchtune recipe config: a source torchtune file with only what the plan changed
    (``emitting.changed_only``); the recipe it runs (distributed when sharded) is in ``launch``."""

    same = source is not None and source.tool == NAME
    old = source.data.get("optimizer") if same else None
    settings = _settings(model, run, source, old)
    if not same:
        return _nested(settings)
    out = changed_only(source, settings, _settings(source.model, source.run, source, old), GROUPS)
    return out


def _settings(model: str, run, source: Reading | None, old_optimizer) -> dict[str, Any]:
    """torchtune's keys for ``run`` (dotted keys inside a component)."""
    module, preset = _builder(model, source)
    model_cfg: dict[str, Any] = {"_component_": f"{module}.{preset}"}
    if run.is_lora():
        prefix = "qlora_" if str(run.quantize) == "4bit" else "lora_"
        model_cfg["_component_"] = f"{module}.{prefix}{preset}"
        inverse = {v: k for k, v in MODULES.items()}
        targets = list(MODULES.values()) + list(MLP) if run.lora.targets == ("all-linear",) else run.lora.targets
        model_cfg.update(lora_attn_modules=[inverse[t] for t in targets if t in inverse],
                         apply_lora_to_mlp=all(m in targets for m in MLP), apply_lora_to_output=False,
                         lora_rank=run.lora.r, lora_alpha=run.lora.alpha, lora_dropout=run.lora.dropout)
    losses = {"dpo": "torchtune.rlhf.loss.DPOLoss", "simpo": "torchtune.rlhf.loss.SimPOLoss"}
    loss = losses.get(str(run.method)) or ("torchtune.modules.loss.LinearCrossEntropyLoss"
                                           if str(run.loss) == "chunked" else "torch.nn.CrossEntropyLoss")
    return {
        "model": model_cfg, "tokenizer.max_seq_len": run.seq_len, "dataset.packed": str(run.packing) == "documents",
        "batch_size": run.micro_batch, "gradient_accumulation_steps": run.grad_accum, "dtype": str(run.dtype),
        "enable_activation_checkpointing": run.grad_checkpointing,
        "enable_activation_offloading": str(run.offload) == "activations",
        "optimizer_in_bwd": run.optimizer_in_backward, "optimizer": _optimizer_cfg(run, old_optimizer),
        "loss": {"_component_": loss}, "fsdp_cpu_offload": True if str(run.offload) == "params" else None,
    }


def _nested(settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in settings.items():
        head, _, rest = key.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        elif value is not None:
            out[key] = value
    return out


def launch(run) -> str:
    """``tune run``: the recipe of ``run`` (LoRA or full, fine-tuning or DPO, distributed when sharded) and its
    process count (read back by ``_recipe`` and ``common.stated_processes``)."""
    kind = "lora" if run.is_lora() else "full"
    job = "finetune" if str(run.method) == "sft" else "dpo"
    if str(run.sharding) == "ddp" and run.num_processes == 1:
        return f"tune run {kind}_{job}_single_device --config THIS_FILE"
    return f"tune run --nproc_per_node {run.num_processes} {kind}_{job}_distributed --config THIS_FILE"


def _builder(model: str, source: Reading | None) -> tuple[str, str]:
    """(module, builder without lora_/qlora_) of ``model``: the source file's own where it names the same model
    (a checkpoint folder) or a builder memfit has no preset for (``model`` is then the MODEL given over the file
    as one of the same architecture: it prices the file's builder, which stays), else the builder of its preset."""
    own = source is not None and source.tool == NAME
    if own and (source.model == model or source.unknown_model):
        module, name = source.data["model"]["_component_"].rsplit(".", 1)
        return module, re.sub(r"^(q?lora)_", "", name)
    preset = {v: k for k, v in BUILDERS.items()}.get(model)
    if preset is None:
        raise UserError(f"{model} has no torchtune builder memfit knows; torchtune builds "
                        f"{', '.join(sorted(set(BUILDERS.values())))}.")
    return f"torchtune.models.{_family(preset)}", preset


def _family(builder: str) -> str:
    return builder.split("_")[0] if not builder.startswith(("llama3_2", "llama3_1", "qwen2_5")) else \
        "_".join(builder.split("_")[:2])


def _optimizer_cfg(run, old) -> dict[str, Any]:
    kept = {k: v for k, v in (old or {}).items() if k in ("lr", "weight_decay", "betas", "eps")}
    component = {"adamw-8bit": "bitsandbytes.optim.PagedAdamW8bit", "sgd": "torch.optim.SGD",
                 "adafactor": "torchtune.training.Adafactor"}.get(str(run.optimizer), "torch.optim.AdamW")
    out: dict[str, Any] = {"_component_": component, **kept}
    if str(run.optimizer) == "adamw-fused":
        out["fused"] = True
    elif str(run.optimizer) == "adamw-foreach":
        out["foreach"] = True
    return out


def realize(run):
    """A planner candidate as torchtune runs it (None: it cannot): no autocast (the weights' dtype is the
    compute dtype), no 8-bit base, no optimizer-state offload on one device, the loss chunked or torch's."""
    if str(run.quantize) == "8bit" or str(run.offload) == "optimizer" or str(run.loss) in ("liger", "cce"):
        return None
    if str(run.sharding) in ("zero2", "zero3") or run.precompute_reference or str(run.method) == "orpo":
        return None
    if run.num_processes > 1 and str(run.sharding) == "ddp":  # the distributed recipes always shard (FSDP2)
        return None
    if str(run.offload) == "params" and str(run.sharding) != "fsdp":  # fsdp_cpu_offload: distributed recipes only
        return None
    half = {"bf16": "bf16", "fp16": "fp16"}.get(str(run.mixed_precision))
    # the builder's attention: SDPA, except where it materializes the scores (Gemma 2's soft-capping, read as
    # eager and pinned from the file), which forcing SDPA made a refusal of every candidate
    attention = "eager" if str(run.attn_implementation) == "eager" else "sdpa"
    return run.replace(mixed_precision="no", dtype=half or str(run.dtype), attn_implementation=attention)
