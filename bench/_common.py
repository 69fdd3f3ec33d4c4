"""Helpers shared by the benchmarks: model building, deterministic data, timing, JSON output.

The benchmarks compare memfit with what users would otherwise run, so everything that is not
the thing being measured (model, data, seed, optimizer, steps) comes from here and is identical
for every contender.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Runs from a checkout (`python bench/x.py`) without installing the bench folder as a package.
BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


def set_threads(n: int) -> None:
    """Pin intra-op threads so contenders get the same CPU (the default is every core)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ``ru_maxrss`` in KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib * 1024) if sys.platform != "darwin" else int(kib)


def model_config(model: str, *, vocab_size: int | None = None):
    """A transformers config from a memfit preset (or checkpoint folder), never downloaded."""
    from memfit.spec.model import resolve_config

    config = resolve_config(model)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    return config


def build_model(config, *, seed: int, dtype: str = "fp32", device: str = "cpu"):
    """Random-init causal LM from ``config``; the seed makes every contender start from the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return model


def token_blocks(vocab_size: int, n_blocks: int, seq_len: int, seed: int):
    """``(n_blocks, seq_len)`` int64 token ids, uniform over the vocabulary, from a fixed seed.

    On a dense model the tokens' values do not change the work done, only the shapes do, so
    synthetic ids measure the same step as real text of the same packed length.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    # Ids 0-2 are pad/bos/eos in memfit's presets; keep them out so no label is ignored.
    return torch.randint(3, vocab_size, (n_blocks, seq_len), generator=gen)


def steady_tokens_per_s(step_ends: list[float], start: float, tokens_per_step: int, warmup: int) -> float:
    """Tokens/s over the steps after the first ``warmup`` ones (allocator and kernel warm-up excluded).

    ``step_ends[i]`` is the ``perf_counter`` time step ``i`` finished; ``start`` is when step 0 began.
    With ``warmup=0`` (or too few steps) the whole run counts.
    """
    if len(step_ends) > warmup and warmup > 0:
        t0, steps = step_ends[warmup - 1], len(step_ends) - warmup
    else:
        t0, steps = start, len(step_ends)
    elapsed = step_ends[-1] - t0
    return steps * tokens_per_step / elapsed if elapsed > 0 else 0.0


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def machine_info() -> dict[str, Any]:
    """Where the figures come from: they mean little without the machine and versions."""
    import accelerate
    import torch
    import transformers

    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
    return info


def write_json(path: str | os.PathLike | None, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON (``-`` or None: stdout)."""
    text = json.dumps(data, indent=2, default=str)
    if path in (None, "-"):
        print(text)
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons so the next ``Accelerator`` may use another precision.

    Accelerate keeps one ``AcceleratorState`` per process and refuses a second ``mixed_precision``;
    benchmarks that run several configurations in one process call this between them.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def fill_defaults(args, defaults: dict[str, Any], keys: tuple[str, ...], trace_workers: int) -> None:
    """The GPU scripts' unset options from their GPU or ``--dry-run`` defaults: ``keys`` taken as they are,
    comma lists (``models``, ``configs``) split, and trace workers (0 = inline on a dry run)."""
    for key in ("models", "configs"):
        if hasattr(args, key):
            value = getattr(args, key)
            setattr(args, key, value.split(",") if value else defaults.get(key))
    for key in keys:
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.trace_workers is None:
        args.trace_workers = 0 if args.dry_run else trace_workers


def dry_run_models(args, tmp: str) -> None:
    """``--dry-run`` without ``--models``: one tiny local checkpoint in ``tmp`` and one torch thread (the
    test machine is small and shared)."""
    if args.models is None:
        import _device as dev

        set_threads(1)
        args.models = [dev.make_dry_run_model(Path(tmp) / "dry-run-model")]


def cuda_missing(dry_run: bool) -> bool:
    """True (after printing the one-line error) when a GPU script runs without --dry-run and no GPU."""
    import torch

    if dry_run or torch.cuda.is_available():
        return False
    print("error: no CUDA device is visible; run with --dry-run to check the script on CPU.", file=sys.stderr)
    return True


def trainer_step_timer():
    """A transformers ``TrainerCallback`` that records when training starts (``.start``) and when each
    optimizer step ends (``.ends``), after waiting for queued GPU work so the times are real."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.start: float | None = None
            self.ends: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    return StepTimer()
