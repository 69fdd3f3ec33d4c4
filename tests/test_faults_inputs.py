"""The fault suite, second pass (issue 27, items 4, 5 and 7): user files decoded and checked before use,
model configs validated before building, flags and YAML checked in the flags' words.

Each case asserts the exit status and the one ``error:`` line (or, for a legitimate input, that it
trains correctly), and that a refused run leaves no output folder. Runs are 1-2 steps of the 2-layer
hidden-64 Llama (``_train_helpers.TINY_LLAMA``).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
from pathlib import Path

import pytest

from _train_helpers import TINY_LLAMA, write_model, write_qa, write_text
from test_faults import _one_sentence, _run
from test_faults import _train as train_args


def _train(model, data, output, *extra):
    """test_faults' train command, one step (click keeps the last ``--max-steps``)."""
    return train_args(model, data, output, "--max-steps", "1", *extra)


@pytest.fixture
def inputs(tmp_path):
    return Path(write_model(tmp_path / "m")), Path(write_qa(tmp_path, n=24))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A datasets cache of this test's own, to damage."""
    import datasets

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


# ------------------------------------------------------------------------------ item 4: user files
@pytest.mark.parametrize("content, line, offset", [
    (b'{"text": "ok"}\n{"text": "b\xff\xfead"}\n', 2, 26),
    (b'{"text": "caf\xc3\xa9"}\n\n{"text": "\xc3"}\n', 3, 29),  # a cut UTF-8 sequence, after a valid one
])
def test_invalid_utf8_in_jsonl_names_line_and_byte(tmp_path, inputs, content, line, offset):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    text = _one_sentence(_run(_train(inputs[0], bad, tmp_path / "out")), f"{bad} is not UTF-8 text")
    assert f"line {line}, byte offset {offset}" in text
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_in_yaml_config_and_chat_template(tmp_path, inputs):
    config = tmp_path / "c.yaml"
    config.write_bytes(b"lr: 0.1\nmodel: \xff\n")
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--config", str(config))),
                  f"{config} is not UTF-8 text: line 2, byte offset 15")
    template = tmp_path / "t.jinja"
    template.write_bytes(b"{{ messages }}\xfe\n")
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--chat-template", str(template))),
                  f"{template} is not UTF-8 text: line 1, byte offset 14")
    assert not (tmp_path / "o").exists()


def test_chat_template_that_is_no_file(tmp_path, inputs):
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--chat-template", "../../../x")), "is not a file")


def test_binary_file_as_txt_is_refused(tmp_path, inputs):
    blob = tmp_path / "blob.txt"
    blob.write_bytes(bytes([0x50, 0x4B, 3, 4]) + bytes(range(1, 32)) * 50 + b"\0" * 100)  # valid UTF-8, not text
    _one_sentence(_run(_train(inputs[0], blob, tmp_path / "o")), "is binary data, not UTF-8 text")
    assert not (tmp_path / "o").exists()


def test_data_format_that_does_not_match_a_txt_file(tmp_path, inputs):
    text = write_text(tmp_path)
    _one_sentence(_run(_train(inputs[0], text, tmp_path / "o", "--data-format", "messages")),
                  "--data-format messages does not match")
    assert not (tmp_path / "o").exists()


def test_damaged_save_to_disk_folder_is_one_sentence(tmp_path, inputs):
    from datasets import Dataset

    saved = tmp_path / "saved"
    Dataset.from_dict({"text": ["the cat sat on the mat"] * 20}).save_to_disk(str(saved))
    for arrow in saved.glob("*.arrow"):
        arrow.unlink()
    _one_sentence(_run(_train(inputs[0], saved, tmp_path / "o")), "is a save_to_disk folder whose data cannot be read")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_sentence(_run(_train(inputs[0], empty, tmp_path / "o")), "holds no .txt, .jsonl")
    assert not (tmp_path / "o").exists()


def _tool_chats(path: Path) -> Path:
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    with path.open("w") as fh:
        for _ in range(6):
            fh.write(json.dumps({"messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"},
                {"role": "assistant", "content": "It is sunny."}]}) + "\n")
    return path


def test_tool_calls_are_rendered_and_trained_on(tmp_path, inputs):
    from memfit.data.dataset import load_tokenizer
    from memfit.data.formats import IGNORE_INDEX, chat_template_of, encode_conversation
    from memfit.data.sources import load_examples

    data = _tool_chats(tmp_path / "tools.jsonl")
    example = load_examples(str(data))[0]
    tokenizer = load_tokenizer("byte", str(inputs[0]), is_preset=False)
    chat_template_of(tokenizer, None, data_has_conversations=True)
    ids, labels = encode_conversation(tokenizer, example.messages, train_on_prompt=False, where="x")
    trained = tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    assert '"name": "weather"' in trained and "Oslo" in trained  # the call is the assistant's: loss on it
    assert "sunny" not in trained.replace("It is sunny", "")  # the tool's answer is no target
    result = _run(_train(inputs[0], data, tmp_path / "o", "--seq-len", "256"))
    assert result.exit_code == 0, result.output


