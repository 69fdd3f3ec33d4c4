"""Typed configuration: what changes memory (``RunConfig``) and how to train (``TrainConfig``).

One vocabulary everywhere: precision uses Accelerate's names (``no``, ``fp16``, ``bf16``); the keys of
``RunConfig.to_flat()`` are the names of ``memfit train``'s flags with ``-`` replaced by ``_``, so a
plan written as YAML is read back by ``memfit train --config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from memfit import validate
from memfit.defaults import DEMO_MICRO_BATCH, DEMO_SEQ_LEN
from memfit.errors import UserError


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
    """Quantized frozen base for QLoRA (bitsandbytes: CUDA, or the CPU from 0.50; ``memfit.quant_support``)."""

    NONE = "none"
    Q4 = "4bit"
    Q8 = "8bit"


class Sharding(StrEnum):
    """How model states are split across ``num_processes`` ranks."""

    DDP = "ddp"  # replicated
    FSDP = "fsdp"  # FULL_SHARD: params, grads and optimizer state sharded
    ZERO2 = "zero2"  # grads and optimizer state sharded
    ZERO3 = "zero3"  # like FSDP full shard


class Offload(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # optimizer state (and step) on CPU
    PARAMS = "params"  # parameters and optimizer state on CPU
    ACTIVATIONS = "activations"  # tensors saved for backward kept in pinned CPU memory (CUDA only)


class Loss(StrEnum):
    """How the LM head and cross-entropy run; the table of what each costs is ``memfit.losses.LOSSES``."""

    STANDARD = "standard"  # transformers' head + ForCausalLMLoss: full (B, T, V) logits and their gradient
    CHUNKED = "chunked"  # memfit's pure-PyTorch chunked linear cross-entropy (any device)
    LIGER = "liger"  # Liger kernel's fused linear cross-entropy (CUDA, optional extra)
    CCE = "cce"  # Apple's Cut Cross-Entropy (CUDA, optional extra)


class Attention(StrEnum):
    """The attention implementation asked of transformers; ``auto`` lets transformers choose for the model
    (SDPA where the model supports it, else eager), as ``from_pretrained`` does without the argument."""

    AUTO = "auto"
    SDPA = "sdpa"
    EAGER = "eager"
    FLASH = "flash_attention_2"


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
    if isinstance(value, bool):
        return Packing.DOCUMENTS if value else Packing.NONE
    return _enum(Packing, value, "--packing")


DEFAULT_LORA_TARGETS: tuple[str, ...] = ("all-linear",)


def _enum(cls: type[Enum], value: Any, flag: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        choices = ", ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise UserError(f"Unknown {flag} {value!r}; choose one of: {choices}.") from None


@dataclass(frozen=True)
class RunConfig:
    """Everything about a training run that changes its memory and speed (what estimate and plan see)."""

    seq_len: int = 256
    """Tokens per sequence."""
    micro_batch: int = 8
    """Sequences per forward/backward pass on one process."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    num_processes: int = 1
    """Data-parallel ranks; memory numbers are per rank."""
    mixed_precision: Precision = Precision.NO
    """Accelerate's autocast precision."""
    dtype: DType = DType.FP32
    """Stored weight dtype (``bf16`` with ``mixed_precision=no`` is pure bf16 training)."""
    grad_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations."""
    lora_r: int = 0
    """LoRA rank; 0 is a full fine-tune."""
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """Module names LoRA wraps; ``all-linear`` is PEFT's shorthand for every linear but the head."""
    quantize: Quantize = Quantize.NONE
    """QLoRA: frozen base in 4 or 8 bit (needs ``lora_r > 0``)."""
    optimizer: Optimizer = Optimizer.ADAMW
    offload: Offload = Offload.NONE
    sharding: Sharding = Sharding.DDP
    attn_implementation: Attention = Attention.AUTO
    """Requested attention; what actually runs is asked of transformers (``memfit.resolved``)."""
    packing: Packing = Packing.DOCUMENTS
    """How documents fill rows; ``documents`` makes transformers build a block-causal (B, 1, T, T) mask."""
    loss: Loss = Loss.STANDARD
    """LM head + cross-entropy implementation (``chunked``: never the full logits; see ``memfit.losses``)."""
    optimizer_in_backward: bool = False
    """Step each parameter as soon as its gradient is ready and free it (no full set of gradients)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "mixed_precision", _enum(Precision, self.mixed_precision, "--mixed-precision"))
        set_(self, "dtype", _enum(DType, self.dtype, "--dtype"))
        set_(self, "optimizer", _enum(Optimizer, self.optimizer, "--optimizer"))
        set_(self, "quantize", _enum(Quantize, self.quantize, "--quantize"))
        set_(self, "offload", _enum(Offload, self.offload, "--offload"))
        set_(self, "sharding", _enum(Sharding, self.sharding, "--sharding"))
        set_(self, "attn_implementation", _enum(Attention, self.attn_implementation, "--attn-implementation"))
        set_(self, "packing", parse_packing(self.packing))
        set_(self, "loss", _enum(Loss, self.loss, "--loss"))
        if isinstance(self.lora_targets, str):
            set_(self, "lora_targets", tuple(t.strip() for t in self.lora_targets.split(",") if t.strip()))
        elif isinstance(self.lora_targets, (list, tuple)) and all(isinstance(t, str) for t in self.lora_targets):
            set_(self, "lora_targets", tuple(self.lora_targets))
        else:
            raise UserError(f"--lora-targets must be module names separated by commas, got {self.lora_targets!r}.")
        for name, value in validate.check_run(self).items():  # one place for every value check
            set_(self, name, value)
        if self.quantize is not Quantize.NONE and self.lora_r == 0:
            raise UserError("--quantize trains LoRA adapters on a frozen quantized base; set --lora-r too.")
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise UserError("--optimizer-in-backward steps each parameter during backward, so it cannot accumulate "
                            "gradients over micro-batches; use --grad-accum 1 (a larger --micro-batch).")

    # derived numbers -------------------------------------------------------------------------
    def effective_batch(self) -> int:
        """Sequences per optimizer step across all processes."""
        return self.micro_batch * self.grad_accum * self.num_processes

    def tokens_per_step(self) -> int:
        """Tokens per optimizer step across all processes (padding included)."""
        return self.effective_batch() * self.seq_len

    def is_lora(self) -> bool:
        return self.lora_r > 0

    def compute_dtype(self) -> str:
        """The dtype matmuls run in: the autocast dtype if mixed precision is on, else the weight dtype."""
        return str(self.dtype) if self.mixed_precision is Precision.NO else str(self.mixed_precision)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_flat(self) -> dict[str, Any]:
        """Plain dict with train-flag keys and YAML-friendly values."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = ",".join(value)
            out[f.name] = value
        return out

    @classmethod
    def from_flat(cls, data: dict[str, Any]) -> RunConfig:
        """Build from a flat dict, ignoring keys that are not memory settings."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names and v is not None})


@dataclass(frozen=True)
class TrainConfig:
    """A whole ``memfit train`` invocation: the model, the data, the run, and the loop's knobs."""

    model: str = "tiny"
    """Architecture preset name, local Hugging Face checkpoint directory, or Hugging Face Hub id (org/name)."""
    data: str | None = None
    """.txt, .jsonl (``text`` or ``prompt``/``completion``) or a folder; None = the shipped corpus."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the model's, or memfit's byte-level tokenizer for presets."""
    run: RunConfig = field(default_factory=lambda: RunConfig(seq_len=DEMO_SEQ_LEN, micro_batch=DEMO_MICRO_BATCH))
    """Train's own defaults for the memory settings: sized for the demo (tiny preset, 2 CPU cores, < 3 min).
    On the user's model or data a ``seq_len`` not in ``explicit`` comes from the data (``memfit.defaults``);
    library callers (``explicit`` None) get exactly the ``seq_len`` they pass."""
    optimizer_lr: float | None = None
    """Peak learning rate; None: by method (``memfit.defaults.default_lr``: 1e-3 from random weights, as
    the demo, 2e-4 for LoRA, 2e-5 for a full fine-tune), filled in when the run is built."""
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_steps: int | None = None
    """Optimizer steps (with ``epochs``: whichever ends first); with neither, the demo trains 300 and any
    other run one epoch (``memfit.defaults.default_steps``)."""
    epochs: int | None = None
    truncate: bool = False
    """Keep conversations longer than ``seq_len`` cut to it (when the cut keeps a target token), instead of
    dropping them."""
    seed: int = 0
    eval_every: int = 40
    eval_fraction: float = 0.02
    save_every: int | None = None
    """Checkpoint every N optimizer steps (and at the end); None: automatically, ten times per run; 0: never."""
    keep_last: int = 2
    """Checkpoints kept: older ones are removed only after a newer one is complete and verified."""
    state_dict: str = "sharded"
    """Sharded runs' checkpoints: ``sharded`` (each rank writes its shards; resumes on any number of ranks
    of a sharded run) or ``full`` (gathered on rank 0 into an unsharded run's files; resumes on any
    number of processes, sharded or not). ``training.sharding``."""
    init: str = "pretrained"
    """``random``: train a model folder that holds only a config.json from random initialisation."""
    log_every: int = 5
    max_grad_norm: float = 1.0
    output: str | None = None
    """Run folder; None: a fresh ``runs/<model-name>-<YYYYmmdd-HHMMSS>`` per run (``--resume`` needs one given)."""
    resume: bool = False
    extend_schedule: bool = False
    """With ``resume``: train a finished run on past its end, its learning-rate schedule recomputed over the
    new total (the lr rises again from 0); refused without it (``training.resume.check_extension``)."""
    overwrite: bool = False
    merge: bool = False
    trust_remote_code: bool = False
    samples: int = 3
    """Generated samples printed at the end of the run."""
    eval_samples: int = 0
    """Samples generated after each ``--eval-every`` evaluation (``samples.jsonl``); 0: only at the end."""
    batch: int | None = None
    """Effective batch in sequences (all micro-batches and processes of one step); sets ``grad_accum``."""
    budget: str | None = None
    """Memory budget (``24GiB``); when set, ``memfit plan`` picks the run settings first."""
    pinned: tuple[str, ...] = ()
    """Run settings the user set explicitly; with ``budget`` the planner keeps them."""
    tracker: str | None = None
    """Accelerate tracker (``tensorboard``) to log to, under ``output``."""
    check_equivalence: bool = False
    json: bool = False
    # Data (issue 11; see memfit.data_formats and memfit.data_sources) -------------------------------
    data_format: str | None = None
    """Force the record format (messages, sharegpt, alpaca, prompt-completion, text); None: detect."""
    train_on_prompt: bool = False
    """Take the loss on every token (prompts, user turns) too, not only on completions/assistant turns."""
    chat_template: str | None = None
    """Jinja chat template file, for a tokenizer without one (or to replace its own)."""
    split: str = "train"
    """Split of a Hub dataset or a saved ``DatasetDict``."""
    data_config: str | None = None
    """Configuration (subset) name of a Hub dataset."""
    text_field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    messages_field: str | None = None
    num_proc: int = 1
    """Processes ``datasets.map`` tokenizes a ``datasets`` source with."""
    threads: int | None = None
    """torch CPU threads; None: OMP_NUM_THREADS when set, else the idle cores available (training/threads.py)."""
    # Hub models (issue 22; memfit.hub) --------------------------------------------------------------
    revision: str | None = None
    """Branch, tag or commit of a Hub ``model`` (org/name); None: its default branch. A run pins the commit
    it resolved to here, so ``--resume`` continues on the same weights (offline, from the cache)."""
    allow_pickle_weights: bool = False
    """Load a Hub model whose weights are PyTorch pickles (``*.bin``/``*.pt``), which can run code when loaded."""

    explicit: tuple[str, ...] | None = None
    """Settings the user gave (flags typed or in ``--config``); None for library callers, whose whole
    config counts as given. ``--resume`` restores the run's saved settings for the others."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunConfig):
            raise UserError("TrainConfig.run must be a RunConfig.")
        for name, value in validate.check_train(self).items():  # one place for every value check
            object.__setattr__(self, name, value)

    def to_flat(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "run"}
        out["lr"] = out.pop("optimizer_lr")
        out.update(self.run.to_flat())
        return out

    @classmethod
    def from_flat(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from flat train-flag keys (a YAML config, or the CLI's merged flags)."""
        data = {k.replace("-", "_"): v for k, v in data.items()}
        names = {f.name for f in fields(cls)} - {"run", "optimizer_lr"}
        run_names = {f.name for f in fields(RunConfig)}
        validate.unknown_keys(set(data) - names - run_names - {"lr"}, names | run_names | {"lr"})
        kwargs = {k: v for k, v in data.items() if k in names and v is not None}
        if data.get("lr") is not None:
            kwargs["optimizer_lr"] = data["lr"]  # checked (finite, positive) by validate.check_train
        return cls(run=RunConfig.from_flat(data), **kwargs)
