"""Tokenize and pack a ``datasets`` source on disk: ``datasets.map`` with its cache and ``--num-proc``.

Used for the sources ``memfit.data_sources`` reads (json/csv/parquet/arrow files, ``save_to_disk``
folders, Hub ids). The steps, each an Arrow table on disk (memory-mapped; rows are read when used):

1. ``map``: every record -> ``input_ids``/``labels`` (the same ``memfit.data`` encoding as the
   in-memory path, chat templates included), cached by ``datasets`` under the source's cache folder
   with a fingerprint of the function, the tokenizer and the options; a second run on the same data
   and tokenizer reuses it (and ``--num-proc N`` runs it in N processes).
2. the held-out split by document (``memfit.data.split_documents``): ``select`` of row indices.
3. packing in one streaming pass (``memfit.packing.pack_documents`` or the concat/none rules) written
   by ``Dataset.from_generator``, cached under a fingerprint of step 1's table, the split and the
   packing settings.

``ArrowRows`` gives the result the list interface the loop uses (``len``, ``rows[i]``, slices), so the
loop's ``StepBatchSampler`` indexes rows lazily and exact resume lands on the same sample.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from functools import partial

from memfit.errors import UserError


class ArrowRows(Sequence):
    """A ``datasets.Dataset`` of rows seen as a list of row dicts (slices materialise only the slice)."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.ds[i] for i in range(*index.indices(len(self.ds)))]
        return self.ds[index]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.ds)


def _encode_batch(batch: dict, indices: list[int], *, tokenizer, fmt, fields, train_on_prompt, where) -> dict:
    from memfit.data import _encode_docs, record_to_example

    columns = list(batch)
    rows = [{c: batch[c][i] for c in columns} for i in range(len(indices))]
    examples = [record_to_example(row, f"{where} row {idx + 1}", fmt, fields)
                for row, idx in zip(rows, indices, strict=True)]
    docs = _encode_docs(examples, tokenizer, train_on_prompt)
    return {"input_ids": [d[0] for d in docs], "labels": [d[1] for d in docs],
            "conversation": [len(d) > 2 for d in docs], "length": [len(d[0]) for d in docs]}


def _encoding_fingerprint(ds, tokenizer, fmt, fields, train_on_prompt) -> str:
    """The cache key of step 1: the source, the tokenizer (vocabulary and chat template), the options,
    and the source code of the encoding. ``datasets`` hashes a module-level function by reference, so
    without the code an upgraded memfit would reuse a cache its old encoding wrote."""
    from pathlib import Path

    from datasets.fingerprint import Hasher

    import memfit.data
    import memfit.data_formats

    code = "".join(Path(m.__file__).read_text() for m in (memfit.data, memfit.data_formats)) + Path(__file__).read_text()
    return Hasher.hash((ds._fingerprint, Hasher.hash(tokenizer), getattr(tokenizer, "chat_template", None), fmt,
                        fields, train_on_prompt, code))


def tokenize_dataset(ds, tokenizer, *, seq_len: int, packing, eval_fraction: float, seed: int, fmt, fields,
                     train_on_prompt: bool, num_proc: int, where: str):
    """``TokenizedData`` whose ``train``/``eval`` are ``ArrowRows`` (see the module docstring)."""
    from memfit.config import parse_packing
    from memfit.data import TokenizedData, split_documents

    encode = partial(_encode_batch, tokenizer=tokenizer, fmt=fmt, fields=fields,
                     train_on_prompt=train_on_prompt, where=where)
    fingerprint = _encoding_fingerprint(ds, tokenizer, fmt, fields, train_on_prompt)
    try:
        encoded = ds.map(encode, batched=True, with_indices=True, remove_columns=ds.column_names,
                         num_proc=num_proc if num_proc > 1 else None, desc="tokenizing",
                         new_fingerprint=fingerprint)
    except UserError:
        raise
    except Exception as err:  # a UserError raised in a worker process comes back wrapped
        cause = err
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise UserError(str(cause)) from None
        raise
    train_idx, eval_idx = split_documents(len(encoded), eval_fraction, seed)
    mode = parse_packing(packing)
    conversations = sum(encoded.select_columns(["conversation"])[:]["conversation"]) if len(encoded) else 0
    train, dropped_train = _pack_split(encoded, train_idx, seq_len, mode, "train", seed)
    held, dropped_eval = _pack_split(encoded, eval_idx, seq_len, mode, "eval", seed)
    return TokenizedData(train=ArrowRows(train), eval=ArrowRows(held), conversations=conversations,
                         dropped_long=dropped_train + dropped_eval)


def _pack_split(encoded, indices: list[int], seq_len: int, mode, name: str, seed: int):
    """The rows of one split, packed, as a cached Arrow table; and the conversations dropped as too long."""
    import datasets

    if not indices:
        return datasets.Dataset.from_dict({"input_ids": [], "labels": []}), 0
    part = encoded.select(indices)
    meta = part.select_columns(["length", "conversation"])[:]  # two small columns, read at once
    long = [i for i, (n, chat) in enumerate(zip(meta["length"], meta["conversation"], strict=True))
            if chat and n > seq_len]
    if long:
        drop = set(long)
        part = part.select([i for i in range(len(part)) if i not in drop])
    digest = hashlib.sha256(f"{encoded._fingerprint}|{name}|{seed}|{len(indices)}|{indices[:64]}|{indices[-64:]}|"
                            f"{seq_len}|{mode}".encode()).hexdigest()[:16]
    packed = datasets.Dataset.from_generator(_rows, gen_kwargs={"part": part, "seq_len": seq_len,
                                                               "mode": str(mode)}, fingerprint=digest)
    return packed, len(long)


def _rows(part, seq_len: int, mode: str):
    from memfit.data import _n_targets
    from memfit.packing import pack_documents

    # batches, not rows: datasets' per-row iteration costs a Python dict per row; 1,000 rows at a time
    # keep memory bounded and read ~10x faster
    docs = (doc for batch in part.select_columns(["input_ids", "labels"]).iter(batch_size=1000)
            for doc in zip(batch["input_ids"], batch["labels"], strict=True))
    if mode == "documents":
        yield from pack_documents(docs, seq_len)
    elif mode == "none":
        for ids, labels in docs:
            row = {"input_ids": ids[:seq_len], "labels": labels[:seq_len]}
            if _n_targets(row["labels"]) > 0:
                yield row
    else:  # concat: one stream cut every seq_len tokens, streamed
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
