"""memfit's calls into transformers and PEFT whose names changed across the supported versions.

One place for them, so a user never sees a deprecation warning caused by memfit's own calls:

- transformers 5 renamed ``gradient_checkpointing_enable`` / ``is_gradient_checkpointing`` to
  ``activation_checkpointing_enable`` / ``is_activation_checkpointing`` (the old names warn with a
  ``FutureWarning`` and go in v6). transformers 4.x (memfit supports >= 4.46) has only the old names,
  which do not warn there. ``enable_checkpointing`` calls whichever the installed version has.
- PEFT (0.21) still reads ``model.is_gradient_checkpointing`` inside ``get_peft_model`` and calls
  ``gradient_checkpointing_enable`` in ``prepare_model_for_kbit_training``; memfit cannot change PEFT's
  calls, so ``peft_wrap_quietly`` silences exactly those two messages around them.
- Checkpointing is non-reentrant everywhere (``CHECKPOINT_KWARGS``): ``enable_checkpointing`` and, for a
  quantized base, ``prepare_for_kbit_training``, which hands PEFT the same kwargs (PEFT re-enables
  checkpointing itself, and without them torch's reentrant default runs, with its ``use_reentrant`` warning).
- transformers 5 shows a tqdm "Loading weights" bar inside ``from_pretrained``, in the middle of
  memfit's own output; ``no_loading_bar`` turns transformers' bars off for the load (and restores them).
- transformers 5.0's ``from_config`` under ``torch.device("meta")`` leaves a tied head untied (5.25 ties it there;
  a model built on a device ties it in both): ``tied_as_built`` ties it, so a meta build counts what a run holds.
- transformers 5's heterogeneous configs (``per_layer_config``: gemma4_text's ``head_dim`` differs between its sliding
  and full attention layers) refuse a global read of a per-layer attribute; ``config_value`` reads it as the
  largest of its layers' values.
- Four messages from dependencies say nothing a memfit user can act on, each for a reason memfit knows;
  each is dropped by its logger and its exact text (``dropping_log``), or its warning text, around the
  call that causes it, and every other record of the same logger still shows:
  ``quiet_bnb_kernel_notice`` (bitsandbytes at import, on a CPU with AVX512-BF16),
  ``quiet_deepspeed_cpu_notice`` (DeepSpeed, installed, on a machine without a GPU),
  ``quiet_tied_weight_save`` (Accelerate's ``save_state`` of a model with tied embeddings),
  ``quiet_4bit_merge`` (PEFT merging an adapter into a 4-bit base), ``quiet_json_parse_log`` (``datasets``
  logging a JSON parse error before raising it).
"""

# Inside functions: peft (11.7 s) and transformers (1.1 s; python -X importtime, 2026-12-06, this shared 2-core machine): `memfit --help` imports this module and
# takes 0.16 s, 2.9 s with torch (tests/test_layers.py::test_import_memfit_and_help_load_no_torch).
from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

#: torch's recommended mode; it also works with frozen inputs (LoRA).
CHECKPOINT_KWARGS = {"use_reentrant": False}


def enable_checkpointing(model) -> None:
    """Turn on activation (gradient) checkpointing with the installed transformers' current API."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    else:  # transformers 4.x: the only name, and it does not warn there
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))


def default_causal_loss(model) -> None:
    """Name transformers' own fallback loss on a causal LM whose class name maps to none (GPT-2's
    ``GPT2LMHeadModel``, ...): ``PreTrainedModel.loss_function`` falls back to ``ForCausalLM`` for an unknown
    ``model.loss_type``, and logs "`loss_type=None` was set in the config but it is unrecognized" the first time
    (transformers 5.25, ``modeling_utils.py``). Set on the model, not its config: nothing saved changes."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    if getattr(model, "loss_type", None) not in LOSS_MAPPING:
        model.loss_type = "ForCausalLM"


def prepare_for_kbit_training(model, checkpointing: bool):
    """PEFT's ``prepare_model_for_kbit_training`` (freeze the base, cast what is not quantized to fp32) with
    memfit's checkpointing kwargs: it re-enables checkpointing when ``checkpointing``, and passes
    ``gradient_checkpointing_kwargs`` (``{}`` by default) to transformers, whose ``checkpoint`` call then lacks
    ``use_reentrant`` and runs torch's reentrant mode (peft 0.21 ``utils/other.py``)."""
    from peft import prepare_model_for_kbit_training

    with peft_wrap_quietly():
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                               gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))


@contextlib.contextmanager
def peft_wrap_quietly() -> Iterator[None]:
    """Around PEFT's calls: hide its own uses of transformers' deprecated checkpointing names."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`(is_gradient_checkpointing|gradient_checkpointing_enable)` "
                                                  r"is deprecated",
                                category=FutureWarning)
        yield


@contextlib.contextmanager
def no_loading_bar() -> Iterator[None]:
    """transformers' tqdm bars off while a checkpoint loads (memfit prints its own progress)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


