"""A normal run shows no warnings caused by memfit's use of its dependencies, and no foreign progress bars.

pyproject's ``filterwarnings`` ignores Deprecation/FutureWarning for the whole suite, so these tests
record warnings themselves (``catch_warnings(record=True)`` + ``simplefilter("always")``).

``test_the_cli_prints_nothing_foreign`` runs the real CLI in one fresh process (bitsandbytes logs when it
is imported, and a library's log handler writes to the stderr of the process that first imported it), with
Python's default warning filters, as a user's shell does, over the cases of issue 22: a normal run, a
tied-embedding run, LoRA and QLoRA with ``--merge``, a bad JSON file. It fails on any line that looks like
another library's output (``FOREIGN``), and on any log record of warning level or above that a non-memfit
logger hands to its handlers (the driver reports those itself: most libraries log the bare message).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from _accuracy_models import accuracy_config
from _train_helpers import TINY_LLAMA, foreign_lines, write_qa
from memfit.settings.config import RunConfig, TrainConfig
from memfit.training.loop import train


def _warnings_of(config: TrainConfig) -> list[str]:
    """Every warning of the run that a user could see: all but a DeprecationWarning a dependency raises about
    its own code (torch's ``torch.jit.script_method`` inside ``torch.utils.mkldnn``, imported when
    bitsandbytes calls ``torch.compile`` at import), which Python's default filters hide (they show
    DeprecationWarning only when it is attributed to ``__main__``); one attributed to memfit's code stays."""
    import memfit

    own = str(Path(memfit.__file__).parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(config, show=True)
    assert summary["steps"] == config.length.max_steps
    return [f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}" for w in caught
            if not issubclass(w.category, DeprecationWarning) or w.filename.startswith(own)]


@pytest.mark.heavy
@pytest.mark.parametrize("lora_r", [0, 8], ids=["full", "lora"])
def test_demo_with_checkpointing_warns_nothing(tmp_path, lora_r):
    """The demo's settings (tiny preset, shipped corpus, eval, samples) for 2 steps with checkpointing.

    Before memfit used transformers 5's ``activation_checkpointing_enable`` (and hid PEFT's read of
    ``is_gradient_checkpointing``) this caught two FutureWarnings per run.
    """
    run = RunConfig.of(seq_len=128, micro_batch=4, grad_checkpointing=True, lora_r=lora_r)
    config = TrainConfig.of(run=run, max_steps=2, eval_every=2, samples=1, output=str(tmp_path / "out"),
                         merge=bool(lora_r))
    assert _warnings_of(config) == []


def test_loading_a_checkpoint_shows_no_loading_bar(tmp_path, capfd):
    """transformers 5 prints a tqdm "Loading weights" bar inside from_pretrained; memfit switches it off."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    folder = tmp_path / "ckpt"
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    capfd.readouterr()
    (tmp_path / "data.txt").write_text("\n\n".join(f"Tom found {i} kites. The end." for i in range(40)))
    config = TrainConfig.of(model=str(folder), tokenizer="byte", data=str(tmp_path / "data.txt"),
                         run=RunConfig.of(seq_len=64, micro_batch=2, grad_checkpointing=True), max_steps=1,
                         eval_every=0, samples=0, output=str(tmp_path / "out"))
    assert _warnings_of(config) == []
    err = capfd.readouterr().err
    assert "Loading weights" not in err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored after the load
    assert json.loads((tmp_path / "out" / "run.json").read_text())["steps"] == 1


# ------------------------------------------------------------------------------------- the real CLI, one process


DRIVER = r"""
import logging, sys

_callHandlers = logging.Logger.callHandlers


def _report(self, record):  # every record a logger hands to its handlers, after the logger's filters
    if record.levelno >= logging.WARNING and not record.name.startswith("memfit"):
        sys.stderr.write(f"foreign log record {record.name} {record.levelname}: {record.getMessage()}\n")
    return _callHandlers(self, record)


logging.Logger.callHandlers = _report
from memfit.cli import cli  # noqa: E402

for line in open(sys.argv[1]):
    name, *args = line.split("\t")
    for stream in (sys.stdout, sys.stderr):
        print(f"=== case {name}", file=stream, flush=True)
    try:
        cli.main(args=[a.strip() for a in args], prog_name="memfit")
        code = 0
    except SystemExit as err:
        code = err.code
    for stream in (sys.stdout, sys.stderr):
        print(f"=== exit {code}", file=stream, flush=True)
