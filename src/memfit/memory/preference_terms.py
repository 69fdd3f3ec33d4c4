"""What a preference method (``--method dpo|orpo|simpo``, ``memfit.builder.preference``) changes in a step's memory.

Read by the estimator, the exact trace, the planner and train alike (one fact, one place):

* **One forward of 2B sequences.** Each micro-batch of B pairs runs chosen and rejected through the
  model together (``memfit.data.pairs.collate_pairs``, TRL's ``concatenated_forward``): every activation
  term is that of a micro-batch of 2B (``pair_forward_run``).
* **The logits.** No transformers loss: the model returns the (2B, T, V) logits (c bytes; Accelerate's
  ``convert_outputs_to_fp32`` adds an fp32 copy under mixed precision) and ``sequence_logps`` reads
  ``z_y - logsumexp(z)`` from them; ``preference_logits_terms`` prices that.
* **The reference policy** (DPO only): a frozen copy of the base (full fine-tune: one more set of
  weights at the weight dtype, ``reference_copy_bytes``), the base with the LoRA adapter disabled (no
  bytes), or log-probabilities precomputed before training (two floats a pair, nothing on the device).
  The reference forward runs under ``no_grad`` before the policy's: its transient is its logits and
  their fp32 log-sum-exp input, beside the model states (``reference_transient``); it is the forward
  phase's peak only when that exceeds the policy forward's.
"""

from __future__ import annotations

from memfit.settings.config import Method, RunConfig

FP32 = 4


def is_pairs(run: RunConfig) -> bool:
    return run.method is not Method.SFT


def pair_forward_run(run: RunConfig) -> RunConfig:
    """The run whose micro-batch is the forward's sequences: 2B for a preference method."""
    return run.replace(micro_batch=run.forward_sequences()) if is_pairs(run) else run


def reference_policy(run: RunConfig) -> str | None:
    """How DPO gets its reference log-probabilities: ``copy``, ``adapter-off`` or ``precomputed``; None
    for the methods without a reference (sft, orpo, simpo)."""
    if run.method is not Method.DPO:
        return None
    if run.precompute_reference:
        return "precomputed"
    return "adapter-off" if run.is_lora() else "copy"


def reference_copy_bytes(spec, run: RunConfig) -> int:
    """Bytes of the frozen copy of the base (``copy`` policy): every parameter at the weight dtype, on each
    rank (the copy is not sharded: ``memfit.builder.preference.frozen_copy`` copies the model before sharding)."""
    if reference_policy(run) != "copy":
        return 0
    return int(spec.params) * (2 if str(run.dtype) in ("bf16", "fp16") else 4)


def preference_logits_terms(spec, run: RunConfig, prec):
    """``(forward, backward)`` bytes of the preference loss (``activations.LogitsTerms``), ``N = 2B x T x V`` elements (``run``: the pair-forward run).

    Forward: the head's logits (c N) and, when c is not fp32, Accelerate's fp32 copy (4 N), which
    ``sequence_logps`` reads (CPU ``logsumexp`` keeps only a (2B, T) result and no (2B, T, V) temporary).
    Backward start: only the fp32 logits are still referenced (the c ones died with the model's output),
    with ``logsumexp``'s gradient ``exp(z - lse) * g`` (4 N), ``gather``'s scattered gradient (4 N) and
    their sum padded back through the slice (4 N): 16 N in every regime.
    Known error (``tests/test_preference.py``, tiny Llama, seq 64, 2 pairs): the step's peak +1.0% (fp32)
    over the exact trace; the trace frees part of the slice's gradient earlier.
    """
    n = run.micro_batch * run.seq_len * spec.vocab_size
    return n * (FP32 if prec.c == FP32 else prec.c + FP32), 4 * FP32 * n


def reference_transient(spec, run: RunConfig, prec) -> int:
    """Bytes alive during the reference forward (``no_grad``), beyond the model states: its logits (c N), their
    fp32 copy when c is not fp32; nothing is saved for backward."""
    if reference_policy(run) in (None, "precomputed"):
        return 0
    n = run.micro_batch * run.seq_len * spec.vocab_size  # run: the pair-forward run
    return n * (FP32 if prec.c == FP32 else prec.c + FP32)