def test_template_that_drops_tool_calls_is_refused(tmp_path, inputs):
    data = _tool_chats(tmp_path / "tools.jsonl")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    _one_sentence(_run(_train(inputs[0], data, tmp_path / "o", "--seq-len", "256", "--chat-template", str(template))),
                  "does not render the tool_calls of")


@pytest.mark.parametrize("damage", ["targets.npy", "map arrow", "builder arrow"])
def test_damaged_datasets_cache_is_rebuilt_not_blamed_on_the_data(tmp_path, inputs, fresh_cache, damage):
    model, data = inputs
    assert _run(_train(model, data, tmp_path / "first")).exit_code == 0
    files = [p for p in fresh_cache.rglob("*") if p.is_file()]
    if damage == "targets.npy":
        hit = [p for p in files if p.name.endswith(".targets.npy")]
    elif damage == "map arrow":
        hit = [p for p in files if p.name.startswith("cache-") and p.suffix == ".arrow"]
    else:
        hit = [p for p in files if p.name == "json-train.arrow"]
    assert hit, sorted(p.name for p in files)
    for path in hit:
        path.write_bytes(path.read_bytes()[:40])
    result = _run(_train(model, data, tmp_path / "second"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "second" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------ item 5: model configs
@pytest.mark.parametrize("change, pattern", [
    ({"num_attention_heads": 0}, "num_attention_heads = 0"),
    ({"hidden_act": "nope"}, "hidden_act = 'nope', an activation transformers does not know"),
    ({"pad_token_id": 5000}, "pad_token_id = 5000; it must be a token id below its vocab_size 384"),
    ({"rope_theta": "fast"}, "rope_theta = 'fast'; it must be a finite positive number"),
    ({"rope_scaling": {"type": "bogus", "factor": -3}}, "the RoPE type 'bogus'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -3}}, "rope factor = -3"),
])
@pytest.mark.parametrize("command", ["estimate", "exact", "train"])
def test_model_config_fields_checked_before_building(tmp_path, inputs, command, change, pattern):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**TINY_LLAMA, **change}))
    args = {"estimate": ["estimate", str(bad), "--seq-len", "32"],
            "exact": ["estimate", str(bad), "--seq-len", "32", "--exact"],
            "train": _train(bad, inputs[1], tmp_path / "out", "--init", "random")}[command]
    _one_sentence(_run(args), pattern)
    assert not (tmp_path / "out").exists()


def test_model_larger_than_the_machine_refused_before_allocation(tmp_path, inputs, monkeypatch):
    from memfit.settings import validate

    monkeypatch.setattr(validate, "machine_memory", lambda: (8 << 30, 0))
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 10**12}))
    line = _one_sentence(_run(_train(big, inputs[1], tmp_path / "out", "--init", "random")),
                         "so it cannot be built here")
    assert "8.00 GiB of RAM and no GPU" in line
    assert not (tmp_path / "out").exists()
    result = _run(["estimate", str(big), "--seq-len", "32"])  # a prediction builds nothing: it answers
    assert result.exit_code == 0, result.output


def test_malicious_pickle_weights_refused_without_advice_to_disable_the_check(tmp_path, inputs):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Evil()))
    line = _one_sentence(_run(_train(folder, inputs[1], tmp_path / "o")), "memfit does not run such files")
    assert "weights_only" not in line and "False" not in line


# ------------------------------------------------------------------------------ item 7: flags and YAML
@pytest.mark.parametrize("flag", ["--budget", "--host-memory"])
@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-3"])
def test_memory_sizes_finite_and_positive(flag, value):
    args = ["plan", "tiny", "--budget", "8GiB", flag, value] if flag != "--budget" else ["plan", "tiny", flag, value]
    _one_sentence(_run(args), "Memory size must be a positive number of bytes up to 1 EiB")


def test_plan_margin_nan_is_one_sentence():
    _one_sentence(_run(["plan", "tiny", "--budget", "8GiB", "--margin", "nan"]), "--margin must be a finite number")


def test_seed_beyond_64_bits_is_one_sentence(tmp_path, inputs):
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--seed", str(2**70))), "--seed must be 0 or a positive "
                  "whole number below 2**63")
    config = tmp_path / "c.yaml"
    config.write_text(f"seed: {2**70}\n")
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--config", str(config))), "below 2**63")
    assert not (tmp_path / "o").exists()