"""


def _qlora_refusal() -> str | None:
    from memfit.integrations import quant_support

    return quant_support.refusal("cpu", "--quantize 4bit")


def _cases(tmp: Path) -> dict[str, list[str]]:
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    tied = tmp / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({**TINY_LLAMA, "tie_word_embeddings": True}))
    bad = tmp / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "cut off\n')
    common = ["--tokenizer", "byte", "--data", write_qa(tmp, n=40), "--seq-len", "48", "--micro-batch", "2",
              "--max-steps", "2", "--eval-every", "2", "--eval-fraction", "0.1", "--samples", "1",
              "--save-every", "1", "--warmup-steps", "0"]
    # issue 34: a family with no hand-written recipe (Qwen 3) on an empty recipe cache: the first estimate, plan
    # and train derive its recipes (torch's ModTracker warned five times per derivation), offline
    qwen3 = tmp / "qwen3"
    accuracy_config("qwen3").save_pretrained(qwen3)
    shape = ["--seq-len", "48", "--micro-batch", "2"]
    cases = {
        "derived-estimate": ["estimate", str(qwen3 / "config.json"), *shape, "--device", "cpu"],
        # GPT-2's class name maps to no transformers loss: "`loss_type=None` ... unrecognized" on its first forward
        "gpt2-exact": ["estimate", "gpt2", *shape, "--device", "cpu", "--exact"],
        "derived-plan": ["plan", str(qwen3 / "config.json"), "--budget", "2GiB", "--seq-len", "48", "--batch", "4"],
        "derived-train": ["train", "--model", str(qwen3 / "config.json"), *common],
        "derived-qlora": ["train", "--model", str(qwen3 / "config.json"), "--quantize", "4bit", "--lora-r", "4",
                          *common],
        "normal": ["train", "--model", str(model / "config.json"), *common],
        "tied": ["train", "--model", str(tied / "config.json"), *common],
        "lora-merge": ["train", "--model", str(model / "config.json"), "--lora-r", "4", "--merge", *common],
        "qlora-merge": ["train", "--model", str(tied / "config.json"), "--quantize", "4bit", "--lora-r", "4",
                        "--merge", *common],
        "bad-json": ["train", "--model", str(model / "config.json"), *common[:2], "--data", str(bad)],
    }
    if _qlora_refusal():
        del cases["qlora-merge"], cases["derived-qlora"]
    return {name: [*args, "--output", str(tmp / f"out-{name}")] if args[0] == "train" else args
            for name, args in cases.items()}


def _sections(text: str) -> dict[str, tuple[int, str]]:
    found = re.findall(r"^=== case (\S+)\n(.*?)^=== exit (\S+)$", text, flags=re.M | re.S)
    return {name: (int(code) if code.lstrip("-").isdigit() else code, body) for name, body, code in found}


@pytest.fixture(scope="module")
def cli_output(tmp_path_factory):
    """``{case: (exit code, stdout, stderr)}`` of the cases, run one after the other in one fresh process."""
    tmp = tmp_path_factory.mktemp("clean-cli")
    cases = _cases(tmp)
    (tmp / "cases.tsv").write_text("".join("\t".join([name, *args]) + "\n" for name, args in cases.items()))
    (tmp / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "MEMFIT_CACHE_DIR": str(tmp / "empty-recipe-cache")}
    proc = subprocess.run([sys.executable, str(tmp / "driver.py"), str(tmp / "cases.tsv")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp)
    out, err = _sections(proc.stdout), _sections(proc.stderr)
    assert proc.returncode == 0 and out.keys() == err.keys() == cases.keys(), proc.stderr[-3000:]
    return {name: (out[name][0], out[name][1], err[name][1]) for name in cases}


_foreign = foreign_lines


@pytest.mark.heavy
@pytest.mark.parametrize("case", ["gpt2-exact", "derived-estimate", "derived-plan", "derived-train", "derived-qlora", "normal", "tied",
                                  "lora-merge", "qlora-merge", "bad-json"])
def test_the_cli_prints_nothing_foreign(cli_output, case):
    """Each case's stdout and stderr hold memfit's lines only (the run writes checkpoints, evaluates, samples),
    with ``HF_HUB_OFFLINE=1`` and, for the derived family's first commands, an empty recipe cache."""
    if case in ("qlora-merge", "derived-qlora") and _qlora_refusal():
        pytest.skip(_qlora_refusal())
    code, out, err = cli_output[case]
    assert _foreign(out + err) == [], err[-3000:]
    if case == "bad-json":  # memfit's one sentence, and nothing before it
        assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    elif case in ("derived-estimate", "derived-plan"):
        assert code == 0 and "memfit: deriving a memory recipe for qwen3" in err, err[-3000:]
    elif case == "gpt2-exact":
        assert code == 0 and "(exact)" in out, err[-3000:]
    else:
        assert code == 0 and "memfit train: summary" in out, err[-3000:]