class _DropMatching(logging.Filter):
    """Drops the records whose formatted message matches ``pattern`` (``re.match``); passes every other one."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


@contextlib.contextmanager
def dropping_log(logger_name: str, pattern: str) -> Iterator[None]:
    """While inside, the logger named ``logger_name`` drops records whose message matches ``pattern``.

    A filter on the logger a library logs to (``logging.getLogger(__name__)`` in its module) runs before any
    handler, whether the library's own (transformers, ``datasets``) or Python's last-resort stderr one; the
    logger object exists before the library's module is imported, so a record logged at import is caught.
    """
    logger = logging.getLogger(logger_name)
    drop = _DropMatching(pattern)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def quiet_bnb_kernel_notice() -> Iterator[None]:
    """bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community: ..." and, with ``HF_HUB_OFFLINE=1``,
    the ``kernels`` package's "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'
    because Hugging Face Hub is in offline mode." logged on its way there.

    Logged once per process when bitsandbytes is imported (by PEFT's or transformers' import, not only by
    memfit's) on a CPU with AVX512-BF16: its CPU backend asks the Hub for that kernel through ``kernels``
    (``backends/cpu/ops.py``; ``kernels`` is a dependency of transformers from 5.25, absent before, when the
    message ended "No module named 'kernels'"). Safe to drop: that kernel serves only bitsandbytes' CPU
    inference path, which memfit turns off in every 4-bit layer
    (``memfit.integrations.quant_support.keep_training_path``), so no memfit run would use it. Only records naming
    that repository are dropped: ``kernels``' other messages still show. The CLI holds this around every command
    (``memfit.cli``), and ``memfit.training.loop.built`` around a run.
    """
    with (dropping_log("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community"),
          dropping_log("kernels._internals.hf_hub",
                       r"Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'")):
        yield


def quiet_deepspeed_cpu_notice() -> contextlib.AbstractContextManager:
    """DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."

    Logged once per process where DeepSpeed is installed and finds no GPU, when its accelerator is first
    asked for: Accelerate's ``unwrap_model`` imports DeepSpeed in every run, DeepSpeed or not (seen in CI,
    whose venv has the ``deepspeed`` extra). Safe to drop: memfit's preamble already names the device
    ("on cpu"), and on a machine with a GPU DeepSpeed finds it and says nothing.
    """
    return dropping_log("DeepSpeed", r"Setting accelerator to CPU\.")


@contextlib.contextmanager
def quiet_import_notices() -> Iterator[None]:
    """The notices dependencies log once per process when memfit's work first imports them
    (``quiet_bnb_kernel_notice``, ``quiet_deepspeed_cpu_notice``); held by the CLI around every command and
    by ``memfit.training.loop.built`` around a run."""
    with quiet_bnb_kernel_notice(), quiet_deepspeed_cpu_notice():
        yield


def quiet_tied_weight_save() -> contextlib.AbstractContextManager:
    """Accelerate's "Removed shared tensor {'lm_head.weight'} while saving" (``utils/other.py``,
    ``clean_state_dict_for_safetensors``), at every checkpoint of a model whose head is tied to its embedding.

    Safe to drop: safetensors stores a tensor held under two names once, and its ``load_model`` (what
    Accelerate's ``load_state`` calls on ``--resume``) fills the other name from the rebuilt model's own tying,
    which memfit rebuilds from the same config (tests/test_shard_tied.py resumes a tied model from such a
    checkpoint).
    """
    return dropping_log("accelerate.utils.other", r"(\[RANK \d+\] )?Removed shared tensor \{.*\} while saving")


@contextlib.contextmanager
def quiet_4bit_merge() -> Iterator[None]:
    """PEFT's "Merge lora module to 4-bit linear may get different generations due to rounding errors"
    (``tuners/lora/bnb.py``), once per layer of a ``--merge`` on a 4-bit base: memfit's docs say the merged
    model is 4-bit again (dequantized, adapter added, quantized again), so it differs by that rounding."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Merge lora module to 4-bit linear may get different generations",
                                category=UserWarning)
        yield


def quiet_json_parse_log() -> contextlib.AbstractContextManager:
    """``datasets``' "Failed to load JSON from file '...' with error ...", which its JSON builder logs just
    before raising the same error (``packaged_modules/json/json.py``): memfit turns that error into its own
    sentence naming the file (and, for .jsonl, the line), so the log line would say it twice, differently."""
    return dropping_log("datasets.packaged_modules.json.json", r"Failed to load JSON from file ")


def config_value(config, name: str):
    """``config.<name>``, None where the config has none. A per-layer attribute of a heterogeneous config, which
    transformers refuses to read globally (``AmbiguousGlobalPerLayerAttributeError``, a ``RuntimeError``: "may vary
    across layers"), reads as the largest of its layers' values (``config.per_layer_config[i].<name>``): the safe side
    for what memfit reads one for (bytes that grow with it), and the exact value where the layers agree."""
    try:
        return getattr(config, name, None)
    except RuntimeError:
        values = [getattr(layer, name, None) for layer in getattr(config, "per_layer_config", None) or ()]
        values = [v for v in values if v is not None]
        if not values:
            return None
        try:
            return max(values)
        except TypeError:  # values with no order (lists): the first layer's
            return values[0]


def tied_as_built(model):
    """``model`` (built on the meta device) with its tied weights tied, as a model built on a device has them:
    transformers 5.0.0's ``from_config`` under ``torch.device("meta")`` leaves the head of a
    ``tie_word_embeddings`` model a separate matrix (checked: qwen2 with a tied head, 804,736 parameters counted
    where the trained model has 670,464; 5.25 ties it on meta too), which priced a whole extra embedding matrix,
    its gradient and its optimizer state. ``tie_weights`` is transformers' own step for it."""
    model.tie_weights()
    return model
