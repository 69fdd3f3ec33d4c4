"""Fault census (issue 14): bad inputs, corrupt checkpoints, mismatched resumes, full disks and kill -9.

Runs every case through the CLI in this process (click's CliRunner) and classifies what happened:

- ``sentence``: refused with one ``error:`` line and exit 1, no traceback (what a user error must do);
- ``ok``: succeeded and did the right thing (a resume that continued the right run, a fallback to an
  intact checkpoint);
- ``traceback``: an exception other than memfit's ``UserError`` escaped;
- ``accepted``: exit 0 although the input is invalid (``--max-steps -3``), or the run did the wrong
  thing silently (NaN weights saved, another run's data used, user files overwritten).

For checkpoint and disk cases it also checks that the checkpoints that were intact before the case
are still there, byte for byte (``lost``). ``--kills N`` adds N ``kill -9`` trials on a subprocess that
checkpoints every step, each followed by ``--resume``. Run it against any checkout:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src python bench/faults.py --kills 4 --json faults.json
    OMP_NUM_THREADS=1 PYTHONPATH=/work/main/src python bench/faults.py --kills 4   # before

Cases that use a flag only the new code has (``--init random``) are marked ``new_flag`` and skipped
on a checkout without it.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ACCELERATE_USE_CPU", "true")

TINY = {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def fast(model: str, data: str, output: str, *extra: str) -> list[str]:
    return ["train", "--model", model, "--tokenizer", "byte", "--data", data, "--seq-len", "32",
            "--micro-batch", "2", "--max-steps", "2", "--eval-every", "0", "--samples", "0", "--no-packing",
            "--output", output, *extra]


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative path -> hex)."""
    if not folder.is_dir():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class Census:
    def __init__(self, root: Path) -> None:
        from click.testing import CliRunner

        self.root, self.runner, self.rows = root, CliRunner(), []
        self.has_init = None

    def invoke(self, args: list[str]):
        from memfit.cli import cli

        return self.runner.invoke(cli, args)

    def record(self, category: str, name: str, result, *, expect: str, wrong: bool = False,
               lost: bool = False) -> dict:
        exc = result.exception
        traceback = exc is not None and not isinstance(exc, SystemExit)
        # memfit's "error: ..." line, or click's own usage error ("Error: Invalid value ...", exit 2)
        errors = [line for line in result.output.splitlines() if line.lower().startswith("error: ")]
        if traceback:
            outcome = "traceback"
        elif result.exit_code == 0:
            outcome = "accepted" if expect == "refuse" or wrong else "ok"
        else:
            outcome = "sentence" if len(errors) == 1 else "other-exit"
        message = errors[0] if errors else (f"{type(exc).__name__}: {str(exc)[:150]}" if traceback else "")
        row = {"category": category, "case": name, "exit": result.exit_code, "outcome": outcome,
               "lost": lost, "message": message}
        self.rows.append(row)
        print(f"{category:11} {name:38} exit {result.exit_code}  {outcome:9} {'LOST ' if lost else ''}{message[:110]}",
              flush=True)
        return row


def model_folder(root: Path, *, weights: bool = True, **overrides) -> Path:
    """A Hugging Face model folder: config.json, and (``weights``) a saved random tiny Llama."""
    folder = root
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY, **overrides}
    if weights:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(**cfg)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def write_data(root: Path) -> str:
    path = root / "qa.jsonl"
    rng = random.Random(0)
    with path.open("w") as fh:
        for _ in range(40):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            fh.write(json.dumps({"prompt": f"{a}+{b}=", "completion": f" {a + b}."}) + "\n")
    return str(path)


