"""The fast encoding paths (``memfit.data.fast``) give exactly the reference encoding
(``memfit.data.dataset.encode_docs``), and the ``datasets.map`` cache key follows the encoder's source."""

from __future__ import annotations

import json

import pytest

from memfit.data import arrow as data_arrow
from memfit.data import fast as data_fast
from memfit.data.dataset import byte_tokenizer, encode_docs, record_to_example
from memfit.data.formats import Fields
from memfit.errors import UserError

TEXTS = [
    "plain ascii",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600 \u20ac",  # 2-, 3- and 4-byte UTF-8
    "a\nsecond line\ttab",
    "x",
    "\u0000nul and \u00ff",
]


def _reference(records, fmt=None, fields=Fields(), tokenizer=None):
    """What ``memfit.data.dataset``'s reference encoding gives, as rows of the encoded table."""
    tokenizer = tokenizer or byte_tokenizer()
    examples = [record_to_example(r, f"row {i}", fmt, fields) for i, r in enumerate(records)]
    return [{"input_ids": d[0], "labels": d[1], "conversation": len(d) > 2, "length": len(d[0])}
            for d in encode_docs(examples, tokenizer)]


def _encode(records, *, fast: bool, fmt=None, fields=Fields(), tokenizer=None):
    tokenizer = tokenizer or byte_tokenizer()
    batch = {key: [r.get(key) for r in records] for key in dict.fromkeys(k for r in records for k in r)}
    offset = data_fast.byte_offset(tokenizer) if fast else None
    table = data_arrow._encode_batch(batch, list(range(len(records))), tokenizer=tokenizer, fmt=fmt, fields=fields,
                                     train_on_prompt=False, where="src", byte_offset=offset)
    return table.to_pylist()


@pytest.fixture()
def fast_calls(monkeypatch):
    """How many batches the byte fast path encoded (it returns None when it leaves one to the reference)."""
    calls = []
    real = data_fast.encode_byte_texts

    def counted(*args, **kwargs):
        table = real(*args, **kwargs)
        calls.append(table is not None)
        return table

    monkeypatch.setattr(data_fast, "encode_byte_texts", counted)
    return calls


def test_byte_fast_path_equals_the_reference_on_non_ascii_text(fast_calls):
    records = [{"text": t} for t in TEXTS]
    expected = _reference(records)
    # hand check of one document: "x" = byte 120 -> id 123, framed by bos 1 and eos 2, bos carries no loss
    assert expected[3] == {"input_ids": [1, 123, 2], "labels": [-100, 123, 2], "conversation": False, "length": 3}
    assert _encode(records, fast=True) == expected
    assert _encode(records, fast=True, fmt="text") == expected
    assert _encode(records, fast=False) == expected
    assert fast_calls == [True, True]


def test_byte_fast_path_leaves_special_token_text_and_empty_records_to_the_reference(fast_calls):
    # "</s>" in a text is read by the tokenizer as the eos token (id 2), not as four bytes
    records = [{"text": "ends with </s> inside"}, {"text": "ok"}]
    expected = _reference(records)
    assert 2 in expected[0]["input_ids"][1:-1]
    assert _encode(records, fast=True) == expected
    with pytest.raises(UserError, match="src row 2 has a text that is not a non-empty string"):
        _encode([{"text": "ok"}, {"text": ""}], fast=True)
    with pytest.raises(UserError, match="src row 1 has a text that is not a non-empty string"):
        _encode([{"text": None}], fast=True, fmt="text")
    assert fast_calls == [False, False, False]


def test_other_formats_take_the_reference_path_through_numpy_columns(fast_calls):
    records = [{"prompt": "Q: caf\u00e9?", "completion": " A."}, {"prompt": "", "completion": "\u00e9"}]
    assert _encode(records, fast=True) == _reference(records)
    chat = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}]
    assert _encode(chat, fast=True) == _reference(chat)
    assert _encode(chat, fast=True)[0]["conversation"] is True
    # a text column beside a filled prompt column: detected as prompt/completion, so no byte path
    mixed = [{"text": None, "prompt": "a", "completion": "b"}, {"text": "t", "prompt": None, "completion": None}]
    assert _encode(mixed, fast=True) == _reference(mixed)
    assert fast_calls == []


