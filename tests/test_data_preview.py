"""``memfit data preview`` reads the source only up to the record it shows (``memfit.data.stream``).

Each test spoils a file after its first records (bad JSON, bytes that are not UTF-8, corrupt parquet
pages): a full read fails on them (checked), the preview of an early record does not, so it never
read there."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memfit.cli import cli
from memfit.data.prep import preview_record
from memfit.data.sources import load_examples
from memfit.data.stream import record_at
from memfit.errors import UserError
from memfit.settings.config import TrainConfig


@pytest.fixture(autouse=True)
def own_datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def test_jsonl_preview_stops_at_its_record(tmp_path):
    path = tmp_path / "qa.jsonl"
    good = [json.dumps({"prompt": f"q{i}?", "completion": f" a{i}."}) for i in range(3)]
    path.write_text("\n".join(good) + "\n\n{not json\n" + "\n".join(good) + "\n")
    with pytest.raises(UserError, match=r"qa\.jsonl line 5 is not valid JSON"):
        load_examples(path)  # a full read
    example = record_at(str(path), 2)
    assert (example.prompt, example.completion, example.where) == ("q2?", " a2.", f"{path} line 3")
    with pytest.raises(UserError, match=r"qa\.jsonl line 5 is not valid JSON"):
        record_at(str(path), 3)  # reading on to record 3 meets the bad line, and names it


def test_txt_preview_reads_only_the_start_of_a_large_file(tmp_path):
    """2.5 MB of documents, then a byte that is not UTF-8: the text builder streams 1 MiB chunks, so
    document 0 (and one 1.5 MB in) come without reading the end."""
    path = tmp_path / "big.txt"
    docs = [f"Story {i}: caf\u00e9 and more words here." for i in range(80_000)]
    path.write_bytes("\n\n".join(docs).encode() + b"\n\n\xff\xfe broken\n")
    assert path.stat().st_size > 2_500_000
    with pytest.raises(UserError, match=r"big\.txt is not UTF-8"):
        load_examples(path)
    first = record_at(str(path), 0)
    assert (first.text, first.where) == (docs[0], f"{path} document 1")
    assert record_at(str(path), 40_000).text == docs[40_000]
    with pytest.raises(UserError, match=r"big\.txt is not UTF-8"):
        record_at(str(path), 79_999)


def _corrupt_parquet(path, rows: int, group: int):
    """A parquet file of ``rows`` text rows in row groups of ``group``, zstd-compressed, every row group
    after the first overwritten with zeros (so their pages cannot be decompressed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"body": [f"row {i} " + "x" * (i % 50) for i in range(rows)], "n": list(range(rows))})
    pq.write_table(table, path, row_group_size=group, compression="zstd")
    meta = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    for g in range(1, meta.num_row_groups):
        for c in range(meta.num_columns):
            col = meta.row_group(g).column(c)
            start = col.dictionary_page_offset or col.data_page_offset
            data[start : start + col.total_compressed_size] = bytes(col.total_compressed_size)
    path.write_bytes(bytes(data))
    return meta.num_row_groups


def test_parquet_preview_reads_only_the_first_row_group(tmp_path):
    path = tmp_path / "t.parquet"
    assert _corrupt_parquet(path, rows=20_000, group=1_000) == 20
    with pytest.raises(UserError, match=r"t\.parquet cannot be read as parquet"):
        load_examples(path)  # a full read: datasets converts the whole file to Arrow
    config = TrainConfig.of(data=str(path), text_field="body")
    result = preview_record(config, 0)
    assert result["where"] == f"{path} row 1" and result["marked"].startswith("[[no loss: <s>]]row 0 ")
    assert preview_record(config, 999)["where"] == f"{path} row 1000"
    with pytest.raises(UserError, match=r"t\.parquet cannot be read as parquet"):
        preview_record(config, 1_000)  # the first row of the second, spoilt, group
    with pytest.raises(UserError, match=r"has no column 'txt'; its columns are: body, n"):
        preview_record(TrainConfig.of(data=str(path), text_field="txt"), 0)


def test_folder_preview_counts_records_across_files_in_training_order(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("first doc\n\n \n\nsecond doc\n")
    (folder / "b.jsonl").write_text(json.dumps({"text": "third"}) + "\n")
    (folder / "c.jsonl").write_text("{broken\n")
    assert record_at(str(folder), 1).text == "second doc"
    assert record_at(str(folder), 2).where == f"{folder / 'b.jsonl'} line 1"
    with pytest.raises(UserError, match=r"c\.jsonl line 1 is not valid JSON"):
        record_at(str(folder), 3)
    (folder / "c.jsonl").unlink()
    with pytest.raises(UserError, match=r"--index 3 is outside the data's 3 records"):
        record_at(str(folder), 3)


def test_preview_of_a_saved_dataset_and_the_cli(tmp_path):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": f"doc {i}"} for i in range(5)]).save_to_disk(str(saved))
    assert record_at(str(saved), 4).text == "doc 4"
    result = CliRunner().invoke(cli, ["data", "preview", "--data", str(saved), "--index", "4"])
    assert result.exit_code == 0, result.output
    assert f"{saved} row 5 (text): 7 tokens, 6 with loss" in result.output  # bos "doc 4" eos; bos no target
    bad = CliRunner().invoke(cli, ["data", "preview", "--data", str(saved), "--index", "9"])
    assert bad.exit_code == 1 and "--index 9 is outside the data's 5 records." in bad.output
    assert "Traceback" not in bad.output
