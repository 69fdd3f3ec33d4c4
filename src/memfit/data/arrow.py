"""Tokenize and pack the data of a run on disk: ``datasets.map`` with its cache and ``--num-proc``.

Every source of ``memfit train`` comes here (``memfit.data.sources.load_parts``: .txt, .jsonl, .json,
.csv, .parquet, .arrow, ``save_to_disk`` folders, Hub ids), so a corpus larger than RAM trains: each
step below is an Arrow table on disk, memory-mapped, read a batch or a row at a time, never whole.

1. ``map``: every record -> ``input_ids``/``labels`` (``memfit.data.dataset``'s encoding, chat templates
   included), cached by ``datasets`` under the source's cache folder
   with a fingerprint of the function, the tokenizer and the options; a second run on the same data
   and tokenizer reuses it (and ``--num-proc N`` runs it in N processes). Token ids are stored as
   int16 when the vocabulary allows (int32 otherwise): 2 bytes a token, not Arrow's default 8.
2. the held-out split by document (``memfit.data.dataset.split_indices``) and the conversations longer than
   ``seq_len`` (dropped), as two boolean masks over the documents (1 byte a document).
3. packing in one streaming pass per split (``memfit.data.packing.pack_documents`` or the concat/none
   rules) written by ``datasets``' ``ArrowWriter`` into its cache, keyed by step 1's fingerprint, the
   mask and the packing settings.

The full passes (packing, the unigram baseline) read the Arrow files with plain reads
(``stream_batches``), not through ``datasets``' memory map: every page a process reads through a map
stays in its resident set (as file-backed pages) until the kernel needs the memory back, so a pass
over a 10 GB table would show a 10 GB RSS; read batch by batch, the process holds one batch.

``ArrowRows`` gives the result the list interface the loop uses (``len``, ``rows[i]``, lazy slices),
so the loop's ``StepBatchSampler`` indexes rows lazily and exact resume lands on the same sample; the
unigram baseline reads its labels in batches (``ArrowRows.target_batches``).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Features, List, Value
from datasets.arrow_writer import ArrowWriter
from datasets.fingerprint import Hasher
from datasets.table import ConcatenationTable, MemoryMappedTable

import memfit.data.packing
from memfit.data import fast as data_fast
from memfit.data.dataset import TokenizedData, count_targets, encode_docs, record_to_example, split_indices
from memfit.data.packing import one_array, pack_arrow_documents, pack_concat, pack_documents, pack_truncated
from memfit.errors import UserError
from memfit.settings.config import parse_packing

BATCH_ROWS = 1000
"""Rows per batch when a table is read through (``datasets``' default writer batch)."""


class ArrowRows(Sequence):
    """A ``datasets.Dataset`` of rows seen as a list of row dicts; a slice is another ``ArrowRows``
    (a view: nothing is read until a row is)."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ArrowRows(self.ds.select(range(*index.indices(len(self.ds)))))
        return self.ds[int(index)]

    def __iter__(self) -> Iterator[dict]:
        for batch in self.ds.iter(batch_size=BATCH_ROWS):
            columns = list(batch)
            yield from ({c: batch[c][i] for c in columns} for i in range(len(batch[columns[0]])))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def target_counts(self):
        """``memfit.data.dataset.target_counts`` of these rows, kept next to their Arrow file (``<file>.targets.npy``)
        so that a second run on the same cached table does not read it through again."""
        files = _plain_files(self.ds)
        cached = Path(files[0] + ".targets.npy") if files else None
        if cached is not None and cached.is_file():
            counts = _load_counts(cached)
            if counts is not None:
                return counts
        counts = count_targets(self.target_batches())  # none cached, or a damaged file: counted again
        if cached is not None:
            try:
                np.save(cached, counts)
            except OSError:
                pass  # a read-only cache: count again next time
        return counts

    def target_batches(self):
        """The targets of each batch of rows (labels after the causal shift that are not -100) as a flat
        int64 numpy array, read through Arrow (no Python object per token)."""
        if not len(self.ds):
            return
        for batch in stream_batches(self.ds, ["labels"]):
            flat = pc.list_flatten(pc.list_slice(batch.column(0), 1)).to_numpy(zero_copy_only=False)
            flat = flat.astype("int64")
            yield flat[flat != -100]



def _load_counts(path: Path):
    """The counts saved at ``path``, or None when the file is damaged (truncated, another dtype, a pickle,
    negative counts): the cache is memfit's, so it is rebuilt, never reported as the user's problem."""
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if counts.ndim != 1 or counts.dtype != np.int64 or (counts.size and int(counts.min()) < 0):
        return None
    return counts


def cache_damage(err: BaseException) -> bool:
    """Whether ``err`` (raised while ``datasets`` opened or wrote its cache) says a cached Arrow file is
    damaged: pyarrow's invalid-file errors and short reads (a truncated or overwritten cache file)."""
    while err is not None:
        if isinstance(err, (pa.ArrowInvalid, pa.ArrowIOError, EOFError)):
            return True
        err = err.__cause__ or err.__context__
    return False


ENCODER_MODULES = ("memfit.data.dataset", "memfit.data.formats", "memfit.data.sources", "memfit.data.arrow",
                   "memfit.data.fast")
"""The modules whose code decides what the cached ``map`` steps write (their source is in the key)."""


def code_fingerprint(*keys) -> str:
    """A ``datasets`` fingerprint over ``keys`` and memfit's data code (``datasets`` hashes a module-level
    function by reference, so without the code an upgraded memfit would reuse a cache its old code wrote)."""
    code = "".join(Path(importlib.import_module(name).__file__).read_text() for name in ENCODER_MODULES)
    return Hasher.hash((keys, code))

def _plain_files(ds) -> list[str] | None:
    """The Arrow files ``ds`` is exactly (all their rows, in order, no selection), or None."""
    if ds._indices is not None:
        return None
    table = ds._data
    if isinstance(table, ConcatenationTable):
        if any(len(row) != 1 for row in table.blocks):  # blocks side by side: columns from several files
            return None
        tables = [row[0] for row in table.blocks]
    else:
        tables = [table]
    # replays are the operations datasets re-applies to the mapped file; only a schema-metadata one
    # leaves the file's rows as they are
    if not all(isinstance(t, MemoryMappedTable) and all(op == "replace_schema_metadata" for op, *_ in t.replays)
               for t in tables):
        return None
    return [t.path for t in tables]


def stream_batches(ds, columns: list[str]):
    """Record batches of ``columns`` of ``ds``, in row order, read from its Arrow files with plain reads
    (``pyarrow.OSFile``): one batch in memory at a time and no file page left mapped in the process (see
    the module docstring). A dataset that is not exactly its files (in memory, a selection of rows) is
    read with ``Dataset.iter`` instead."""
    files = _plain_files(ds)
    if files is None:
        yield from ds.with_format("arrow").select_columns(columns).iter(batch_size=BATCH_ROWS)
        return
    for path in files:
        with pa.OSFile(path) as source:
            for batch in pa.ipc.open_stream(source):
                yield batch.select(columns)


def token_type(max_value: int) -> str:
    """The smallest Arrow integer type for values in ``[-100, max_value]``: token ids, labels, positions."""
    return "int16" if max_value < 2**15 else "int32"


def _encode_batch(batch: dict, indices: list[int], *, tokenizer, fmt, fields, train_on_prompt, where,
                  byte_offset: int | None = None):
    """One batch of records -> the encoded table (``memfit.data.fast``: the byte tokenizer's numpy path for
    plain text when ``byte_offset`` is set, else memfit's reference encoding turned into Arrow columns)."""
    id_type = token_type(len(tokenizer))
    if byte_offset is not None:
        texts = data_fast.plain_texts(batch, fmt, fields)
        if texts is not None:
            table = data_fast.encode_byte_texts(texts, tokenizer, byte_offset, id_type)
            if table is not None:
                return table
    columns = list(batch)
    rows = [{c: batch[c][i] for c in columns} for i in range(len(indices))]
    examples = [record_to_example(row, f"{where} row {idx + 1}", fmt, fields)
                for row, idx in zip(rows, indices, strict=True)]
    return data_fast.docs_table(encode_docs(examples, tokenizer, train_on_prompt), id_type)


def _encoding_fingerprint(ds, tokenizer, fmt, fields, train_on_prompt) -> str:
    """The cache key of step 1: the source, the tokenizer (vocabulary and chat template), the options,
    and memfit's encoding code (``code_fingerprint``)."""

    return code_fingerprint(ds._fingerprint, Hasher.hash(tokenizer), getattr(tokenizer, "chat_template", None),
                             fmt, fields, train_on_prompt)


def _encoded_features(tokenizer):
    ids = token_type(len(tokenizer))
    return Features({"input_ids": List(Value(ids)), "labels": List(Value(ids)), "conversation": Value("bool"),
                     "length": Value("int64")})


def encode_dataset(ds, tokenizer, *, fmt, fields, train_on_prompt: bool, num_proc: int, where: str):
    """Step 1: the records of ``ds`` encoded, one row per document (cached; see the module docstring)."""
    encode = partial(_encode_batch, tokenizer=tokenizer, fmt=fmt, fields=fields,
                     train_on_prompt=train_on_prompt, where=where, byte_offset=data_fast.byte_offset(tokenizer))
    fingerprint = _encoding_fingerprint(ds, tokenizer, fmt, fields, train_on_prompt)

    def run(from_cache: bool):
        return ds.map(encode, batched=True, with_indices=True, remove_columns=ds.column_names,
                      batch_size=BATCH_ROWS, writer_batch_size=BATCH_ROWS, load_from_cache_file=from_cache,
                      num_proc=num_proc if num_proc > 1 else None, desc="tokenizing",
                      features=_encoded_features(tokenizer), new_fingerprint=fingerprint)

    try:
        try:
            return run(True)
        except Exception as err:
            if isinstance(err, UserError) or not cache_damage(err):
                raise
            return run(False)  # a damaged cached encoding (truncated .arrow): encode again, over it
    except UserError:
        raise
    except Exception as err:  # a UserError raised in a worker process comes back wrapped
        cause = err
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise UserError(str(cause)) from None
        raise


def tokenize_dataset(ds, tokenizer, *, seq_len: int, packing, eval_fraction: float, seed: int, fmt, fields,
                     train_on_prompt: bool, num_proc: int, where: str, truncate: bool = False):
    """``TokenizedData`` whose ``train``/``eval`` are ``ArrowRows`` (see the module docstring).

    ``ds`` is a ``datasets.Dataset`` or a list of parts of one source, in corpus order, each
    ``(dataset, where, fmt, fields)``; their documents are split and packed as one corpus.
    """
    parts = ds if isinstance(ds, list) else [(ds, where, fmt, fields)]
    encoded = encode_parts(parts, tokenizer, train_on_prompt=train_on_prompt, num_proc=num_proc)
    return pack_encoded(encoded, seq_len=seq_len, packing=packing, eval_fraction=eval_fraction, seed=seed,
                        truncate=truncate)


def encode_parts(parts, tokenizer, *, train_on_prompt: bool, num_proc: int):
    """Step 1 over the parts of one source (``(dataset, where, fmt, fields)`` each): one encoded table,
    one row per document in corpus order, with its ``length`` in tokens (cached by ``datasets``)."""
    encoded = [encode_dataset(part, tokenizer, fmt=part_fmt, fields=part_fields, train_on_prompt=train_on_prompt,
                              num_proc=num_proc, where=name) for part, name, part_fmt, part_fields in parts]
    return encoded[0] if len(encoded) == 1 else datasets.concatenate_datasets(encoded)


def pack_encoded(encoded, *, seq_len: int, packing, eval_fraction: float, seed: int, truncate: bool = False):
    """Steps 2-3 on an encoded table (one row per document): split, then pack (or truncate) into training rows.

    **Split first.** Held-out documents are chosen (``memfit.data.dataset.split_indices``) before anything is
    packed, so no text of a held-out document appears in a training sequence.

    **Conversations** longer than ``seq_len`` are dropped (a cut conversation would train on a reply whose
    question is gone, or lose the reply's end-of-turn); with ``truncate``, those whose first ``seq_len``
    tokens hold a target are kept cut to them (the start of the conversation: its first turns stay whole,
    the question before each kept reply too).

    **Packing documents** (``packing="documents"``, the default of ``memfit train``): whole documents
    per row with position ids restarting at 0 each, so no document attends to another; see
    ``memfit.data.packing`` for the rule and a worked example.

    **Concatenation** (``packing="concat"``) and **no packing** (``packing="none"``): ``memfit.data.packing.pack_concat``
    and ``memfit.data.packing.pack_truncated`` (the rules, and a worked example of concat).
    """
    if seq_len < 2:
        raise UserError(f"The sequence length must be at least 2 tokens; got {seq_len}.")
    mode = parse_packing(packing)
    n_docs = len(encoded)
    _, eval_idx = split_indices(n_docs, eval_fraction, seed)
    held = np.zeros(n_docs, dtype=bool)
    held[eval_idx] = True
    # two small columns (9 bytes a document), read through the memory map: it touches only their pages
    columns = encoded.select_columns(["conversation", "length"]).with_format("arrow")[:]
    conversation = columns.column("conversation").to_numpy().astype(bool)
    too_long = conversation & (columns.column("length").to_numpy() > seq_len)
    cut = too_long & _target_within(encoded, too_long, seq_len) if truncate else np.zeros(n_docs, dtype=bool)
    dropped = too_long & ~cut
    train = _pack_split(encoded, ~held & ~dropped, seq_len, mode, "train", cut)
    kept_eval = _pack_split(encoded, held & ~dropped, seq_len, mode, "eval", cut)
    return TokenizedData(train=ArrowRows(train), eval=ArrowRows(kept_eval), conversations=int(conversation.sum()),
                         dropped_long=int(dropped.sum()), truncated_long=int(cut.sum()))


def _target_within(encoded, mask, seq_len: int):
    """Per document, whether its first ``seq_len`` tokens hold a target (a label after the causal shift
    that is not -100); read for the documents of ``mask`` only (False for the others)."""
    out = np.zeros(len(mask), dtype=bool)
    if not mask.any():
        return out
    where = np.flatnonzero(mask)
    found = []
    for batch in _kept_batches(encoded, mask, columns=["labels"]):
        head = pc.list_slice(batch.column(0), 1, seq_len)  # labels[1:seq_len]: the targets of the cut
        rows = pc.list_parent_indices(head).to_numpy(zero_copy_only=False)
        has = np.zeros(batch.num_rows, dtype=bool)
        has[rows[pc.not_equal(pc.list_flatten(head), -100).to_numpy(zero_copy_only=False)]] = True
        found.append(has)
    out[where] = np.concatenate(found)
    return out


def _packed_features(encoded, mode: str, seq_len: int):
    ids = encoded.features["input_ids"].feature.dtype
    columns = {"input_ids": List(Value(ids)), "labels": List(Value(ids))}
    if mode == "documents":
        columns["position_ids"] = List(Value(token_type(seq_len)))
    return Features(columns)


def _pack_split(encoded, keep, seq_len: int, mode, name: str, cut=None):
    """The documents of ``keep`` (a boolean mask), packed, as an Arrow file in the ``datasets`` cache
    (``memfit-packed/<key>.arrow``, written by ``datasets``' ``ArrowWriter`` and read back memory-mapped);
    the key covers step 1's fingerprint, the masks, the packing settings and the packer's source, so a
    second run reuses it. The documents of ``cut`` (a boolean mask, or None) are cut to ``seq_len`` first."""
    if not keep.any():
        return datasets.Dataset.from_dict({"input_ids": [], "labels": []})

    packer = Path(memfit.data.packing.__file__).read_bytes()  # a changed packer never reuses an old packed file
    cuts = cut.tobytes() if cut is not None and cut.any() else b""  # no cut: the key of a run without --truncate
    digest = hashlib.sha256(f"{encoded._fingerprint}|{name}|{seq_len}|{mode}|".encode() + packer
                            + keep.tobytes() + cuts).hexdigest()[:24]
    path = Path(datasets.config.HF_DATASETS_CACHE) / "memfit-packed" / f"{digest}.arrow"
    if path.is_file():
        try:
            return datasets.Dataset.from_file(str(path))
        except Exception as err:
            if not cache_damage(err):
                raise
            path.unlink()  # a damaged packed file (truncated, overwritten): packed again below
            Path(f"{path}.targets.npy").unlink(missing_ok=True)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial_path = path.with_name(f"{path.name}.{os.getpid()}.partial")
        writer = ArrowWriter(features=_packed_features(encoded, str(mode), seq_len), path=str(partial_path))
        try:
            for batch in _packed_batches(encoded, keep, seq_len, str(mode), cut):
                writer.write_table(batch)
            writer.finalize()
        finally:
            writer.close()
        os.replace(partial_path, path)  # whole or absent: a killed run leaves only a .partial file
    return datasets.Dataset.from_file(str(path))


def _packed_batches(encoded, keep, seq_len: int, mode: str, cut=None):
    """Tables of packed rows: ``documents`` with numpy (``memfit.data.packing.pack_arrow_documents``), the
    others row by row in Python."""
    cut = (cut, seq_len) if cut is not None and cut.any() else None
    if mode == "documents":
        for batch in pack_arrow_documents(_kept_batches(encoded, keep, cut=cut), seq_len, rows_per_batch=BATCH_ROWS):
            yield pa.Table.from_batches([batch])
        return
    features = _packed_features(encoded, mode, seq_len)
    rows = []
    for row in _rows(_kept_docs(encoded, keep, cut), seq_len, mode):
        rows.append(row)
        if len(rows) >= BATCH_ROWS:
            yield pa.Table.from_pylist(rows, schema=features.arrow_schema)
            rows = []
    if rows:
        yield pa.Table.from_pylist(rows, schema=features.arrow_schema)


def _kept_batches(encoded, keep, *, columns=("input_ids", "labels"), cut=None):
    """Record batches (``columns``) of the documents ``keep`` marks, in corpus order; ``cut``: a
    ``(mask, seq_len)`` whose documents are cut to their first ``seq_len`` tokens."""
    start = 0
    for batch in stream_batches(encoded, list(columns)):
        mask = keep[start : start + batch.num_rows]
        cut_here = cut[0][start : start + batch.num_rows][mask] if cut is not None else None
        start += batch.num_rows
        if mask.any():
            kept = batch.filter(pa.array(mask))
            yield kept if cut_here is None or not cut_here.any() else _cut_rows(kept, cut_here, cut[1])


def _cut_rows(batch, rows, seq_len: int):
    """``batch`` with the lists of the ``rows`` it marks (every column) cut to their first ``seq_len`` items."""
    columns = []
    for column in batch.columns:
        column = one_array(column)
        offsets = column.offsets.to_numpy()
        lengths = np.diff(offsets)
        new_lengths = np.where(rows, np.minimum(lengths, seq_len), lengths)
        within = np.arange(offsets[-1] - offsets[0]) - np.repeat(offsets[:-1] - offsets[0], lengths)
        values = column.flatten().filter(pa.array(within < np.repeat(new_lengths, lengths)))
        new_offsets = pa.array(np.concatenate([[0], np.cumsum(new_lengths)]).astype(np.int32))
        columns.append(pa.ListArray.from_arrays(new_offsets, values))
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _kept_docs(encoded, keep, cut=None):
    """``(input_ids, labels)`` of the documents ``keep`` marks, in corpus order, as Python lists."""
    for batch in _kept_batches(encoded, keep, cut=cut):
        yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)


def _rows(docs, seq_len: int, mode: str):
    pack = {"documents": pack_documents, "none": pack_truncated, "concat": pack_concat}[mode]
    yield from pack(docs, seq_len)
