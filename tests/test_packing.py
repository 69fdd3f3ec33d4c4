"""Packing without cross-document attention (issue 11, item 4): rows, positions, and the proof that a
packed batch trains exactly like its documents one by one."""

from __future__ import annotations

import pytest
import torch

from _data_helpers import tokenize
from _train_helpers import TINY_LLAMA
from memfit.data.dataset import IGNORE_INDEX as X
from memfit.data.dataset import Example, byte_tokenizer, collate, count_target_tokens
from memfit.data.packing import pack_documents, padding_share
from memfit.settings.config import Packing, RunConfig, parse_packing
from memfit.spec.batch import model_inputs

BOS, EOS, PAD = 1, 2, 0
A, B, C = 100, 101, 102


def test_worked_example_of_the_module_docstring():
    docs = [([BOS, A, B, EOS], [X, A, B, EOS]), ([BOS, C, EOS], [X, C, EOS])]
    (row,) = pack_documents(docs, seq_len=8)
    assert row == {"input_ids": [BOS, A, B, EOS, BOS, C, EOS], "labels": [X, A, B, EOS, X, C, EOS],
                   "position_ids": [0, 1, 2, 3, 0, 1, 2]}


def test_long_documents_are_cut_into_pieces_whose_first_token_is_no_target():
    ids = list(range(10, 20))  # 10 tokens, seq_len 4 -> pieces of 4, 4, 2
    rows = list(pack_documents([(ids, ids)], seq_len=4))
    assert [r["input_ids"] for r in rows] == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    assert [r["labels"] for r in rows] == [[X, 11, 12, 13], [X, 15, 16, 17], [X, 19]]
    assert all(r["position_ids"] == list(range(len(r["input_ids"]))) for r in rows)


def test_first_fit_keeps_whole_documents_and_loses_no_token(tok):
    docs = [Example(text="x" * n) for n in (5, 17, 3, 20, 9, 1, 12)]
    rows = tokenize(docs, tok, seq_len=24, packing="documents", eval_fraction=0.0, seed=0).train
    assert all(len(r["input_ids"]) <= 24 for r in rows)
    # every document (bos ... eos, length n + 2) sits whole inside one row: count them by their bos
    assert sum(r["input_ids"].count(BOS) for r in rows) == 7
    assert sum(len(r["input_ids"]) for r in rows) == sum(n + 2 for n in (5, 17, 3, 20, 9, 1, 12))
    for r in rows:  # positions restart exactly at each bos
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0]
        assert starts == [i for i, t in enumerate(r["input_ids"]) if t == BOS]


def test_collate_gives_padding_a_segment_of_its_own_and_model_inputs_drop_the_mask():
    rows = [{"input_ids": [BOS, A, EOS, BOS, B], "labels": [X, A, EOS, X, B], "position_ids": [0, 1, 2, 0, 1]},
            {"input_ids": [BOS, C], "labels": [X, C], "position_ids": [0, 1]}]
    batch = collate(rows, PAD)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert set(model_inputs(batch)) == {"input_ids", "labels", "position_ids"}
    assert count_target_tokens(batch["labels"]) == 4  # A, EOS, B in row 0; C in row 1; padding none
    unpacked = collate([{"input_ids": [BOS, A], "labels": [X, A]}], PAD)
    assert "position_ids" not in unpacked and model_inputs(unpacked) is unpacked


def test_packing_setting_reads_old_booleans_and_names():
    assert parse_packing(True) is Packing.DOCUMENTS and parse_packing(False) is Packing.NONE
    assert RunConfig().packing is Packing.DOCUMENTS
    assert RunConfig.of(packing="concat").packing is Packing.CONCAT


