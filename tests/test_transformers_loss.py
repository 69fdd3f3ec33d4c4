"""An older transformers release's causal-LM head and loss (``memory.transformers_loss``), measured on real tensors.

Each release's head and loss run here as their own source writes them (quoted line by line below: transformers
4.37.2 ``modeling_llama.py`` L1199-1215 and 4.46.0 ``loss/loss_utils.py`` L32-45) under memfit's tensor counter
(``memory.measure.counted``), and the bytes are compared with what the estimator prices for that stack.

Shapes: B = 2 rows of T = 64 tokens, vocabulary V = 1,000, hidden 32: N = 128,000 logits, N' = B (T - 1) V = 126,000
shifted ones. Beside the priced terms the loss makes the shifted labels (int64, 2 x 63 x 8 = 1,008 B) and two fp32
scalars (the loss and ``nll_loss``'s total weight, 8 B), which the estimator does not price.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn.functional as F
from torch.nn import CrossEntropyLoss

from _loss_helpers import head_and_loss_peaks
from memfit.memory.activations import Precisions, logits_terms
from memfit.memory.transformers_loss import logits_terms as release_logits_terms
from memfit.settings.config import RunConfig
from memfit.settings.stack import LossEra, Stack
from memfit.spec.model import load_spec

B, T, H, V = 2, 64, 32, 1000
UNPRICED = 2 * (T - 1) * 8 + 8  # the shifted int64 labels and two fp32 scalars


def _loss_4_37(hidden, head, labels):
    """transformers 4.37.2 ``LlamaForCausalLM.forward``, L1199-1215 (pretraining_tp 1)."""
    logits = F.linear(hidden, head)  # self.lm_head(hidden_states)
    logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    loss_fct = CrossEntropyLoss()
    shift_logits = shift_logits.view(-1, V)
    shift_labels = shift_labels.view(-1)
    loss = loss_fct(shift_logits, shift_labels)
    return loss, logits


def _loss_4_46(hidden, head, labels):
    """transformers 4.46.0: the head's logits returned as they are, ``ForCausalLMLoss`` (L32-45) upcasting and
    shifting a contiguous copy (``fixed_cross_entropy`` with no ``num_items_in_batch``: a mean cross-entropy)."""
    logits = F.linear(hidden, head)

    def for_causal_lm_loss(logits, labels, vocab_size):
        logits = logits.float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        shift_logits = shift_logits.view(-1, vocab_size)
        shift_labels = shift_labels.view(-1)
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="mean")

    return for_causal_lm_loss(logits, labels, V), logits


def _measured(loss_fn, keep_output: bool) -> tuple[int, int]:
    """(forward's peak, backward's peak) of the head and loss, bytes beyond the hidden states, head and labels;
    ``keep_output``: the caller holds the returned logits through backward (fsdp_qlora's ``output``)."""
    return head_and_loss_peaks(loss_fn, (B, T, H, V), keep_output=keep_output)


def _priced(version: str, trainer: str) -> tuple:
    """The tiny preset's Llama with V = 1,000 (only the vocabulary enters these terms), pure bf16 LoRA."""
    spec = dataclasses.replace(load_spec("tiny"), vocab_size=V)
    run = RunConfig.of(seq_len=T, micro_batch=B, dtype="bf16", mixed_precision="no", lora_r=8)
    return release_logits_terms(spec, run, Precisions.of(run), Stack(trainer=trainer, transformers=version)), spec


@pytest.mark.parametrize(("version", "era"), [
    ("4.31.0", LossEra.FP32_LOGITS), ("4.37.2", LossEra.FP32_LOGITS), ("4.45.2", LossEra.FP32_LOGITS),
    ("4.46.0", LossEra.SHIFTED_COPY), ("4.48.3", LossEra.SHIFTED_COPY), ("4.49.0", None), ("5.25.0", None)])
def test_the_loss_era_follows_the_release(version, era):
    assert Stack(trainer="hf", transformers=version).loss_era() is era
    assert Stack(trainer="litgpt", transformers=version).loss_era() is None  # its own head and loss
    assert Stack(trainer="hf").loss_era() is None  # no release named: the installed one


def test_fsdp_qlora_on_4_37_holds_the_fp32_logits_through_backward():
    """4.37.2 under fsdp_qlora's loop: forward 4 N + 8 N' = 1,520,000 B (fp32 logits, shifted copy, saved output);
    backward 4 N + 12 N' = 2,024,000 B (the kept logits, the saved output, its gradient and its input's)."""
    terms, _ = _priced("4.37.2", "answerai-fsdp-qlora")
    forward, backward = _measured(_loss_4_37, keep_output=True)
    assert (forward - UNPRICED, backward - 8) == (1_520_000, 2_024_000)
    assert terms.backward == 2_024_000 and terms.retained == 4 * B * T * V
    # in the next micro-batch's forward the previous logits are still bound to ``output``: + 4 N
    assert terms.forward == 1_520_000 + 4 * B * T * V


def test_a_trainer_that_keeps_only_the_loss_frees_the_logits_before_backward():
    """transformers' Trainer on 4.37.2 (``compute_loss`` returns the loss alone): backward 12 N' = 1,512,000 B."""
    terms, _ = _priced("4.37.2", "hf")
    forward, backward = _measured(_loss_4_37, keep_output=False)
    assert (forward - UNPRICED, backward - 8) == (terms.forward, terms.backward) == (1_520_000, 1_512_000)
    assert terms.retained == 0


def test_4_46_upcasts_inside_the_loss_beside_the_bf16_logits():
    """4.46.0: the bf16 logits (2 N), their fp32 copy (4 N), the shifted copy and the saved output (8 N'):
    256,000 + 512,000 + 1,008,000 = 1,776,000 B; backward 12 N' as before."""
    terms, _ = _priced("4.46.0", "hf")
    forward, backward = _measured(_loss_4_46, keep_output=False)
    assert (forward - UNPRICED, backward - 8) == (terms.forward, terms.backward) == (1_776_000, 1_512_000)


def test_4_49_and_later_keep_memfits_pricing():
    terms, spec = _priced("4.49.0", "hf")
    assert terms is None
    run = RunConfig.of(seq_len=T, micro_batch=B, dtype="bf16", mixed_precision="no", lora_r=8)
    assert logits_terms(spec, run, Precisions.of(run)).backward == 12 * B * T * spec.vocab_size
