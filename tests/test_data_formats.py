"""Conversations through the chat template, ShareGPT/Alpaca, datasets sources, data preview, trackers,
and the bad inputs of issue 11 (one sentence naming file and record, exit 1, nothing written)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from _data_helpers import tokenize
from memfit.cli import cli
from memfit.data.dataset import IGNORE_INDEX as X
from memfit.data.dataset import Example, byte_tokenizer, record_to_example
from memfit.data.sources import load_examples
from memfit.errors import UserError

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4."}, {"role": "user", "content": "3+3?"},
                     {"role": "assistant", "content": "6."}]}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _targets(tok, row):
    return tok.decode([t for t in row["labels"] if t != X])


def test_loss_on_every_assistant_turn_and_its_end_of_turn_token(tok):
    (row,) = tokenize([record_to_example(CHAT, "r")], tok, seq_len=256, packing="none", eval_fraction=0, seed=0).train
    # byte template: "<s><|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n4.</s>\n<|user|>..." -- the
    # targets are each reply, its eos and the newline the template closes the turn with, nothing else.
    assert _targets(tok, row) == "4.</s>\n6.</s>\n"
    assert row["input_ids"][0] == tok.bos_token_id and row["labels"][0] == X


def test_train_on_prompt_takes_the_loss_on_every_token(tok):
    ex = record_to_example(CHAT, "r")
    (row,) = tokenize([ex], tok, seq_len=256, packing="none", eval_fraction=0, seed=0, train_on_prompt=True).train
    assert row["labels"] == row["input_ids"]


def test_sharegpt_and_alpaca_take_the_messages_path(tok):
    share = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4."}]}
    alpaca = {"instruction": "Add", "input": "2+2", "output": "4."}
    assert record_to_example(share, "r").messages == (("user", "2+2?"), ("assistant", "4."))
    assert record_to_example(alpaca, "r").messages == (("user", "Add\n\n2+2"), ("assistant", "4."))
    (row,) = tokenize([record_to_example(alpaca, "r")], tok, seq_len=256, packing="none", eval_fraction=0,
                      seed=0).train
    assert _targets(tok, row) == "4.</s>\n"


def test_chat_template_file_replaces_the_template(tok, tmp_path):
    from memfit.data.formats import chat_template_of

    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    chat_template_of(tok, str(path), data_has_conversations=True)
    (row,) = tokenize([record_to_example(CHAT, "r")], tok, seq_len=256, packing="none", eval_fraction=0,
                      seed=0).train
    assert _targets(tok, row) == "4.<|im_end|>\n6.<|im_end|>\n"


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, r"f\.jsonl line 1 has no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     r"f\.jsonl line 1 turn 1 has the unknown role 'robot'"),
    ({"conversations": [{"from": "alien", "value": "hi"}]}, r"line 1 turn 1 has the unknown role 'alien'"),
    ({"body": "x"}, r"line 1 has neither .* its fields are: body"),
])
def test_bad_records_are_one_sentence_naming_file_and_record(tmp_path, record, message):
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match=message):
        load_examples(path)


def test_tokenizer_without_template_and_a_failing_template_are_refused(tmp_path):
    from memfit.data.formats import chat_template_of, encode_conversation

    bare = byte_tokenizer()
    bare.chat_template = None
    with pytest.raises(UserError, match="no chat template; pass --chat-template FILE"):
        chat_template_of(bare, None, data_has_conversations=True)
    bare.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(UserError, match=r"fails to render chats\.jsonl line 7: only user turns"):
        encode_conversation(bare, (("user", "a"), ("assistant", "b")), train_on_prompt=False,
                            where="chats.jsonl line 7")


def test_long_conversations_are_dropped_and_counted(tok):
    short = Example(messages=(("user", "a"), ("assistant", "b")))
    long = Example(messages=(("user", "a" * 300), ("assistant", "b")))
    data = tokenize([short, long, long], tok, seq_len=64, packing="documents", eval_fraction=0, seed=0)
    assert data.dropped_long == 2 and len(data.train) == 1 and data.conversations == 3


# ------------------------------------------------------------------------------ sources via datasets


def _rows():
    return [{"body": f"doc {i} " * 5, "n": i} for i in range(6)]


def test_parquet_csv_and_save_to_disk_sources(tmp_path):
    import datasets

    from memfit.data.formats import Fields

    ds = datasets.Dataset.from_list(_rows())
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    fields = Fields(text="body")
    for source in ("d.parquet", "d.csv", "saved"):
        examples = load_examples(tmp_path / source, fields=fields, named_fields=("text",))
        assert [ex.text for ex in examples] == [r["body"] for r in _rows()], source
    with pytest.raises(UserError, match=r"has no column 'txt'; its columns are: body, n"):
        load_examples(tmp_path / "d.parquet", fields=Fields(text="txt"), named_fields=("text",))


def test_unreadable_parquet_and_offline_hub_id(tmp_path, monkeypatch):
    import datasets

    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=r"broken\.parquet cannot be read as parquet"):
        load_examples(bad)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=r"some-org/some-data is neither a local path nor reachable"):
        load_examples("some-org/some-data")


# ---------------------------------------------------------------------------------------- the CLI


def test_data_preview_marks_the_spans_without_loss(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    result = CliRunner().invoke(cli, ["data", "preview", "--data", str(path)])
    assert result.exit_code == 0, result.output
    assert "(conversation): " in result.output and "8 with loss" in result.output  # "4.</s>\n" + "6.</s>\n"
    assert "[[no loss: <s><|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n]]4.</s>\n" in result.output


@pytest.mark.parametrize("args,message", [
    (["--tracker", "aim"], "--tracker aim needs the aim package; install it with pip install 'memfit[aim]'."),
    (["--data-format", "text"], "has a text that is not a non-empty string"),
])
def test_train_refuses_bad_input_and_writes_nothing(tmp_path, args, message, monkeypatch):
    import importlib.util

    from _train_helpers import write_model

    real = importlib.util.find_spec  # aim may be installed: the refusal is checked as if it were not
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aim" else real(name, *a))

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["train", "--model", write_model(tmp_path / "m"), "--tokenizer", "byte",
                                      "--data", str(path), "--max-steps", "1", "--output", str(out), *args])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_tiny_model_trains_on_conversations_and_samples_in_chat_format(tmp_path):
    from _train_helpers import tiny_config
    from memfit.training.loop import train

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1?"},
                                                     {"role": "assistant", "content": f"{i + 1}."}]}) + "\n"
                            for i in range(12)))
    summary = train(tiny_config(tmp_path, data=str(path), packing="documents", samples=1, eval_fraction=0.2),
                    show=False)
    assert summary["steps"] == 3 and summary["samples"][0]["prompt"].endswith("+1?")
    # the exported tokenizer keeps the template, so the trained model chats in the format it learned
    assert "<|assistant|>" in (Path(summary["output"]) / "chat_template.jinja").read_text()


@pytest.fixture()
def tok():
    return byte_tokenizer()


# ---------------------------------------------------------------------- datasets.map path (on disk)


@pytest.mark.parametrize("packing", ["documents", "concat", "none"])
def test_a_json_file_gives_the_rows_of_its_records_and_reuses_the_cache(tmp_path, packing):
    """Records read from a .json file give exactly the rows (and the held-out split) the same records give
    from memory; a second call reads the cache (same Arrow files)."""
    import datasets

    from memfit.data.arrow import tokenize_dataset
    from memfit.data.formats import Fields

    tok = byte_tokenizer()
    records = [{"text": f"doc {i} " * (i % 7 + 1)} for i in range(30)] + [CHAT]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    ds = datasets.load_dataset("json", data_files=[str(path)], split="train", cache_dir=str(tmp_path / "cache"))
    kwargs = dict(seq_len=48, packing=packing, eval_fraction=0.1, seed=1)
    arrow = tokenize_dataset(ds, tok, fmt=None, fields=Fields(), train_on_prompt=False, num_proc=1, where="d.json",
                             **kwargs)
    memory = tokenize([record_to_example(r, "r") for r in records], tok, **kwargs)
    assert list(arrow.train) == memory.train and list(arrow.eval) == memory.eval
    assert arrow.train[2:4] == memory.train[2:4] and arrow.conversations == 1
    again = tokenize_dataset(ds, tok, fmt=None, fields=Fields(), train_on_prompt=False, num_proc=1, where="d.json",
                             **kwargs)
    assert again.train.ds.cache_files == arrow.train.ds.cache_files


def test_tiny_model_trains_from_parquet_and_save_to_disk(tmp_path):
    import datasets

    from _train_helpers import tiny_config
    from memfit.training.loop import train

    ds = datasets.Dataset.from_list([{"body": f"the cat sat on mat {i}. " * 3} for i in range(24)])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for source in ("d.parquet", "saved"):
        cfg = tiny_config(tmp_path, data=str(tmp_path / source), text_field="body", packing="documents",
                          output=str(tmp_path / f"out-{source}"))
        summary = train(cfg, show=False)
        assert summary["steps"] == 3 and math.isfinite(summary["final_train_loss"])


# ---------------------------------------------------------------------- folders: each file its own format


def _chats(n: int, sharegpt: bool = False) -> str:
    if sharegpt:
        rows = [{"conversations": [{"from": "human", "value": f"{i}+2?"}, {"from": "gpt", "value": f"{i + 2}."}]}
                for i in range(n)]
    else:
        rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}."}]}
                for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_folder_of_a_messages_and_a_sharegpt_file_trains_on_both(tmp_path):
    """One builder call cannot read files of different columns into one table ("cannot be read as json"):
    the files are then read one by one, each record's format detected, and every record of both counted."""
    from _train_helpers import tiny_config
    from memfit.data.prep import load_for_run
    from memfit.settings.config import RunConfig
    from memfit.training.loop import train

    folder = tmp_path / "mix"
    folder.mkdir()
    (folder / "a.jsonl").write_text(_chats(12))
    (folder / "b.jsonl").write_text(_chats(10, sharegpt=True))
    cfg = tiny_config(tmp_path, data=str(folder), packing="documents", eval_fraction=0.0)
    examples, tokenized = load_for_run(cfg, RunConfig.of(seq_len=64), byte_tokenizer())
    assert tokenized.conversations == 22 and len(examples) == 22
    assert examples[12].where == f"{folder / 'b.jsonl'} row 1" and examples[12].is_conversation
    summary = train(cfg, show=False)
    assert summary["steps"] == 3 and math.isfinite(summary["final_train_loss"])


