"""Typed configuration: what changes memory (``RunConfig``) and how to train (``TrainConfig``).

One vocabulary everywhere: precision uses Accelerate's names (``no``, ``fp16``, ``bf16``); the keys of
``RunConfig.to_flat()`` are the names of ``memfit train``'s flags with ``-`` replaced by ``_``, so a
plan written as YAML is read back by ``memfit train --config``.

Every field is a setting of the schema (``memfit.settings.schema.setting``): it declares its flag's help, its
check, its group, what ``--resume`` and ``memfit plan`` do with it, and which commands take it. The
click options of estimate, plan and train, the YAML keys, the value checks (``memfit.settings.validate``),
resume's rules and the planner's constraints are derived from these fields; ``tests/test_schema.py``
fails when a flag, a key or a rule exists that the schema does not declare.

Size: over 500 lines because every setting's declaration (flag, help, check, resume rule: ``schema.setting``)
lives here, one table a reader scans for the setting they look for; splitting it would split that table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from memfit.errors import UserError
from memfit.integrations.trackers import TRACKERS
from memfit.settings import validate
from memfit.settings.config_file import read_settings
from memfit.settings.defaults import (
    DEMO_LR,
    DEMO_MICRO_BATCH,
    DEMO_SEQ_LEN,
    DEMO_STEPS,
    FULL_LR,
    LORA_LR,
    LORA_RANK,
    SHAPE,
    fmt_lr,
)
from memfit.settings.schema import (
    build,
    flag_of,
    groups,
    in_group,
    nested,
    own_defaults,
    replaced,
    setting,
    settings,
    settings_group,
    walk,
)

#: The record formats ``--data-format`` names; ``memfit.data.formats`` reads each.
FORMATS = ("messages", "sharegpt", "alpaca", "prompt-completion", "text")

class StrEnum(str, Enum):
    def __str__(self) -> str:  # so f-strings and YAML show "bf16", not "Precision.BF16"
        return self.value


class Precision(StrEnum):
    """Accelerate's ``mixed_precision``: autocast compute dtype; weights stay in ``RunConfig.dtype``."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"


class DType(StrEnum):
    """The dtype the model's weights are stored in."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Optimizer(StrEnum):
    """Optimizer variants; they differ in state bytes and in step-time temporaries.

    ``adamw`` is torch's default implementation choice: ``foreach`` on CUDA, single-tensor on CPU.
    """

    ADAMW = "adamw"
    ADAMW_FUSED = "adamw-fused"
    ADAMW_FOREACH = "adamw-foreach"
    ADAMW_8BIT = "adamw-8bit"
    SGD = "sgd"
    ADAFACTOR = "adafactor"


class Quantize(StrEnum):
    """Quantized frozen base for QLoRA (bitsandbytes: CUDA, or the CPU from 0.50; ``memfit.integrations.quant_support``)."""

    NONE = "none"
    Q4 = "4bit"
    Q8 = "8bit"


class QloraUpcast(StrEnum):
    """What a quantized base keeps in fp32 besides its LoRA adapters (``memfit.integrations.quant_support.unquantized_dtype``)."""

    LEAN = "lean"  # embeddings, norms, head in --dtype: the residual stream in the compute dtype (litgpt, Unsloth)
    FULL = "full"  # PEFT's prepare_model_for_kbit_training: every unquantized parameter, hence the stream, fp32


class Sharding(StrEnum):
    """How model states are split across ``num_processes`` ranks."""

    DDP = "ddp"  # replicated
    FSDP = "fsdp"  # FULL_SHARD: params, grads and optimizer state sharded
    ZERO2 = "zero2"  # grads and optimizer state sharded
    ZERO3 = "zero3"  # like FSDP full shard
    HYBRID = "hybrid"  # FSDP2 HSDP: full shard within a node, replicated across --nodes (a 2-D device mesh)


class Offload(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # optimizer state (and step) on CPU
    PARAMS = "params"  # parameters and optimizer state on CPU
    ACTIVATIONS = "activations"  # tensors saved for backward kept in pinned CPU memory (CUDA only)


class Loss(StrEnum):
    """How the LM head and cross-entropy run; the table of what each costs is ``memfit.spec.losses.LOSSES``."""

    STANDARD = "standard"  # transformers' head + ForCausalLMLoss: full (B, T, V) logits and their gradient
    CHUNKED = "chunked"  # memfit's pure-PyTorch chunked linear cross-entropy (any device)
    LIGER = "liger"  # Liger kernel's fused linear cross-entropy (CUDA, optional extra)
    CCE = "cce"  # Apple's Cut Cross-Entropy (CUDA, optional extra)
    TRL = "trl"  # TRL's SFTTrainer: its fused LM head (priced by estimate/plan; memfit train does not run it)


class Method(StrEnum):
    """The training objective (``--method``); the preference losses are ``memfit.builder.preference``."""

    SFT = "sft"  # the next-token loss on the data's targets
    DPO = "dpo"  # Direct Preference Optimization: pairs, a reference policy
    ORPO = "orpo"  # Odds Ratio Preference Optimization: pairs, the chosen NLL, no reference
    SIMPO = "simpo"  # Simple Preference Optimization: pairs, length-normalised, no reference


class Attention(StrEnum):
    """The attention implementation asked of transformers; ``auto`` lets transformers choose for the model
    (SDPA where the model supports it, else eager), as ``from_pretrained`` does without the argument."""

    AUTO = "auto"
    SDPA = "sdpa"
    EAGER = "eager"
    FLASH = "flash_attention_2"


class Experts(StrEnum):
    """The mixture-of-experts kernel asked of transformers (``experts_implementation``); ``auto`` lets memfit
    choose the one that runs the run's precision (``memfit.spec.resolved.experts``). Only MoE models have one."""

    AUTO = "auto"
    GROUPED_MM = "grouped_mm"  # torch's grouped matrix multiply: bf16 weights only
    BATCHED_MM = "batched_mm"  # one bmm over per-token gathered expert weights: any dtype, (S, out, in) copies
    EAGER = "eager"  # the model's own per-expert loop: any dtype, autocast applies


