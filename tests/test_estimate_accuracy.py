"""The analytic estimate held to the exact trace: tensor peak and every phase peak within 3%.

Both sides use ``device="cpu"`` semantics: the trace runs CPU kernels, and the analytic estimate's
``device="cpu"`` models those kernels and leaves out ``other`` (CUDA context, cuBLAS workspace,
allocator reserve), so the comparison is on tensor bytes only.

Bound (do not loosen): the tensor peak and the forward, backward and optimizer phase peaks each within
3% of the trace, or 256 KiB where 3% is less (it never is here: every peak is above 8 MiB, where 3% is
over 256 KiB). The configurations are chosen so that activations and logits, not model states, set the
peak (sequences of 256-512, micro-batches of 2-8, LoRA), with hidden sizes of 64-128 and GPT-2's
default dropouts on. Families without a hand-written recipe (GPT-NeoX, OLMo 2, StableLM, Granite),
Mistral beyond its sliding window and GPT-2 with dropout and checkpointing go through the derived recipe (memory/derive.py); ``test_recipe_used``
pins which path each case takes. On failure the message is a per-category table (analytic vs exact, MiB).
"""

from __future__ import annotations

import pytest

from _accuracy_models import FAMILIES, accuracy_config, accuracy_model, wide_config
from _trace_helpers import compare_table, tensor_peak
from memfit.integrations import versions
from memfit.settings.config import RunConfig
from memfit.units import KiB

FP32 = {}
AMP = {"mixed_precision": "bf16"}
AMP16 = {"mixed_precision": "fp16"}
PURE = {"dtype": "bf16"}
LORA = {"lora_r": 8}
GC = {"grad_checkpointing": True}

BOUND = 0.03
FLOOR = 256 * KiB
PHASES = ("forward", "backward", "optimizer")


def _case(family, seq, batch, *parts, marks=(), **extra):
    changes = {k: v for part in parts for k, v in part.items()}
    changes.update(extra)
    if family == "gemma2":
        changes.setdefault("attn_implementation", "eager")  # transformers runs Gemma 2 eager only
    label = "-".join([family, f"T{seq}", f"B{batch}"] + [f"{k}={v}" for k, v in changes.items()])
    # A case's tests run on one xdist worker, in file order: test_recipe_used then finds the recipe that
    # test_analytic_matches_trace derived (gemma2's took ~10 s twice when the two ran on two workers at once).
    marks = (*(marks if isinstance(marks, (list, tuple)) else (marks,)), pytest.mark.xdist_group(f"accuracy:{label}"))
    return pytest.param(family, RunConfig.of(seq_len=seq, micro_batch=batch, **changes), id=label, marks=marks)


#: CI grid: every family once or twice; 13 traces and 5 derived recipes (5 traces each), the recipes
#: cached for the session (a derivation is most of the file's time).
GRID = [
    _case("llama-mha", 512, 2, FP32),
    _case("llama-gqa", 256, 8, AMP),
    _case("llama-gqa", 512, 2, PURE, LORA),
    _case("mistral", 256, 4, FP32),          # beyond the window: derived
    _case("mistral", 64, 8, AMP),            # within it: hand-written
    _case("qwen2", 512, 2, AMP),
    _case("phi3", 256, 4, FP32, LORA),
    _case("gemma2", 256, 2, AMP),
    _case("gpt2", 256, 4, FP32),
    _case("gpt_neox", 512, 2, FP32),
    _case("olmo2", 256, 4, AMP),
    _case("stablelm", 512, 2, PURE, LORA),
    _case("granite", 256, 4, FP32, GC),
    _case("qwen3", 256, 4, FP32),
    # Checkpointing with the default --packing documents: the block-causal boolean mask every checkpointed
    # layer keeps, RoPE's per-row cos/sin, the recomputed layer's transient (its input not saved twice).
    _case("llama-gqa", 1024, 1, FP32, GC),   # the mask is 5.6% of this peak: dropping it fails here
    _case("qwen2", 512, 2, AMP, GC),
    _case("gemma2", 512, 2, FP32, GC),       # eager + checkpointing: derived (the hand-written one was 9% under)
]

