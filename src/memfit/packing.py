"""Packing documents into training rows without cross-document attention (``--packing documents``).

Each row holds whole documents, each with ``position_ids`` that restart at 0. The collator passes
``position_ids`` and *no* ``attention_mask``; transformers then finds the document boundaries itself
(``masking_utils.find_packed_sequence_indices``: a new document starts wherever a position id is not
the previous one + 1) and builds a block-causal mask, so every document attends only to itself
(SDPA and eager: a (B, 1, T, T) boolean mask; flash-attention 2: the varlen kernel with
``cu_seqlens`` derived from the same position ids). RoPE and learned position embeddings see each
document from position 0, as if it were alone. This is what ``DataCollatorWithFlattening`` does, but
row by row (B rows of ``seq_len``), not all sequences flattened into one row, so SDPA's mask stays
B x T x T instead of (B T)^2.

The first label of every document in a row is ``-100``: transformers' loss shifts labels along the
whole row, so without it the first token of a document would be "predicted" from the last token of
the one before it (``DataCollatorWithFlattening`` does the same with ``separator_id=-100``). With it,
the sum of the per-token losses of a packed row equals the sum over its documents run one by one
(``tests/test_packing.py`` checks this within 1e-5).

Worked example, byte tokenizer (bos 1, eos 2, ``a`` = 100, ``b`` = 101, ``c`` = 102), ``seq_len = 8``,
documents ``"ab"`` and ``"c"``::

    doc 0     input_ids = [   1, 100, 101, 2]   labels = [-100, 100, 101, 2]
    doc 1     input_ids = [   1, 102, 2]        labels = [-100, 102, 2]
    row       input_ids    = [   1, 100, 101, 2,    1, 102, 2]
              labels       = [-100, 100, 101, 2, -100, 102, 2]
              position_ids = [   0,   1,   2, 3,    0,   1, 2]

5 targets (100, 101, 2 and 102, 2), as the two documents alone would have. A document longer than
``seq_len`` is cut into pieces of ``seq_len`` tokens, each a document of its own (positions restart,
its first token is not a target). Rows are filled first-fit over a bounded window of open rows
(``OPEN_ROWS``), so packing streams: it never holds more than that many rows in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from memfit.config import Packing

__all__ = ["Packing", "pack_documents", "padding_share"]

IGNORE_INDEX = -100

OPEN_ROWS = 16
"""Rows kept open for first-fit; a document that fits none of them closes the fullest one. 16 keeps
padding low on mixed lengths (see ``padding_share``) while packing in one streaming pass."""


def pack_documents(docs: Iterable[tuple[list[int], list[int]]], seq_len: int) -> Iterator[dict[str, list[int]]]:
    """Rows of whole documents with per-document ``position_ids`` (see the module docstring).

    Args:
        docs: ``(input_ids, labels)`` per document, in corpus order.
        seq_len: the most tokens a row holds.

    Yields:
        ``{"input_ids", "labels", "position_ids"}`` rows of at most ``seq_len`` tokens, each with at
        least one target; in a deterministic order (rows are emitted as they close).
    """
    open_rows: list[dict[str, list[int]]] = []
    for ids, labels in docs:
        for start in range(0, len(ids), seq_len):
            piece_ids, piece_labels = ids[start : start + seq_len], labels[start : start + seq_len]
            if not any(t != IGNORE_INDEX for t in piece_labels[1:]):
                continue  # nothing to learn from it (a lone token, or prompt only)
            row = _first_fit(open_rows, len(piece_ids), seq_len)
            if row is None:
                if len(open_rows) >= OPEN_ROWS:
                    fullest = max(range(len(open_rows)), key=lambda i: len(open_rows[i]["input_ids"]))
                    yield open_rows.pop(fullest)
                row = {"input_ids": [], "labels": [], "position_ids": []}
                open_rows.append(row)
            row["input_ids"] += piece_ids
            row["labels"] += [IGNORE_INDEX] + piece_labels[1:]  # the first token is never a target
            row["position_ids"] += list(range(len(piece_ids)))
    yield from open_rows


def _first_fit(rows: list[dict[str, list[int]]], length: int, seq_len: int):
    for row in rows:
        if len(row["input_ids"]) + length <= seq_len:
            return row
    return None


def padding_share(rows: Iterable[dict[str, list[int]]], seq_len: int, micro_batch: int) -> float:
    """Share of the token slots of padded micro-batches that are padding, in [0, 1).

    Micro-batches are ``micro_batch`` consecutive rows padded to their longest row (what ``collate``
    does); the figure shown before training, since padding costs compute like any token.
    """
    lengths = [len(row["input_ids"]) for row in rows]
    if not lengths:
        return 0.0
    slots = 0
    for i in range(0, len(lengths), micro_batch):
        group = lengths[i : i + micro_batch]
        slots += max(group) * len(group)
    return 1.0 - sum(lengths) / slots