# --------------------------------------------------------------------------------------------- cases
def model_cases(c: Census, tmp: Path, data: str) -> None:
    def cfg_file(name: str, text: str) -> str:
        folder = tmp / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        return str(folder / "config.json")

    bad = {
        "config.json not JSON (folder)": (str(Path(cfg_file("notjson", "{oops")).parent), None),
        "config.json empty (file)": (cfg_file("empty", ""), None),
        "hidden_size 0": (cfg_file("h0", json.dumps({**TINY, "hidden_size": 0})), None),
        "vocab_size -5": (cfg_file("v5", json.dumps({**TINY, "vocab_size": -5})), None),
        "kv heads 3 of 4": (cfg_file("kv3", json.dumps({**TINY, "num_key_value_heads": 3})), None),
        "heads 3 of hidden 64": (cfg_file("h3", json.dumps({**TINY, "num_attention_heads": 3,
                                                             "num_key_value_heads": 3})), None),
        "0 layers": (cfg_file("l0", json.dumps({**TINY, "num_hidden_layers": 0})), None),
        "vocab smaller than tokenizer": (cfg_file("v100", json.dumps({**TINY, "vocab_size": 100})), None),
    }
    for name, (model, _) in bad.items():
        for command in ("train", "estimate", "plan"):
            if command == "train":
                args = fast(model, data, str(tmp / f"out-{len(c.rows)}"))
            elif command == "estimate":
                args = ["estimate", model, "--seq-len", "32", "--micro-batch", "1"]
            else:
                args = ["plan", model, "--budget", "8GiB", "--seq-len", "32", "--batch", "4"]
            if name == "vocab smaller than tokenizer" and command != "train":
                continue  # estimate/plan have no tokenizer
            c.record("model", f"{command}: {name}", c.invoke(args), expect="refuse")
    bare = model_folder(tmp / "bare", weights=False)
    c.record("model", "train: config-only folder", c.invoke(fast(str(bare), data, str(tmp / "o-bare"))),
             expect="refuse")
    if c.has_init:
        c.record("model", "train: config-only --init random", c.invoke(
            fast(str(bare), data, str(tmp / "o-bare2"), "--init", "random")), expect="ok")
    trunc = model_folder(tmp / "trunc")
    weights = trunc / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    c.record("model", "train: truncated weights", c.invoke(fast(str(trunc), data, str(tmp / "o-trunc"))),
             expect="refuse")


def flag_cases(c: Census, tmp: Path, model: str, data: str) -> None:
    def nan_weights(out: Path) -> bool:
        from safetensors.torch import load_file

        f = out / "model.safetensors"
        return f.is_file() and any(bool(t.float().isnan().any() or t.float().isinf().any())
                                   for t in load_file(str(f)).values())

    refuse = {
        "--lr nan": ["--lr", "nan"], "--lr -1": ["--lr", "-1"], "--lr inf": ["--lr", "inf"],
        "--weight-decay nan": ["--weight-decay", "nan", "--optimizer", "adamw"],
        "--max-steps -3": ["--max-steps", "-3"], "--warmup-steps -5": ["--warmup-steps", "-5"],
        "--lora-alpha -16": ["--lora-r", "4", "--lora-alpha", "-16"], "--save-every -1": ["--save-every", "-1"],
        "--epochs 0": ["--epochs", "0"], "--max-grad-norm nan": ["--max-grad-norm", "nan"],
        "--eval-fraction 1.5": ["--eval-fraction", "1.5"], "--lora-dropout nan": ["--lora-r", "4", "--lora-dropout", "nan"],
        "--attn flash_attention_2": ["--attn-implementation", "flash_attention_2"],
    }
    for name, extra in refuse.items():
        out = tmp / f"flag-{len(c.rows)}"
        result = c.invoke(fast(model, data, str(out), *extra))
        c.record("flags", name, result, expect="refuse", wrong=nan_weights(out))
    existing = tmp / "a-file"
    existing.write_text("mine")
    c.record("flags", "--output an existing file", c.invoke(fast(model, data, str(existing))), expect="refuse")
    ro = tmp / "readonly"
    ro.mkdir()
    with read_only(ro):
        c.record("flags", "--output in a read-only folder", c.invoke(fast(model, data, str(ro / "run"))),
                 expect="refuse")
        c.record("flags", "plan --output in a read-only folder", c.invoke(
            ["plan", "tiny", "--budget", "8GiB", "--output", str(ro / "plan.yaml")]), expect="refuse")
    c.record("flags", "plan --output a folder", c.invoke(
        ["plan", "tiny", "--budget", "8GiB", "--output", str(tmp)]), expect="refuse")
    for name, text in {"yaml lr: fast": "lr: fast\n", "yaml max_steps: ten": "max_steps: ten\n",
                       "yaml packing: 3": "packing: 3\n", "yaml unknown key max_step": "max_step: 5\n",
                       "yaml lora_r: [4]": "lora_r: [4]\n", "yaml seq_len: 3.5": "seq_len: 3.5\n"}.items():
        path = tmp / f"cfg-{len(c.rows)}.yaml"
        path.write_text(text)
        out = tmp / f"yaml-{len(c.rows)}"
        c.record("flags", name, c.invoke(fast(model, data, str(out), "--config", str(path))), expect="refuse")