@pytest.mark.parametrize("name,broken,message", [
    ("b.json", '[{"text": "a"}, {"text": ', "b.json cannot be read as json (Expected object or value"),
    ("b.jsonl", '{"text": "a"}\n{"text": "oops\n', "b.jsonl line 2 is not valid JSON"),
])
def test_folder_with_one_broken_file_names_that_file_alone(tmp_path, name, broken, message):
    """Also: no log line of ``datasets`` before memfit's sentence (its JSON builder logs the parse error it
    then raises); collected from its logger, since its handler writes to whichever stderr was current when
    ``datasets`` was first imported."""
    import logging

    from _train_helpers import write_model

    folder = tmp_path / "mix"
    folder.mkdir()
    (folder / f"a{Path(name).suffix}").write_text(json.dumps([{"text": "fine"}]) if name.endswith(".json")
                                                  else _chats(3))
    (folder / name).write_text(broken)
    out = tmp_path / "out"
    records = []
    collect = logging.Handler(logging.WARNING)
    collect.emit = records.append
    logging.getLogger("datasets").addHandler(collect)
    try:
        result = CliRunner().invoke(cli, ["train", "--model", write_model(tmp_path / "m"), "--tokenizer", "byte",
                                          "--data", str(folder), "--max-steps", "1", "--output", str(out)])
    finally:
        logging.getLogger("datasets").removeHandler(collect)
    assert result.exit_code == 1 and result.output.startswith(f"error: {folder / name}"), result.output
    assert message in result.output and result.output.count("\n") == 1  # one sentence, nothing else
    assert [r.getMessage() for r in records] == []
    assert not out.exists()
