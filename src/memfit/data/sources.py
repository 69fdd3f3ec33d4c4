"""Data sources read through Hugging Face ``datasets`` (never a hand-written reader for these formats).

``--data`` may be:

* a ``.txt``/``.jsonl``/``.json``/``.csv``/``.parquet``/``.arrow`` file, or a folder of such files;
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
* a Hub dataset id (``org/name``) when online, with ``--split`` and ``--data-config``.

Training reads every source here (``load_parts``), so the records live in memory-mapped Arrow files
under the ``datasets`` cache, never all in RAM: ``.txt`` through the ``text`` builder (paragraphs, cut
further into memfit's documents by a cached ``map``), ``.jsonl`` through the ``json`` builder. Each row
becomes a record for ``memfit.data.dataset.record_to_example`` (format detection, checks), named in messages
as ``<source> row <n>`` (1-based); for ``.txt``/``.jsonl``, an error is traced back to the file's line
or byte by ``memfit.data.dataset.find_bad_input``, as memfit's own reader (``memfit.data.dataset.load_local_examples``) names it.
"""

# Inside functions: datasets (1.4 s), memfit.data.arrow (3.2 s) and memfit.data.dataset (4.8 s: torch; python -X importtime, 2026-12-06, this shared 2-core machine);
# a mistyped --data is refused before any of them loads (tests/test_faults_inputs.py).
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from memfit import textfiles
from memfit.data.formats import Fields
from memfit.errors import UserError
from memfit.files import user_path
from memfit.integrations.hf_compat import quiet_json_parse_log

BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> the ``datasets`` packaged builder that reads it (``load_examples``)."""

LINE_BUILDERS = {".txt": "text", ".jsonl": "json"}
"""The suffixes ``memfit.data.dataset.load_local_examples`` reads itself, and the builder that reads them for training."""

ALL_BUILDERS = {**BUILDERS, **LINE_BUILDERS}

TEXT_CHUNK = 1 << 20
"""Bytes of a .txt file the ``text`` builder reads at a time (its default is 10 MB)."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def handles(path) -> bool:
    """Whether ``path`` is read here (rather than by ``memfit.data.dataset``'s .txt/.jsonl reader)."""
    p = user_path(path)
    if p.is_file():
        return p.suffix.lower() in BUILDERS
    if p.is_dir():
        return is_saved_dataset(p) or bool(_table_files(p))
    return bool(_HUB_ID.match(str(path)))


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` was written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def _table_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def load_dataset(path: str, *, split: str = "train", data_config: str | None = None):
    """The ``datasets.Dataset`` behind ``--data`` (memory-mapped Arrow: rows are read when used)."""
    import datasets

    datasets.disable_progress_bars()
    p = user_path(path)
    if p.is_dir() and is_saved_dataset(p):
        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as err:  # noqa: BLE001 - a deleted .arrow, a damaged state.json: pyarrow/OS/JSON errors
            raise UserError(f"{p} is a save_to_disk folder whose data cannot be read ({_first_line(err)}); its "
                            ".arrow files are missing or damaged: save the data set again.") from None
        return _pick_split(ds, split, str(p))
    if p.exists():
        files = [p] if p.is_file() else _table_files(p)
        suffixes = {f.suffix.lower() for f in files}
        if len(suffixes) != 1:
            raise UserError(f"Data folder {p} mixes file types ({', '.join(sorted(suffixes))}); keep one per folder.")
        builder = BUILDERS[suffixes.pop()]

        try:
            with quiet_json_parse_log():  # the parse error comes back as the exception worded below
                return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        except Exception as err:  # noqa: BLE001 - pyarrow/json/csv raise many types; all mean "cannot read"
            raise UserError(f"{p} cannot be read as {builder} ({_first_line(err)}).") from None
    if datasets.config.HF_HUB_OFFLINE:
        raise UserError(f"{path} is neither a local path nor reachable: the Hugging Face Hub is offline "
                        "(HF_HUB_OFFLINE is set).")
    try:
        return datasets.load_dataset(path, data_config, split=split)
    except Exception as err:  # noqa: BLE001 - network, missing repo, missing split: one sentence each
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UserError(f"The Hub dataset {path} cannot be loaded (offline, or no such dataset/split): {first}") \
            from None


def _pick_split(ds, split: str, where: str):
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{where} has no split {split!r}; it has: {', '.join(ds)}.")
        return ds[split]
    return ds


def check_columns(ds, where: str, wanted: list[str]) -> None:
    """Refuse a column the user named that the data set lacks, listing those it has."""
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise UserError(f"{where} has no column {missing[0]!r}; its columns are: {', '.join(ds.column_names)}.")


def load_examples(path=None, *, fmt: str | None = None, fields=None, split: str = "train",
                  data_config: str | None = None, named_fields: tuple[str, ...] = ()) -> list:
    """Every record of ``--data`` in memory, as ``memfit.data.dataset.Example`` records: ``.txt``/``.jsonl`` files,
    folders of them and the shipped corpus (``None``) by ``memfit.data.dataset.load_local_examples``; the sources
    ``datasets`` reads (``handles``) by ``load_dataset``. The library's reader; ``memfit train`` goes through
    ``load_parts`` and Arrow instead, so a corpus larger than memory trains."""
    from memfit.data.dataset import load_local_examples

    fields = fields or Fields()
    if path is None or not handles(path):
        return load_local_examples(path, fmt=fmt, fields=fields)
    return _dataset_examples(str(path), fmt=fmt, fields=fields, split=split, data_config=data_config,
                             named_fields=named_fields)


def _dataset_examples(path: str, *, fmt: str | None, fields, split: str, data_config: str | None,
                      named_fields: tuple[str, ...]) -> list:
    """The rows of a ``datasets`` source as ``memfit.data.dataset.Example`` records."""
    from memfit.data.dataset import record_to_example

    ds = load_dataset(path, split=split, data_config=data_config)
    check_columns(ds, path, [getattr(fields, name) for name in named_fields])
    if len(ds) == 0:
        raise UserError(f"Data source {path} is empty.")
    return [record_to_example(row, f"{path} row {i}", fmt, fields) for i, row in enumerate(ds, start=1)]


# ------------------------------------------------------------------------------ training: every source


@dataclass
class Part:
    """Records of one builder, in corpus order: a file, a run of files of one type, or a whole source."""

    ds: object
    """A ``datasets.Dataset`` (memory-mapped); a ``.txt`` part holds one ``text`` row per document."""
    where: str
    """The source as the user named it, for messages."""
    files: list[Path] = field(default_factory=list)
    """The ``.txt``/``.jsonl`` files of the part (searched for the bad line when a record fails)."""


def load_parts(path, *, split: str = "train", data_config: str | None = None, fmt: str | None = None,
               fields=None) -> list[Part]:
    """The records of ``--data`` (``None``: the shipped corpus) as datasets, in corpus order.

    A folder's files are read sorted by path (as ``memfit.data.dataset.load_local_examples`` reads them); consecutive
    files of one type form one part, read by one builder.

    Raises:
        UserError: a missing path, a folder with no data file, an unreadable file (naming the line or byte
            of a ``.txt``/``.jsonl`` file where it can), an empty source.
    """
    from memfit.data.dataset import default_corpus_path

    root = default_corpus_path() if path is None else user_path(path)
    where = str(root if path is None else path)
    if check_data_path(path) == "hub":
        return [Part(load_dataset(str(path), split=split, data_config=data_config), where)]
    if root.is_dir() and is_saved_dataset(root):
        return [Part(load_dataset(str(root), split=split), where)]
    files = [root] if root.is_file() else source_files(root)
    if not files:
        raise UserError(f"Data folder {root} holds no .txt, .jsonl, .json, .csv, .parquet or .arrow files.")
    parts, run = [], [files[0]]
    for file in files[1:] + [None]:
        if file is not None and file.suffix.lower() == run[0].suffix.lower():
            run.append(file)
            continue
        parts += _read_run(run, where, fmt, fields)
        run = [file]
    if not sum(len(part.ds) for part in parts):
        raise UserError(f"Data {'file' if root.is_file() else 'folder'} {root} is empty.")
    return parts


def check_data_path(path) -> str:
    """What ``--data`` names, ``"hub"`` (a Hub dataset id: ``org/name``, nothing local of that name), ``"local"``
    or ``"corpus"`` (``None``: the shipped one); else the sentence a missing path or a file of no data type
    gets. Only the file system is read: the CLI checks a typo here before torch and transformers load.

    Raises:
        UserError: a local-looking path that does not exist, a device or pipe, or a file whose suffix is no
            data type.
    """
    if path is None:
        return "corpus"
    if not str(path).strip():  # an unset shell variable: "" would read every data file under the current folder
        raise UserError("--data is empty; name a data file, a folder of them or a Hub dataset (org/name), or leave "
                        "it out for the shipped corpus.")
    root = user_path(path)
    if not root.exists():
        if not _is_local_looking(str(path)):
            return "hub"
        raise UserError(f"Data path {root} does not exist.")
    if not root.is_file() and not root.is_dir():  # /dev/zero, a FIFO: reading one would never end
        raise UserError(f"{root} is neither a file nor a folder (a device, pipe or socket); --data takes .txt, .jsonl, "
                        ".json, .csv, .parquet, .arrow or a folder of them.")
    if root.is_file() and root.suffix.lower() not in ALL_BUILDERS:
        raise UserError(f"{root} is a {root.suffix or 'suffix-less'} file; --data takes .txt, .jsonl, .json, .csv, "
                        ".parquet, .arrow or a folder of them.")
    return "local"


def _is_local_looking(path: str) -> bool:
    return not _HUB_ID.match(path) or Path(path).suffix.lower() in ALL_BUILDERS


def source_files(folder: Path) -> list[Path]:
    """The data files of a ``--data`` folder that ``datasets`` reads (any suffix of ``ALL_BUILDERS``), sorted by
    path, hidden files and folders left out."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in ALL_BUILDERS
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _read_run(files: list[Path], where: str, fmt, fields) -> list[Part]:
    """The parts of a run of files of one suffix: one part read by one builder call when the files share
    their columns, else one part per file.

    A builder reads its files into one table, so files whose records are of different formats (a
    ``messages`` file beside a ShareGPT one) cannot be read together; the format is detected per record
    (``memfit.data.formats.detect_format``), so each file is then read on its own, named by its path, and
    their encodings are concatenated like any parts (``memfit.data.arrow.tokenize_dataset``). A file that
    cannot be read even alone is named in the error.
    """
    _check_text_files(files, fmt)
    try:
        return [_read_fresh_on_damage(files, where)]
    except Exception as err:  # noqa: BLE001 - pyarrow/json/csv/unicode raise many types; all mean "cannot read"
        if len(files) == 1:
            _refuse(files[0], where, err, fmt, fields)
    parts = []
    for file in files:
        try:
            parts.append(_read_fresh_on_damage([file], str(file)))
        except Exception as err:  # noqa: BLE001 - as above
            _refuse(file, str(file), err, fmt, fields)
    return parts


def _read_fresh_on_damage(files: list[Path], where: str) -> Part:
    """``_read_files``, read again past the cache when ``datasets``' cached copy of the files is damaged
    (a truncated ``.arrow``): the cache is rebuilt, and the user's file is blamed only when it fails itself."""
    from memfit.data.arrow import cache_damage

    try:
        return _read_files(files, where)
    except Exception as err:
        if not cache_damage(err):
            raise
    return _read_files(files, where, fresh=True)


def _check_text_files(files: list[Path], fmt: str | None) -> None:
    """Refuse, before ``datasets`` reads them, ``.txt``/``.jsonl`` files that are binary data or not UTF-8
    (pyarrow's JSON reader takes any bytes into a text column and fails only when a row is read, and the
    ``text`` builder would train on a binary file's bytes), and a ``--data-format`` that a ``.txt`` file
    cannot hold: its documents are plain text, never conversations or prompt/completion pairs."""

    for file in files:
        if file.suffix.lower() not in LINE_BUILDERS:
            continue
        if file.suffix.lower() == ".txt" and fmt not in (None, "text"):
            raise UserError(f"--data-format {fmt} does not match {file}: a .txt file holds plain text documents; "
                            f"drop --data-format or give a .jsonl/.json/.parquet file of {fmt} records.")
        textfiles.refuse_binary(file)
        textfiles.check_utf8_stream(file)


def _read_files(files: list[Path], where: str, *, fresh: bool = False) -> Part:
    """One part: ``files`` (one suffix) read by one ``datasets`` builder call; raises what the builder raises.
    ``fresh``: rebuild ``datasets``' cached copy (and the documents ``map``) instead of reusing it."""
    import datasets

    from memfit.data import arrow as data_arrow

    datasets.disable_progress_bars()
    suffix = files[0].suffix.lower()
    names = [str(f) for f in files]
    mode = "force_redownload" if fresh else None  # local files: rebuild the cached Arrow copy from them
    if suffix == ".txt":  # paragraphs (cut at "\n\n"), then memfit's documents (blank lines, stripped)
        raw = datasets.load_dataset("text", data_files=names, split="train", sample_by="paragraph",
                                    encoding="utf-8-sig", chunksize=TEXT_CHUNK, download_mode=mode)
        ds = raw.map(_documents_of_paragraphs, batched=True, remove_columns=raw.column_names,
                     load_from_cache_file=not fresh,
                     batch_size=data_arrow.BATCH_ROWS, writer_batch_size=data_arrow.BATCH_ROWS,
                     new_fingerprint=data_arrow.code_fingerprint(raw._fingerprint, "documents"), desc="documents")
    else:
        with quiet_json_parse_log():  # a parse error comes back as the exception memfit words (_refuse)
            ds = datasets.load_dataset(ALL_BUILDERS[suffix], data_files=names, split="train", download_mode=mode)
    return Part(ds, where, files if suffix in LINE_BUILDERS else [])


def _refuse(file: Path, where: str, err: Exception, fmt, fields):
    """Raise the one sentence for a file ``datasets`` could not read (``where`` names it)."""
    suffix = file.suffix.lower()
    if suffix in LINE_BUILDERS:
        from memfit.data.dataset import find_bad_input

        find_bad_input(file, fmt, fields)  # a .jsonl line or .txt byte: named as memfit's own reader names it
        if file.stat().st_size < (1 << 20) and not file.read_text(encoding="utf-8-sig").strip():
            raise UserError(f"Data file {file} is empty.") from None  # datasets fails on no rows
    raise UserError(f"{where} cannot be read as {ALL_BUILDERS[suffix]} ({_first_line(err)}).") from None


def _first_line(err: BaseException) -> str:
    """The first line of what went wrong: the cause of ``datasets``' "An error occurred while generating the
    dataset" (its ``DatasetGenerationError`` wraps the parser's error), else ``err`` itself."""
    if type(err).__name__ == "DatasetGenerationError" and err.__cause__ is not None:
        err = err.__cause__
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _documents_of_paragraphs(batch: dict) -> dict:
    from memfit.data.dataset import txt_documents

    return {"text": [doc for paragraph in batch["text"] for doc in txt_documents(paragraph)]}