@contextmanager
def read_only(folder: Path):
    """A read-only folder; as root permissions are not enforced, so also refuse writes below it by patch."""
    folder.chmod(0o555)
    real_mkdir, real_open = Path.mkdir, open

    def mkdir(self, *a, **k):
        if str(self).startswith(str(folder) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    try:
        with mock.patch.object(Path, "mkdir", mkdir), mock.patch("os.access", lambda p, m: not str(p).startswith(str(folder))):
            yield
    finally:
        folder.chmod(0o755)
        del real_open


def base_run(c: Census, tmp: Path, model: str, data: str, name: str, *extra: str) -> Path:
    """A run of 4 steps with checkpoints at steps 2 and 4, to corrupt/resume copies of."""
    out = tmp / name
    result = c.invoke(fast(model, data, str(out), "--max-steps", "4", "--save-every", "2", "--optimizer", "adamw",
                           *extra))
    assert result.exit_code == 0, result.output
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def checkpoint_cases(c: Census, tmp: Path, model: str, data: str) -> None:
    base = base_run(c, tmp, model, data, "ckpt-base")

    def corrupt_truncate(step: Path):
        f = step / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])

    corruptions = {
        "truncated model.safetensors": corrupt_truncate,
        "empty model.safetensors": lambda s: (s / "model.safetensors").write_bytes(b""),
        "missing optimizer.bin": lambda s: (s / "optimizer.bin").unlink(),
        "missing scheduler.bin": lambda s: (s / "scheduler.bin").unlink(),
        "garbage trainer_state.json": lambda s: (s / "trainer_state.json").write_text("{garbage"),
        "trainer_state.json a list": lambda s: (s / "trainer_state.json").write_text("[1, 2]"),
        "trainer_state step a string": lambda s: (s / "trainer_state.json").write_text('{"step": "four"}'),
        "unsafe pickle in optimizer.bin": unsafe_pickle,
    }
    for name, corrupt in corruptions.items():
        run = copy_run(base, tmp / f"ck-{len(c.rows)}")
        corrupt(run / "checkpoints" / "step-4")
        before = digest(run / "checkpoints" / "step-2")
        result = c.invoke(fast(model, data, str(run), "--resume", "--max-steps", "5", "--save-every", "2",
                               "--optimizer", "adamw"))
        lost = not before.items() <= digest(run / "checkpoints" / "step-2").items() and not _newer_intact(run)
        c.record("checkpoint", name, result, expect="ok", lost=lost)
    run = copy_run(base, tmp / f"ck-{len(c.rows)}")
    shutil.rmtree(run / "checkpoints" / "step-4")
    (run / "checkpoints" / "step-4").write_text("a file")
    c.record("checkpoint", "checkpoint path is a file", c.invoke(
        fast(model, data, str(run), "--resume", "--max-steps", "5", "--optimizer", "adamw")), expect="ok")
    run = copy_run(base, tmp / f"ck-{len(c.rows)}")
    for step in ("step-2", "step-4"):
        corrupt_truncate(run / "checkpoints" / step)
    c.record("checkpoint", "no intact checkpoint", c.invoke(
        fast(model, data, str(run), "--resume", "--max-steps", "5", "--optimizer", "adamw")), expect="refuse")


def _newer_intact(run: Path) -> bool:
    """A resumed run that rotated step-2 out after writing newer checkpoints lost nothing."""
    return (run / "checkpoints" / "step-5").is_dir() or (run / "checkpoints" / "step-6").is_dir()


