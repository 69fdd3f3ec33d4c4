"""Small builders for a training run: preflight checks, Accelerator, model, data, optimizer, scheduler.

Each builder does one job with the library that owns it (Accelerate, transformers, PEFT, torch);
``train.loop`` wires them together.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from memfit.config import DType, Optimizer, Precision, Quantize, RunConfig, Sharding, TrainConfig
from memfit.errors import UserError
from memfit.hf_compat import enable_checkpointing, no_loading_bar, peft_wrap_quietly

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_precision() -> Precision:
    """What a run uses when the user did not choose: bf16 autocast on a GPU that supports it, else none."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return Precision.BF16
    return Precision.NO


def preflight(run: RunConfig) -> None:
    """Refuse, in one sentence, what cannot work on this machine before anything is built."""
    cuda = cuda_available()
    if run.mixed_precision is Precision.FP16 and run.dtype is DType.FP16 and not run.is_lora():
        raise UserError("fp16 mixed precision cannot train weights stored in fp16 (the loss scaler cannot unscale "
                        "fp16 gradients); use --dtype fp32, or --mixed-precision bf16 where the device supports it.")
    if run.mixed_precision is Precision.FP16 and not cuda:
        raise UserError("fp16 mixed precision needs a CUDA GPU (Accelerate runs no loss scaler on CPU); "
                        "use --mixed-precision bf16 on this machine.")
    if cuda and Precision.BF16 in (run.mixed_precision, run.dtype) and not _bf16_ok():
        raise UserError("This GPU does not support bf16; use --mixed-precision fp16 with --dtype fp32.")
    if run.quantize is not Quantize.NONE and not cuda:
        raise UserError(f"--quantize {run.quantize} needs bitsandbytes on a CUDA GPU; use --quantize none here.")
    if run.optimizer is Optimizer.ADAMW_8BIT and not cuda:
        raise UserError("--optimizer adamw-8bit needs bitsandbytes on a CUDA GPU; use adamw here.")
    if run.sharding is not Sharding.DDP or str(run.offload) != "none":
        raise UserError("memfit train runs data-parallel (--sharding ddp, --offload none) for now; "
                        "FSDP/ZeRO and offload are modelled by estimate and plan only.")


def _bf16_ok() -> bool:
    import torch

    return torch.cuda.is_bf16_supported()


def build_accelerator(run: RunConfig, config: TrainConfig):
    """``Accelerator`` with memfit's choices.

    ``sync_with_dataloader=False``: a step's micro-batches are fetched before they are run, so the
    loader may be exhausted while the step is still accumulating; the step counter alone decides
    when gradients sync. ``step_scheduler_with_optimizer=False``: the loop steps the scheduler once per
    optimizer step itself (Accelerate would step it ``num_processes`` times), and not after an fp16
    step the scaler skipped.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin

    # One process may train twice (tests, --check-equivalence): forget the previous run's precision.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(
        mixed_precision=str(run.mixed_precision),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=run.grad_accum, sync_with_dataloader=False),
        cpu=not cuda_available(),
        log_with=config.tracker,
        project_dir=config.output,
        step_scheduler_with_optimizer=False,
    )


@dataclass
class ModelBundle:
    model: object
    tokenizer: object
    random_init: bool
    """Built from a config (preset or config.json) with random weights, not loaded from a checkpoint."""
    trainable_params: int
    params: int
    uses_model_loss: bool
    """The model's forward accepts ``num_items_in_batch`` (transformers' loss kwargs)."""


@dataclass
class ModelSource:
    """What a run's model is, resolved before anything heavy is built or any folder is written."""

    hf_config: object
    tokenizer: object
    random_init: bool
    """A preset or a bare config.json: the architecture only, built with random weights."""


def resolve_model(config: TrainConfig, run: RunConfig) -> ModelSource:
    """The model's transformers config and the tokenizer, checked against the run (seq-len, vocabulary).

    Cheap (no weights), so the loop calls it before it creates the output folder: a bad ``--model``,
    ``--tokenizer`` or ``--seq-len`` leaves nothing behind.
    """
    from memfit import data, modelspec

    hf_config = modelspec.resolve_config(config.model, trust_remote_code=config.trust_remote_code)
    is_preset = modelspec.is_preset(config.model)
    modelspec.check_seq_len(run.seq_len, getattr(hf_config, "max_position_embeddings", None))
    tokenizer = data.load_tokenizer(config.tokenizer, config.model, is_preset=is_preset,
                                    trust_remote_code=config.trust_remote_code)
    if len(tokenizer) > hf_config.vocab_size:
        raise UserError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {hf_config.vocab_size}.")
    hf_config.use_cache = False  # training: no KV cache
    random_init = is_preset or Path(config.model).expanduser().is_file()
    return ModelSource(hf_config, tokenizer, random_init)


