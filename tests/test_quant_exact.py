"""``--exact`` with a 4-bit base (``memory/quantized_trace.py``) against the analytic QLoRA estimate.

The analytic estimate is held to the exact trace as everywhere (tests/test_estimate_accuracy.py): the tensor peak
and the forward, backward and optimizer phase peaks within 3%, here with ``--quantize 4bit`` on two families of
the accuracy grid (Llama with GQA; Qwen2: tied embeddings and q/k/v biases, which stay unquantized in
``--dtype``), lean and with PEFT's full upcast, pure bf16 and under bf16 autocast. That the trace itself is the
real step is held to real tensors in tests/test_quant_accuracy.py.
"""

from __future__ import annotations

import pytest

from _accuracy_models import accuracy_config
from _trace_helpers import compare_table, tensor_peak
from memfit.settings.config import RunConfig

pytest.importorskip("bitsandbytes")  # installed by scripts/setup.sh (the quant extra): runs in CI

BOUND = 0.03
PHASES = ("forward", "backward", "optimizer")


def _case(family, seq, batch, **changes):
    label = "-".join([family, f"T{seq}", f"B{batch}"] + [f"{k}={v}" for k, v in changes.items()])
    run = RunConfig.of(seq_len=seq, micro_batch=batch, lora_r=8, quantize="4bit", **changes)
    return pytest.param(family, run, id=label)


CASES = [
    _case("llama-gqa", 512, 2, dtype="bf16"),
    _case("llama-gqa", 512, 2, dtype="bf16", qlora_upcast="full"),
    _case("qwen2", 256, 4, mixed_precision="bf16"),
    _case("qwen2", 512, 2, dtype="bf16", qlora_upcast="full"),
]


@pytest.mark.parametrize("family, run", CASES)
def test_analytic_qlora_matches_exact_trace(family, run):
    from memfit.memory.estimate import estimate
    from memfit.memory.states import model_states
    from memfit.memory.trace import trace
    from memfit.spec.model import spec_from_config

    config = accuracy_config(family)
    spec = spec_from_config(config, f"test-{family}")
    exact = trace(config, run, device="cpu")
    analytic = estimate(spec, run, device="cpu")
    table = "\n" + compare_table(analytic, exact)
    assert exact.weights == model_states(spec, run, device="cpu").weights, table  # packed + quant state, exact
    assert abs(tensor_peak(analytic) / tensor_peak(exact) - 1) <= BOUND, f"tensor peak off by more than 3%{table}"
    for phase in PHASES:
        a, e = analytic.phase_peaks[phase], exact.phase_peaks[phase]
        assert abs(a / e - 1) <= BOUND, f"{phase} peak off by more than 3%: {a:,} vs {e:,} bytes{table}"
