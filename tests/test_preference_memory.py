"""Estimate and ``--exact`` trace of a preference step (issue 26): one forward of 2B sequences, DPO's
reference (frozen copy, adapter switched off, precomputed) and the preference loss's logits, within 3%
of the exact trace on the peak and on each phase, across families (``memory/preference_terms.py``)."""

from __future__ import annotations

import pytest

from _accuracy_models import accuracy_config
from memfit.config import RunConfig
from memfit.memory.estimate import estimate
from memfit.memory.trace import trace
from memfit.modelspec import spec_from_config

CASES = [
    ("llama-gqa", dict(method="dpo")),  # reference: a frozen copy of the base
    ("llama-gqa", dict(method="dpo", lora_r=8, mixed_precision="bf16")),  # reference: the adapter switched off
    ("qwen2", dict(method="dpo", precompute_reference=True)),
    ("gpt2", dict(method="orpo")),
    ("qwen2", dict(method="simpo", mixed_precision="bf16")),
]


@pytest.mark.parametrize(("family", "settings"), CASES, ids=[f"{f}-{'-'.join(map(str, s.values()))}" for f, s in CASES])
def test_analytic_matches_exact_within_3_percent(family, settings):
    config = accuracy_config(family)
    spec = spec_from_config(config, f"test-{family}")
    run = RunConfig(seq_len=128, micro_batch=2, **settings)
    analytic = estimate(spec, run, device="cpu", derived=False)
    exact = trace(config, run, device="cpu")
    assert abs(analytic.peak_bytes - exact.peak_bytes) <= 0.03 * exact.peak_bytes, (analytic, exact)
    for phase, peak in exact.phase_peaks.items():
        assert abs(analytic.phase_peaks[phase] - peak) <= 0.03 * peak, (phase, analytic.phase_peaks, exact.phase_peaks)


def test_the_reference_policy_prices_differently():
    """The frozen copy adds one set of weights; the adapter switched off and the precomputed one add none; a
    preference step holds the logits of 2B sequences."""
    config = accuracy_config("llama-gqa")
    spec = spec_from_config(config, "test-llama-gqa")
    sft = estimate(spec, RunConfig(seq_len=128, micro_batch=2), device="cpu", derived=False)
    copy = estimate(spec, RunConfig(seq_len=128, micro_batch=2, method="dpo"), device="cpu", derived=False)
    pre = estimate(spec, RunConfig(seq_len=128, micro_batch=2, method="dpo", precompute_reference=True),
                   device="cpu", derived=False)
    assert copy.weights - pre.weights == spec.params * 4 and pre.weights == sft.weights  # fp32 weights
    assert copy.peak_bytes - pre.peak_bytes == spec.params * 4
    assert pre.logits == 2 * sft.logits * 16 // 12  # 2B sequences; 16 N bytes at backward's start, not 12 N
