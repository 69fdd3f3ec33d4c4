"""Small random configs of every architecture family the accuracy grid covers (no download).

Hidden 64-128, 3 layers, vocabularies of about a thousand (prime, so never equal to a model dimension
or to B*T: the tracer recognises logits by their last dimension V and B*T*V elements). Activations and
logits, not model states, set the peak at the grid's sequence lengths (256-512) and micro-batches.
Shared by tests/test_estimate_accuracy.py and bench/estimate_accuracy.py.
"""

from __future__ import annotations

#: 3 layers: derived recipes trace 2 and extrapolate, so the grid checks the per-layer term too.
_LAYERS = dict(num_hidden_layers=3, max_position_embeddings=1024)


def accuracy_config(family: str):
    """A transformers config of one family, with the feature the grid exercises in it."""
    import transformers as tf

    if family == "llama-mha":  # multi-head attention: as many key/value heads as query heads
        return tf.LlamaConfig(vocab_size=1031, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                              num_key_value_heads=4, tie_word_embeddings=False, **_LAYERS)
    if family == "llama-gqa":  # grouped-query attention, hidden 64
        return tf.LlamaConfig(vocab_size=1033, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                              num_key_value_heads=2, tie_word_embeddings=False, **_LAYERS)
    if family == "mistral":  # sliding window 64: runs longer than it pass SDPA a mask
        return tf.MistralConfig(vocab_size=1039, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                                num_key_value_heads=2, sliding_window=64, **_LAYERS)
    if family == "qwen2":  # tied embeddings, qkv bias
        return tf.Qwen2Config(vocab_size=1049, hidden_size=128, intermediate_size=336, num_attention_heads=4,
                              num_key_value_heads=2, tie_word_embeddings=True, **_LAYERS)
    if family == "phi3":  # fused qkv and gate_up projections
        return tf.Phi3Config(vocab_size=1051, hidden_size=128, intermediate_size=320, num_attention_heads=4,
                             num_key_value_heads=4, pad_token_id=0, **_LAYERS)
    if family == "gemma2":  # logit soft-capping (eager attention), four norms, sliding window
        return tf.Gemma2Config(vocab_size=1061, hidden_size=128, intermediate_size=336, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, sliding_window=64, **_LAYERS)
    if family == "gpt2":  # the library's default dropouts (0.1 attention, residual, embedding)
        return tf.GPT2Config(vocab_size=1063, n_embd=128, n_layer=3, n_head=4, n_positions=1024,
                             bos_token_id=0, eos_token_id=0)
    if family == "gpt_neox":  # parallel residual, partial rotary, LayerNorm
        return tf.GPTNeoXConfig(vocab_size=1069, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                **_LAYERS)
    if family == "olmo2":  # norms after attention and MLP, q/k norms
        return tf.Olmo2Config(vocab_size=1087, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                              num_key_value_heads=2, pad_token_id=0, **_LAYERS)
    if family == "stablelm":  # LayerNorm, partial rotary
        return tf.StableLmConfig(vocab_size=1091, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                                 num_key_value_heads=2, **_LAYERS)
    if family == "granite":  # never named by memfit before: embedding, residual and logit multipliers
        return tf.GraniteConfig(vocab_size=1093, hidden_size=128, intermediate_size=320, num_attention_heads=4,
                                num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                                logits_scaling=8.0, attention_multiplier=0.0625, pad_token_id=0, **_LAYERS)
    if family == "qwen3":  # per-head q/k RMSNorms: the Llama recipe it used to get was 6.5% under
        return tf.Qwen3Config(vocab_size=1097, hidden_size=128, intermediate_size=336, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, **_LAYERS)
    raise ValueError(family)


FAMILIES = ("llama-mha", "llama-gqa", "mistral", "qwen2", "phi3", "gemma2", "gpt2", "gpt_neox", "olmo2",
            "stablelm", "granite", "qwen3")


def wide_config(family: str):
    """A wide (hidden 512), 4-layer config of a family: at a short sequence each layer's weight gradients
    outweigh the tensors it saves, so the first layer's backward (all layers above it holding their
    gradients) sets the backward peak, as in llama-2-7b at 2,048 tokens; fake tensors cost the same at any
    width. Used by the AMP cases of tests/test_estimate_accuracy.py."""
    import transformers as tf

    common = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_hidden_layers=4,
                  max_position_embeddings=1024)
    if family == "llama":
        return tf.LlamaConfig(vocab_size=1031, num_key_value_heads=8, tie_word_embeddings=False, **common)
    if family == "qwen2":  # tied: the head's gradient only comes with the embedding's
        return tf.Qwen2Config(vocab_size=1049, num_key_value_heads=4, tie_word_embeddings=True, **common)
    if family == "olmo2":  # derived
        return tf.Olmo2Config(vocab_size=1087, num_key_value_heads=4, pad_token_id=0, **common)
    if family == "gpt_neox":  # derived, parallel residual
        return tf.GPTNeoXConfig(vocab_size=1069, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                                num_hidden_layers=4, max_position_embeddings=1024)
    raise ValueError(family)


#: Mixture-of-experts families (tests/test_moe.py, bench/moe_accuracy.py): 4 experts, 2 per token.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def moe_config(family: str, layers: int = 3):
    """A small config of a mixture-of-experts family: hidden 64, 4 experts, 2 per token (no download);
    qwen2_moe and deepseek_v3 with a shared expert, deepseek_v3's first layer dense."""
    import transformers as tf

    common = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=layers, max_position_embeddings=1024,
                  num_experts_per_tok=2)
    if family == "mixtral":
        return tf.MixtralConfig(vocab_size=1103, intermediate_size=128, num_key_value_heads=2, num_local_experts=4,
                                **common)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(vocab_size=1109, intermediate_size=128, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=128, num_key_value_heads=2, num_experts=4, **common)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(vocab_size=1117, intermediate_size=128, moe_intermediate_size=64, head_dim=16,
                                 num_key_value_heads=2, num_experts=4, **common)
    if family == "olmoe":
        return tf.OlmoeConfig(vocab_size=1123, intermediate_size=64, num_key_value_heads=4, num_experts=4,
                              pad_token_id=0, eos_token_id=1, bos_token_id=None, **common)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(vocab_size=1129, intermediate_size=128, moe_intermediate_size=32,
                                   num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4,
                                   n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **common)
    if family == "gpt_oss":
        return tf.GptOssConfig(vocab_size=1151, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                               num_local_experts=4, sliding_window=64,
                               rope_parameters={"rope_type": "default", "rope_theta": 150000.0}, **common)
    raise ValueError(family)


_SPECS: dict[str, tuple] = {}


def accuracy_model(family: str):
    """(transformers config, ModelSpec) of ``accuracy_config(family)``, built once per test session."""
    from memfit.spec.model import spec_from_config

    if family not in _SPECS:
        config = accuracy_config(family)
        _SPECS[family] = (config, spec_from_config(config, f"test-{family}"))
    return _SPECS[family]