_SLOW = pytest.mark.slow
#: The larger grid (``pytest -m slow``): the other regimes on every family, two sizes each. The fp32 +
#: checkpointing regime (seq 256 x 2) is where the first layer's backward, holding the weight gradients of
#: all layers above it, sets the backward peak, and where Gemma 2's checkpointed layers keep its masks.
SLOW_GRID = [
    _case(family, seq, batch, *parts, marks=_SLOW)
    for family in FAMILIES
    for seq, batch, parts in ((512, 4, (AMP,)), (256, 2, (FP32, GC)), (384, 2, (PURE, LORA)))
] + [
    _case("gpt2", 256, 4, AMP, GC, marks=_SLOW),      # dropout + checkpointing on CPU kernels: derived
    _case("gpt_neox", 256, 8, FP32, marks=_SLOW),     # a derived recipe at a second size
    _case("llama-mha", 256, 4, AMP, GC, marks=_SLOW),
    _case("llama-gqa", 512, 2, FP32, GC, attn_implementation="eager", marks=_SLOW),  # derived (was 34% under)
]
# Not in either grid: LoRA + checkpointing together (docs/estimate.md: tensor, forward and backward peaks
# within 0.1%, but the trace's optimizer phase keeps the embedding output that torch's ModTracker holds
# after backward, which a real run frees: 12-15% there).

DERIVED = {"gpt_neox", "olmo2", "stablelm", "granite", "qwen3"}

_SPECS: dict[str, tuple] = {}


_model = accuracy_model


def _wide_model(family: str):
    """(config, ModelSpec) of ``wide_config(family)``, built once per test session."""
    from memfit.spec.model import spec_from_config

    key = f"wide-{family}"
    if key not in _SPECS:
        config = wide_config(family)
        _SPECS[key] = (config, spec_from_config(config, f"test-{key}"))
    return _SPECS[key]


def _within(analytic: int, exact: int) -> bool:
    return abs(analytic - exact) <= max(BOUND * exact, FLOOR)


def test_grid_covers_the_issue():
    runs = [p.values[1] for p in GRID]
    assert {p.values[0] for p in GRID} == set(FAMILIES)
    assert any(r.mixed_precision.value == "bf16" and r.dtype.value == "fp32" for r in runs)  # AMP
    assert any(r.mixed_precision.value == "no" and r.dtype.value == "bf16" for r in runs)  # pure bf16
    assert any(r.is_lora() for r in runs) and any(r.grad_checkpointing for r in runs)
    assert max(r.seq_len for r in runs) >= 512 and max(r.micro_batch for r in runs) >= 8
    assert min(accuracy_config(f).hidden_size for f in FAMILIES) == 64
    assert accuracy_config("gpt2").attn_pdrop > 0 and accuracy_config("gpt2").resid_pdrop > 0
    assert FLOOR <= 256 * KiB and BOUND <= 0.03


@pytest.mark.parametrize("family, run", GRID + SLOW_GRID)
def test_analytic_matches_trace(family, run):
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace

    config, spec = _model(family)
    exact = trace(config, run, device="cpu")
    analytic = estimate(spec, run, device="cpu")
    table = "\n" + compare_table(analytic, exact)
    assert analytic.other == 0 and exact.other == 0, table
    # Activations, logits and temporaries must matter at the peak, or the bound checks model states only.
    assert exact.activations + exact.logits + exact.temporary > 0.1 * tensor_peak(exact), table
    assert _within(tensor_peak(analytic), tensor_peak(exact)), f"tensor peak off by more than 3%{table}"
    for phase in PHASES:
        a, e = analytic.phase_peaks[phase], exact.phase_peaks[phase]
        assert _within(a, e), f"{phase} peak off by more than 3%: {a:,} vs {e:,} bytes{table}"


@pytest.mark.parametrize("family, run", GRID + SLOW_GRID[-4:])
def test_recipe_used(family, run):
    """Each case states which recipe it tests: hand-written where one models the run, else derived."""
    from memfit.memory.estimate import estimate

    _, spec = _model(family)
    got = estimate(spec, run, device="cpu").recipe
    beyond_window = family == "mistral" and run.seq_len > 64
    recomputed_math_attention = family == "gpt2" and run.grad_checkpointing  # dropout on: CPU math kernel
    eager_checkpointed = run.grad_checkpointing and (family == "gemma2" or run.attn_implementation.value == "eager")
    outside_verified = bool(versions.unverified())  # other versions' modeling code: every recipe derived from it
    if family in DERIVED or beyond_window or recomputed_math_attention or eager_checkpointed or outside_verified:
        # gemma2's sliding and full attention layers are two kinds: one of each traced after the first
        traced = "3 layers of gemma2 (2 kinds)" if family == "gemma2" else f"1-2 layer {spec.model_type}"
        assert got == f"derived from traces of {traced}"
    else:
        assert got.startswith("hand-written recipe: ")


