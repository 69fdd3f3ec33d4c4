"""Data sources read through Hugging Face ``datasets`` (never a hand-written reader for these formats).

``--data`` may be:

* a ``.json``/``.csv``/``.parquet``/``.arrow`` file (``.jsonl`` and ``.txt`` keep memfit's own reader,
  which names the line of a bad record), or a folder of such files;
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
* a Hub dataset id (``org/name``) when online, with ``--split`` and ``--data-config``.

Each row becomes a record for ``memfit.data.record_to_example`` (format detection, checks), named in
messages as ``<source> row <n>`` (1-based).
"""

from __future__ import annotations

import re
from pathlib import Path

from memfit.errors import UserError

BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> the ``datasets`` packaged builder that reads it."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def handles(path) -> bool:
    """Whether ``path`` is read here (rather than by ``memfit.data``'s .txt/.jsonl reader)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix.lower() in BUILDERS
    if p.is_dir():
        return _is_saved_dataset(p) or bool(_table_files(p))
    return bool(_HUB_ID.match(str(path)))


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def _table_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def load_dataset(path: str, *, split: str = "train", data_config: str | None = None):
    """The ``datasets.Dataset`` behind ``--data`` (memory-mapped Arrow: rows are read when used)."""
    import datasets

    datasets.disable_progress_bars()
    p = Path(path).expanduser()
    if p.is_dir() and _is_saved_dataset(p):
        ds = datasets.load_from_disk(str(p))
        return _pick_split(ds, split, str(p))
    if p.exists():
        files = [p] if p.is_file() else _table_files(p)
        suffixes = {f.suffix.lower() for f in files}
        if len(suffixes) != 1:
            raise UserError(f"Data folder {p} mixes file types ({', '.join(sorted(suffixes))}); keep one per folder.")
        builder = BUILDERS[suffixes.pop()]
        try:
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        except Exception as err:  # noqa: BLE001 - pyarrow/json/csv raise many types; all mean "cannot read"
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise UserError(f"{p} cannot be read as {builder} ({first}).") from None
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


def load_examples(path: str, *, fmt: str | None, fields, split: str = "train", data_config: str | None = None,
                  named_fields: tuple[str, ...] = ()) -> list:
    """The rows of a ``datasets`` source as ``memfit.data.Example`` records."""
    from memfit.data import record_to_example

    ds = load_dataset(path, split=split, data_config=data_config)
    check_columns(ds, path, [getattr(fields, name) for name in named_fields])
    if len(ds) == 0:
        raise UserError(f"Data source {path} is empty.")
    return [record_to_example(row, f"{path} row {i}", fmt, fields) for i, row in enumerate(ds, start=1)]
