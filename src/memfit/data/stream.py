"""Records of ``--data`` read one at a time, in corpus order, reading no more of the source than the
records up to the one asked for: what ``memfit data preview`` shows (record 0 of a 2 GB file is read
from its first megabyte, not from the whole file).

The files of a folder come in the order training reads them (``memfit.data.sources.load_parts``:
sorted by path), each read the way training reads it, but streamed:

* ``.txt``: ``datasets``' ``text`` builder with ``streaming=True``, by paragraph, each paragraph cut
  into memfit's documents (``memfit.data.dataset.txt_documents``): the documents training gets;
* ``.jsonl``: memfit's own line reader over the open file (``memfit.data.dataset.jsonl_records``), so that a
  record is named by its line, as before;
* ``.json``, ``.csv``, ``.arrow``: ``datasets``' builders with ``streaming=True``; ``.parquet``:
  ``pyarrow.parquet``'s reader, a few rows at a time (``datasets``' streaming scan reads ahead);
* a ``save_to_disk`` folder: memory-mapped, the row read directly;
* a Hub id: streamed (``streaming=True``).
"""

# Inside functions: datasets (1.4 s), pyarrow.parquet and memfit.data.dataset (4.8 s: torch; python -X importtime, 2026-12-06, this shared 2-core machine); `memfit
# data preview` checks its input before any of them loads (tests/test_faults_inputs.py).
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from memfit import textfiles
from memfit.data import sources as data_sources
from memfit.data.formats import Fields
from memfit.data.pairs import is_pair_record, record_to_pair
from memfit.data.sources import check_columns, load_dataset
from memfit.errors import UserError
from memfit.files import user_path


def record_at(path, index: int, *, fmt: str | None = None, fields=None, split: str = "train",
              data_config: str | None = None, named_fields: tuple[str, ...] = ()):
    """Record ``index`` (0-based, across the whole source) of ``--data`` as a ``memfit.data.dataset.Example``.

    Raises:
        UserError: a missing or unreadable source, a bad record up to ``index``, a named column the data
            lacks, an empty source, or ``index`` outside its records (the records are counted then).
    """
    from memfit.data.dataset import record_to_example

    fields = fields or Fields()
    if index < 0:
        raise UserError(f"--index {index} is outside the data's records (it counts from 0).")
    wanted = [getattr(fields, name) for name in named_fields]
    seen = 0
    for record, where, default_fmt in _records(path, split=split, data_config=data_config, wanted=wanted):
        if seen == index:
            if isinstance(record, str):  # a document of a .txt file
                from memfit.data.dataset import Example

                return Example(text=record, where=where)

            if fmt is None and is_pair_record(record):  # a preference pair (memfit.data.pairs)
                return record_to_pair(record, where)
            return record_to_example(record, where, fmt or default_fmt, fields)
        seen += 1
    if not seen:
        raise UserError(f"Data source {path if path is not None else 'the shipped corpus'} is empty.")
    raise UserError(f"--index {index} is outside the data's {seen:,} records.")


def _records(path, *, split: str, data_config: str | None, wanted: list[str]) -> Iterator[tuple]:
    """``(record, where, format)`` in corpus order; a record is a dict, or a ``.txt`` document's text."""
    from memfit.data.dataset import default_corpus_path

    root = default_corpus_path() if path is None else user_path(path)
    if data_sources.check_data_path(path) == "hub":
        yield from _hub_rows(str(path), split, data_config, wanted)
        return
    if root.is_dir() and data_sources.is_saved_dataset(root):
        yield from _saved_rows(root, split, wanted)
        return
    files = [root] if root.is_file() else data_sources.source_files(root)
    if not files:
        raise UserError(f"Data folder {root} holds no .txt, .jsonl, .json, .csv, .parquet or .arrow files.")
    for file in files:
        suffix = file.suffix.lower()
        if suffix == ".txt":
            yield from _txt_documents(file)
        elif suffix == ".jsonl":
            yield from _jsonl_records(file)
        else:
            yield from _table_rows(file, data_sources.ALL_BUILDERS[suffix], wanted)


