"""Shared fixtures: tiny models built from a transformers config (never downloaded)."""

from __future__ import annotations

import os
import tempfile

import pytest

# Tests run on CPU, offline, deterministic, with few threads so the 2-core CI is not oversubscribed.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ACCELERATE_USE_CPU", "true")
# Derived activation recipes (memory/derive.py) are cached per test session, never in the user's ~/.cache.
os.environ.setdefault("MEMFIT_CACHE_DIR", tempfile.mkdtemp(prefix="memfit-test-recipes-"))


@pytest.fixture
def tiny_llama_config():
    """A 2-layer, hidden-64 Llama config with GQA (the test-size model)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="session")
def gloo_runs(request, tmp_path_factory):
    """``{name: CaseRun}``: the 2-process cases of ``_gloo_cases`` that this session's tests ask for
    (``@pytest.mark.launch_cases(NAME, ...)``), run one after the other in ONE torchrun."""
    import _gloo_cases
    from _launch_helpers import launch_cases

    wanted = {name for item in request.session.items for mark in item.iter_markers("launch_cases")
              for name in mark.args}
    root = tmp_path_factory.mktemp("gloo-cases")
    return launch_cases(_gloo_cases.build(sorted(wanted), root), root)