def test_yaml_no_off_yes_are_the_options_words(tmp_path, inputs):
    config = tmp_path / "c.yaml"
    config.write_text("mixed_precision: no\npacking: off\ngrad_checkpointing: yes\n")
    result = _run(_train(*inputs, tmp_path / "o", "--config", str(config)))
    assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "o" / "run.json").read_text())["settings"]
    assert settings["mixed_precision"] == "no" and settings["packing"] == "none"
    assert settings["grad_checkpointing"] is True


@pytest.mark.parametrize("text, pattern", [
    ("config:\n  lr: 0.1\nlr: .nan\n", "nests settings under config:"),
    ("config:\n  lr: 0.1\n", "nests settings under config:"),
    ("lr: 1e400\n", "--lr must be a finite positive number, got inf"),
    ("lr: {a: 1}\n", "--lr must be a finite positive number"),
])
def test_yaml_nested_and_out_of_range_keys(tmp_path, inputs, text, pattern):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--config", str(config))), pattern)
    assert not (tmp_path / "o").exists()


def test_yaml_list_bomb_as_model_name_is_short(tmp_path, inputs):
    """A billion-laughs list (9**8 names through aliases): refused in one short sentence, at once."""
    levels = ["&a [" + ", ".join(["x"] * 9) + "]"]
    levels += [f"&{cur} [" + ", ".join([f"*{prev}"] * 9) + "]" for prev, cur in zip("abcdefg", "bcdefgh", strict=True)]
    config = tmp_path / "bomb.yaml"
    config.write_text("model: [" + ", ".join(levels) + ", *h]\n")
    line = _one_sentence(_run(_train(*inputs, tmp_path / "o", "--config", str(config))), "--model must be a text value")
    assert len(line) < 300


def test_merge_without_lora_and_equivalence_of_batch_one_are_refused(tmp_path, inputs):
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--merge")), "drop --merge or add --lora-r")
    assert not (tmp_path / "o").exists()
    _one_sentence(_run(_train(*inputs, tmp_path / "o", "--micro-batch", "1", "--check-equivalence")),
                  "an effective batch of 1 cannot be split")