def test_the_foreign_patterns_catch_what_issue_22_saw():
    """The lines issue 22 reported, and memfit's own lines that must pass (its ``warning:``, a summary row)."""
    seen = [
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure",
        "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but check by verifying",
        "/x/peft/tuners/lora/bnb.py:377: UserWarning: Merge lora module to 4-bit linear may get different generations",
        "  warnings.warn(",
        "Failed to load JSON from file '/x/bad.jsonl' with error <class 'pyarrow.lib.ArrowInvalid'>: JSON parse error",
        "foreign log record transformers.generation.utils WARNING: Setting `pad_token_id` to `eos_token_id`:2",
        "Loading weights: 100%|██████████| 12/12 [00:00<00:00, 3.2 it/s]",
    ]
    assert all(_foreign(line) for line in seen)
    own = ["warning: the held-out loss 5.099 is not below the unigram baseline 3.038", "step 2/2  loss 5.954",
           "│ steps                        │ 2 optimizer steps, 8 sequences                │",
           "error: bad.jsonl line 2 is not valid JSON (Unterminated string starting at)."]
    assert not any(_foreign(line) for line in own)


def test_dropped_log_messages_are_exactly_the_named_ones(capsys):
    """The filters of memfit.integrations.hf_compat drop their one message and let every other record of that logger
    through; bitsandbytes' message (logged only on a CPU with AVX512-BF16, at import) is checked against its
    installed source, so a reworded message would fail here rather than print again."""
    import inspect
    import logging

    from memfit.integrations import hf_compat

    cases = [
        (hf_compat.quiet_bnb_kernel_notice, "bitsandbytes.backends.cpu.ops",
         "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'."),
        (hf_compat.quiet_tied_weight_save, "accelerate.utils.other",
         "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving. This should be OK"),
        (hf_compat.quiet_json_parse_log, "datasets.packaged_modules.json.json",
         "Failed to load JSON from file 'x.jsonl' with error <class 'ValueError'>: bad"),
        # DeepSpeed's, seen in CI (its venv has the deepspeed extra) before the "normal" case's first line
        (hf_compat.quiet_deepspeed_cpu_notice, "DeepSpeed",
         "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."),
    ]
    for quiet, name, message in cases:
        logger = logging.getLogger(name)
        records = []
        collect = logging.Handler(logging.WARNING)
        collect.emit = records.append
        logger.addHandler(collect)
        try:
            with quiet():
                logger.warning(message)
                logger.warning("Something else went wrong")
            logger.warning(message)  # outside: shown again
        finally:
            logger.removeHandler(collect)
        assert [r.getMessage() for r in records] == ["Something else went wrong", message], name
    bnb = pytest.importorskip("bitsandbytes.backends.cpu.ops")
    assert '"Failed to load CPU gemm_4bit_forward from kernels-community: %s.' in inspect.getsource(bnb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hf_compat.quiet_4bit_merge():
            warnings.warn("Merge lora module to 4-bit linear may get different generations due to rounding errors.", stacklevel=1)
            warnings.warn("Another warning", stacklevel=1)
    assert [str(w.message) for w in caught] == ["Another warning"]


def test_every_cli_command_drops_the_bitsandbytes_notice(monkeypatch):
    """The CLI holds the filter around every command: bitsandbytes is imported (by PEFT or transformers) at
    an unknown point inside one, on every rank."""
    import logging

    from click.testing import CliRunner

    from memfit.cli import cli
    from memfit.cli import presets as presets_cli

    records = []
    collect = logging.Handler(logging.WARNING)
    collect.emit = records.append
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    logger.addHandler(collect)
    real = presets_cli.command.callback

    def logging_callback(*args, **kwargs):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...",
                       ModuleNotFoundError("No module named 'kernels'"))
        return real(*args, **kwargs)

    monkeypatch.setattr(presets_cli.command, "callback", logging_callback)
    try:
        result = CliRunner().invoke(cli, ["presets"])
    finally:
        logger.removeHandler(collect)
    assert result.exit_code == 0 and records == []
