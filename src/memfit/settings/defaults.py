"""The defaults of a training run the user did not set, and the reason shown with each.

Two kinds of run, two kinds of default:

* **The demo** (``memfit train`` on a preset with the corpus shipped in the package, no ``--data``):
  sized for 2 CPU cores and under 3 minutes (``DEMO_*``); its numbers are the ones the docs show.
* **A real run** (the user's model or the user's data): what the user did not give comes from the
  data and the method, never from the demo:

  - ``--seq-len``: the ``SEQ_LEN_PERCENTILE``-th percentile of the training records' tokenized
    lengths, rounded up to a multiple of ``SEQ_LEN_MULTIPLE``, capped by the model's context
    (``seq_len_from_lengths``). Most records then fit whole; the longest 1% are cut into pieces (text),
    dropped (conversations: a cut one trains on a reply whose question is gone) or, with ``--truncate``,
    cut to the sequence length.
  - ``--lr``: by method (``default_lr``).
  - length of the run: one epoch (``default_steps``).

Nothing here imports torch or transformers: the CLI's help texts read these constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEMO_SEQ_LEN = 128
DEMO_MICRO_BATCH = 4
DEMO_LR = 1e-3
"""The demo's peak learning rate, chosen by held-out loss on the shipped corpus: 0.71 nats/token for
1e-3 x 300 steps, against 2.15 for 3e-3 x 120 steps and 1.02 for 1e-3 x 240 (2 CPU cores, ~95 s). Also
the default of any run from random weights (a preset, ``--init random``): it is what those were tuned at."""
DEMO_STEPS = 300

LORA_LR = 2e-4
"""LoRA adapters on a pretrained model: the usual value of the LoRA/QLoRA papers and PEFT's examples
(QLoRA: 2e-4 for models up to 13B). Adapters start at zero and need a larger step than the weights."""
LORA_RANK = 16
"""The LoRA rank memfit picks where LoRA is wanted and no rank was given: ``memfit plan``'s LoRA candidates
and ``memfit estimate --compare``'s LoRA rows (a common default: PEFT's examples; the QLoRA paper uses 64)."""

FULL_LR = 2e-5
"""A full fine-tune of a pretrained model: the common 1e-5..5e-5 range (Alpaca, Vicuna: 2e-5); 1e-3
would undo the pretraining within a few steps."""

SEQ_LEN_PERCENTILE = 99
"""The derived ``--seq-len`` holds this share of the training records whole."""
SEQ_LEN_MULTIPLE = 64
"""The derived ``--seq-len`` is rounded up to a multiple of this (tensor-core and kernel tile friendly)."""

SHAPE = (f"--seq-len {DEMO_SEQ_LEN} x --micro-batch {DEMO_MICRO_BATCH} (--batch {DEMO_MICRO_BATCH}: one micro-batch a step) "
         "is the demo's (a preset on the shipped corpus, 2 CPU cores, under 3 minutes); with --data, or your own "
         f"model, --seq-len comes from the data ({SEQ_LEN_PERCENTILE}th percentile of the tokenized records, capped "
         "by the model's context). estimate, plan and train share these defaults: each describes the run "
         "`memfit train` would run with the same flags.")
"""The defaults of ``--seq-len``, ``--micro-batch`` and plan's ``--batch``, one for ``train``, ``estimate`` and
``plan`` alike (each command's ``--help`` shows this line): ``memfit estimate MODEL`` prices the step that
``memfit train --model MODEL`` runs, and ``memfit plan MODEL`` searches for that run."""

PRECISION_ON_A_GPU = ("memfit train picks --mixed-precision bf16 when none is given and its GPU has bf16 "
                      "(memfit.default_precision); this estimate, for a CUDA target, prices none: add "
                      "--mixed-precision bf16 to price that run.")
"""Said by ``estimate`` (CUDA target, no ``--mixed-precision``): the one default of train's that depends on the GPU
it runs on, which an estimate made without that GPU cannot know."""


def fmt_lr(value: float) -> str:
    """``2e-4``, not ``0.0002`` or ``2e-04``."""
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def default_lr(*, random_init: bool, lora: bool) -> tuple[float, str]:
    """``(lr, why)`` for a run that did not give ``--lr``: random weights ``DEMO_LR``, else LoRA
    ``LORA_LR``, else (a full fine-tune of a pretrained model) ``FULL_LR``."""
    if random_init:
        return DEMO_LR, "random weights"
    if lora:
        return LORA_LR, "LoRA default"
    return FULL_LR, "full fine-tune of a pretrained model"


@dataclass(frozen=True)
class SeqLenChoice:
    """A sequence length derived from the data, with what it was derived from."""

    seq_len: int
    records: int
    """Training records whose lengths were read."""
    percentile: int
    """The ``SEQ_LEN_PERCENTILE``-th percentile of their lengths, in tokens."""
    longer: int
    """Records longer than ``seq_len``."""
    context: int | None
    """The model's context, when it capped the length."""

    def describe(self) -> str:
        how = (f"{SEQ_LEN_PERCENTILE}th percentile of {self.records:,} tokenized training records, "
               f"{self.percentile:,} tokens, " + (f"capped by the model's context of {self.context:,}"
                                                  if self.context else f"rounded up to a multiple of {SEQ_LEN_MULTIPLE}"))
        return f"seq-len {self.seq_len:,} ({how}; {self.longer:,} record(s) longer; --seq-len to choose)"


def seq_len_from_lengths(lengths, context: int | None) -> SeqLenChoice | None:
    """The sequence length that holds ``SEQ_LEN_PERCENTILE`` % of the records whole; None without records.

    The percentile is the nearest rank: the smallest length at least 99% of the records fit in (the
    ``k``-th shortest of ``n``, ``k = ceil(0.99 n)``); it is rounded up to a multiple of
    ``SEQ_LEN_MULTIPLE`` and capped by ``context`` (the model's ``max_position_embeddings``; None or 0:
    no limit known). Example: 100 records of 10..109 tokens: the 99th shortest is 108, so 128.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if not lengths.size:
        return None
    k = math.ceil(SEQ_LEN_PERCENTILE / 100 * lengths.size)
    percentile = int(np.partition(lengths, k - 1)[k - 1])
    seq_len = max(SEQ_LEN_MULTIPLE, -(-percentile // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE)
    capped = bool(context) and seq_len > context
    seq_len = min(seq_len, context) if capped else seq_len
    return SeqLenChoice(seq_len, int(lengths.size), percentile, int((lengths > seq_len).sum()),
                        context if capped else None)


def default_steps(*, demo: bool, steps_per_epoch: int) -> tuple[int, str]:
    """``(steps, why)`` for a run given neither ``--max-steps`` nor ``--epochs``.

    The demo trains ``DEMO_STEPS`` steps (its held-out loss was tuned at that length). Any other run
    trains one epoch: every training record seen once, the unit a fine-tune is usually measured in, and
    a length that grows with the data instead of a step count tuned on another corpus (300 steps would
    stop a large dataset a fraction of the way through, and run a small one for dozens of epochs).
    """
    if demo:
        return DEMO_STEPS, ""
    return steps_per_epoch, (f"1 epoch = {steps_per_epoch:,} step(s) (neither --epochs nor --max-steps given; "
                             "--epochs or --max-steps to choose)")
