"""Fast paths of the encoding step (``memfit.data.arrow.encode_dataset``): the same ``input_ids``/``labels``
as ``memfit.data.dataset.encode_docs``, built as Arrow columns from numpy instead of Python lists of ints.

Profiled on a 4 MB ``.txt`` corpus with the built-in byte tokenizer (2026-11-30, 1 process), the
reference path spent 4.1 s encoding: 2.0 s in ``tokenizers``' ``encode_batch``, 0.6 s in transformers'
per-document ``_convert_encoding``, 0.6 s in ``datasets`` turning the Python lists into Arrow, the rest
in memfit's own per-document Python. Two fast paths replace that:

* ``encode_byte_texts``: plain-text records with memfit's byte tokenizer (``byte_offset`` recognises
  it), which maps UTF-8 byte ``b`` to id ``3 + b`` with nothing else: the ids of a batch are
  ``np.frombuffer(b"".join(texts), np.uint8) + 3`` with bos and eos written at each document's bounds,
  the labels the ids with bos set to -100. A batch it cannot encode exactly (a record that is not a
  non-empty string, so the reference raises the user's error; a text holding the text of a special
  token such as ``</s>``, which the tokenizer would read as that token) goes the reference way.
* ``docs_table``: any other batch (HF tokenizers, prompt/completion, conversations), encoded by the
  reference code, becomes Arrow columns through one flat numpy array per column (a checked cast to
  the stored integer type), not through ``datasets``' inference over nested Python lists.

``tests/test_data_fast.py`` compares both with the reference on text with non-ASCII characters,
special-token text, empty documents and prompt/completion records.
"""

from __future__ import annotations

import json
from functools import lru_cache
from itertools import chain

import numpy as np
import pyarrow as pa

from memfit.data.dataset import BYTE_SPECIALS, byte_tokenizer

IGNORE_INDEX = -100


@lru_cache(maxsize=1)
def _byte_reference() -> tuple[str, tuple]:
    """The parts of the byte tokenizer's ``tokenizer.json`` that decide its ids: normalizer, pre-tokenizer,
    model (vocabulary, no merges), and the added tokens (id, text)."""

    return _identity(byte_tokenizer())


def _identity(tokenizer) -> tuple[str, tuple]:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    core = json.dumps([state.get("normalizer"), state.get("pre_tokenizer"), state.get("model")], sort_keys=True)
    added = tuple(sorted((t["id"], t["content"]) for t in state.get("added_tokens", [])))
    return core, added


def byte_offset(tokenizer) -> int | None:
    """The id of byte 0 (3) when ``tokenizer`` is memfit's byte tokenizer (``memfit.data.dataset.byte_tokenizer``,
    also as saved with a model and reloaded), else None: then no byte fast path."""

    if getattr(tokenizer, "backend_tokenizer", None) is None or tokenizer.eos_token_id is None:
        return None
    try:
        same = _identity(tokenizer) == _byte_reference()
    except Exception:  # noqa: BLE001 - a backend that cannot describe itself is not the byte tokenizer
        return None
    return len(BYTE_SPECIALS) if same else None


def _specials(tokenizer) -> tuple[bytes, ...]:
    """The texts the tokenizer reads as one added token wherever they occur in the input."""
    return tuple(content.encode("utf-8") for content in tokenizer.get_added_vocab())


def plain_texts(batch, fmt: str | None, fields) -> list | None:
    """The ``fields.text`` column of ``batch`` when every record of it is read as plain text (forced with
    ``fmt="text"``, or detected: ``memfit.data.formats.detect_format`` finds no other format's column
    holding a value), else None."""
    if fmt is not None:
        return batch.get(fields.text) if fmt == "text" else None
    others = (fields.messages, "conversations", "instruction", "output", fields.prompt, fields.completion)
    if any(key in batch and any(v is not None for v in batch[key]) for key in others):
        return None
    return batch.get(fields.text)


def encode_byte_texts(texts: list, tokenizer, offset: int, id_type: str):
    """The encoded table of ``texts`` (columns as ``memfit.data.arrow._encoded_features``) for the byte
    tokenizer, or None when the batch must take the reference path (see the module docstring).

    Document ``i`` of ``n`` bytes becomes ``[bos] + [offset + b for b in bytes] + [eos]`` (bos only when
    the tokenizer has one distinct from eos), labels the same with bos -100: ``memfit.data.dataset.encode_docs``.
    """

    if not texts or not all(isinstance(t, str) and t for t in texts):
        return None
    raw = [t.encode("utf-8") for t in texts]
    data = b"".join(raw)
    # a special token's text anywhere (even across two joined documents: then merely the slower path)
    if any(special in data for special in _specials(tokenizer)):
        return None
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    head = 1 if bos is not None and bos != eos else 0
    lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw)) + head + 1  # tokens a document
    offsets = np.zeros(len(raw) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    starts, ends = offsets[:-1], offsets[1:] - 1  # the bos (when head) and eos positions
    dtype = np.dtype(id_type)
    ids = np.empty(int(offsets[-1]), dtype=dtype)
    body = np.ones(len(ids), dtype=bool)
    body[ends] = False
    if head:
        body[starts] = False
    ids[body] = np.frombuffer(data, dtype=np.uint8).astype(dtype) + offset
    ids[ends] = eos
    labels = ids.copy()
    if head:
        ids[starts] = bos
        labels[starts] = IGNORE_INDEX
    return _table(offsets, ids, labels, np.zeros(len(raw), dtype=bool), lengths)


def docs_table(docs: list[tuple], id_type: str):
    """``memfit.data.dataset.encode_docs``'s documents (``(ids, labels)`` or ``(ids, labels, True)``) as the
    encoded table; the cast to ``id_type`` is checked (a value out of its range raises)."""

    lengths = np.fromiter((len(d[0]) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = np.fromiter(chain.from_iterable(d[0] for d in docs), dtype=np.int64, count=total)
    labels = np.fromiter(chain.from_iterable(d[1] for d in docs), dtype=np.int64, count=total)
    conversation = np.fromiter((len(d) > 2 for d in docs), dtype=bool, count=len(docs))
    return _table(offsets, ids, labels, conversation, lengths, cast_to=id_type)


def _table(offsets, ids, labels, conversation, lengths, cast_to: str | None = None):
    def column(values):
        flat = pa.array(values)
        if cast_to is not None:
            flat = flat.cast(getattr(pa, cast_to)())  # safe cast: an overflow raises, never wraps
        # int32 offsets (Arrow's list type): a batch of 1,000 documents stays far below 2**31 tokens
        return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), flat)

    return pa.table({"input_ids": column(ids), "labels": column(labels), "conversation": pa.array(conversation),
                     "length": pa.array(lengths, type=pa.int64())})