def test_padding_share():
    rows = [{"input_ids": [0] * n} for n in (8, 6, 4, 4)]
    # micro-batches (8, 6) -> 16 slots, 14 real; (4, 4) -> 8 slots, 8 real: 2 of 24 slots are padding
    assert padding_share(rows, seq_len=8, micro_batch=2) == pytest.approx(2 / 24)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_documents_one_by_one(tok, attn):
    """The proof of item 4: sum of per-token losses / target tokens of a packed, padded batch equals
    the same over the documents run alone (fp32, CPU, within 1e-5).

    Normalisation: each side divides its loss *sum* by its own target count (``num_items_in_batch``);
    both counts are equal (asserted), because the first token of a packed document is no target, as
    it is no target when the document runs alone. Breaking the rule on purpose (passing the
    ``attention_mask`` to the packed forward, which makes transformers skip its packed-sequence path)
    makes the difference 2e-3 on this random-init model, 200 times the tolerance.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, use_cache=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    texts = ["the cat sat on the mat.", "a kite", "one red barn by the river, and a warm old mat.",
             "hi", "near", "saw the kite fly over the barn."]
    rows = tokenize([Example(text=t) for t in texts], tok, seq_len=64, packing="documents",
                    eval_fraction=0.0, seed=0).train
    assert len(rows) < len(texts) and any(r["position_ids"].count(0) > 1 for r in rows)  # really packed
    batch = collate(rows, PAD)  # rows of different lengths: padding included
    n_packed = count_target_tokens(batch["labels"])
    with torch.no_grad():
        packed_sum = model(**model_inputs(batch), num_items_in_batch=torch.tensor(1)).loss
        alone_sum, n_alone = torch.zeros(()), 0
        for text in texts:
            (row,) = tokenize([Example(text=text)], tok, seq_len=64, packing="none", eval_fraction=0.0,
                              seed=0).train
            one = collate([row], PAD)
            alone_sum += model(**one, num_items_in_batch=torch.tensor(1)).loss
            n_alone += count_target_tokens(one["labels"])
    assert n_packed == n_alone
    assert float(packed_sum / n_packed) == pytest.approx(float(alone_sum / n_alone), abs=1e-5)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_trace_and_estimate_model_the_block_causal_mask_of_packed_rows():
    """Under ``--packing documents`` the traced layer saves k/v repeated to all heads and the additive
    (B, 1, T, T) mask; the analytic per-layer bytes match the trace to the byte, and differ from the
    concat (no mask) path by exactly ``packed_mask_per_token``: Llama with GQA 4/2, head_dim 64
    (Q 256, K 128), B 2, T 64, fp32: (2 x (256 - 128) x 4 + 64 x 4) x 128 tokens = 163,840 bytes."""
    from _trace_helpers import family_config
    from memfit.memory.estimate import estimate
    from memfit.memory.trace import trace
    from memfit.spec.model import spec_from_config

    cfg = family_config("llama")
    spec = spec_from_config(cfg, "llama")
    docs, concat = (RunConfig.of(seq_len=64, micro_batch=2, packing=p) for p in ("documents", "concat"))
    traced = trace(cfg, docs, device="cpu").activations_per_layer
    assert traced == estimate(spec, docs, device="cpu").activations_per_layer
    assert traced - estimate(spec, concat, device="cpu").activations_per_layer == 163_840


def test_golden_packed_mask_term_on_the_tiny_llama():
    """tests/test_estimate.py's fp32 golden (tiny Llama: Q = 4 heads x 16 = 64, K = 2 x 16 = 32, B 2,
    T 16, 140,032 bytes per layer without a mask) plus the packed-rows term, by hand: k and v repeated
    to all heads, 2 x (64 - 32) x 4 = 256, and the additive mask, T x 4 = 64, per token: 320 x 32 tokens
    = 10,240 bytes, so 150,272 per layer. Breaking the term (returning 0) fails this test."""
    from transformers import LlamaConfig

    from memfit.memory.estimate import estimate
    from memfit.spec.model import spec_from_config

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    spec = spec_from_config(cfg, "tiny-test")
    packed = estimate(spec, RunConfig.of(seq_len=16, micro_batch=2), device="cpu")
    plain = estimate(spec, RunConfig.of(seq_len=16, micro_batch=2, packing="concat"), device="cpu")
    assert plain.activations_per_layer == 140_032
    assert packed.activations_per_layer == 150_272
