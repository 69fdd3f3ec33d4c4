"""Mixture-of-experts models: the experts kernel is part of the resolved run, and the estimate of every
precision agrees with the exact trace.

The kernel (``memfit.spec.resolved.experts``): grouped_mm for bf16 weights, the model's per-expert loop
(eager, traced on a balanced routing: ``memory/experts_trace.py``) otherwise; a grouped_mm request with
fp32 weights is one sentence. Before, every MoE family failed in fp32 and AMP ("Expected inputs of BF16
type"). The other four families' accuracy is in bench/moe_accuracy.py.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from _accuracy_models import moe_config
from _train_helpers import assert_one_sentence
from memfit.errors import UserError
from memfit.settings.config import RunConfig
from memfit.spec.model import spec_from_config
from memfit.spec.resolved import experts, resolve


@pytest.fixture(scope="module")
def mixtral():
    return spec_from_config(moe_config("mixtral"), "moe-mixtral")


def test_experts_kernel_follows_the_weights_dtype(mixtral, tiny_llama_config):
    assert mixtral.default_experts == "grouped_mm"  # transformers' own default
    assert experts(mixtral, "auto", "bf16") == "grouped_mm"
    assert experts(mixtral, "auto", "fp32") == "eager"  # fp32 weights: AMP too (grouped_mm casts to them)
    assert experts(mixtral, "batched_mm", "fp32") == "batched_mm"  # asked of transformers, which runs it
    with pytest.raises(UserError, match="grouped_mm runs bf16 expert weights only"):
        experts(mixtral, "grouped_mm", "fp32")
    dense = spec_from_config(tiny_llama_config, "tiny")
    assert experts(dense, "auto", "fp32") == "" and resolve(dense, RunConfig()).experts == ""
    resolved = resolve(mixtral, RunConfig.of(mixed_precision="bf16"))
    assert resolved.experts == "eager" and resolved.run.experts_implementation == "eager"
    assert any(line.startswith("experts: eager (the model's per-expert loop") for line in resolved.describe())


def test_unrunnable_kernel_is_one_sentence(tmp_path):
    from memfit.cli import cli

    moe_config("mixtral").save_pretrained(tmp_path)
    result = CliRunner().invoke(cli, ["estimate", str(tmp_path), "--experts-implementation", "grouped_mm"])
    assert_one_sentence(result, "grouped_mm runs bf16 expert weights only")


REGIMES = {"fp32": {}, "amp": {"mixed_precision": "bf16"}, "bf16": {"dtype": "bf16"}}


@pytest.mark.heavy
@pytest.mark.parametrize("family,regime", [("mixtral", "fp32"), ("mixtral", "amp"), ("qwen2_moe", "bf16"),
                                           ("qwen2_moe", "fp32")])
def test_moe_estimate_matches_exact(family, regime, tmp_path, monkeypatch):
    """Analytic (a recipe derived from traces) vs ``--exact``, tensor peak and every phase within 3%; both
    name the kernel that runs. Before: fp32 and AMP failed with "Expected inputs of BF16 type"."""
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    spec = spec_from_config(moe_config(family), f"moe-{family}")
    run = RunConfig.of(seq_len=64, micro_batch=4, **REGIMES[regime])
    analytic, exact = estimate(spec, run, device="cpu"), trace(spec, run, device="cpu")
    assert abs(analytic.peak_bytes - exact.peak_bytes) <= 0.03 * exact.peak_bytes, (analytic.peak_bytes,
                                                                                    exact.peak_bytes)
    for phase, bytes_ in exact.phase_peaks.items():
        assert abs(analytic.phase_peaks[phase] - bytes_) <= 0.03 * bytes_, phase
    kernel = "grouped_mm" if regime == "bf16" else "eager"
    assert any(n.startswith(f"experts: {kernel}") for n in analytic.notes), analytic.notes
    assert any(n.startswith(f"experts: {kernel}") for n in exact.notes), exact.notes
    assert analytic.experts_implementation == exact.experts_implementation == kernel
    # term by term: every expert's states, the router, the dispatch (balanced and worst case)
    moe = [n for n in analytic.notes if n.startswith(("MoE:", "router:", "dispatch:"))]
    assert len(moe) == 3 and "worst case" in moe[2] and "balanced" in moe[2], analytic.notes
    assert json.loads(json.dumps(analytic.to_dict()))["experts_implementation"] == kernel


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_lora_trainable_count_is_pefts(family):
    """The estimate's trainable count is what PEFT builds; deepseek_v3: PEFT wraps the stacked 3-D expert
    weights for the experts' projection names and skips the dense and shared-expert MLPs (the formula
    over Linear modules said 21,696 at r 8, PEFT builds 35,008)."""
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.builder import parts as build

    spec = spec_from_config(moe_config(family), f"moe-{family}")
    resolved = resolve(spec, RunConfig.of(lora_r=8, dtype="bf16"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(moe_config(family), **build.model_kwargs(
            resolved.run, resolved.attention, resolved.experts))
        wrapped = build.adapt(model, resolved.run, resolved.lora.peft_targets)
    built = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert resolved.trainable_params == built
    if family == "deepseek_v3":
        assert built == 35_008


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_moe_trains_as_predicted(lora, tmp_path, monkeypatch):
    """``memfit train`` on a small Mixtral on CPU (fp32: the eager per-expert loop, real routing of random
    weights): the tensor peak torch's tracker measured vs the prediction, within 3% (measured: -0.01% full,
    with rows that fill --seq-len; the balanced routing the trace assumes moves no bytes)."""
    from _train_helpers import metrics, tiny_config, write_text
    from memfit.training.loop import run_training

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "recipes"))
    moe_config("mixtral").save_pretrained(tmp_path / "moe")
    run = {"optimizer": "adamw", "seq_len": 64, "micro_batch": 4, **({"lora_r": 8} if lora else {})}
    cfg = tiny_config(tmp_path, run=run, model=str(tmp_path / "moe"), init="random", packing="concat",
                      data=write_text(tmp_path, n=200))
    summary = run_training(cfg, show=False).summary
    logged = metrics(cfg.folder.output)
    assert all(1.0 <= r["router_max_load"] <= 2.0 for r in logged), logged  # E/k = 2: one expert took all
    measured = summary.to_dict()["peak_memory"]["cpu_tensor_peak"]
    predicted = summary.predicted_peak_bytes
    assert predicted and abs(predicted - measured) <= 0.03 * measured, (measured, predicted)