def _not_utf8(file: Path):
    """Raise the sentence naming the line and byte offset of ``file``'s first byte that is not UTF-8."""

    textfiles.check_utf8_stream(file)
    raise UserError(f"{file} is not UTF-8 text.")


def _txt_documents(file: Path):
    import datasets

    textfiles.refuse_binary(file)  # the text builder would read a binary file's bytes as documents

    from memfit.data.dataset import txt_documents

    datasets.disable_progress_bars()
    n = 0
    try:
        stream = datasets.load_dataset("text", data_files=[str(file)], split="train", streaming=True,
                                       sample_by="paragraph", encoding="utf-8-sig", chunksize=data_sources.TEXT_CHUNK)
        for row in stream:
            for doc in txt_documents(row["text"]):
                n += 1
                yield doc, f"{file} document {n}", "text"
    except UnicodeDecodeError:
        _not_utf8(file)
    except OSError as err:
        raise UserError(f"{file} cannot be read ({err.strerror or err}).") from None


def _jsonl_records(file: Path):
    """The records of a ``.jsonl`` file line by line, each named by its line (bad JSON: ``UserError``)."""
    from memfit.data.dataset import json_lines

    try:
        with file.open(encoding="utf-8-sig", newline="\n") as lines:  # newline: lines end at "\n" only
            for record, where in json_lines(lines, file):
                yield record, where, None
    except UnicodeDecodeError:
        _not_utf8(file)
    except OSError as err:
        raise UserError(f"{file} cannot be read ({err.strerror or err}).") from None


def _table_rows(file: Path, builder: str, wanted: list[str]):
    import datasets

    datasets.disable_progress_bars()
    try:
        if builder == "parquet":
            rows = _parquet_rows(file)
        else:
            rows = iter(datasets.load_dataset(builder, data_files=[str(file)], split="train", streaming=True))
        yield from _named_rows(rows, str(file), wanted)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - pyarrow/json/csv raise many types; all mean "cannot read"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UserError(f"{file} cannot be read as {builder} ({first}).") from None


def _parquet_rows(file: Path, batch_rows: int = 64):
    """The rows of a parquet file through pyarrow's own reader, ``batch_rows`` at a time. Not ``datasets``'
    streaming parquet builder: its Arrow dataset scan reads past the batch it yields (a test spoils the
    row groups after the first: the scan fails on them, this reader does not)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(file) as reader:
        for group in range(reader.num_row_groups):  # a batch never reaches into the next row group
            for batch in reader.iter_batches(batch_size=batch_rows, row_groups=[group]):
                yield from batch.to_pylist()


def _named_rows(rows, where: str, wanted: list[str]):
    """``(row, "<where> row <n>", None)``; the first row shows the columns, checked against ``wanted``."""
    for n, row in enumerate(rows, start=1):
        if n == 1:
            missing = [c for c in wanted if c not in row]
            if missing:
                raise UserError(f"{where} has no column {missing[0]!r}; its columns are: {', '.join(row)}.")
        yield row, f"{where} row {n}", None


def _saved_rows(folder: Path, split: str, wanted: list[str]):
    """A ``save_to_disk`` dataset: memory-mapped, so a row is read without the rest."""

    ds = load_dataset(str(folder), split=split)
    check_columns(ds, str(folder), wanted)
    for n in range(len(ds)):
        yield ds[n], f"{folder} row {n + 1}", None


def _hub_rows(name: str, split: str, data_config: str | None, wanted: list[str]):
    import datasets

    if datasets.config.HF_HUB_OFFLINE:
        raise UserError(f"{name} is neither a local path nor reachable: the Hugging Face Hub is offline "
                        "(HF_HUB_OFFLINE is set).")
    try:
        rows = iter(datasets.load_dataset(name, data_config, split=split, streaming=True))
        yield from _named_rows(rows, name, wanted)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - network, missing repo, missing split: one sentence each
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UserError(f"The Hub dataset {name} cannot be loaded (offline, or no such dataset/split): {first}") \
            from None