class Packing(StrEnum):
    """How documents become training rows (``--packing``); it changes the attention mask, hence memory."""

    DOCUMENTS = "documents"
    """Whole documents per row, position ids restarting per document: no cross-document attention
    (transformers builds a block-causal mask, or runs flash-attention's varlen kernel)."""
    CONCAT = "concat"
    """Concatenate everything and cut every ``seq_len`` tokens; a document attends to the ones before it."""
    NONE = "none"
    """One document per row, truncated to ``seq_len``, padded per batch."""


def parse_packing(value: Any) -> Packing:
    """From a flag or a YAML value; the old boolean ``packing: true/false`` reads as documents / none."""
    if isinstance(value, str) and value.strip().lower() in ("yes", "on", "true", "no", "off", "false"):
        value = value.strip().lower() in ("yes", "on", "true")  # YAML's words for the old boolean
    if isinstance(value, bool):
        return Packing.DOCUMENTS if value else Packing.NONE
    return parse_enum(Packing, value, "--packing")


DEFAULT_LORA_TARGETS: tuple[str, ...] = ("all-linear",)


def parse_enum(cls: type[Enum], value: Any, flag: str) -> Any:
    """``value`` as a member of the enum ``cls`` (its value in any case), or one sentence naming ``flag`` and the
    choices: how every enum setting is read, from a flag, a YAML file, a library call or the planner's pins."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        choices = ", ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise UserError(f"Unknown {flag} {value!r}; choose one of: {choices}.") from None


_ALL = ("estimate", "plan", "train")  # plan: a searched setting's flag pins it (memfit.settings.schema.PLAN_ROLES)
_NOT_PLAN = ("estimate", "train")  # plan keeps the effective batch (--batch) and the data's packing itself
_SHAPE = f"every command's default: the run memfit train runs (memfit.settings.defaults.SHAPE: {SHAPE})"
_FROM_DATA = {"default": DEMO_SEQ_LEN, "why": _SHAPE, "show_default": f"from the data; {DEMO_SEQ_LEN} for the demo"}


def _check_groups(config) -> None:
    """Each nested group of ``config`` holds its own class (a library caller's ``lora={"r": 8}`` is refused here,
    in one sentence, not as an AttributeError deep in a run)."""
    for f in groups(type(config)):
        cls = f.metadata["nested"]
        if not isinstance(getattr(config, f.name), cls):
            raise UserError(f"{type(config).__name__}.{f.name} must be of type {cls.__name__} (or give its settings by key "
                            f"to {type(config).__name__}.of).")


def _normalise(config, check=validate.check_fields) -> None:
    """Parse the enum settings declared on ``config`` itself (their type is their default's) and check every
    value by its field's ``check`` (``memfit.settings.validate.check_fields``; ``check``: ``validate.check_train``
    for the groups whose paths and model it also checks), in place: called by each settings dataclass's
    ``__post_init__``, so a value is refused from a flag, a YAML file or a library call."""
    _check_groups(config)
    set_ = object.__setattr__
    for f in settings(type(config)):
        if isinstance(f.default, Enum):
            value = getattr(config, f.name)
            set_(config, f.name, parse_packing(value) if f.name == "packing" else parse_enum(type(f.default), value,
                                                                                       flag_of(f)))
    for name, value in check(config).items():  # one place for every value check
        set_(config, name, value)


@settings_group("lora", prefix="lora_")
@dataclass(frozen=True)
class LoraSettings:
    """The LoRA adapters PEFT puts on the base (``memfit.spec.lora.lora_config`` builds PEFT's ``LoraConfig``
    from them); ``r = 0`` is a full fine-tune. Flags and YAML keys carry the prefix: ``--lora-r``, ``lora_r``."""

    r: int = setting(0, plan="searched", resume="restored", check="int>=0",
                     what="0 (full fine-tune) or a positive rank",
                     commands=_ALL, help="LoRA rank; 0 = full fine-tune.",
                     overrides={"plan": {"help": "Pin LoRA at this rank (0 = full fine-tune)."}})
    """LoRA rank; 0 is a full fine-tune."""
    alpha: float = setting(16.0, plan="searched", resume="restored", check="pos", commands=_ALL)
    """LoRA's scale numerator: the adapters' update is scaled by ``alpha / r``."""
    dropout: float = setting(0.0, plan="searched", resume="restored", check="frac", commands=_ALL)
    """Dropout on the adapters' input (PEFT's ``lora_dropout``); > 0 keeps a mask per adapted linear."""
    targets: tuple[str, ...] = setting(DEFAULT_LORA_TARGETS, plan="searched", resume="restored", commands=_ALL,
                                       help="Comma-separated module names, or all-linear.")
    """Module names LoRA wraps; ``all-linear`` is PEFT's shorthand for every linear but the head."""

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",") if t.strip()))
        elif isinstance(self.targets, (list, tuple)) and all(isinstance(t, str) for t in self.targets):
            object.__setattr__(self, "targets", tuple(self.targets))
        else:
            raise UserError(f"--lora-targets must be module names separated by commas, got {self.targets!r}.")
        _normalise(self)


