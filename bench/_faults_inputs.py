"""The input cases of ``bench/faults.py`` (issue 27, items 4, 5 and 7): user files, model config fields,
flags and YAML. Each case is run through the CLI in-process and recorded by the census (``Census.record``)
under its category: ``input``, ``config`` or ``flags2``."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path


def _cfg_folder(root: Path, name: str, cfg: dict) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def input_cases(c, tmp: Path, model: str, data: str, fast) -> None:
    """User files: bad UTF-8, binary .txt, a mismatched --data-format, damaged save_to_disk, tool calls."""
    from datasets import Dataset

    def case(name, path, *extra, expect="refuse"):
        c.record("input", name, c.invoke(fast(model, str(path), str(tmp / f"in-{len(c.rows)}"), *extra)),
                 expect=expect)

    bad = tmp / "bad-utf8.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "b\xff"}\n')
    case("JSONL with invalid UTF-8", bad)
    yml = tmp / "bad-utf8.yaml"
    yml.write_bytes(b"lr: 0.1\nmodel: \xff\n")
    case("YAML config with invalid UTF-8", data, "--config", str(yml))
    tmpl = tmp / "bad-utf8.jinja"
    tmpl.write_bytes(b"{{ messages }}\xfe")
    case("chat template with invalid UTF-8", data, "--chat-template", str(tmpl))
    case("chat template ../../../x", data, "--chat-template", "../../../x")
    blob = tmp / "blob.txt"
    blob.write_bytes(bytes(range(1, 32)) * 50 + b"\0" * 100)
    case("binary file as .txt", blob)
    text = tmp / "plain.txt"
    text.write_text("Tom found a kite.\n\nAnn found a hat.\n" * 10)
    case("--data-format messages on a .txt", text, "--data-format", "messages")
    empty = tmp / "empty-ds"
    empty.mkdir()
    case("empty data folder", empty)
    saved = tmp / "saved-ds"
    Dataset.from_dict({"text": ["the cat sat on the mat"] * 20}).save_to_disk(str(saved))
    for arrow in saved.glob("*.arrow"):
        arrow.unlink()
    case("save_to_disk folder without its .arrow", saved)
    tools = tmp / "tools.jsonl"
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    tools.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]}) + "\n"
        for _ in range(6)))
    case("tool_calls and tool messages", tools, "--seq-len", "256", expect="ok")
    plain = tmp / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}")
    case("template that drops tool_calls", tools, "--seq-len", "256", "--chat-template", str(plain))


def config_cases(c, tmp: Path, data: str, fast, tiny: dict) -> None:
    """Model config fields estimate, --exact and train read, each checked before building."""
    bad = {"num_attention_heads 0": {"num_attention_heads": 0}, "hidden_act unknown": {"hidden_act": "nope"},
           "pad_token_id beyond vocab": {"pad_token_id": 5000}, "rope_theta as text": {"rope_theta": "fast"},
           "nonsense rope_scaling": {"rope_scaling": {"type": "bogus", "factor": -3}}}
    for name, change in bad.items():
        folder = _cfg_folder(tmp, f"cfg-{len(c.rows)}", {**tiny, **change})
        for command, args in {"estimate": ["estimate", folder, "--seq-len", "32"],
                              "exact": ["estimate", folder, "--seq-len", "32", "--exact"],
                              "train": fast(folder, data, str(tmp / f"cf-{len(c.rows)}"), "--init", "random")}.items():
            c.record("config", f"{command}: {name}", c.invoke(args), expect="refuse")
    huge = _cfg_folder(tmp, "cfg-huge", {**tiny, "vocab_size": 10**12})
    c.record("config", "train: vocabulary of 10^12", c.invoke(fast(huge, data, str(tmp / "cf-huge"), "--init",
                                                                   "random")), expect="refuse")
    evil = tmp / "evil-model"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps(tiny))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (evil / "pytorch_model.bin").write_bytes(pickle.dumps(Evil()))
    result = c.invoke(fast(str(evil), data, str(tmp / "cf-evil")))
    c.record("config", "malicious pytorch_model.bin", result, expect="refuse",
             wrong="weights_only" in result.output)


def flag_cases(c, tmp: Path, model: str, data: str, fast) -> None:
    """Numeric flags and YAML keys out of range, YAML's booleans, nested keys, paths, escapes."""
    for flag in ("--budget", "--host-memory"):
        for value in ("nan", "inf", "1e400"):
            args = ["plan", "tiny", flag, value] if flag == "--budget" else ["plan", "tiny", "--budget", "8GiB",
                                                                                flag, value]
            c.record("flags2", f"plan {flag} {value}", c.invoke(args), expect="refuse")

    def train(name, *extra, output=None, expect="refuse", wrong=False):
        out = output or str(tmp / f"fl-{len(c.rows)}")
        c.record("flags2", name, c.invoke(fast(model, data, out, *extra)), expect=expect, wrong=wrong)

    train("--seed 2**70", "--seed", str(2**70))
    for name, text, expect in [("yaml mixed_precision: no", "mixed_precision: no\n", "ok"),
                               ("yaml nested config: beside lr: nan", "config:\n  lr: 0.1\nlr: .nan\n", "refuse"),
                               ("yaml list bomb as model", "model: [&a [x, x, x], &b [*a, *a, *a], *b, *b]\n",
                                "refuse")]:
        path = tmp / f"y-{len(c.rows)}.yaml"
        path.write_text(text)
        train(name, "--config", str(path), expect=expect)
    train("--merge without LoRA", "--merge")
    train("--check-equivalence of batch 1", "--micro-batch", "1", "--check-equivalence")
    train("300-character output name", output=str(tmp / ("x" * 300)))
    link = tmp / "dangling"
    link.symlink_to(tmp / "nowhere" / "deeper")
    train("dangling symlink as --output", output=str(link))
    esc = tmp / "esc.jsonl"
    esc.write_text(json.dumps({"\x1b[31mred": "x"}) + "\n")
    result = c.invoke(fast(model, str(esc), str(tmp / "fl-esc")))
    c.record("flags2", "escape sequence in a JSONL field name", result, expect="refuse", wrong="\x1b" in result.output)
    home = tmp / "home"
    old_home, old_cwd = os.environ.get("HOME"), os.getcwd()
    os.environ["HOME"] = str(home)
    os.chdir(tmp)
    try:
        result = c.invoke(fast(model, data, "~/runs/x"))
    finally:
        os.environ["HOME"] = old_home or ""
        os.chdir(old_cwd)
    c.record("flags2", "--output ~/runs/x", result, expect="ok", wrong=(tmp / "~").exists())
