"""Presets and ModelSpec: every preset's meta-device count equals the real checkpoint's."""

from __future__ import annotations

import pytest

from memfit.errors import UserError
from memfit.settings.config import RunConfig
from memfit.spec.model import load_presets, load_spec, preset_names, spec_from_config

REAL = [n for n in preset_names() if load_presets()[n].get("params")]


def test_all_required_presets_exist():
    required = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "smollm2-135m", "smollm2-360m", "smollm2-1.7b",
                "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.2-1b", "llama-3.2-3b", "llama-3-8b", "llama-3.1-8b",
                "llama-2-7b", "llama-2-13b", "mistral-7b", "tinyllama-1.1b", "gemma-2-2b", "phi-3-mini"}
    assert required <= set(preset_names())


@pytest.mark.parametrize("name", REAL)
def test_preset_count_matches_checkpoint(name):
    # transformers builds the module tree on the meta device; a tied head is counted once, like checkpoints.
    assert load_spec(name).params == load_presets()[name]["params"]


def test_well_known_counts():
    assert load_spec("llama-2-7b").params == 6_738_415_616
    assert load_spec("gpt2").params == 124_439_808
    assert load_spec("tinyllama-1.1b").params == 1_100_048_384


def test_spec_shapes_of_tiny_llama(tiny_llama_config):
    spec = spec_from_config(tiny_llama_config, "t")
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (64, 4, 2, 16)
    assert spec.kv_dim == 32 and spec.q_dim == 64
    # 2 layers x (q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up 64x128 x2 + down 128x64)
    assert spec.linear_params == 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192)
    # untied embedding and head, 384 x 64 each; 5 norms of 64
    assert spec.params == spec.linear_params + 2 * 384 * 64 + 5 * 64


def test_lora_params_all_linear_and_named(tiny_llama_config):
    spec = spec_from_config(tiny_llama_config, "t")
    # r * (in + out) per projection: q (64+64) k (64+32) v (64+32) o (64+64) gate/up (64+128)x2 down (128+64)
    per_layer = 8 * (128 + 96 + 96 + 128 + 192 * 3)
    assert spec.lora_params(RunConfig.of(lora_r=8)) == 2 * per_layer
    assert spec.lora_params(RunConfig.of(lora_r=8, lora_targets=("q_proj", "v_proj"))) == 2 * 8 * (128 + 96)
    assert spec.trainable_params(RunConfig()) == spec.params
    with pytest.raises(UserError, match="matches no projection of t; its projections are: down_proj, gate_proj"):
        spec.check_lora_targets(RunConfig.of(lora_r=8, lora_targets=("nope",)))


def test_tied_and_fused_architectures():
    assert load_spec("qwen2.5-0.5b").tie_word_embeddings and load_spec("qwen2.5-0.5b").lm_head_params == 0
    assert {lin.name for lin in load_spec("phi-3-mini").linears} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert load_spec("gemma-2-2b").head_dim == 256 and load_spec("gemma-2-2b").family == "gemma2"


def test_unknown_preset_suggests_names():
    with pytest.raises(UserError, match="Did you mean llama-2-7b"):
        load_spec("llama-2-7")
