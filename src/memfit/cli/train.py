"""``memfit train``: parse flags (and ``--config FILE``), call ``memfit.train``, render."""

# Inside a function: accelerate (2.5 s to import; python -X importtime, 2026-12-06, this shared 2-core machine), after the run: a refused input exits
# before torch loads (tests/test_faults_inputs.py).
from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import click

import memfit
from memfit.cli.options import MEMORY_KEYS, explicit, flags, memory_options, with_options
from memfit.errors import printable
from memfit.report.summary import json_safe, print_summary
from memfit.settings.config import TrainConfig, check_lora_options, read_config_file
from memfit.settings.defaults import SHAPE

EPILOG = """\b
Examples:
  memfit train                                   # demo: tiny preset on the shipped corpus (CPU: < 3 min),
                                                 # written to runs/tiny-<YYYYmmdd-HHMMSS>
  memfit train --model Qwen/Qwen2.5-0.5B-Instruct --data chat.jsonl --lora-r 16   # a Hub model
  memfit train --data notes.jsonl --model ./my-ckpt --lora-r 16 --merge --output runs/notes
  memfit train --data chats.jsonl --model ./my-instruct --lora-r 16   # {"messages": [...]}: loss on replies
  memfit train --data data.parquet --text-field body    # also .csv/.json/.arrow, save_to_disk, org/name
  memfit train --model ./my-ckpt --budget 24GiB --batch 32 --seq-len 1024   # plan, then train
  memfit train --tracker tensorboard --output runs/tb   # then: tensorboard --logdir runs/tb
  memfit train --config plan.yaml --max-steps 500      # flags typed here override the file
  memfit train --output runs/demo --resume             # continue from the latest checkpoint
  memfit train --check-equivalence --micro-batch 2 --grad-accum 4   # 8x1 vs 2x4: same weights?
  accelerate launch --num_processes 2 -m memfit train         # data-parallel on 2 GPUs
  ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 -m memfit train   # 2 CPU processes

Defaults: """ + SHAPE + """ The preamble names every default derived from your data or method."""


#: train's flags that are no setting of the schema: how this invocation reads its settings.
_COMMAND_ONLY = [
    click.option("--no-packing", is_flag=True, hidden=True, help="Old spelling of --packing none."),
    click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                 help="YAML file with any of these settings; flags typed here override it."),
]


def _read_yaml(path: str) -> dict[str, Any]:
    return read_config_file(path)


def build_config(ctx: click.Context, kwargs: dict[str, Any]) -> TrainConfig:
    """Defaults < ``--config`` YAML < flags typed on the command line."""
    config_file = kwargs.pop("config_file")
    if kwargs.pop("no_packing", False):
        kwargs["packing"] = "none"
        ctx.set_parameter_source("packing", click.core.ParameterSource.COMMANDLINE)
    typed = explicit(ctx, kwargs)
    from_file = _read_yaml(config_file) if config_file else {}
    if from_file.get("trust_remote_code") is True and "trust_remote_code" not in typed:
        click.echo(f"warning: {printable(config_file)} turns on trust_remote_code: the model folder's own Python code will "
                   "run; remove it from the file unless you trust that code.", err=True)
    if from_file:  # every value in the file is checked, even one a typed flag overrides
        TrainConfig.from_flat({**kwargs, **from_file})
    merged = {**kwargs, **from_file, **typed}
    chosen = set(typed) | set(from_file)
    check_lora_options(chosen, "lora_r" in chosen)

    model, data = merged.get("model"), merged.get("data")  # YAML's `data: 7` is the file "7", as TrainConfig reads it
    if model is not None:  # None (YAML's null): the default model
        memfit.check_inputs(str(model), None if data is None else str(data), merged.get("revision"))  # before torch
    if "mixed_precision" not in chosen:
        merged["mixed_precision"] = memfit.default_precision().value  # bf16 autocast on a GPU that has it
    merged["pinned"] = tuple(sorted(k for k in chosen if k in MEMORY_KEYS))
    merged["explicit"] = tuple(sorted(chosen))  # --resume restores the saved run's value of the others
    return TrainConfig.from_flat(merged)


@click.command(name="train", epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@flags(TrainConfig, "train")
@with_options(_COMMAND_ONLY)
@memory_options("train")  # with train's own, demo-sized defaults (the schema's overrides, memfit.settings.defaults)
@click.pass_context
def command(ctx: click.Context, **kwargs: Any) -> None:
    """Train or fine-tune a causal LM on Accelerate and report measured against predicted memory.

    With no arguments it trains the `tiny` preset on the corpus shipped with memfit and prints the
    held-out loss next to the unigram baseline it must beat.
    """
    config = build_config(ctx, kwargs)
    if config.check_equivalence:
        result = memfit.check_equivalence(config)
        if config.json:
            click.echo(json.dumps(json_safe(result), indent=2))
        else:
            big, acc = result["big"], result["accumulated"]
            verdict = "equivalent" if result["equivalent"] else "NOT equivalent"
            click.echo(f"{big['micro_batch']} x {big['grad_accum']} vs {acc['micro_batch']} x {acc['grad_accum']}, "
                       f"{result['steps']} steps ({result['optimizer']}, fp32): {verdict}")
            click.echo(f"  largest weight difference {result['max_abs_weight_diff']:.3g} (largest weight "
                       f"{result['max_abs_weight']:.3g}); final loss difference {result['loss_diff']:.3g}")
        return

    # --json: stdout carries the summary only. Libraries print there during the run (DeepSpeed's logger,
    # bound to the stdout of the moment Accelerate's unwrap_model imports it when installed: "Setting
    # accelerator to CPU"), so the run's stdout goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if config.json else contextlib.nullcontext():
        summary = memfit.train(config)  # the summary's JSON form (RunSummary.to_dict())
    import accelerate

    if not accelerate.PartialState().is_main_process:
        return
    if config.json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        print_summary(summary)

