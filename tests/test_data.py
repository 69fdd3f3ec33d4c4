"""memfit.data.dataset: formats, bad inputs, byte tokenizer, packing, prompt masks, split, collate, counts, baseline.

Token ids below are those of the built-in byte tokenizer: pad 0, bos 1, eos 2, byte b -> 3 + b,
so "a" (0x61 = 97) is 100, "b" 101, "c" 102, " " (32) 35, "\\n" (10) 13.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from _data_helpers import tokenize
from memfit.data.dataset import (
    Example,
    TokenizedData,
    byte_tokenizer,
    collate,
    count_target_tokens,
    default_corpus_path,
    load_tokenizer,
    split_documents,
    unigram_loss,
)
from memfit.data.sources import load_examples
from memfit.errors import UserError

A, B, C = 100, 101, 102
BOS, EOS, PAD, X = 1, 2, 0, -100


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------- formats


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    f = write(tmp_path / "a.txt", "first doc\nline two\n\n  \t\nsecond doc\n\n\n\nthird\n")
    assert load_examples(f) == [
        Example(text="first doc\nline two"),
        Example(text="second doc"),
        Example(text="third"),
    ]


def test_txt_without_blank_lines_is_one_document(tmp_path):
    f = write(tmp_path / "a.txt", "one\ntwo\nthree")
    assert load_examples(str(f)) == [Example(text="one\ntwo\nthree")]


def test_jsonl_text_and_prompt_completion(tmp_path):
    f = write(
        tmp_path / "a.jsonl",
        '{"text": "hello"}\n\n{"prompt": "Q: x?\\nA:", "completion": " y", "id": 7}\n{"prompt": "", "completion": "z"}\n',
    )
    assert load_examples(f) == [
        Example(text="hello"),
        Example(prompt="Q: x?\nA:", completion=" y"),
        Example(prompt="", completion="z"),
    ]


def test_folder_is_read_recursively_in_sorted_order_ignoring_other_files(tmp_path):
    write(tmp_path / "b.txt", "bee")
    write(tmp_path / "a" / "z.jsonl", '{"text": "zed"}\n')
    write(tmp_path / "a.txt", "ay")
    write(tmp_path / "README.md", "not data")
    write(tmp_path / ".hidden" / "c.txt", "hidden folder")
    write(tmp_path / ".d.txt", "hidden file")
    # sorted by path components: ("a", "z.jsonl") < ("a.txt",) < ("b.txt",)
    assert [e.text for e in load_examples(tmp_path)] == ["zed", "ay", "bee"]


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "p"}, {"completion": "c"}, {"text": "t", "prompt": "p"}])
def test_example_is_text_or_prompt_and_completion(kwargs):
    with pytest.raises(ValueError):
        Example(**kwargs)


def test_jsonl_line_may_hold_a_raw_line_separator(tmp_path):
    f = write(tmp_path / "a.jsonl", '{"text": "one\u2028two"}\n{"text": "three"}\n')
    assert [e.text for e in load_examples(f)] == ["one\u2028two", "three"]


def test_none_reads_the_shipped_corpus():
    examples = load_examples(None)
    assert default_corpus_path().is_dir()
    assert len(examples) > 1000
    assert any(e.text and e.text.startswith("Once upon a time") for e in examples)
    assert any(e.completion for e in examples)


# ---------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", " \n\n \n", r"empty\.txt is empty"),
        ("empty.jsonl", "\n\n", r"empty\.jsonl is empty"),
        ("bad.jsonl", '{"text": "ok"}\n\n{"text": "oops"\n', r"bad\.jsonl line 3 is not valid JSON"),
        (
            "none.jsonl",
            '{"text": "ok"}\n{"title": "no"}\n',
            r"none\.jsonl line 2 has neither a text field nor prompt",
        ),
        ("half.jsonl", '{"prompt": "p"}\n', r"half\.jsonl line 1 needs both prompt and completion"),
        # issue 34: a preference file given without --method was "needs both prompt and completion"
        ("pairs.jsonl", '{"prompt": "p", "chosen": "a", "rejected": "b"}\n',
         r"pairs\.jsonl line 1 is a preference pair \(chosen and rejected\): train it with --method dpo, orpo or "
         r"simpo\."),
        ("list.jsonl", '["text"]\n', r"list\.jsonl line 1 is a JSON list"),
        ("blank.jsonl", '{"text": ""}\n', r"blank\.jsonl line 1 has a text that is not a non-empty string"),
        ("data.xlsx", "a,b\n", r"data\.xlsx is a \.xlsx file"),
    ],
)
def test_bad_files_name_the_file_and_line(tmp_path, name, content, message):
    with pytest.raises(UserError, match=message):
        load_examples(write(tmp_path / name, content))


def test_missing_path_empty_folder_and_non_utf8(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_examples(tmp_path / "nope.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no .txt or .jsonl files"):
        load_examples(tmp_path / "empty")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt is not UTF-8"):
        load_examples(tmp_path / "latin1.txt")


def test_an_error_message_is_one_sentence(tmp_path):
    with pytest.raises(UserError) as err:
        load_examples(write(tmp_path / "bad.jsonl", "{nope\n"))
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


# ----------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text", ["Once upon a time.", "héllo wörld € 😀", " lead,  trail \n\n\t", "a , b . n't", "\x00\x1f\x7f"]
)
def test_byte_tokenizer_round_trips_any_utf8(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [3 + b for b in text.encode("utf-8")]  # one token per byte, id = 3 + byte
    assert tok.decode(ids) == text


def test_byte_tokenizer_special_ids_and_size(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD, BOS, EOS)
    assert len(tok) == 259 <= 384  # 3 specials + 256 bytes fit the tiny preset's vocab
    assert tok.decode([BOS, A, EOS, PAD], skip_special_tokens=True) == "a"


def test_byte_tokenizer_saves_and_reloads(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(str(tmp_path), "ignored", is_preset=False)
    text = "Tom , the fox 😀\n"
    assert (
        again(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    )
    assert again.decode(again(text, add_special_tokens=False)["input_ids"]) == text
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (PAD, BOS, EOS)


def test_load_tokenizer_sources(tmp_path, tok):
    assert len(load_tokenizer(None, "tiny", is_preset=True)) == 259  # presets: the byte tokenizer
    assert len(load_tokenizer("byte", str(tmp_path), is_preset=False)) == 259
    model_dir = tmp_path / "model"
    tok.save_pretrained(model_dir)  # a model folder carrying its tokenizer
    assert load_tokenizer(None, str(model_dir), is_preset=False).eos_token_id == EOS
    (tmp_path / "bare").mkdir()
    with pytest.raises(UserError, match="holds no tokenizer files"):
        load_tokenizer(None, str(tmp_path / "bare"), is_preset=False)
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"), "tiny", is_preset=True)


def test_load_tokenizer_pads_with_eos_when_no_pad(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    no_pad = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="</s>")
    assert no_pad.pad_token is None
    no_pad.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path), "x", is_preset=False)
    assert loaded.pad_token_id == loaded.eos_token_id == EOS


# ------------------------------------------------------------------------------- packing and masking


def test_concat_packing_worked_example_of_the_docstring(tok):
    docs = [Example(text="ab"), Example(prompt="c", completion="a")]
    data = tokenize(docs, tok, seq_len=4, packing="concat", eval_fraction=0.0, seed=0)
    assert data.train == [
        {"input_ids": [BOS, A, B, EOS], "labels": [X, A, B, EOS]},
        {"input_ids": [BOS, C, A, EOS], "labels": [X, X, A, EOS]},
    ]
    assert data.eval == []
    # targets after the shift: 3 in chunk 0 (a, b, eos), 2 in chunk 1 (a, eos)
    assert count_target_tokens(collate(data.train, PAD)["labels"]) == 5


def test_concat_packing_cuts_exact_chunks_and_loses_no_token(tok):
    docs = [Example(text="x" * n) for n in (5, 17, 3, 40, 9)]  # 74 bytes + 5 x (bos, eos) = 84 tokens
    data = tokenize(docs, tok, seq_len=16, packing="concat", eval_fraction=0.0, seed=0)
    lengths = [len(s["input_ids"]) for s in data.train]
    assert lengths == [16, 16, 16, 16, 16, 4]  # 84 = 5 x 16 + 4: every chunk full but the tail
    stream = [t for s in data.train for t in s["input_ids"]]
    assert stream.count(BOS) == stream.count(EOS) == 5 and len(stream) == 84
    assert all(len(s["labels"]) == len(s["input_ids"]) for s in data.train)


def test_prompt_masking_counts(tok):
    # prompt "Q: hi\nA:" is 8 bytes: bos + 8 prompt positions = 9 masked; completion " yo" + eos = 4 targets.
    ex = Example(prompt="Q: hi\nA:", completion=" yo")
    for packing in ("concat", "none", "documents"):
        (seq,) = tokenize([ex], tok, seq_len=64, packing=packing, eval_fraction=0.0, seed=0).train
        assert len(seq["input_ids"]) == 13
        assert seq["labels"][:9] == [X] * 9
        assert seq["labels"][9:] == seq["input_ids"][9:] == [3 + ord(" "), 3 + ord("y"), 3 + ord("o"), EOS]
        assert tok.decode(seq["input_ids"], skip_special_tokens=True) == "Q: hi\nA: yo"


def test_no_packing_truncates_and_drops_sequences_without_targets(tok):
    docs = [Example(text="abcdefgh"), Example(text="a"), Example(prompt="long prompt", completion="c")]
    data = tokenize(docs, tok, seq_len=4, packing=False, eval_fraction=0.0, seed=0)
    # "abcdefgh" -> [bos, a, b, c] (cut, eos lost); "a" -> [bos, a, eos]; the prompt fills all 4
    # positions with -100 so that record is dropped.
    assert data.train == [
        {"input_ids": [BOS, A, B, C], "labels": [X, A, B, C]},
        {"input_ids": [BOS, A, EOS], "labels": [X, A, EOS]},
    ]


def test_seq_len_must_be_at_least_two(tok):
    with pytest.raises(UserError, match="at least 2"):
        tokenize([Example(text="a")], tok, seq_len=1, packing=True, eval_fraction=0.0, seed=0)


# ----------------------------------------------------------------------------------------- the split


def test_split_by_document_has_no_leakage(tok):
    # Each document is a distinct letter repeated; a held-out letter must not appear in training.
    letters = "abcdefghijklmnopqrst"
    docs = [Example(text=ch * 30) for ch in letters]
    data = tokenize(docs, tok, seq_len=16, packing="documents", eval_fraction=0.2, seed=3)
    train_tokens = {t for s in data.train for t in s["input_ids"]}
    eval_tokens = {t for s in data.eval for t in s["input_ids"]} - {BOS, EOS}
    assert len(eval_tokens) == 4  # round(0.2 x 20) documents held out
    assert not eval_tokens & train_tokens
    assert len(train_tokens - {BOS, EOS}) == 16


def test_split_is_deterministic_and_seeded():
    assert split_documents(100, 0.1, seed=0) == split_documents(100, 0.1, seed=0)
    assert split_documents(100, 0.1, seed=0)[1] != split_documents(100, 0.1, seed=1)[1]
    train, held = split_documents(100, 0.1, seed=0)
    assert len(held) == 10 and sorted(train + held) == list(range(100))
    assert split_documents(2, 0.01, seed=0)[1] != []  # at least one held-out doc from two
    assert len(split_documents(2, 0.9, seed=0)[0]) == 1  # never all of them
    assert split_documents(1, 0.5, seed=0) == ([0], [])
    assert split_documents(10, 0.0, seed=0) == (list(range(10)), [])
    with pytest.raises(UserError, match="eval fraction"):
        split_documents(10, 1.0, seed=0)


# -------------------------------------------------------------------------------- collate and counts


def test_collate_pads_right_and_masks_padding():
    batch = [{"input_ids": [1, 5, 6], "labels": [X, 5, 6]}, {"input_ids": [1, 7], "labels": [X, 7]}]
    out = collate(batch, pad_id=PAD)
    assert out["input_ids"].tolist() == [[1, 5, 6], [1, 7, PAD]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["labels"].tolist() == [[X, 5, 6], [X, 7, X]]
    assert all(t.dtype == torch.long and t.shape == (2, 3) for t in out.values())


def test_count_target_tokens_applies_the_causal_shift():
    labels = torch.tensor([[5, 6, 7, X], [X, X, 8, 9]])
    # Without the shift: 3 + 2 = 5 non-masked labels. The label at position 0 is never predicted,
    # so row 0 has targets 6, 7 (2) and row 1 has 8, 9 (2): 4.
    assert count_target_tokens(labels) == 4
    assert count_target_tokens(labels[0]) == 2  # 1-D works too
    assert count_target_tokens(torch.full((2, 5), X)) == 0


def test_count_target_tokens_is_the_denominator_of_the_model_loss():
    # The mean loss transformers computes equals sum of per-token losses / count_target_tokens.
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11)
    labels = torch.tensor([[3, 4, X, 5], [X, 6, 7, X]])
    shifted = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=X, reduction="sum"
    )
    mean = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=X
    )
    assert torch.allclose(shifted / count_target_tokens(labels), mean)


# ---------------------------------------------------------------------------------- unigram baseline


def test_unigram_loss_hand_computed():
    # Train targets (labels after the shift, -100 dropped): 10, 10, 11 -> N = 3, V = 2, N + V + 1 = 6.
    # p(10) = (2+1)/6 = 1/2, p(11) = (1+1)/6 = 1/3, unseen = 1/6. Eval targets: 10 and 12 (unseen).
    # Loss = (ln 2 + ln 6) / 2 = 1.2424533...
    data = TokenizedData(
        train=[{"input_ids": [1, 10, 10, 11], "labels": [X, 10, 10, 11]}, {"input_ids": [9], "labels": [9]}],
        eval=[{"input_ids": [1, 10, 12, 4], "labels": [X, 10, 12, X]}],
    )
    assert unigram_loss(data) == pytest.approx((math.log(2) + math.log(6)) / 2)
    assert unigram_loss(data) == pytest.approx(1.2424533, abs=1e-6)


def test_unigram_loss_without_eval_is_nan():
    assert math.isnan(unigram_loss(TokenizedData(train=[{"input_ids": [1, 2], "labels": [1, 2]}], eval=[])))


def test_shipped_corpus_baseline_is_that_of_english_bytes(tok):
    data = tokenize(load_examples(None), tok, seq_len=256, packing="concat", eval_fraction=0.05, seed=0)
    assert len(data.train) > 1000 and len(data.eval) > 20
    assert all(len(s["input_ids"]) == 256 for s in data.train[:-1])
    assert 2.5 < unigram_loss(data) < 3.5  # nats per byte; a trained model must get well below


# ------------------------------------------------------------------------------------ the corpus file


def _make_corpus_module():
    path = Path(__file__).resolve().parent.parent / "scripts" / "make_corpus.py"
    spec = importlib.util.spec_from_file_location("make_corpus", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_corpus_is_what_the_script_generates():
    gen = _make_corpus_module()
    stories, qa = gen.generate(gen.N_STORIES, gen.N_QA, gen.SEED)
    assert (default_corpus_path() / "stories.txt").read_text(encoding="utf-8") == stories
    assert (default_corpus_path() / "qa.jsonl").read_text(encoding="utf-8") == qa
    assert len(stories.encode()) + len(qa.encode()) < 1_000_000
    assert all(set(json.loads(line)) == {"prompt", "completion"} for line in qa.splitlines())
