"""Preference losses (DPO, ORPO, SimPO) on a (2B, T) batch of chosen then rejected sequences.

Notation: for pair ``p``, ``c_p``/``r_p`` are the summed log-probabilities of the chosen/rejected
completion tokens under the policy, ``c'_p``/``r'_p`` under the reference, ``n^c_p``/``n^r_p`` their
target-token counts, ``sigma`` the logistic function.

* **DPO** (Rafailov et al. 2023, eq. 7; TRL ``DPOTrainer`` with ``loss_type="sigmoid"``):
  ``l_p = -log sigma(beta * ((c_p - c'_p) - (r_p - r'_p)))``; rewards ``beta * (c_p - c'_p)`` and
  ``beta * (r_p - r'_p)``.
* **SimPO** (Meng et al. 2024, eq. 6; TRL ``CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``):
  ``l_p = -log sigma(beta * (c_p / n^c_p - r_p / n^r_p) - gamma)``; no reference; rewards
  ``beta * c_p / n^c_p`` and ``beta * r_p / n^r_p``. TRL writes ``beta * (x - gamma / beta)``: the same.
* **ORPO** (Hong et al. 2024, eqs. 4-7; TRL ``ORPOTrainer.odds_ratio_loss``): with the mean
  log-probabilities ``a = c_p / n^c_p``, ``b = r_p / n^r_p``, ``log odds = (a - b) - (log(1 - e^a) -
  log(1 - e^b))`` and ``l_p = -lambda * log sigma(log odds)``, plus the chosen completion's NLL, the mean
  over all chosen target tokens of the step. (TRL takes that NLL over prompt and completion; the paper's
  ``L_SFT`` and memfit's next-token loss take it over the completion: memfit follows the paper.)

**Normalisation** (exact under accumulation and data parallelism, as ``training/step.py`` does for
tokens): the step's loss is ``sum_p l_p / P`` with ``P`` the real pairs of the whole step (all
micro-batches, all ranks), TRL's mean over its batch; ORPO adds ``sum NLL tokens / N^c`` with ``N^c``
the step's chosen target tokens. Each micro-batch back-propagates its share of these sums, so any split
of the step gives the big batch's gradient. The test (``tests/test_preference.py``) checks losses and
gradients against TRL's functions within 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from memfit.data.pairs import collate_pairs
from memfit.settings.config import Method, PreferenceSettings
from memfit.spec.batch import model_inputs

IGNORE_INDEX = -100

NEEDS_REFERENCE = {Method.DPO}
"""The methods whose loss reads a reference policy's log-probabilities."""


@dataclass(frozen=True)
class PreferenceLoss:
    """The method and its parameters (``TrainConfig.preference``; their defaults are TRL's: ``DPOConfig.beta``,
    ``CPOConfig.beta`` and ``simpo_gamma``, ``ORPOConfig.beta`` for lambda)."""

    method: Method
    params: PreferenceSettings = field(default_factory=PreferenceSettings)

    @property
    def needs_reference(self) -> bool:
        return self.method in NEEDS_REFERENCE


@dataclass
class Norms:
    """The step's normalisers, the same on every micro-batch and rank."""

    pairs: torch.Tensor
    chosen_targets: torch.Tensor


def sequence_logps(logits, labels):
    """``(sums, counts)``: each sequence's summed log-probability of its target tokens, and their number.

    ``logits`` (S, T, V), ``labels`` (S, T) unshifted with -100 (the model's convention: position ``t``
    predicts ``labels[t + 1]``). One fp32 copy of the logits and the log-sum-exp per position; the
    selected log-probability is ``z_y - logsumexp(z)`` (TRL's ``selective_log_softmax`` for fp32), exact.
    """
    targets = labels[:, 1:]  # (S, T-1)
    mask = targets != IGNORE_INDEX
    z = logits[:, :-1]
    z = z.float() if z.element_size() < 4 else z  # (S, T-1, V): half logits upcast to fp32, as TRL does
    picked = z.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)  # (S, T-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def pair_mask(counts):
    """(B,) real pairs: both sides carry a target (the sampler's dummy row carries none)."""
    chosen, rejected = counts.chunk(2)
    return (chosen > 0) & (rejected > 0)


def pair_losses(spec: PreferenceLoss, sums, counts, ref_sums=None):
    """``(losses, chosen_rewards, rejected_rewards)``, each (B,), by the formulas of the module docstring."""
    c, r = sums.chunk(2)
    nc, nr = counts.clamp(min=1).to(sums.dtype).chunk(2)
    if spec.method is Method.DPO:
        rc, rr = ref_sums.chunk(2)
        chosen, rejected = c - rc, r - rr
        return -F.logsigmoid(spec.params.beta * (chosen - rejected)), spec.params.beta * chosen.detach(), spec.params.beta * rejected.detach()
    a, b = c / nc, r / nr
    # a pair with no target (the sampler's dummy row) has a = b = 0, where log(1 - e^0) is -inf: keep it finite
    # (its loss is masked out, but 0 x inf in backward would still be NaN)
    real = pair_mask(counts)
    a, b = torch.where(real, a, -1.0), torch.where(real, b, -1.0)
    if spec.method is Method.SIMPO:
        return -F.logsigmoid(spec.params.beta * (a - b) - spec.params.simpo_gamma), spec.params.beta * a.detach(), spec.params.beta * b.detach()
    log_odds = (a - b) - (_log1mexp(a) - _log1mexp(b))
    return -spec.params.orpo_lambda * F.logsigmoid(log_odds), spec.params.orpo_lambda * a.detach(), spec.params.orpo_lambda * b.detach()