def test_peak_is_set_by_activations_in_most_cases():
    """The grid is not dominated by optimizer-step peaks (where only model states would be compared)."""
    from memfit.memory.estimate import estimate

    phases = [estimate(_model(p.values[0])[1], p.values[1], device="cpu").phase for p in GRID]
    assert phases.count("optimizer") <= len(phases) // 4, phases


#: AMP (fp32 weights, bf16 or fp16 autocast) where the first layer's backward sets the backward peak: wide
#: layers (hidden 512, ``wide_config``) and few tokens, the shape of llama-2-7b at 2,048 x 1. By then the
#: layers above it have freed, with their saved tensors, the half weight copies their linears saved for
#: backward; counting those copies put the backward peak 4-10% high (before this grid). With checkpointing
#: a layer saves no copies (its recompute's are its backward's transient): those cases guard the fp32 fix.
AMP_FIRST_LAYER = [
    _case("llama", 128, 1, AMP),
    _case("olmo2", 128, 1, AMP16),                      # derived
    _case("llama", 128, 1, AMP16, marks=_SLOW),
    _case("qwen2", 128, 1, AMP, marks=_SLOW),          # tied head
    _case("gpt_neox", 128, 1, AMP, marks=_SLOW),       # derived, parallel residual
    _case("llama", 256, 1, AMP, GC, marks=_SLOW),
    _case("olmo2", 256, 1, AMP, GC, marks=_SLOW),
]


@pytest.mark.parametrize("family, run", AMP_FIRST_LAYER)
def test_amp_first_layer_backward_matches_trace(family, run):
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace

    config, spec = _wide_model(family)
    exact, line = trace(config, run, device="cpu", timeline=True)
    analytic = estimate(spec, run, device="cpu")
    table = "\n" + compare_table(analytic, exact)
    # The case prices the moment it is about: the exact backward peak lies in the first layer's backward.
    totals = line.totals()
    first, last = line.phase_bounds()["backward"]
    peak = max(range(first, last + 1), key=totals.__getitem__)
    first_layer = next(n for layer, when, n in line.layer_marks if (layer, when) == (0, "grad"))
    assert first_layer - 1 <= peak, f"backward peak at sample {peak}, before the first layer's backward{table}"
    assert _within(tensor_peak(analytic), tensor_peak(exact)), f"tensor peak off by more than 3%{table}"
    for phase in PHASES:
        a, e = analytic.phase_peaks[phase], exact.phase_peaks[phase]
        assert _within(a, e), f"{phase} peak off by more than 3%: {a:,} vs {e:,} bytes{table}"


#: Checkpointed runs of the hand-written Llama recipe, held to 0.3%: each term found by reading the trace
#: is 0.5-2.2% of these peaks, under the grid's 3% bound, so this guards them one by one (each was dropped
#: once and failed here). Llama MHA: RoPE's cos/sin per packed row (-0.5% without), the recomputed layer's
#: input not counted twice and its transient gradients (+1.7% without either); Qwen2: the tied head's
#: gradient buffer (fp32, -2.0%), the decoder's last hidden state alive in the loss (AMP forward, -2.2%).
CHECKPOINTED_TERMS = [
    _case("llama-mha", 512, 2, FP32, GC),
    _case("qwen2", 512, 2, FP32, GC),
    _case("qwen2", 512, 2, AMP, GC),
]
TERM_BOUND = 0.003


@pytest.mark.parametrize("family, run", CHECKPOINTED_TERMS)
def test_checkpointed_llama_terms_match_trace_closely(family, run):
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace

    config, spec = _model(family)
    exact = trace(config, run, device="cpu")
    analytic = estimate(spec, run, device="cpu", derived=False)  # these terms, on any installed versions
    assert analytic.recipe == "hand-written recipe: llama"
    table = "\n" + compare_table(analytic, exact)
    for phase in ("forward", "backward"):
        a, e = analytic.phase_peaks[phase], exact.phase_peaks[phase]
        assert abs(a - e) <= TERM_BOUND * e, f"{phase} peak off by more than 0.3%: {a:,} vs {e:,} bytes{table}"