@dataclass(frozen=True)
class RunConfig:
    """Everything about a training run that changes its memory and speed (what estimate and plan see).

    Each field is a setting of the schema (``memfit.settings.schema``): its flag, help, check and resume rule.
    ``RunConfig`` is itself the group of the memory settings (``TrainConfig.run``), handed whole to estimate,
    trace, plan and the builders; only LoRA's adapters, which PEFT takes together, are a group within it. Its
    precision, technique and parallelism fields stay flat: each is one axis of the planner's search
    (``searched``), read on its own by the formulas that price it, and another level (``run.precision.dtype``)
    would add a step to hundreds of reads without making any of them a fact kept in fewer places."""

    seq_len: int = setting(256, plan="given", resume="restored", check="int>=1", commands=_ALL,
                           help="Tokens per sequence.",
                           overrides={command: _FROM_DATA for command in _ALL})
    """Tokens per sequence."""
    micro_batch: int = setting(8, plan="searched", resume="may-change", check="int>=1", commands=_ALL,
                               help="Sequences per forward/backward on one process.",
                               overrides={"train": {"default": DEMO_MICRO_BATCH, "why": _SHAPE},
                                          "estimate": {"default": DEMO_MICRO_BATCH, "why": _SHAPE},
                                          "plan": {"help": "Pin the micro-batch (grad-accum follows from --batch)."}})
    """Sequences per forward/backward pass on one process."""
    grad_accum: int = setting(1, plan="searched", resume="may-change", check="int>=1", commands=_NOT_PLAN,
                              help="Micro-batches accumulated per optimizer step.")
    """Micro-batches accumulated per optimizer step."""
    num_processes: int = setting(1, plan="given", resume="never-restored", check="int>=1", commands=_ALL,
                                 help="Data-parallel ranks (memory is per rank).")
    """Data-parallel ranks; memory numbers are per rank. Not restored by ``--resume``: the launcher decides it."""
    nodes: int = setting(1, plan="given", resume="never-restored", check="int>=1", commands=_ALL,
                         help="Machines the --num-processes ranks are spread over, the same number on each "
                         "(--sharding hybrid shards within a node and replicates across nodes).")
    """Machines (nodes) the ``num_processes`` ranks run on, ``num_processes / nodes`` each. It changes what a rank
    holds only under ``--sharding hybrid`` (``memfit.spec.engines.shard_group_size``); the planner charges the
    traffic between nodes (``memfit.planning.internode``). Not restored by ``--resume``: the launcher decides it."""
    mixed_precision: Precision = setting(Precision.NO, plan="searched", resume="restored", commands=_ALL,
                                         help="Accelerate's autocast precision (weights stay in --dtype).")
    """Accelerate's autocast precision."""
    dtype: DType = setting(DType.FP32, plan="searched", resume="restored", commands=_ALL,
                           help="Stored weight dtype; bf16 with --mixed-precision no is pure bf16.")
    """Stored weight dtype (``bf16`` with ``mixed_precision=no`` is pure bf16 training)."""
    grad_checkpointing: bool = setting(False, plan="searched", resume="may-change", check="bool", commands=_ALL,
                                       click={"negatable": True},
                                       help="Recompute each layer in backward instead of storing activations.",
                                       overrides={"plan": {"help": "Pin checkpointing on or off."}})
    """Recompute each decoder layer in backward instead of keeping its activations."""
    lora: LoraSettings = nested(LoraSettings)
    """The LoRA adapters (``LoraSettings``: ``--lora-r``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``)."""
    quantize: Quantize = setting(Quantize.NONE, plan="searched", resume="restored", commands=_ALL,
                                 help="QLoRA: frozen base in 4 or 8 bit (bitsandbytes: CUDA, or CPU from 0.50).",
                                 overrides={"plan": {"help": "Pin the QLoRA base (none forbids it)."}})
    """QLoRA: frozen base in 4 or 8 bit (needs ``lora_r > 0``)."""
    qlora_upcast: QloraUpcast = setting(QloraUpcast.LEAN, plan="searched", resume="restored", commands=_ALL,
                                        help="With --quantize: lean keeps embeddings, norms and head in --dtype (the "
                                        "residual stream in the compute dtype); full is PEFT's "
                                        "prepare_model_for_kbit_training (all of them fp32).")
    """What a quantized base upcasts to fp32 (``QloraUpcast``; ``memfit.integrations.quant_support.unquantized_dtype``)."""
    optimizer: Optimizer = setting(Optimizer.ADAMW, plan="searched", resume="restored", commands=_ALL,
                                   overrides={"plan": {"help": "Pin the optimizer (default: try adamw-fused, "
                                                               "adamw-foreach, adamw-8bit)."}})
    """The optimizer variant (``Optimizer``)."""
    offload: Offload = setting(Offload.NONE, plan="searched", resume="restored", commands=_ALL)
    """What is kept in CPU memory (``Offload``)."""
    sharding: Sharding = setting(Sharding.DDP, plan="searched", resume="may-change", commands=_ALL)
    """How model states are split over the ranks; resumable under another (the loader refuses a checkpoint
    format it cannot read, ``training.sharding.state_loader``)."""
    attn_implementation: Attention = setting(Attention.AUTO, plan="searched", resume="may-change", commands=_ALL)
    """Requested attention; what actually runs is asked of transformers (``memfit.spec.resolved``)."""
    experts_implementation: Experts = setting(Experts.AUTO, resume="may-change", commands=("estimate", "train"),
                                              help="Mixture-of-experts kernel (MoE models only); auto: grouped_mm "
                                              "for bf16 weights, else eager.")
    """Requested experts kernel; what runs is resolved against the weights' dtype (``memfit.spec.resolved.experts``)."""
    packing: Packing = setting(Packing.DOCUMENTS, plan="searched", resume="restored", commands=_NOT_PLAN,
                               help="documents: whole documents per row, each attending only to itself (position "
                               "ids restart; a block-causal mask); concat: cut one stream, documents see the ones "
                               "before; none: one document per row, padded.")
    """How documents fill rows; ``documents`` makes transformers build a block-causal (B, 1, T, T) mask."""
    loss: Loss = setting(Loss.STANDARD, plan="searched", resume="restored", commands=_ALL,
                         help="LM head + cross-entropy: chunked never builds the full logits; trl prices TRL's SFTTrainer "
                         "(estimate and plan only).",
                         overrides={"plan": {"help": "Pin the loss (default: try standard and chunked)."}})
    """LM head + cross-entropy implementation (``chunked``: never the full logits; see ``memfit.spec.losses``)."""
    optimizer_in_backward: bool = setting(False, plan="searched", resume="restored", commands=_ALL, check="bool",
                                          click={"negatable": True},
                                          help="Step each parameter as its gradient arrives (needs --grad-accum 1).",
                                          overrides={"plan": {"help": "Pin the optimizer step in backward on or off "
                                                                      "(default: try both where possible)."}})
    """Step each parameter as soon as its gradient is ready and free it (no full set of gradients)."""
    method: Method = setting(Method.SFT, plan="given", resume="restored", commands=_ALL,
                             help="Objective: sft (next-token loss) or a preference loss on prompt/chosen/rejected "
                             "records (dpo, orpo, simpo).")
    """The objective: ``sft``, or ``dpo``/``orpo``/``simpo`` on preference pairs (each step's micro-batch of B
    pairs is one (2B, T) forward, chosen then rejected; ``memfit.builder.preference``)."""
    precompute_reference: bool = setting(False, plan="searched", resume="restored", check="bool", commands=_ALL,
                                         click={"negatable": True},
                                         help="DPO: compute the reference log-probabilities once before training "
                                         "(no reference forward or copy during training).",
                                         overrides={"plan": {"help": "Pin DPO's precomputed reference on or off "
                                                             "(default: try both)."}})
    """DPO's reference policy: computed once over the data before training, instead of a frozen copy of the
    base (full fine-tune) or the base with the LoRA adapter switched off (LoRA) at every step."""
    compile: bool = setting(False, resume="may-change", check="bool",
                            commands=("estimate", "train"), click={"negatable": True},
                            help="torch.compile the model (inductor; its C++ backend on CPU).")
    """``torch.compile`` the model (Accelerate's dynamo plugin, inductor; the loss computed inside the model's
    forward is compiled with it). Memory: ``memory/compiled.py``. The planner does not choose it (no measured
    factor on GPUs to justify one). May change on resume: it changes how a step runs, not what it computes."""

    def __post_init__(self) -> None:
        _normalise(self)
        if self.quantize is not Quantize.NONE and self.lora.r == 0:
            raise UserError("--quantize trains LoRA adapters on a frozen quantized base; set --lora-r too.")
        if self.method is not Method.SFT and self.loss is not Loss.STANDARD:
            raise UserError(f"--method {self.method} reads each sequence's log-probabilities from the full logits; "
                            f"use --loss standard (not {self.loss}).")
        if self.precompute_reference and self.method is not Method.DPO:
            raise UserError(f"--precompute-reference is for --method dpo, the method with a reference policy; "
                            f"--method {self.method} has none.")
        if self.num_processes > 1 and self.num_processes % self.nodes:  # 1: train takes the launch's count
            raise UserError(f"--num-processes {self.num_processes} is not a multiple of --nodes {self.nodes}: each "
                            "node runs the same number of processes (--num-processes counts them on all nodes).")
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise UserError("--optimizer-in-backward steps each parameter during backward, so it cannot accumulate "
                            "gradients over micro-batches; use --grad-accum 1 (a larger --micro-batch).")

    # derived numbers -------------------------------------------------------------------------
    def effective_batch(self) -> int:
        """Sequences per optimizer step across all processes."""
        return self.micro_batch * self.grad_accum * self.num_processes

    def processes_per_node(self) -> int:
        """Ranks on each machine (``num_processes / nodes``; 1 while the processes are left to the launch)."""
        return max(self.num_processes // self.nodes, 1)

    def forward_sequences(self) -> int:
        """Sequences in one micro-batch's forward: B, or 2B for a preference method, whose micro-batch of B
        pairs runs the chosen and the rejected sequences together (``memfit.data.pairs.collate_pairs``)."""
        return self.micro_batch * (1 if self.method is Method.SFT else 2)

    def tokens_per_step(self) -> int:
        """Tokens per optimizer step across all processes (padding included): of both sides of each pair."""
        return self.forward_sequences() * self.grad_accum * self.num_processes * self.seq_len

    def is_lora(self) -> bool:
        return self.lora.r > 0

    def compute_dtype(self) -> str:
        """The dtype matmuls run in: the autocast dtype if mixed precision is on, else the weight dtype."""
        return str(self.dtype) if self.mixed_precision is Precision.NO else str(self.mixed_precision)

    def replace(self, **changes: Any) -> RunConfig:
        """This run with settings changed by key (``lora_r=8``, the names flags and YAML use) or by field
        (``lora=LoraSettings(...)``)."""
        return replaced(self, changes)

    @classmethod
    def of(cls, **values: Any) -> RunConfig:
        """A run from settings by key (``RunConfig.of(seq_len=512, lora_r=16)``): the flat names of flags and YAML,
        nested groups built from their keys; an unknown key raises ``TypeError`` as a constructor does."""
        return build(cls, values)

    def to_flat(self) -> dict[str, Any]:
        """Plain dict with train-flag keys and YAML-friendly values."""
        out: dict[str, Any] = {}
        for s in walk(type(self)):
            value = s.get(self)
            if isinstance(value, Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = ",".join(value)
            out[s.key] = value
        return out

    @classmethod
    def from_flat(cls, data: dict[str, Any]) -> RunConfig:
        """Build from a flat dict, ignoring keys that are not memory settings."""
        keys = {s.key for s in walk(cls)}
        return build(cls, {k: v for k, v in data.items() if k in keys and v is not None})


def check_lora_options(given, lora_r_given: bool) -> None:
    """Refuse ``--lora-targets``/``--lora-alpha``/``--lora-dropout`` given (typed or in a ``--config`` file)
    without ``--lora-r``: the run would be a full fine-tune and ignore them. An explicit ``--lora-r 0`` is
    a full fine-tune asked for (a plan's launch line and ``plan.yaml`` spell out every setting). Read by
    train, estimate and plan."""
    # the LoRA group's settings (memfit.settings.schema) but --lora-r, which switches the adapters on
    named = [flag_of(s) for s in in_group(RunConfig, "lora") if s.key != "lora_r" and s.key in given]
    if named and not lora_r_given:
        raise UserError(f"{' and '.join(named)} shape{'s' if len(named) == 1 else ''} LoRA adapters, which only "
                        f"--lora-r turns on; add --lora-r ({LORA_RANK} is common) or drop {' and '.join(named)}.")


@settings_group("data")
@dataclass(frozen=True)
class DataReading:
    """How the records of ``TrainConfig.data`` are read and tokenized (``memfit.data.prep``; issue 11, see
    ``memfit.data.formats`` and ``memfit.data.sources``): the flags ``memfit data preview`` shares with train.
    Flags and YAML keys are the field names (``--data-format``, ``data_format``)."""

    data_format: str | None = setting(None, resume="restored", check="text",
                                      click={"choices": FORMATS},
                                      help="Force the record format instead of detecting it from the keys.")
    """Force the record format (messages, sharegpt, alpaca, prompt-completion, text); None: detect."""
    train_on_prompt: bool = setting(False, resume="restored", check="bool",
                                    help="Take the loss on prompts and user turns too (default: completions/"
                                    "assistant turns).")
    """Take the loss on every token (prompts, user turns) too, not only on completions/assistant turns."""
    chat_template: str | None = setting(None, resume="restored", check="text", click={"path": True},
                                        help="Jinja chat template file for a tokenizer without one (or to replace "
                                        "its own).")
    """Jinja chat template file, for a tokenizer without one (or to replace its own)."""
    split: str = setting("train", resume="restored", check="text",
                         help="Split of a Hub dataset or a save_to_disk DatasetDict.")
    """Split of a Hub dataset or a saved ``DatasetDict``."""
    data_config: str | None = setting(None, resume="restored", check="text",
                                      help="Configuration (subset) of a Hub dataset.")
    """Configuration (subset) name of a Hub dataset."""
    text_field: str | None = setting(None, resume="restored", check="text",
                                     help="Column holding the text (default: text).")
    prompt_field: str | None = setting(None, resume="restored", check="text",
                                       help="Column holding the prompt (default: prompt).")
    completion_field: str | None = setting(None, resume="restored", check="text",
                                           help="Column holding the completion (default: completion).")
    messages_field: str | None = setting(None, resume="restored", check="text",
                                         help="Column holding the conversation (default: messages).")
    num_proc: int = setting(1, resume="restored", check="int>=1",
                            help="Processes that tokenize a datasets source (.parquet/.csv/.json/.arrow, Hub id).")
    """Processes ``datasets.map`` tokenizes a ``datasets`` source with."""

    def __post_init__(self) -> None:
        _normalise(self)
        if isinstance(self.chat_template, str) and self.chat_template.startswith("~"):  # not expanded by a shell
            object.__setattr__(self, "chat_template", os.path.expanduser(self.chat_template))


@settings_group("optim")
@dataclass(frozen=True)
class OptimSettings:
    """The optimizer's step (``memfit.training.setup.build_optimizer`` and the schedule; the optimizer's kind,
    which changes memory, is ``RunConfig.optimizer``). Flags and YAML keys are the field names: ``--lr``, ``lr``."""

    lr: float | None = setting(None, resume="restored", check="pos",
                               help=f"Peak learning rate; default by method: {fmt_lr(DEMO_LR)} from random "
                               f"weights (a preset, the demo), {fmt_lr(LORA_LR)} for LoRA, "
                               f"{fmt_lr(FULL_LR)} for a full fine-tune.")
    """Peak learning rate; None: by method (``memfit.settings.defaults.default_lr``: 1e-3 from random weights, as
    the demo, 2e-4 for LoRA, 2e-5 for a full fine-tune), filled in when the run is built."""
    weight_decay: float = setting(0.0, resume="restored", check="nonneg")
    warmup_steps: int = setting(10, resume="restored", check="int>=0")
    max_grad_norm: float = setting(1.0, resume="restored", check="nonneg", help="Gradient clipping (0: off).")

    def __post_init__(self) -> None:
        _normalise(self)


@settings_group("checkpoints")
@dataclass(frozen=True)
class CheckpointSettings:
    """When a run writes checkpoints, how many it keeps and in which form (``memfit.training.runfolder.checkpoint``).
    Flags and YAML keys are the field names: ``--save-every``, ``save_every``."""

    save_every: int | None = setting(None, resume="may-change", check="int>=0",
                                     help="Checkpoint every N steps (and at the end); default: ten times per run; "
                                     "0: never.")
    """Checkpoint every N optimizer steps (and at the end); None: automatically, ten times per run; 0: never."""
    keep_last: int = setting(2, resume="may-change", check="int>=1",
                             help="Checkpoints kept (older ones go only once a newer one is complete).")
    """Checkpoints kept: older ones are removed only after a newer one is complete and verified."""
    state_dict: str = setting("sharded", resume="may-change", click={"choices": ("sharded", "full")},
                              help="Checkpoints of a sharded run: each rank's shards, or the full state gathered on "
                              "rank 0 (resumes on any number of processes, --sharding ddp on 1 included).")
    """Sharded runs' checkpoints: ``sharded`` (each rank writes its shards; resumes on any number of ranks
    of a sharded run) or ``full`` (gathered on rank 0 into an unsharded run's files; resumes on any
    number of processes, sharded or not). ``training.sharding``."""

    def __post_init__(self) -> None:
        _normalise(self)


@settings_group("preference")
@dataclass(frozen=True)
class PreferenceSettings:
    """The hyperparameters of the preference losses (``--method dpo/orpo/simpo``; ``memfit.builder.preference``),
    with TRL's defaults. Flags and YAML keys are the field names: ``--beta``, ``beta``."""

    beta: float = setting(0.1, resume="restored", check="pos",
                          help="DPO/SimPO temperature beta (TRL's default 0.1).")
    """DPO's beta (deviation from the reference) and SimPO's reward scale (TRL's ``beta``)."""
    orpo_lambda: float = setting(0.1, resume="restored", check="pos",
                                 help="ORPO: weight lambda of the odds-ratio term (TRL's default 0.1).")
    """ORPO's lambda (TRL's ``ORPOConfig.beta``)."""
    simpo_gamma: float = setting(0.5, resume="restored", check="nonneg",
                                 help="SimPO: target reward margin gamma (TRL's default 0.5).")
    """SimPO's gamma (TRL's ``CPOConfig.simpo_gamma``)."""

    def __post_init__(self) -> None:
        _normalise(self)


@settings_group("model")
@dataclass(frozen=True)
class ModelSource:
    """Which model a run trains and how it is loaded: the weights (``model``, ``revision``, ``init``), the tokenizer,
    and what loading may run (``trust_remote_code``, ``allow_pickle_weights``). Read together by whatever resolves,
    fetches or loads the model (``memfit.training.setup``, ``memfit.spec.model.source_spec``, ``memfit.data.prep``).
    Flags and YAML keys are the field names: ``--model``, ``model``."""

    model: str = setting("tiny", resume="restored", check="text",
                         help="Preset name (random weights), a local Hugging Face checkpoint folder, or a Hub id "
                         "(org/name: fetched into the Hugging Face cache; HF_TOKEN for gated models).")
    """Architecture preset name, local Hugging Face checkpoint directory, or Hugging Face Hub id (org/name)."""
    tokenizer: str | None = setting(None, resume="restored", check="text", commands=_ALL,
                                    help="Tokenizer folder, or 'byte'; default: the model's.",
                                    overrides={c: {"help": "With --data: the tokenizer train would use (a folder, or "
                                                   "'byte'); default: the model's."} for c in ("estimate", "plan")})
    """Tokenizer directory; default: the model's, or memfit's byte-level tokenizer for presets."""
    revision: str | None = setting(None, resume="restored", check="text", commands=_ALL,
                                   help="Branch, tag or commit of a Hub --model; default: its main branch (the run "
                                   "records the commit).",
                                   overrides={c: {"help": "Branch, tag or commit of a Hub MODEL (org/name); default: "
                                                  "its main branch."} for c in ("estimate", "plan")})
    """Branch, tag or commit of a Hub ``model`` (org/name); None: its default branch. A run pins the commit
    it resolved to here, so ``--resume`` continues on the same weights (offline, from the cache)."""
    trust_remote_code: bool = setting(False, resume="never-restored", check="bool", commands=("estimate", "train"),
                                      help="Allow the model's own Python code (local or Hub).",
                                      overrides={"estimate": {"help": "Allow the model's own Python code (a local "
                                                              "folder or a Hub model)."}})
    allow_pickle_weights: bool = setting(False, resume="never-restored", check="bool",
                                         help="Accept a Hub model whose weights are PyTorch pickles (*.bin, *.pt), "
                                         "which can run code when loaded; default: safetensors only.")
    """Load a Hub model whose weights are PyTorch pickles (``*.bin``/``*.pt``), which can run code when loaded."""
    init: str = setting("pretrained", resume="restored", click={"choices": ("pretrained", "random")},
                        help="random: train a model folder that holds only config.json from random weights.")
    """``random``: train a model folder that holds only a config.json from random initialisation."""

    def __post_init__(self) -> None:
        _normalise(self, validate.check_train)


@settings_group("folder")
@dataclass(frozen=True)
class FolderSettings:
    """The run folder and what may happen to what it holds: a fresh run, a replaced one (``overwrite``) or one
    continued (``resume``, ``extend_schedule``, ``allow_data_change``). Read by ``memfit.training.session``
    (which folder), ``memfit.training.guard`` (what is written) and ``memfit.training.resume`` (what may go on).
    None of it is restored by ``--resume``. Flags and YAML keys are the field names: ``--output``, ``output``."""

    output: str | None = setting(None, resume="never-restored", check="text",
                                 help="Run folder; default: a new runs/<model>-<YYYYmmdd-HHMMSS>. A folder holding "
                                 "another run is refused unless --overwrite or --resume.")
    """Run folder; None: a fresh ``runs/<model-name>-<YYYYmmdd-HHMMSS>`` per run (``--resume`` needs one given)."""
    resume: bool = setting(False, resume="never-restored", check="bool",
                           help="Continue from the latest checkpoint in --output (required).")
    overwrite: bool = setting(False, resume="never-restored", check="bool",
                              help="Replace a previous run in --output.")
    extend_schedule: bool = setting(False, resume="never-restored", check="bool",
                                    help="With --resume and more --max-steps/--epochs than a finished run had: train "
                                    "on, the learning-rate schedule recomputed over the new total (its lr rises "
                                    "again from 0).")
    """With ``resume``: train a finished run on past its end, its learning-rate schedule recomputed over the
    new total (the lr rises again from 0); refused without it (``training.resume.check_extension``)."""
    allow_data_change: bool = setting(False, resume="never-restored", check="bool",
                                      help="With --resume: train on although the data file's content changed since "
                                      "the checkpoint was saved (refused otherwise).")
    """With ``resume``: go on although the data's fingerprint differs from the checkpoint's
    (``training.resume.check_data``)."""

    def __post_init__(self) -> None:
        _normalise(self, validate.check_train)


@settings_group("length")
@dataclass(frozen=True)
class RunLength:
    """How long a run trains: optimizer steps and/or passes over the data, whichever ends first
    (``memfit.training.derived.total_steps``; ``--resume`` restores neither when one is given:
    ``RESUME_RULES["length"]``). Flags and YAML keys are the field names: ``--max-steps``, ``max_steps``."""

    max_steps: int | None = setting(None, resume="length", check="int>=1",
                                    help="Optimizer steps (with --epochs: whichever ends first); default: "
                                    f"{DEMO_STEPS} for the demo, else 1 epoch.")
    """Optimizer steps (with ``epochs``: whichever ends first); with neither, the demo trains 300 and any
    other run one epoch (``memfit.settings.defaults.default_steps``)."""
    epochs: int | None = setting(None, resume="length", check="int>=1",
                                 help="Passes over the training data (never capped by a default --max-steps).")
    """Passes over the training data; a default ``max_steps`` never caps them."""

    def __post_init__(self) -> None:
        _normalise(self)


@settings_group("cadence")
@dataclass(frozen=True)
class Cadence:
    """How often the loop evaluates, logs and shows samples (``memfit.training.loop``, ``memfit.training.samples``):
    what a run reports, never what a step computes, so each may change on ``--resume``. Flags and YAML keys are
    the field names: ``--eval-every``, ``eval_every``."""

    eval_every: int = setting(40, resume="may-change", check="int>=0",
                              help="Evaluate on the held-out split every N steps (0: never).")
    """Evaluate on the held-out split every N optimizer steps; 0: never."""
    log_every: int = setting(5, resume="may-change", check="int>=1")
    """Log the training loss every N optimizer steps."""
    samples: int = setting(3, resume="may-change", check="int>=0",
                           help="Samples printed at the end: the model continues the beginnings of held-out "
                           "documents.")
    """Generated samples printed at the end of the run."""
    eval_samples: int = setting(0, resume="may-change", click={"min": 0},
                                help="Also generate N samples at each --eval-every evaluation (samples.jsonl in "
                                "--output).")
    """Samples generated after each ``--eval-every`` evaluation (``samples.jsonl``); 0: only at the end."""

    def __post_init__(self) -> None:
        _normalise(self)


@dataclass(frozen=True)
class TrainConfig:
    """A whole ``memfit train`` invocation: the model, the data, the run, and the loop's knobs.

    Each field but ``run`` (the memory settings' group) is a setting of the schema (``memfit.settings.schema``) or a
    nested group of them (``source``, ``folder``, ``length``, ``cadence``, ...), whose flags and keys stay flat."""

    source: ModelSource = nested(ModelSource)
    """Which model and tokenizer, and how they load (``ModelSource``: ``--model``, ``--tokenizer``, ...)."""
    data: str | None = setting(None, resume="restored", check="text", commands=_ALL,
                               help=".txt, .jsonl (text or prompt/completion) or a folder; default: the corpus "
                               "shipped with memfit.",
                               overrides={c: {"help": "The run's data (as memfit train --data): --seq-len, when not "
                                              "given, is derived from it as train derives it."}
                                          for c in ("estimate", "plan")})
    """.txt, .jsonl (``text`` or ``prompt``/``completion``) or a folder; None = the shipped corpus."""
    run: RunConfig = field(default_factory=lambda: RunConfig.of(**own_defaults(RunConfig, "train")))
    """The memory settings, with train's own defaults (``RunConfig``'s ``overrides['train']``: the demo's shape).
    On the user's model or data a ``seq_len`` not in ``explicit`` comes from the data (``memfit.settings.defaults``);
    library callers (``explicit`` None) get exactly the ``seq_len`` they pass."""
    optim: OptimSettings = nested(OptimSettings)
    """The optimizer's step: learning rate, weight decay, warm-up, clipping (``OptimSettings``: ``--lr``, ...)."""
    length: RunLength = nested(RunLength)
    """How long the run trains (``RunLength``: ``--max-steps``, ``--epochs``)."""
    truncate: bool = setting(False, resume="restored", check="bool",
                             help="Keep conversations longer than --seq-len cut to it (when the cut keeps a reply "
                             "token) instead of dropping them.")
    """Keep conversations longer than ``seq_len`` cut to it (when the cut keeps a target token), instead of
    dropping them."""
    seed: int = setting(0, resume="restored", check="int>=0")
    cadence: Cadence = nested(Cadence)
    """How often the loop evaluates, logs and samples (``Cadence``: ``--eval-every``, ``--log-every``, ...)."""
    eval_fraction: float = setting(0.02, resume="restored", check="frac")
    checkpoints: CheckpointSettings = nested(CheckpointSettings)
    """When checkpoints are written, how many are kept, in which form (``CheckpointSettings``: ``--save-every``, ...)."""
    folder: FolderSettings = nested(FolderSettings)
    """The run folder and what may happen to it (``FolderSettings``: ``--output``, ``--resume``, ...)."""
    merge: bool = setting(False, resume="may-change", check="bool",
                          help="LoRA: also save the adapter merged into the base.")
    batch: int | None = setting(None, plan="given", resume="restored", check="int>=1", commands=("plan", "train"),
                                help="Effective batch in sequences per optimizer step (sets --grad-accum).",
                                overrides={"plan": {"default": DEMO_MICRO_BATCH, "why": _SHAPE, "help": "Effective batch: "
                                                    "sequences per optimizer step over all processes (kept exact)."}})
    """Effective batch in sequences (all micro-batches and processes of one step); sets ``grad_accum``."""
    budget: str | None = setting(None, resume="restored", check="text", commands=("plan", "train"),
                                 help="Memory budget (24GiB): plan the fastest settings that fit, then train them. "
                                 "Full fine-tune unless --lora-r; --dtype/--mixed-precision kept when given.",
                                 overrides={"plan": {"help": "Memory per GPU, e.g. 24GiB or 24GB (default: the "
                                                     "--gpu's memory)."}})
    """Memory budget (``24GiB``); when set, ``memfit plan`` picks the run settings first."""
    pinned: tuple[str, ...] = setting((), resume="never-restored", commands=())
    """Run settings the user set explicitly; with ``budget`` the planner keeps them."""
    tracker: str | None = setting(None, resume="may-change", check="text", click={"choices": tuple(TRACKERS)},
                                  help="Also log metrics with an Accelerate tracker (files under --output; wandb/"
                                  "mlflow/trackio/aim need their extra: pip install 'memfit[wandb]' and so on).")
    """Accelerate tracker (``tensorboard``) to log to, under ``output``."""
    check_equivalence: bool = setting(False, resume="never-restored", check="bool",
                                      help="Train 3 steps as E x 1 and E/k x k on your model and data; print the "
                                      "weight difference.")
    json: bool = setting(False, resume="never-restored", check="bool",
                         help="Print the final summary as JSON on stdout.")
    reading: DataReading = nested(DataReading)
    """How the records of ``data`` are read (``DataReading``: ``--data-format``, ``--split``, the column names, ...)."""
    preference: PreferenceSettings = nested(PreferenceSettings)
    """The preference losses' hyperparameters (``PreferenceSettings``: ``--beta``, ``--orpo-lambda``, ``--simpo-gamma``)."""
    threads: int | None = setting(None, resume="restored", check="int>=1", click={"min": 1},
                                  help="torch CPU threads; default: OMP_NUM_THREADS when set, else the cores idle "
                                  "and available to this process (affinity, cgroup quota).")
    """torch CPU threads; None: OMP_NUM_THREADS when set, else the idle cores available (training/threads.py)."""
    explicit: tuple[str, ...] | None = setting(None, resume="never-restored", commands=())
    """Settings the user gave (flags typed or in ``--config``); None for library callers, whose whole
    config counts as given. ``--resume`` restores the run's saved settings for the others."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunConfig):
            raise UserError("TrainConfig.run must be a RunConfig.")
        _check_groups(self)
        for name, value in validate.check_train(self).items():  # one place for every value check
            object.__setattr__(self, name, value)

    def to_flat(self) -> dict[str, Any]:
        """Flat train-flag keys (``memfit.settings.schema.key_of``), nested groups' included, with the run's settings."""
        out = {s.key: s.get(self) for s in walk(type(self))}
        out.update(self.run.to_flat())
        return out

    def replace(self, **changes: Any) -> TrainConfig:
        """This config with settings changed by key (``data_format=...``, nested groups' included) or by field."""
        return replaced(self, changes)

    @classmethod
    def of(cls, **values: Any) -> TrainConfig:
        """A train config from settings by key (``TrainConfig.of(model="tiny", beta=0.2, text_field="body")``),
        the run's too (``lora_r=8``, into ``run``: train's defaults for the rest) or ``run=`` a ``RunConfig``;
        an unknown key raises ``TypeError``."""
        run_keys = {s.key for s in walk(RunConfig)}
        run_values = {k: values.pop(k) for k in list(values) if k in run_keys}
        run = values.pop("run", None) or RunConfig.of(**own_defaults(RunConfig, "train"))
        return build(cls, {"run": run.replace(**run_values) if run_values else run, **values})

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Every key a YAML config (or ``from_flat``) accepts -> where the setting lives (``"optim.lr"``,
        ``"run.lora.r"``): the schema's settings."""
        return {s.key: ".".join(s.path) for s in walk(cls)} | {s.key: "run." + ".".join(s.path) for s in walk(RunConfig)}

    @classmethod
    def from_flat(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from flat train-flag keys (a YAML config, or the CLI's merged flags)."""
        data = {k.replace("-", "_"): v for k, v in data.items()}
        keys = cls.keys()
        validate.unknown_keys(set(data) - set(keys), set(keys))
        own = {s.key for s in walk(cls)}
        return build(cls, {"run": RunConfig.from_flat(data),
                           **{k: v for k, v in data.items() if k in own and v is not None}})


def read_config_file(path) -> dict[str, Any]:
    """The settings of a ``--config`` YAML file (``memfit.settings.config_file.read_settings``: UTF-8 checked,
    ``no``/``off`` kept as words, nested ``config:`` refused)."""

    return read_settings(path)
