"""Chunked cross-entropy (``--loss chunked``): the same loss and gradients as transformers' path."""

from __future__ import annotations

import pytest
import torch

from memfit.errors import UserError
from memfit.settings.config import Loss, RunConfig
from memfit.spec.losses import LOSSES, check_loss_runnable, chunk_tokens, chunked_micro_loss


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Drop memfit's 128-token floor so the 51-token test batches run Liger's rule: chunks of 16 tokens,
    the last one partial (3 + 1 chunks), which is what the equality tests must cover."""
    import memfit.spec.losses

    monkeypatch.setattr(memfit.spec.losses, "MIN_CHUNK_TOKENS", 1)


def _model(kind: str, **extra):
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    torch.manual_seed(0)
    if kind == "gemma2":
        cfg = Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                           final_logit_softcapping=3.0, **extra)
        # cap 3 keeps tanh far from saturating on random logits, so the cap's derivative matters in the test
    else:
        cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.train()
    return model


def _batch(vocab: int, b: int = 3, t: int = 17):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    labels[2, 11:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[2, 11:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _both(model, batch, num_items=40):
    n = torch.tensor(num_items)
    loss = model(**batch, num_items_in_batch=n).loss
    loss.backward()
    std = (loss.detach(), _grads(model))
    model.zero_grad(set_to_none=True)
    loss = chunked_micro_loss(model, batch, n)
    loss.backward()
    chunked = (loss.detach(), _grads(model))
    model.zero_grad(set_to_none=True)
    return std, chunked


@pytest.mark.parametrize("kind, extra", [
    ("llama", {"tie_word_embeddings": False}),
    ("llama", {"tie_word_embeddings": True}),
    ("gemma2", {}),  # tied embeddings + final-logit soft-capping
])
def test_chunked_matches_standard_loss_and_gradients(kind, extra):
    model = _model(kind, **extra)
    batch = _batch(model.config.vocab_size)
    (l0, g0), (l1, g1) = _both(model, batch)
    assert abs(float(l0 - l1)) <= 1e-5 * max(1.0, abs(float(l0)))
    assert g0.keys() == g1.keys() and "model.embed_tokens.weight" in g0
    for name in g0:
        err = float((g0[name] - g1[name]).abs().max())
        assert err <= 1e-5 * max(1.0, float(g0[name].abs().max())), name


def test_chunked_with_lora_and_checkpointing_matches():
    from peft import LoraConfig, get_peft_model

    model = _model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT initialises B to 0: give it values so gradients reach A
            torch.nn.init.normal_(p, std=0.02)
    batch = _batch(300)
    (l0, g0), (l1, g1) = _both(model, batch)
    assert abs(float(l0 - l1)) <= 1e-5 * abs(float(l0))
    assert g0.keys() == g1.keys() and len(g0) == 2 * 7 * 2  # A and B of 7 projections x 2 layers
    for name in g0:
        assert float((g0[name] - g1[name]).abs().max()) <= 1e-5 * max(1.0, float(g0[name].abs().max())), name


def test_chunked_refuses_lora_on_the_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                       task_type="CAUSAL_LM"))
    with pytest.raises(UserError, match="lm_head"):
        chunked_micro_loss(model, _batch(300), torch.tensor(10))


def test_chunk_rule_is_liger_s(monkeypatch):
    import memfit.spec.losses

    monkeypatch.setattr(memfit.spec.losses, "MIN_CHUNK_TOKENS", 128)
    # Llama 3 8B, 8 x 2,048 tokens: ceil(128,256 / 4,096) = 32 -> 16,384 / 32 = 512 tokens per chunk.
    assert chunk_tokens(16_384, 128_256, 4_096) == 512
    # 4,096 tokens of the tiny test model: ceil(300/64) = 5 -> 4,096 / 5 = 819.2 -> next power of two 1,024.
    assert chunk_tokens(4096, 300, 64) == 1024
    # few tokens: memfit's floor of 128 tokens per chunk (restored here from the fixture's 1) (Liger's rule alone would give 16), capped at the total
    assert chunk_tokens(1000, 300, 64) == 256 and chunk_tokens(600, 300, 64) == 128
    assert chunk_tokens(51, 300, 64) == 51


def test_fused_kernels_are_refused_without_cuda():
    assert LOSSES[Loss.LIGER].needs_cuda and not LOSSES[Loss.CHUNKED].needs_cuda
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        check_loss_runnable(RunConfig.of(loss="liger"), cuda=False)
    check_loss_runnable(RunConfig.of(loss="chunked"), cuda=False)
