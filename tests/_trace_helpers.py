"""Shared by the trace tests: small configs of each architecture family and a comparison table.

Sizes are scaled down to run in seconds on 2 CPU cores yet large enough that per-layer terms, not
constants, dominate: hidden 256, 2 layers, vocab a few thousand (never equal to any other dimension,
since the tracer recognises logits by their last dimension V and B*T*V elements).
"""

from __future__ import annotations

from memfit.memory.breakdown import CATEGORIES, MemoryBreakdown
from memfit.units import MiB

TENSOR_CATEGORIES = tuple(c for c in CATEGORIES if c != "other")


def family_config(family: str):
    """A small transformers config of one architecture family (no download)."""
    from transformers import Gemma2Config, GPT2Config, LlamaConfig, Phi3Config, Qwen2Config

    common = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    if family == "llama":  # GQA: 4 query heads share 2 key/value heads
        return LlamaConfig(vocab_size=3001, intermediate_size=688, num_key_value_heads=2,
                           tie_word_embeddings=False, **common)
    if family == "qwen2":  # tied embeddings, qkv bias
        return Qwen2Config(vocab_size=3011, intermediate_size=704, num_key_value_heads=2,
                           tie_word_embeddings=True, **common)
    if family == "gpt2":
        return GPT2Config(vocab_size=3019, n_embd=256, n_layer=2, n_head=4, n_positions=512)
    if family == "gemma2":
        return Gemma2Config(vocab_size=3023, intermediate_size=672, num_key_value_heads=2, head_dim=64,
                            sliding_window=64, **common)
    if family == "phi3":
        return Phi3Config(vocab_size=3037, intermediate_size=640, num_key_value_heads=4,
                          pad_token_id=0, **common)
    raise ValueError(family)


def compare_table(analytic: MemoryBreakdown, exact: MemoryBreakdown) -> str:
    """Per-category analytic vs exact (tensor bytes, no `other`), for failure messages and the bench."""
    rows = [f"{'category':<12}{'analytic MiB':>14}{'exact MiB':>12}{'diff MiB':>10}{'err %':>8}"]
    for c in (*TENSOR_CATEGORIES, "peak"):
        a = tensor_peak(analytic) if c == "peak" else getattr(analytic, c)
        e = tensor_peak(exact) if c == "peak" else getattr(exact, c)
        err = (a - e) / e * 100 if e else 0.0
        rows.append(f"{c:<12}{a / MiB:>14.3f}{e / MiB:>12.3f}{(a - e) / MiB:>10.3f}{err:>8.1f}")
    rows.append(f"phase: analytic {analytic.phase}, exact {exact.phase}; phase peaks (MiB) analytic "
                f"{ {k: round(v / MiB, 2) for k, v in analytic.phase_peaks.items()} } exact "
                f"{ {k: round(v / MiB, 2) for k, v in exact.phase_peaks.items()} }")
    return "\n".join(rows)


def tensor_peak(b: MemoryBreakdown) -> int:
    """Peak without `other` (CUDA context/reserve): what both methods compute from tensors."""
    return sum(getattr(b, c) for c in TENSOR_CATEGORIES)