def test_output_tilde_is_expanded(tmp_path, inputs, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    result = _run(_train(*inputs, "~/runs/x"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "home" / "runs" / "x" / "model.safetensors").is_file()
    assert not (tmp_path / "~").exists()


def test_long_name_and_dangling_symlink_as_output(tmp_path, inputs):
    _one_sentence(_run(_train(*inputs, tmp_path / ("x" * 300))), "longer than the 255 bytes")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere" / "deeper")
    _one_sentence(_run(_train(*inputs, link)), "is a symbolic link to")
    assert not (tmp_path / "nowhere").exists()


def test_terminal_escapes_in_a_field_name_are_shown_escaped(tmp_path, inputs):
    data = tmp_path / "esc.jsonl"
    data.write_text(json.dumps({"\x1b[31mred\x1b]0;title\x07": "x"}) + "\n")
    result = _run(_train(inputs[0], data, tmp_path / "o"))
    line = _one_sentence(result, "its fields are:")
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\\x1b[31mred" in line


def test_terminal_escapes_in_a_previewed_record_and_an_output_path_are_shown_escaped(tmp_path):
    """A record's own text carries an escape sequence: ``data preview`` shows it (escaped, lines kept); a file
    name with one, echoed by ``plan --accelerate-config``, likewise."""
    data = tmp_path / "esc.jsonl"
    data.write_text(json.dumps({"text": "a \x1b[31mred\x1b[0m line"}) + "\n")
    result = _run(["data", "preview", "--data", str(data)])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\\x1b[31mred" in result.output
    target = tmp_path / "acc\x1b[2J.yaml"
    result = _run(["plan", "tiny", "--budget", "1GiB", "--accelerate-config", str(target)])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "acc\\x1b[2J.yaml" in result.output and target.is_file()


def test_ctrl_c_during_tokenization_removes_the_run_and_exits_130(tmp_path, inputs, monkeypatch):
    import memfit.data.arrow as data_arrow

    real = data_arrow.encode_parts

    def ctrl_c_then_encode(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_arrow, "encode_parts", ctrl_c_then_encode)
    out = tmp_path / "o"
    _one_sentence(_run(_train(*inputs, out, "--max-steps", "3")), "Interrupted by Ctrl-C before the first step",
                  code=130)
    assert not out.exists()


def test_a_mistyped_empty_or_unexpandable_model_or_data_path_is_refused_before_torch_loads(tmp_path):
    # memfit.check_inputs (training/inputs.py) runs the loaders' own file-system checks first: these errors
    # used to come after importing torch, transformers and PEFT (~9 s here). A fresh interpreter (this one has
    # torch) runs every command with click's test runner, then says whether torch was imported.
    import subprocess
    import sys

    pdf = tmp_path / "notes.pdf"
    pdf.write_text("not data")
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    (tmp_path / "number.yaml").write_text("data: 7\n")  # the file "7", as TrainConfig reads it (a TypeError once)
    missing = str(tmp_path / "notes.jsnol")
    commands = {
        "train --data": ["train", "--data", missing, "--output", str(tmp_path / "out")],
        "train --model": ["train", "--model", str(tmp_path / "no-such-model")],
        "train --data FILE.pdf": ["train", "--data", str(pdf)],
        "train --model HUB-ID --data": ["train", "--model", "org/name", "--data", missing],
        "train --revision": ["train", "--revision", "v1"],
        "estimate": ["estimate", str(tmp_path / "no-such-model")],
        "plan": ["plan", "tinyy", "--budget", "8GiB"],
        "data preview": ["data", "preview", "--data", missing],
        "train --data FIFO": ["train", "--data", str(fifo)],  # was "Data folder ... holds no ... files"
        "train --config FIFO": ["train", "--config", str(fifo)],  # was "Config file ... does not exist."
        "train --config data: 7": ["train", "--config", str(tmp_path / "number.yaml")],
        # An unset shell variable ("$DATA"): "" is the current folder to pathlib, whose data files were read.
        "train --data EMPTY": ["train", "--data", ""],
        "train --model BLANK": ["train", "--model", " "],
        # ~user of no such user: Path.expanduser raised RuntimeError (a traceback); the shell leaves it as typed
        "train --data ~USER": ["train", "--data", "~memfit-no-such-user/x.txt"],
        "train --config ~USER": ["train", "--config", "~memfit-no-such-user/c.yaml"],
        "estimate ~USER": ["estimate", "~memfit-no-such-user/m"],
    }
    code = ("import json, sys\nfrom click.testing import CliRunner\nfrom memfit.cli import cli\nout = {}\n"
            "for name, argv in json.loads(sys.argv[1]).items():\n"
            "    result = CliRunner().invoke(cli, argv)\n"
            "    out[name] = [result.exit_code, result.output.strip().splitlines()]\n"
            "print(json.dumps({'results': out, 'torch': 'torch' in sys.modules}))\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = {}
    for name, (code_, lines) in report["results"].items():
        assert code_ == 1 and len(lines) == 1 and lines[0].startswith("error: "), (name, lines)
        errors[name] = lines[0]
    assert errors["train --data"] == f"error: Data path {missing} does not exist."
    assert errors["train --model HUB-ID --data"] == errors["train --data"]  # the Hub id is looked up later
    assert errors["data preview"] == errors["train --data"]
    assert "is neither a preset, a local model folder or config.json, nor a Hugging Face Hub id" in errors["train --model"]
    assert "is neither a preset" in errors["estimate"] and "Did you mean tiny" in errors["plan"]
    assert errors["train --data FILE.pdf"].startswith(f"error: {pdf} is a .pdf file; --data takes .txt, .jsonl")
    assert "--revision picks a version of a Hugging Face Hub model, but 'tiny' is not a Hub id" in errors["train --revision"]
    assert errors["train --data EMPTY"] == ("error: --data is empty; name a data file, a folder of them or a Hub "
                                            "dataset (org/name), or leave it out for the shipped corpus.")
    assert errors["train --model BLANK"] == ("error: --model is empty; name a preset, a model folder, a config.json "
                                             "or a Hub id (org/name).")
    assert errors["train --data ~USER"] == "error: Data path ~memfit-no-such-user/x.txt does not exist."
    assert errors["train --config ~USER"] == "error: Config file ~memfit-no-such-user/c.yaml does not exist."
    assert "'~memfit-no-such-user/m' is neither a preset" in errors["estimate ~USER"]
    assert errors["train --data FIFO"] == (f"error: {fifo} is neither a file nor a folder (a device, pipe or socket); "
                                           "--data takes .txt, .jsonl, .json, .csv, .parquet, .arrow or a folder of them.")
    assert errors["train --config FIFO"] == (f"error: Config file {fifo} is not a file (a folder, device or pipe); "
                                             "pass a YAML file.")
    assert errors["train --config data: 7"] == "error: Data path 7 does not exist."
    assert report["torch"] is False
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_is_no_folder_is_said_so(inputs, tmp_path):
    # A FIFO where --tokenizer names a folder: it exists, so "does not exist" (the old sentence) was false.
    model, data = inputs
    fifo = tmp_path / "tok"
    os.mkfifo(fifo)
    args = _train(model, data, tmp_path / "out")
    args[args.index("--tokenizer") + 1] = str(fifo)
    _one_sentence(_run(args), f"Tokenizer folder {fifo} is not a folder; pass --tokenizer DIR (or --tokenizer byte).")
    assert not (tmp_path / "out").exists()
