"""What a run builds, once: the model's load options, LoRA wrapping, parameter groups and the optimizer.

``memfit train`` (``training/setup.py``) and ``--exact``'s trace (``memory/trace.py``) both call these
functions, so the model and optimizer the trace measures are the ones training steps: the same PEFT
``LoraConfig``, the same wrapping order (checkpointing on the base model, then k-bit preparation, then
PEFT), the same weight-decay parameter groups (torch's optimizers run their step one group at a time, so
the groups shape the step's temporaries) and the same row of ``memfit.spec.optimizers``. Where the two differ
they say so at the call: train loads weights (or quantizes), the trace builds on the meta device and
swaps in fake tensors; train names the adapter's base model; the trace picks torch's CUDA
implementation (``cuda_like``) while running CPU kernels.

A leaf below ``memory/`` and ``training/``: it imports neither.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.builder.optim_in_backward import OptimizerInBackward
from memfit.integrations.hf_compat import default_causal_loss, enable_checkpointing
from memfit.settings.config import RunConfig
from memfit.spec.lora import wrap_lora
from memfit.spec.optimizers import row
from memfit.units import torch_dtype_name


def torch_dtype(run: RunConfig):
    """The torch dtype of the weights (``from_pretrained(dtype=...)``: rotary buffers stay fp32)."""

    return getattr(torch, torch_dtype_name(run.dtype))


def model_kwargs(run: RunConfig, attention: str, experts: str = "") -> dict[str, Any]:
    """The keyword arguments ``AutoModelForCausalLM.from_config``/``from_pretrained`` get from the run;
    ``experts``: the resolved experts kernel (``memfit.spec.resolved.experts``; empty: a model without MoE layers)."""
    kwargs = {"dtype": torch_dtype(run), "attn_implementation": attention}
    if experts:
        kwargs["experts_implementation"] = experts
    return kwargs


def adapt(model, run: RunConfig, targets: tuple[str, ...] | list[str], *, revision: str | None = None):
    """The built base model made ready to train: gradient checkpointing (on the base model, before PEFT),
    LoRA (``wrap_lora``), and training mode for every module.

    Training mode: ``from_pretrained`` returns the model in eval mode (a checkpoint folder, and every QLoRA
    base, which is loaded back through bitsandbytes), and PEFT's wrapper alone is in training mode, so the
    decoder layers would skip checkpointing (transformers' ``GradientCheckpointingLayer`` runs it only when
    ``self.training``) and dropout until the first evaluation restored the mode.
    """
    default_causal_loss(model)  # the loss transformers falls back to, named: no "loss_type=None" log line
    if run.grad_checkpointing:
        enable_checkpointing(model)  # non-reentrant: works with frozen inputs (LoRA), torch's recommended mode
    if run.is_lora():
        model = wrap_lora(model, run, targets, revision=revision)
    model.train()
    return model


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """The trainable parameters in weight-decay groups: matrices (``ndim >= 2``) decay, vectors (norms,
    biases) do not, the usual convention; an empty group is left out (LoRA's adapters are all matrices).

    The groups matter to memory too: torch's optimizers step one group at a time (``Adam.step`` calls
    ``_multi_tensor_adam``/``_single_tensor_adam`` per group), so foreach's ``_foreach_sqrt`` temporary
    spans one group, not every trainable parameter, and the per-tensor loop starts afresh at each group.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def make_optimizer(run: RunConfig, groups: list[dict], lr: float, *, cuda_like: bool = False):
    """The optimizer of ``run.optimizer``'s row (``memfit.spec.optimizers``: what estimate and plan priced) over
    ``groups``; with ``--optimizer-in-backward`` one such optimizer per parameter, stepped from backward's
    gradient hooks. ``cuda_like``: the implementation torch picks on CUDA (the trace's CPU tensors model a
    CUDA run); training passes False and lets torch pick for the device it runs on."""
    build = row(run.optimizer).build
    if run.optimizer_in_backward:
        return OptimizerInBackward(groups, lambda one: build(one, lr, cuda_like=cuda_like))
    return build(groups, lr, cuda_like=cuda_like)
