"""The exact trace for a CUDA target: CUDA's kernels stand in where their saved tensors differ from the CPU's.

GPT-2 with its default dropout (0.1) is the case that showed it: on the CPU SDPA with dropout takes the math
path (three (B, n, T, T) fp32 matrices a layer), on CUDA flash / memory-efficient attention keeps none.
"""

from __future__ import annotations

import re

import pytest

from _trace_helpers import compare_table, family_config, tensor_peak
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.trace import trace
from memfit.settings.config import RunConfig
from memfit.spec.model import spec_from_config


@pytest.fixture(scope="module")
def gpt2():
    config = family_config("gpt2")
    assert config.attn_pdrop > 0 and config.resid_pdrop > 0  # transformers' default dropout, the case at hand
    return config


def _agree(config, run: RunConfig, family: str):
    analytic = estimate(spec_from_config(config, family), run, device="cuda")
    exact = trace(config, run, device="cuda")
    err = abs(tensor_peak(analytic) - tensor_peak(exact)) / tensor_peak(exact)
    assert err < 0.001, compare_table(analytic, exact)
    return exact


def test_gpt2_dropout_exact_cuda_agrees_with_the_analytic_cuda_estimate(gpt2):
    run = RunConfig.of(seq_len=128, micro_batch=2)
    exact = _agree(gpt2, run, "gpt2")
    notes = "\n".join(exact.notes)
    assert "memory-efficient attention with dropout" in notes  # fp32: flash needs fp16/bf16
    assert "fused native_dropout" in notes
    # The CPU's own kernels (math SDPA with dropout: T x T matrices) hold more and say nothing of CUDA.
    cpu = trace(gpt2, run, device="cpu")
    assert cpu.activations > exact.activations * 1.2
    assert not any("CUDA kernel substituted" in n for n in cpu.notes)


def test_bf16_with_checkpointing_runs_flash_in_forward_and_recompute(gpt2):
    run = RunConfig.of(seq_len=128, micro_batch=2, mixed_precision="bf16", grad_checkpointing=True, packing="concat")
    exact = _agree(gpt2, run, "gpt2")
    # two layers, each in forward and in its recompute
    assert any(re.search(r"4 SDPA call\(s\) priced as CUDA's flash attention with dropout", n) for n in exact.notes)


def test_fused_loss_is_traced_as_chunked_for_cuda_and_refused_for_cpu():
    config = family_config("llama")
    run = RunConfig.of(seq_len=128, micro_batch=2, loss="liger")
    exact = _agree(config, run, "llama")
    assert any("--loss liger traced as --loss chunked" in n for n in exact.notes)
    with pytest.raises(UserError, match="Triton kernels"):
        trace(config, run, device="cpu")
