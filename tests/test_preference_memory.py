"""Estimate and ``--exact`` trace of a preference step (issue 26): one forward of 2B sequences, DPO's
reference (frozen copy, adapter switched off, precomputed) and the preference loss's logits, within 3%
of the exact trace on the peak and on each phase, across families (``memory/preference_terms.py``)."""

from __future__ import annotations

import pytest

from _accuracy_models import accuracy_config
from memfit.memory.estimate import estimate
from memfit.memory.trace import trace
from memfit.settings.config import RunConfig
from memfit.spec.model import spec_from_config

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
    run = RunConfig.of(seq_len=128, micro_batch=2, **settings)
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
    sft = estimate(spec, RunConfig.of(seq_len=128, micro_batch=2), device="cpu", derived=False)
    copy = estimate(spec, RunConfig.of(seq_len=128, micro_batch=2, method="dpo"), device="cpu", derived=False)
    pre = estimate(spec, RunConfig.of(seq_len=128, micro_batch=2, method="dpo", precompute_reference=True),
                   device="cpu", derived=False)
    assert copy.weights - pre.weights == spec.params * 4 and pre.weights == sft.weights  # fp32 weights
    assert copy.peak_bytes - pre.peak_bytes == spec.params * 4
    assert pre.logits == 2 * sft.logits * 16 // 12  # 2B sequences; 16 N bytes at backward's start, not 12 N


def test_plan_picks_a_reference_policy_that_fits():
    """A budget below every plan with a frozen copy: the planner precomputes the reference instead; the
    plans of a preference method never use a loss that cannot read the logits."""
    from memfit.memory.preference_terms import reference_policy
    from memfit.planning.search import SAFETY_MARGIN, plan
    from memfit.planning.space import Constraints

    shape = dict(seq_len=1024, batch=8, method="dpo", gpu="A100-80GB")
    with_copy = plan("llama-3.2-1b", "80GiB", constraints=Constraints(full=True, precompute_reference=False), **shape)
    assert reference_policy(with_copy.best.config) == "copy"
    assert {str(p.config.loss) for p in with_copy.plans} == {"standard"}
    below = int(min(p.peak_bytes for p in with_copy.plans) * (1 + SAFETY_MARGIN)) - 1
    chosen = plan("llama-3.2-1b", below, constraints=Constraints(full=True), **shape).best.config
    assert reference_policy(chosen) == "precomputed"