def build_model(config: TrainConfig, run: RunConfig, source: ModelSource | None = None,
                device=None) -> ModelBundle:
    """The causal LM (preset with random weights, or a local checkpoint), with checkpointing and LoRA.

    ``device``: a CUDA device builds the model there directly (random init under ``torch.device``,
    checkpoints with ``device_map``), which for a 1.5 B model saves building it in CPU memory and
    copying it over; ``None`` or a CPU device builds on the CPU (Accelerate's ``prepare`` moves it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    source = source or resolve_model(config, run)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    kwargs = {"dtype": getattr(torch, TORCH_DTYPES[str(run.dtype)]), "attn_implementation": str(run.attn_implementation)}
    if run.quantize is not Quantize.NONE:
        kwargs["quantization_config"] = _bnb_config(run)
    torch.manual_seed(config.seed)  # presets: the same random init on every rank and every run
    if source.random_init:
        with torch.device(device) if on_gpu else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(source.hf_config, trust_remote_code=config.trust_remote_code,
                                                     **kwargs)
    else:
        if on_gpu:
            kwargs["device_map"] = {"": torch.device(device)}
        with no_loading_bar():
            model = AutoModelForCausalLM.from_pretrained(Path(config.model).expanduser(), config=source.hf_config,
                                                         local_files_only=True,
                                                         trust_remote_code=config.trust_remote_code, **kwargs)
    if run.grad_checkpointing:
        enable_checkpointing(model)  # non-reentrant: works with frozen inputs (LoRA), torch's recommended mode
    if run.is_lora():
        model = _add_lora(model, run)
    uses_model_loss = _accepts_loss_kwargs(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return ModelBundle(model, source.tokenizer, source.random_init, trainable, total, uses_model_loss)


def _bnb_config(run: RunConfig):
    import torch
    from transformers import BitsAndBytesConfig

    if run.quantize is Quantize.Q4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
    return BitsAndBytesConfig(load_in_8bit=True)


def _add_lora(model, run: RunConfig):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if run.quantize is not Quantize.NONE:
        with peft_wrap_quietly():
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=run.grad_checkpointing)
    targets = run.lora_targets
    target_modules = "all-linear" if targets == ("all-linear",) else list(targets)
    lora = LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                      target_modules=target_modules, task_type="CAUSAL_LM")
    try:
        with peft_wrap_quietly():
            return get_peft_model(model, lora)
    except ValueError as err:
        raise UserError(f"LoRA cannot wrap --lora-targets {','.join(targets)}: {str(err).splitlines()[0]}") from None


def _accepts_loss_kwargs(model) -> bool:
    """Whether the model computes its loss with ``num_items_in_batch`` (the rule transformers' Trainer uses:
    an explicit ``accepts_loss_kwargs`` attribute, else a ``**kwargs`` in ``forward``).

    Every model built on transformers' ``GenericForCausalLM``/``ForCausalLMLoss`` (Llama, Qwen2/3,
    Mistral, Gemma, Phi-3, GPT-NeoX and most others in transformers 5) does; for the rest memfit
    computes the same loss from the logits with ``transformers.loss.loss_utils.ForCausalLMLoss``.
    """
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclass
class DataBundle:
    """Tokenized training and held-out sequences, the unigram baseline, and the held-out documents."""

    train: list[dict]
    eval: list[dict]
    unigram: float
    prompt_docs: list
    """Documents whose beginnings prompt the end-of-run samples: held-out ``Example`` records (training
    ones when nothing is held out), evenly spread over the corpus."""


def build_data(config: TrainConfig, run: RunConfig, tokenizer) -> DataBundle:
    """Load, check and tokenize the data (every data error surfaces here, before the output folder exists)."""
    from memfit import data

    examples = data.load_examples(config.data)
    tokenized = data.tokenize(examples, tokenizer, seq_len=run.seq_len, packing=config.packing,
                              eval_fraction=config.eval_fraction, seed=config.seed)
    if not tokenized.train:
        raise UserError("The data yields no training sequence with a target token.")
    train_idx, held = data.split_documents(len(examples), config.eval_fraction, config.seed)  # tokenize's split
    docs = [examples[i] for i in spread(held or train_idx, config.samples)]
    return DataBundle(tokenized.train, tokenized.eval, data.unigram_loss(tokenized), docs)


def spread(items: list, count: int) -> list:
    """``count`` items evenly spaced over ``items`` (all of them when there are fewer): documents from
    all over the corpus (e.g. both files of a data folder), not only from the first file."""
    if count <= 0:
        return []
    if count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def build_optimizer(model, run: RunConfig, config: TrainConfig):
    """The optimizer named by ``run.optimizer`` over the trainable parameters.

    Weight decay applies to matrices only (not norms or biases), the usual convention. ``sgd`` is
    plain SGD without momentum (no optimizer state).
    """
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    lr = config.optimizer_lr
    name = run.optimizer
    if name is Optimizer.SGD:
        return torch.optim.SGD(groups, lr=lr)
    if name is Optimizer.ADAFACTOR:
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    if name is Optimizer.ADAMW_8BIT:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=lr)
    flags = {Optimizer.ADAMW_FUSED: {"fused": True}, Optimizer.ADAMW_FOREACH: {"foreach": True}}.get(name, {})
    return torch.optim.AdamW(groups, lr=lr, **flags)


def build_scheduler(optimizer, config: TrainConfig, total_steps: int):
    """Linear warmup then cosine decay to 0 over the run (transformers' schedule)."""
    from transformers import get_cosine_schedule_with_warmup

    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
