"""The sequences ``memfit train`` makes of records held in a test: the one data path users run.

Every ``--data`` source reaches training through ``memfit.data.arrow.tokenize_dataset`` (``memfit.data.prep``:
``datasets`` tables, encoded by a cached ``map``, split, then packed on disk). ``tokenize`` puts a test's
records in one in-memory ``datasets`` table (a table that mixes formats, as a json/parquet file may, holds
null where a row has no such column: ``memfit.data.formats.detect_format`` skips those) and runs that path,
with the ``datasets`` cache in a folder of its own, removed once the rows are read into lists.
"""

from __future__ import annotations

import shutil
import tempfile
from unittest import mock

import datasets

from memfit.data.arrow import tokenize_dataset
from memfit.data.dataset import Example, TokenizedData
from memfit.data.formats import Fields


def record_of(example: Example | dict) -> dict:
    """``example`` as the record a data file would hold (a dict passes as it is)."""
    if isinstance(example, dict):
        return example
    if example.is_conversation:
        return {"messages": [{"role": role, "content": content} for role, content, *_ in example.messages]}
    if example.is_prompt_completion:
        return {"prompt": example.prompt, "completion": example.completion}
    return {"text": example.text}


def tokenize(examples, tokenizer, *, seq_len: int, packing, eval_fraction: float, seed: int,
             train_on_prompt: bool = False, truncate: bool = False) -> TokenizedData:
    """``TokenizedData`` of ``examples`` (``Example`` objects or records) with ``train``/``eval`` as lists of
    row dicts, made by ``memfit.data.arrow.tokenize_dataset``."""
    records = [record_of(ex) for ex in examples]
    columns = list(dict.fromkeys(key for record in records for key in record))  # from_list reads the first row's
    table = datasets.Dataset.from_list([{key: record.get(key) for key in columns} for record in records])
    cache = tempfile.mkdtemp(prefix="memfit-test-datasets-")
    try:
        with mock.patch.object(datasets.config, "HF_DATASETS_CACHE", cache):
            data = tokenize_dataset(table, tokenizer, seq_len=seq_len, packing=packing, eval_fraction=eval_fraction,
                                    seed=seed, fmt=None, fields=Fields(), train_on_prompt=train_on_prompt,
                                    num_proc=1, where="records", truncate=truncate)
            return TokenizedData(train=list(data.train), eval=list(data.eval), conversations=data.conversations,
                                 dropped_long=data.dropped_long, truncated_long=data.truncated_long)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
