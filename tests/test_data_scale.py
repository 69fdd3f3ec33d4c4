"""Data at scale (issue 11.3): every source is tokenized and packed on disk by ``datasets`` and read from
memory-mapped Arrow tables, with bounded memory; exact resume on Arrow data; samples at --eval-every."""

from __future__ import annotations

import json
import math
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from _data_helpers import tokenize
from memfit.data.dataset import byte_tokenizer, unigram_loss
from memfit.data.sources import load_examples
from memfit.errors import UserError
from memfit.settings.config import RunConfig, TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.fixture(autouse=True)
def own_datasets_cache(tmp_path, monkeypatch):
    """Each test writes its Arrow caches under its own tmp folder (a first run really tokenizes)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def _load(data: str, seq_len: int = 48, packing: str = "documents", eval_fraction: float = 0.1, **config):
    from memfit.data.prep import load_for_run

    cfg = TrainConfig.of(data=data, eval_fraction=eval_fraction, seed=1, **config)
    return load_for_run(cfg, RunConfig.of(seq_len=seq_len, packing=packing), byte_tokenizer())


def _folder(tmp_path: Path) -> Path:
    """A .txt with odd separators (spaces on a blank line, three newlines, a byte-order mark) and a .jsonl
    of prompt/completion records with a blank line, sorted after it."""
    folder = tmp_path / "data"
    folder.mkdir()
    docs = [f"doc {i} " * (i % 9 + 1) for i in range(40)]
    text = "\ufeff" + docs[0] + "\n \n" + "\n\n\n".join(docs[1:20]) + "\n\n" + "\n\n".join(docs[20:]) + "\n"
    (folder / "a.txt").write_text(text, encoding="utf-8")
    qa = [json.dumps({"prompt": f"q{i}?", "completion": f" a{i}."}) for i in range(15)]
    (folder / "b.jsonl").write_text("\n".join(qa[:7]) + "\n\n" + "\n".join(qa[7:]) + "\n")
    return folder


@pytest.mark.parametrize("packing", ["documents", "concat", "none"])
def test_txt_and_jsonl_go_through_datasets_and_give_the_in_memory_rows(tmp_path, packing):
    from datasets.table import MemoryMappedTable

    from memfit.data.arrow import ArrowRows

    folder = _folder(tmp_path)
    examples, arrow = _load(str(folder), packing=packing)
    memory = tokenize(load_examples(folder), byte_tokenizer(), seq_len=48, packing=packing, eval_fraction=0.1,
                      seed=1)
    assert len(examples) == 55 and [examples[i] for i in range(55)] == load_examples(folder)
    assert list(arrow.train) == memory.train and list(arrow.eval) == memory.eval
    assert isinstance(arrow.train, ArrowRows) and isinstance(arrow.train.ds.data, MemoryMappedTable)
    assert unigram_loss(arrow) == pytest.approx(unigram_loss(memory), rel=1e-12)


def test_jsonl_errors_name_the_line_on_the_datasets_path(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "oops"\n')
    with pytest.raises(UserError, match=r"bad\.jsonl line 3 is not valid JSON"):
        _load(str(bad))
    none = tmp_path / "none.jsonl"
    none.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(UserError, match=r"none\.jsonl line 3 has neither a text field"):
        _load(str(none))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt is not UTF-8"):
        _load(str(latin))
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n \n")
    with pytest.raises(UserError, match=r"empty\.txt is empty"):
        _load(str(empty))


def test_unigram_loss_reads_arrow_rows_in_batches_and_matches_a_hand_count(tmp_path):
    """Two train rows with targets a, a, b and one held-out row with targets a, c (byte tokenizer, labels
    after the shift): N = 3, V = 2, p(a) = 3/6, p(c) = 1/6 (unseen), loss = (ln 2 + ln 6) / 2."""
    import datasets

    from memfit.data.arrow import ArrowRows
    from memfit.data.dataset import TokenizedData

    a, b, c = 100, 101, 102
    rows = {"train": [{"input_ids": [1, a, a], "labels": [-100, a, a]}, {"input_ids": [1, b], "labels": [-100, b]}],
            "eval": [{"input_ids": [1, a, c], "labels": [-100, a, c]}]}
    on_disk = {k: ArrowRows(datasets.Dataset.from_list(v)) for k, v in rows.items()}
    expected = (math.log(2) + math.log(6)) / 2
    assert unigram_loss(TokenizedData(train=rows["train"], eval=rows["eval"])) == pytest.approx(expected, rel=1e-12)
    assert unigram_loss(TokenizedData(train=on_disk["train"], eval=on_disk["eval"])) == pytest.approx(expected,
                                                                                                     rel=1e-12)


def _python_peak(path: Path, trace: bool = True) -> int:
    """Peak bytes Python (and numpy) allocate while ``path`` is read, tokenized, split and packed, and the
    unigram baseline counted, from a cold cache."""
    import datasets

    datasets.config.HF_DATASETS_CACHE = path.parent / "hf-cache"
    if not trace:
        _load(str(path), seq_len=256, eval_fraction=0.05)
        return 0
    tracemalloc.start()
    try:
        _, tokenized = _load(str(path), seq_len=256, eval_fraction=0.05)
        unigram_loss(tokenized)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_tokenizing_a_corpus_keeps_memory_bounded(tmp_path, monkeypatch):
    """The peak of Python's allocations does not grow with the corpus: 8x the text (100 kB -> 800 kB of
    stories) raises it by less than half. The in-memory path held every token in Python lists (ids and
    labels, an 8-byte pointer each: >= 16 bytes a token, 12.8 MB for the 800 kB corpus with the byte
    tokenizer); the datasets path holds one batch of documents (here 100) and one chunk of text (128 KiB)
    at a time, so its peak stays near 1-2 MB, below a quarter of what the in-memory lists alone took.
    (Checked: with one batch for the whole corpus the 8x corpus has a ~8x peak and this test fails.)"""
    from make_corpus import write_large

    from memfit.data import arrow as data_arrow
    from memfit.data import sources as data_sources

    monkeypatch.setattr(data_arrow, "BATCH_ROWS", 100)
    monkeypatch.setattr(data_sources, "TEXT_CHUNK", 1 << 17)
    warm = tmp_path / "warm" / "w.txt"  # first use imports datasets' builders: not the corpus' cost
    warm.parent.mkdir()
    warm.write_text("a b\n\nc d\n")
    _python_peak(warm, trace=False)
    small, big = tmp_path / "small", tmp_path / "big"
    write_large(small, 100_000, seed=0)
    big_bytes = write_large(big, 800_000, seed=1)
    peak_small, peak_big = _python_peak(small / "stories.txt"), _python_peak(big / "stories.txt")
    assert peak_big < 1.5 * peak_small, (peak_small, peak_big)
    assert peak_big < 16 * big_bytes / 4, (peak_big, big_bytes)


# ----------------------------------------------------------------------------------- exact resume
def _parquet(tmp_path: Path) -> str:
    import datasets

    texts = [f"{name} found a {thing} near the river. " * (1 + i % 3)
             for i, (name, thing) in enumerate((n, t) for n in ("Tom", "Ann", "Max", "Lily")
                                               for t in ("kite", "hat", "ball", "book", "cup"))]
    path = tmp_path / "stories.parquet"
    datasets.Dataset.from_list([{"body": t} for t in texts]).to_parquet(str(path))
    return str(path)


def test_resume_on_arrow_data_lands_on_the_same_samples_and_weights(tmp_path, monkeypatch):
    """4 AdamW steps on a parquet source (20 documents packed on disk into 26 rows of <= 64 tokens, 4 rows
    a step) vs 2 steps, a crash right after the step-2 checkpoint, and a resume: the same losses at steps
    3 and 4 (so the same samples) and bit-identical weights."""
    from _train_helpers import crash_after_first_checkpoint_then_resume, metrics, tiny_config
    from memfit.training.loop import run_training

    data = _parquet(tmp_path)
    common = dict(data=data, text_field="body", max_steps=4, packing="documents", lr=1e-2, warmup_steps=2,
                  run={"optimizer": "adamw"})
    full = run_training(tiny_config(tmp_path / "a", **common), show=False)
    cfg = tiny_config(tmp_path / "b", save_every=2, **common)
    resumed = crash_after_first_checkpoint_then_resume(cfg, monkeypatch)  # killed after the step-2 checkpoint
    assert resumed.summary.steps == 4 and resumed.summary.sequences == full.summary.sequences
    losses = [{m["step"]: m["loss"] for m in metrics(out) if "loss" in m}
              for out in (cfg.folder.output, full.summary.output)]
    assert losses[0][3] == losses[1][3] and losses[0][4] == losses[1][4]
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


# -------------------------------------------------------------------------- samples at --eval-every
def test_eval_samples_use_the_chat_template_and_leave_training_unchanged(tmp_path):
    """--eval-samples 2 with --eval-every 2: samples.jsonl gets 2 samples at steps 2 and 4, prompted with
    held-out user turns; the trained weights equal those of the same run without samples (sampling does
    not move the random state training draws from)."""
    from _train_helpers import tiny_config
    from memfit.training.loop import run_training

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1?"},
                                                     {"role": "assistant", "content": f"{i + 1}."}]}) + "\n"
                            for i in range(20)))
    common = dict(data=str(path), packing="documents", eval_every=2, eval_fraction=0.2, max_steps=4,
                  run={"optimizer": "adamw"}, lr=1e-2)
    plain = run_training(tiny_config(tmp_path / "plain", **common), show=False)
    cfg = tiny_config(tmp_path / "sampled", eval_samples=2, **common)
    sampled = run_training(cfg, show=False)
    lines = [json.loads(line) for line in (Path(cfg.folder.output) / "samples.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 2, 4, 4]
    held_out = {f"{i}+1?" for i in range(20)}
    assert all(line["prompt"] in held_out and isinstance(line["completion"], str) for line in lines)
    for (name, a), b in zip(plain.model.state_dict().items(), sampled.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_arrow_packing_over_many_small_batches_gives_the_list_packing():
    """``pack_arrow_documents`` (numpy gathers over record batches, rows left open across batches) gives
    exactly ``pack_documents``' rows on 300 documents of 1-70 tokens, half of them 3, 5 or 7 (open rows of
    equal fill: the fullest to close is the first of equals), seq_len 16 (cut pieces, lone-token pieces and
    prompt-only pieces dropped), fed 7 documents a batch and written 5 rows a batch."""
    import random

    import pyarrow as pa

    from memfit.data.packing import pack_arrow_documents, pack_documents

    rng = random.Random(0)
    docs = []
    for _ in range(300):
        n = rng.randrange(1, 71) if rng.random() < 0.5 else rng.choice([3, 5, 7])  # short ties: equal rows
        ids = [rng.randrange(3, 259) for _ in range(n)]
        masked = rng.randrange(0, len(ids) + 1) if rng.random() < 0.3 else 1  # a prompt, or just bos
        docs.append((ids, [-100] * masked + ids[masked:]))
    list_type = pa.list_(pa.int16())
    batches = [pa.RecordBatch.from_arrays([pa.array([d[0] for d in docs[i : i + 7]], type=list_type),
                                           pa.array([d[1] for d in docs[i : i + 7]], type=list_type)],
                                          names=["input_ids", "labels"]) for i in range(0, len(docs), 7)]
    arrow_rows = [row for batch in pack_arrow_documents(iter(batches), 16, rows_per_batch=5)
                  for row in batch.to_pylist()]
    expected = list(pack_documents(docs, 16))
    assert len(expected) > 50 and arrow_rows == expected
