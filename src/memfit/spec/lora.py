"""LoRA as PEFT builds it for a run: its ``LoraConfig`` and the wrap, one place read by the builder (train and
``--exact``) and by the spec's trainable counts (a mixture-of-experts model's adapters are PEFT's own count).
"""

# Inside functions: peft (11.7 s to import; python -X importtime, 2026-12-06, this shared 2-core machine), only when an adapter is built.
from __future__ import annotations

from memfit.errors import UserError
from memfit.integrations.hf_compat import peft_wrap_quietly, prepare_for_kbit_training
from memfit.integrations.quant_support import upcasts_fully
from memfit.settings.config import RunConfig


def lora_config(run: RunConfig, targets: tuple[str, ...] | list[str], fan_in_fan_out: bool = False):
    """PEFT's ``LoraConfig`` of the run over ``targets`` (``memfit.spec.resolved``'s ``peft_targets``: what
    estimate counted). PEFT's defaults apply to everything else (``autocast_adapter_dtype=True`` at the
    wrap keeps adapters in fp32 over a bf16/fp16 base); ``fan_in_fan_out`` for a model whose projections are
    transformers' ``Conv1D`` (gpt2: weights stored (in, out)), which PEFT would otherwise set itself, with a warning
    (peft 0.21 ``tuners/lora/layer.py``: "fan_in_fan_out is set to False but the target module is `Conv1D`")."""
    from peft import LoraConfig

    return LoraConfig(r=run.lora.r, lora_alpha=run.lora.alpha, lora_dropout=run.lora.dropout,
                      target_modules=list(targets), task_type="CAUSAL_LM", fan_in_fan_out=fan_in_fan_out)


def wrap_lora(model, run: RunConfig, targets: tuple[str, ...] | list[str], *, revision: str | None = None):
    """``model`` with LoRA adapters on ``targets``: PEFT's k-bit preparation first under ``--quantize`` with
    ``--qlora-upcast full``, then
    PEFT's ``get_peft_model`` (its notices silenced). ``revision``: the Hub commit the saved adapter names.

    A target PEFT cannot wrap is one sentence (``UserError``).
    """
    from peft import get_peft_model
    from transformers.pytorch_utils import Conv1D

    conv1d = any(isinstance(module, Conv1D) for module in model.modules())  # gpt2's projections, all of them
    if upcasts_fully(run):  # --qlora-upcast full: PEFT's preparation, its fp32 cast included
        model = prepare_for_kbit_training(model, run.grad_checkpointing)
    # lean (quant_support.unquantized_dtype): nothing else to do. The rest of PEFT's preparation happens anyway:
    # get_peft_model freezes the base, adapt() has turned on non-reentrant checkpointing (which needs no
    # enable_input_require_grads); the unquantized parameters stay in --dtype.
    try:
        with peft_wrap_quietly():
            return get_peft_model(model, lora_config(run, targets, fan_in_fan_out=conv1d), revision=revision)
    except ValueError as err:
        raise UserError(f"LoRA cannot wrap --lora-targets {','.join(run.lora.targets)}: "
                        f"{str(err).splitlines()[0]}") from None