def test_the_byte_tokenizer_is_recognised_also_when_reloaded_and_no_other_is(tmp_path):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = byte_tokenizer()
    assert data_fast.byte_offset(tok) == 3
    tok.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert data_fast.byte_offset(reloaded) == 3
    assert _encode([{"text": t} for t in TEXTS], fast=True, tokenizer=reloaded) == _reference(
        [{"text": t} for t in TEXTS], tokenizer=reloaded)
    prefixed = byte_tokenizer()  # a leading space added to every text: other ids, so no fast path
    prefixed.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)
    assert data_fast.byte_offset(prefixed) is None
    extra = byte_tokenizer()
    extra.add_tokens(["hello"])
    assert data_fast.byte_offset(extra) is None


def test_a_txt_corpus_encodes_through_datasets_to_the_reference(tmp_path, monkeypatch, fast_calls):
    """End to end through ``datasets.map``: a .txt with non-ASCII text and empty documents (blank runs),
    encoded by the fast path, equals the reference encoding of ``memfit.data.dataset``'s own reader."""
    import datasets

    from memfit.data.sources import load_examples, load_parts

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(data_arrow, "BATCH_ROWS", 2)
    path = tmp_path / "c.txt"
    path.write_text("\n\n \n\n".join(TEXTS) + "\n\n\n\n\n" + "last \u00e9\n", encoding="utf-8")
    (part,) = load_parts(str(path))
    encoded = data_arrow.encode_dataset(part.ds, byte_tokenizer(), fmt="text", fields=Fields(),
                                        train_on_prompt=False, num_proc=1, where=str(path))
    expected = _reference([{"text": ex.text} for ex in load_examples(path)])
    assert len(expected) == len(TEXTS) + 1 and encoded.to_list() == expected
    assert fast_calls == [True, True, True]
    assert encoded.features["input_ids"].feature.dtype == "int16"


def test_the_cache_key_changes_with_the_encoder_source(tmp_path, monkeypatch):
    """The ``datasets.map`` fingerprint covers the source of every module of the encoding, the fast path
    included: a changed ``data/fast.py`` or ``data/arrow.py`` is a new cache entry."""
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["a", "b"]})
    tok = byte_tokenizer()

    def key():
        return data_arrow._encoding_fingerprint(ds, tok, "text", Fields(), False)

    before = key()
    assert key() == before
    for module in (data_fast, data_arrow):
        edited = tmp_path / f"{module.__name__}.py"
        edited.write_text(open(module.__file__).read() + "\n# changed\n")
        with monkeypatch.context() as m:
            m.setattr(module, "__file__", str(edited))
            assert key() != before, module.__name__
    assert key() == before


def test_jsonl_records_through_datasets_match_the_reference(tmp_path, monkeypatch, fast_calls):
    import datasets

    from memfit.data.sources import load_parts

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    records = [{"text": t} for t in TEXTS]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (part,) = load_parts(str(path))
    encoded = data_arrow.encode_dataset(part.ds, byte_tokenizer(), fmt=None, fields=Fields(),
                                        train_on_prompt=False, num_proc=1, where=str(path))
    assert encoded.to_list() == _reference(records) and fast_calls == [True]


def test_the_packed_file_key_changes_with_the_packer_source(tmp_path, monkeypatch):
    """A changed ``memfit.data.packing`` writes a new packed file rather than reusing one the old packer wrote."""
    import datasets

    import memfit.data.packing

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    ds = datasets.Dataset.from_dict({"text": [f"document {i}" for i in range(6)]})
    encoded = data_arrow.encode_dataset(ds, byte_tokenizer(), fmt="text", fields=Fields(), train_on_prompt=False,
                                        num_proc=1, where="docs")
    packed_dir = tmp_path / "hf-cache" / "memfit-packed"

    def pack():
        data_arrow.pack_encoded(encoded, seq_len=32, packing="documents", eval_fraction=0.0, seed=0)
        return sorted(p.name for p in packed_dir.glob("*.arrow"))

    first = pack()
    assert pack() == first and len(first) == 1  # the same packer: the same file, reused
    edited = tmp_path / "packing.py"
    edited.write_text(open(memfit.data.packing.__file__).read() + "\n# changed\n")
    monkeypatch.setattr(memfit.data.packing, "__file__", str(edited))
    assert len(pack()) == 2