def unsafe_pickle(step: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (step / "optimizer.bin").write_bytes(pickle.dumps(Evil()))


def resume_cases(c: Census, tmp: Path, model: str, data: str) -> None:
    full = base_run(c, tmp, model, data, "resume-full")
    other_model = tmp / "other" / "config.json"
    other_model.parent.mkdir()
    other_model.write_text(json.dumps({**TINY, "hidden_size": 128, "intermediate_size": 256}))
    cases = {
        "another model": ["--model", str(other_model)],
        "LoRA on a full run": ["--lora-r", "4"],
        "another optimizer": ["--optimizer", "sgd"],
        "another seq-len": ["--seq-len", "48"],
    }
    for name, extra in cases.items():
        run = copy_run(full, tmp / f"rs-{len(c.rows)}")
        before = digest(run / "checkpoints")
        args = ["train", "--output", str(run), "--resume", "--max-steps", "5", *extra]
        if name == "another model":
            args += ["--tokenizer", "byte"]
        result = c.invoke(args)
        lost = not before.items() <= digest(run / "checkpoints").items()
        c.record("resume", f"--resume with {name}", result, expect="refuse", lost=lost)
    # The documented `memfit train --output X --resume`: must continue X's model and data.
    run = copy_run(full, tmp / f"rs-{len(c.rows)}")
    result = c.invoke(["train", "--output", str(run), "--resume", "--max-steps", "5"])
    wrong = _resumed_elsewhere(run, data)
    c.record("resume", "bare --resume continues the run", result, expect="ok", wrong=wrong)
    lora = base_run(c, tmp, model, data, "resume-lora", "--lora-r", "4")
    run = copy_run(lora, tmp / f"rs-{len(c.rows)}")
    result = c.invoke(["train", "--output", str(run), "--resume", "--max-steps", "5"])
    c.record("resume", "bare --resume of a LoRA run", result, expect="ok", wrong=_resumed_elsewhere(run, data))


def _resumed_elsewhere(run: Path, data: str) -> bool:
    try:
        doc = json.loads((run / "run.json").read_text())
    except (OSError, ValueError):
        return True
    return doc.get("settings", {}).get("data") != data or doc.get("steps") != 5


def folder_cases(c: Census, tmp: Path, data: str) -> None:
    mine = model_folder(tmp / "mymodel")
    (mine / "README.md").write_text("my notes")
    before = digest(mine)
    result = c.invoke(fast(str(mine), data, str(mine), "--overwrite"))
    c.record("folder", "--output = --model folder (--overwrite)", result, expect="refuse",
             wrong=digest(mine) != before)
    user = tmp / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    result = c.invoke(fast(str(tmp / "m" / "config.json"), data, str(user)))
    c.record("folder", "--output a user folder without a run", result, expect="refuse",
             wrong=sorted(p.name for p in user.iterdir()) != ["notes.txt"])
    data_dir = Path(data).parent
    result = c.invoke(fast(str(tmp / "m" / "config.json"), data, str(data_dir), "--overwrite"))
    c.record("folder", "--output = --data folder (--overwrite)", result, expect="refuse",
             wrong=(data_dir / "metrics.jsonl").exists())
    bad_data = tmp / "bad.jsonl"
    bad_data.write_text("{oops\n")
    out = tmp / "failed-early"
    result = c.invoke(fast(str(tmp / "m" / "config.json"), str(bad_data), str(out)))
    c.record("folder", "failure before training leaves no folder", result, expect="refuse", wrong=out.exists())
    # Two runs into one folder: the second starts while the first is training.
    out = tmp / "shared"
    first = subprocess.Popen([sys.executable, "-m", "memfit", *fast(str(tmp / "m" / "config.json"), data, str(out),
                                                                     "--max-steps", "400")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.2)
        result = c.invoke(fast(str(tmp / "m" / "config.json"), data, str(out), "--overwrite"))
        c.record("folder", "second run into a running run's folder", result, expect="refuse")
    finally:
        first.kill()
        first.wait()


def disk_cases(c: Census, tmp: Path, model: str, data: str) -> None:
    """ENOSPC injected into the writer after ``after`` successful writes, leaving a half-written file."""
    import accelerate.checkpointing as ack
    import transformers.modeling_utils as tmu

    def full_disk(real, after: int):
        calls = {"n": 0}

        def writer(obj, path, *a, **k):
            calls["n"] += 1
            if calls["n"] > after:
                Path(path).write_bytes(b"\0" * 64)  # what a full disk leaves: a partial file
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(obj, path, *a, **k)
        return writer

    # accelerate's save() writes the model, optimizer and scheduler of a checkpoint (3 calls per checkpoint)
    for name, after in {"first checkpoint": 0, "second checkpoint": 3}.items():
        out = tmp / f"disk-{len(c.rows)}"
        with mock.patch.object(ack, "save", full_disk(ack.save, after)):
            result = c.invoke(fast(model, data, str(out), "--max-steps", "4", "--save-every", "2",
                                   "--optimizer", "adamw"))
        intact = [p.name for p in sorted((out / "checkpoints").glob("step-*"))]
        lost = name == "second checkpoint" and "step-2" not in intact
        c.record("disk", f"ENOSPC in {name}", result, expect="refuse", lost=lost)
        if name == "second checkpoint":
            r2 = c.invoke(fast(model, data, str(out), "--resume", "--max-steps", "4", "--save-every", "2",
                               "--optimizer", "adamw"))
            c.record("disk", "resume after ENOSPC", r2, expect="ok")
    out = tmp / f"disk-{len(c.rows)}"
    with mock.patch.object(tmu, "safe_save_file", full_disk(tmu.safe_save_file, 0)):
        result = c.invoke(fast(model, data, str(out), "--max-steps", "2", "--save-every", "2"))
    half = (out / "model.safetensors").is_file() and (out / "model.safetensors").stat().st_size == 64
    c.record("disk", "ENOSPC in the final export", result, expect="refuse", wrong=half)


def kill_trials(c: Census, tmp: Path, model: str, data: str, trials: int, seed: int = 0) -> list[dict]:
    """kill -9 a run that checkpoints every step at a random moment, then resume it."""
    rng = random.Random(seed)
    out_rows = []
    for i in range(trials):
        out = tmp / f"kill-{i}"
        args = fast(model, data, str(out), "--max-steps", "200", "--save-every", "1", "--optimizer", "adamw")
        proc = subprocess.Popen([sys.executable, "-m", "memfit", *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while not (out / "checkpoints").is_dir() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        steps = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if p.name[5:].isdigit())
        target = (max(steps) if steps else 0) + 1
        result = c.invoke(fast(model, data, str(out), "--resume", "--max-steps", str(target), "--save-every", "1",
                               "--optimizer", "adamw"))
        row = c.record("kill", f"kill -9 trial {i} ({len(steps)} ckpts)", result, expect="ok")
        out_rows.append(row)
    return out_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--only", default=None, help="comma-separated categories")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import faults_refused  # issue 40's cases
    import faults_runfolder  # issue 27's cases (beside this file)
    import memfit.cli.train as train_cli

    sys.path.insert(0, str(Path(__file__).parent))
    import _faults_inputs as inputs  # issue 27's input cases: user files, model config fields, flags and YAML

    tmp = Path(tempfile.mkdtemp(prefix="memfit-faults-"))
    c = Census(tmp)
    c.has_init = any(p.name == "init" for p in train_cli.command.params)
    data = write_data(tmp)
    model = str(Path(model_folder(tmp / "m", weights=False)) / "config.json")
    only = set(args.only.split(",")) if args.only else None
    started = time.time()
    plan = [("model", lambda: model_cases(c, tmp, data)), ("flags", lambda: flag_cases(c, tmp, model, data)),
            ("checkpoint", lambda: checkpoint_cases(c, tmp, model, data)),
            ("resume", lambda: resume_cases(c, tmp, model, data)), ("folder", lambda: folder_cases(c, tmp, data)),
            ("disk", lambda: disk_cases(c, tmp, model, data)),
            ("runfolder", lambda: faults_runfolder.runfolder_cases(c, tmp, model, data)),
            ("lineage", lambda: faults_runfolder.lineage_cases(c, tmp, model, data)),
            ("readback", lambda: faults_runfolder.readback_cases(c, tmp, model, data)),
            ("space", lambda: faults_runfolder.space_cases(c, tmp, model, data)),
            ("input", lambda: inputs.input_cases(c, tmp, model, data, fast)),
            ("config", lambda: inputs.config_cases(c, tmp, data, fast, TINY)),
            ("flags2", lambda: inputs.flag_cases(c, tmp, model, data, fast)),
            ("refused", lambda: faults_refused.refused_cases(c, tmp, model, data)),
            ("kill", lambda: kill_trials(c, tmp, model, data, args.kills))]
    for name, fn in plan:
        if only is None or name in only:
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - a harness failure is reported, the census goes on
                print(f"{name}: harness failed: {type(err).__name__}: {err}", flush=True)
    table = defaultdict(Counter)
    for row in c.rows:
        table[row["category"]][row["outcome"]] += 1
        table[row["category"]]["lost"] += int(row["lost"])
    print(f"\n{'category':11} cases  sentence  ok  traceback  accepted/wrong  other  checkpoints-lost")
    for cat, counts in table.items():
        total = sum(v for k, v in counts.items() if k != "lost")
        print(f"{cat:11} {total:5}  {counts['sentence']:8}  {counts['ok']:2}  {counts['traceback']:9}  "
              f"{counts['accepted']:14}  {counts['other-exit']:5}  {counts['lost']:16}")
    print(f"({time.time() - started:.0f} s, folder {tmp})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": c.rows}, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
