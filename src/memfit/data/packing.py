"""Packing documents into training rows without cross-document attention (``--packing documents``), and the
rows of ``--packing concat`` and ``none`` (``pack_concat``, ``pack_truncated``).

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

import numpy as np
import pyarrow as pa

from memfit.settings.config import Packing

__all__ = ["FirstFit", "Packing", "pack_arrow_documents", "pack_concat", "pack_documents", "pack_truncated",
           "padding_share"]

IGNORE_INDEX = -100

OPEN_ROWS = 16
"""Rows kept open for first-fit; a document that fits none of them closes the fullest one. 16 keeps
padding low on mixed lengths (see ``padding_share``) while packing in one streaming pass."""


class FirstFit:
    """The open rows of first-fit packing over pieces of known length: the one rule both packers follow
    (``pack_documents`` on lists, ``pack_arrow_documents`` on Arrow batches).

    ``add`` puts a piece into the first open row it fits; when it fits none and ``OPEN_ROWS`` rows are
    open, the fullest (the first of equals) closes and is returned; ``rest`` gives the rows still open,
    in the order they were opened.
    """

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.used: list[int] = []  # tokens in each open row
        self.pieces: list[list] = []  # the pieces of each open row

    def add(self, piece, length: int) -> list | None:
        room = self.seq_len - length
        for i, used in enumerate(self.used):
            if used <= room:
                self.used[i] = used + length
                self.pieces[i].append(piece)
                return None
        closed = None
        if len(self.used) >= OPEN_ROWS:
            fullest = self.used.index(max(self.used))  # the first of equals
            del self.used[fullest]
            closed = self.pieces.pop(fullest)
        self.used.append(length)
        self.pieces.append([piece])
        return closed

    def rest(self) -> list[list]:
        return list(self.pieces)


def pack_documents(docs: Iterable[tuple[list[int], list[int]]], seq_len: int) -> Iterator[dict[str, list[int]]]:
    """Rows of whole documents with per-document ``position_ids`` (see the module docstring).

    Args:
        docs: ``(input_ids, labels)`` per document, in corpus order.
        seq_len: the most tokens a row holds.

    Yields:
        ``{"input_ids", "labels", "position_ids"}`` rows of at most ``seq_len`` tokens, each with at
        least one target; in a deterministic order (rows are emitted as they close).
    """
    rows = FirstFit(seq_len)
    for ids, labels in docs:
        for start in range(0, len(ids), seq_len):
            piece_ids, piece_labels = ids[start : start + seq_len], labels[start : start + seq_len]
            if not any(t != IGNORE_INDEX for t in piece_labels[1:]):
                continue  # nothing to learn from it (a lone token, or prompt only)
            closed = rows.add((piece_ids, piece_labels), len(piece_ids))
            if closed is not None:
                yield _row(closed)
    for pieces in rows.rest():
        yield _row(pieces)


def pack_concat(docs: Iterable[tuple[list[int], list[int]]], seq_len: int) -> Iterator[dict[str, list[int]]]:
    """Rows of ``--packing concat``, streamed over ``(input_ids, labels)`` documents in corpus order.

    The documents are concatenated into one stream cut into chunks of exactly ``seq_len`` tokens; the final
    tail, shorter than ``seq_len``, is kept as a last, shorter row (padded by ``collate``) so that no text is
    dropped; only a chunk with no target at all (a one-token tail, or nothing but prompt) is left out, as it
    adds no loss. Labels travel with their tokens, so prompt masks survive packing. Attention is not blocked
    at document boundaries: a document may attend to the end of the one before it, the usual packing
    trade-off; the eos in between tells the model a new document starts. Worked example, byte tokenizer
    (bos = 1, eos = 2, byte ``b`` = ``3+b``, so ``a`` = 100, ``b`` = 101, ``c`` = 102), ``seq_len = 4``,
    documents ``"ab"`` and prompt ``"c"`` with completion ``"a"``::

        stream    input_ids = [   1, 100, 101, 2,    1,  102, 100, 2]
                  labels    = [-100, 100, 101, 2, -100, -100, 100, 2]
        chunk 0   input_ids = [1, 100, 101, 2]     labels = [-100, 100, 101, 2]
        chunk 1   input_ids = [1, 102, 100, 2]     labels = [-100, -100, 100, 2]

    After the model's shift, chunk 0 trains on 3 targets (100, 101, 2: the label at position 0 is
    never a target) and chunk 1 on 2 (100, 2). The first token of each chunk is never predicted: one
    target per chunk is lost to the cut, which is why ``count_target_tokens`` applies the shift.
    """
    ids_buf: list[int] = []
    lab_buf: list[int] = []
    for ids, labels in docs:
        ids_buf += ids
        lab_buf += labels
        while len(ids_buf) >= seq_len:
            row = {"input_ids": ids_buf[:seq_len], "labels": lab_buf[:seq_len]}
            del ids_buf[:seq_len], lab_buf[:seq_len]
            if _n_targets(row["labels"]) > 0:
                yield row
    if ids_buf and _n_targets(lab_buf) > 0:
        yield {"input_ids": ids_buf, "labels": lab_buf}


def pack_truncated(docs: Iterable[tuple[list[int], list[int]]], seq_len: int) -> Iterator[dict[str, list[int]]]:
    """Rows of ``--packing none``: one row per document, cut to ``seq_len`` (its eos is lost when it is cut);
    lengths vary and ``collate`` pads. A row left with no target after the cut (a prompt longer than
    ``seq_len``) is dropped, since it cannot contribute loss."""
    for ids, labels in docs:
        row = {"input_ids": ids[:seq_len], "labels": labels[:seq_len]}
        if _n_targets(row["labels"]) > 0:
            yield row


def _n_targets(labels: list[int]) -> int:
    """Targets of a row: labels after the causal shift that are not -100."""
    return sum(1 for t in labels[1:] if t != IGNORE_INDEX)


def _row(pieces) -> dict[str, list[int]]:
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for piece_ids, piece_labels in pieces:
        row["input_ids"] += piece_ids
        row["labels"] += [IGNORE_INDEX] + piece_labels[1:]  # the first token is never a target
        row["position_ids"] += list(range(len(piece_ids)))
    return row


def pack_arrow_documents(batches, seq_len: int, *, rows_per_batch: int = 1000):
    """``pack_documents`` over Arrow record batches of documents (``input_ids``, ``labels`` list columns),
    yielding ``pyarrow.RecordBatch`` es of packed rows: the same rows in the same order, but the tokens
    move as numpy slices, never as Python ints (the Python work is per piece, not per token).
    """
    rows = FirstFit(seq_len)
    done: list = []
    id_type = None
    for batch in batches:
        ids_col, labels_col = (one_array(batch.column(i)) for i in (0, 1))
        id_type = ids_col.type.value_type
        offsets = ids_col.offsets.to_numpy()
        base = int(offsets[0])
        flat = (ids_col.flatten().to_numpy(zero_copy_only=False),
                labels_col.flatten().to_numpy(zero_copy_only=False))
        targets = np.concatenate([[0], np.cumsum(flat[1] != IGNORE_INDEX)])  # targets before each position
        bounds = (offsets - base).tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            for start in range(a, b, seq_len):
                stop = min(start + seq_len, b)
                if stop - start < 2 or targets[stop] == targets[start + 1]:
                    continue  # nothing to learn from it (a lone token, or prompt only)
                closed = rows.add((flat, start, stop), stop - start)
                if closed is not None:
                    done.append(closed)
        if len(done) >= rows_per_batch:
            yield _arrow_rows(done, id_type, seq_len)
            done = []
    done += rows.rest()
    if done:
        yield _arrow_rows(done, id_type, seq_len)


def one_array(column):
    """A pyarrow column as one array (a ChunkedArray's chunks combined; an Array as it is)."""
    return column.combine_chunks() if hasattr(column, "combine_chunks") else column


def _arrow_rows(rows: list, id_type, seq_len: int):
    """A record batch of packed rows (each a list of ``(flat arrays, start, stop)`` pieces)."""
    lengths = [b - a for pieces in rows for _, a, b in pieces]
    ids = np.concatenate([flat[0][a:b] for pieces in rows for flat, a, b in pieces])
    labels = np.concatenate([flat[1][a:b] for pieces in rows for flat, a, b in pieces])
    piece_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    labels[piece_starts] = IGNORE_INDEX  # the first token of a piece is never a target
    positions = np.arange(len(ids)) - np.repeat(piece_starts, lengths)
    row_ends = np.cumsum([sum(b - a for _, a, b in pieces) for pieces in rows])
    offsets = pa.array(np.concatenate([[0], row_ends]).astype(np.int32))
    pos_type = pa.int16() if seq_len < 2**15 else pa.int32()
    return pa.RecordBatch.from_arrays(
        [pa.ListArray.from_arrays(offsets, pa.array(ids, type=id_type)),
         pa.ListArray.from_arrays(offsets, pa.array(labels, type=id_type)),
         pa.ListArray.from_arrays(offsets, pa.array(positions.astype(pos_type.to_pandas_dtype()), type=pos_type))],
        names=["input_ids", "labels", "position_ids"])


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