def _log1mexp(x):
    """``log(1 - e^x)`` for ``x < 0``, stable at both ends (Maechler 2012; TRL's ``log1mexp``)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def step_norms(batches: list[dict], reduce) -> Norms:
    """The step's real pairs and chosen target tokens over its micro-batches and (``reduce``) ranks."""
    pairs = chosen = 0
    for b in batches:
        counts = (b["labels"][:, 1:] != IGNORE_INDEX).sum(-1)
        pairs += int(pair_mask(counts).sum())
        chosen += int(counts.chunk(2)[0].sum())
    device = batches[0]["labels"].device
    total = reduce(torch.tensor([pairs, chosen], device=device))
    return Norms(total[0].clamp(min=1), total[1].clamp(min=1))


def micro_loss(spec: PreferenceLoss, logits, labels, norms: Norms, ref_sums=None):
    """``(loss, stats)`` of one micro-batch: its share of the step's loss (module docstring) and the sums
    ``(pairs, correct, margin, chosen reward, rejected reward)`` of its real pairs, for the metrics."""
    sums, counts = sequence_logps(logits, labels)  # (2B,)
    real = pair_mask(counts)
    losses, chosen, rejected = pair_losses(spec, sums, counts, ref_sums)
    loss = (losses * real).sum() / norms.pairs
    if spec.method is Method.ORPO:  # the chosen completion's NLL, per chosen target token of the step
        loss = loss - sums.chunk(2)[0].sum() / norms.chosen_targets
    w = real.float()
    stats = torch.stack([w.sum(), ((chosen > rejected).float() * w).sum(), ((chosen - rejected) * w).sum(),
                         (chosen * w).sum(), (rejected * w).sum()]).detach()
    return loss, stats


def reference_sums(batch: dict, *, model, reference, autocast=contextlib.nullcontext):
    """(2B,) summed log-probabilities of the batch's targets under the reference policy, without gradients.

    ``reference``: a frozen copy of the base (``"copy"``), ``None`` for the trained model with its LoRA
    adapter switched off (PEFT's ``disable_adapter()``: no second copy of the weights), or the batch's
    ``ref_logps`` computed before training (``--precompute-reference``).
    """
    if "ref_logps" in batch:
        return batch["ref_logps"]

    inputs = {k: v for k, v in model_inputs(batch).items() if k not in ("labels", "ref_logps")}
    with torch.no_grad(), (autocast or contextlib.nullcontext)():
        if reference is not None:
            logits = reference(**inputs, use_cache=False).logits
        else:
            peft_model = _peft_of(model)
            with peft_model.disable_adapter():
                logits = peft_model(**inputs, use_cache=False).logits
        sums, _ = sequence_logps(logits, batch["labels"])
    return sums


def _peft_of(model):
    """The PEFT model under DDP / Accelerate wrappers."""
    net = model
    while not hasattr(net, "disable_adapter") and hasattr(net, "module"):
        net = net.module
    return net


def frozen_copy(model):
    """DPO's reference for a full fine-tune: a copy of the base weights, frozen and in eval mode."""

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


@torch.no_grad()
def reference_logps(model, rows: list[dict], *, pad_id: int, batch_size: int,
                    autocast=contextlib.nullcontext) -> list[tuple[float, float]]:
    """Each row's ``(chosen, rejected)`` log-probabilities under ``model`` as it is now (the base), ``batch_size``
    pairs per forward (TRL's ``precompute_ref_log_probs``)."""

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = {k: v.to(device) for k, v in collate_pairs(chunk, pad_id).items() if k != "ref_logps"}
        sums = reference_sums(batch, model=model, reference=model, autocast=autocast)
        chosen, rejected = sums.float().cpu().chunk(2)
        out += list(zip(chosen.tolist(), rejected.tolist(), strict=True))
    model.train(was_training)
    return out


def precompute(model, rows: list[dict], *, pad_id: int, batch_size: int, autocast=contextlib.nullcontext,
               rank: int = 0, holders: int = 1, gather=None) -> int:
    """``--precompute-reference``: every row's reference log-probabilities (``reference_logps``), written into
    the row as ``ref_logps``; training then runs no reference forward and keeps no copy.

    Over several processes each of the ``holders`` ranks that hold the weights computes every ``holders``-th
    row from its ``rank`` (the others none), and ``gather`` (Accelerate's ``gather_object``: the lists of all
    ranks, concatenated) gives every rank all of them. Returns the rows this rank computed.
    """
    mine = list(range(rank, len(rows), holders)) if rank < holders else []
    logps = reference_logps(model, [rows[i] for i in mine], pad_id=pad_id, batch_size=batch_size, autocast=autocast)
    computed = list(zip(mine, logps, strict=True))
    for i, (chosen, rejected) in (gather(computed) if gather is not None else computed):
        rows[i]["ref_logps"] = (chosen, rejected)
    return len(mine)
