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
"""

from __future__ import annotations

import contextlib
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
