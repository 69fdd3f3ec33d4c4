"""Flags shared by ``train``, ``estimate`` and ``plan`` for what changes memory.

The names are ``memfit train``'s interface; ``run_config_from`` turns them into a ``RunConfig``.
``explicit`` tells which flags the user typed, so a ``--config`` YAML fills only the rest.
"""

from __future__ import annotations

from typing import Any

import click

from memfit.config import (
    Attention,
    DType,
    Loss,
    Offload,
    Optimizer,
    Packing,
    Precision,
    Quantize,
    RunConfig,
    Sharding,
)

_DEFAULT = RunConfig()


def _choice(enum) -> click.Choice:
    return click.Choice([m.value for m in enum], case_sensitive=False)


def memory_options(func):
    """Decorate a click command with the memory flags (defaults from ``RunConfig``)."""
    opts = [
        click.option("--seq-len", type=int, default=_DEFAULT.seq_len, show_default=True, help="Tokens per sequence."),
        click.option("--micro-batch", type=int, default=_DEFAULT.micro_batch, show_default=True,
                     help="Sequences per forward/backward on one process."),
        click.option("--grad-accum", type=int, default=_DEFAULT.grad_accum, show_default=True,
                     help="Micro-batches accumulated per optimizer step."),
        click.option("--mixed-precision", type=_choice(Precision), default=_DEFAULT.mixed_precision.value,
                     show_default=True, help="Accelerate's autocast precision (weights stay in --dtype)."),
        click.option("--dtype", type=_choice(DType), default=_DEFAULT.dtype.value, show_default=True,
                     help="Stored weight dtype; bf16 with --mixed-precision no is pure bf16."),
        click.option("--grad-checkpointing/--no-grad-checkpointing", default=_DEFAULT.grad_checkpointing,
                     show_default=True, help="Recompute each layer in backward instead of storing activations."),
        click.option("--lora-r", type=int, default=_DEFAULT.lora_r, show_default=True,
                     help="LoRA rank; 0 = full fine-tune."),
        click.option("--lora-alpha", type=float, default=_DEFAULT.lora_alpha, show_default=True),
        click.option("--lora-dropout", type=float, default=_DEFAULT.lora_dropout, show_default=True),
        click.option("--lora-targets", type=str, default=",".join(_DEFAULT.lora_targets), show_default=True,
                     help="Comma-separated module names, or all-linear."),
        click.option("--quantize", type=_choice(Quantize), default=_DEFAULT.quantize.value, show_default=True,
                     help="QLoRA: frozen base in 4 or 8 bit (bitsandbytes: CUDA, or CPU from 0.50)."),
        click.option("--optimizer", type=_choice(Optimizer), default=_DEFAULT.optimizer.value, show_default=True),
        click.option("--num-processes", type=int, default=_DEFAULT.num_processes, show_default=True,
                     help="Data-parallel ranks (memory is per rank)."),
        click.option("--sharding", type=_choice(Sharding), default=_DEFAULT.sharding.value, show_default=True),
        click.option("--offload", type=_choice(Offload), default=_DEFAULT.offload.value, show_default=True),
        click.option("--attn-implementation", type=_choice(Attention), default=_DEFAULT.attn_implementation.value,
                     show_default=True),
        click.option("--packing", type=_choice(Packing), default=_DEFAULT.packing.value, show_default=True,
                     help="documents: whole documents per row, each attending only to itself (position ids "
                     "restart; a block-causal mask); concat: cut one stream, documents see the ones before; "
                     "none: one document per row, padded."),
        click.option("--loss", type=_choice(Loss), default=_DEFAULT.loss.value, show_default=True,
                     help="LM head + cross-entropy: chunked never builds the full logits."),
        click.option("--optimizer-in-backward/--no-optimizer-in-backward", default=_DEFAULT.optimizer_in_backward,
                     show_default=True, help="Step each parameter as its gradient arrives (needs --grad-accum 1)."),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


MEMORY_KEYS = tuple(f for f in RunConfig.__dataclass_fields__)


def run_config_from(kwargs: dict[str, Any]) -> RunConfig:
    """``RunConfig`` from a click kwargs dict (extra keys ignored)."""
    return RunConfig.from_flat({k: v for k, v in kwargs.items() if k in MEMORY_KEYS})


def explicit(ctx: click.Context, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Only the parameters the user set on the command line (not defaults)."""
    source = click.core.ParameterSource
    return {
        k: v
        for k, v in kwargs.items()
        if ctx.get_parameter_source(k) not in (source.DEFAULT, source.DEFAULT_MAP, None)
    }
