"""``memfit train``: parse flags (and ``--config FILE``), call ``memfit.training.loop.train``, render."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from memfit.cli.data_options import data_options
from memfit.cli.options import explicit, memory_options
from memfit.config import RunConfig, TrainConfig
from memfit.defaults import DEMO_LR, DEMO_SEQ_LEN, DEMO_STEPS, FULL_LR, LORA_LR, SHAPES, fmt_lr
from memfit.errors import UserError
from memfit.trackers import TRACKERS
from memfit.validate import check_lora_options

_D = TrainConfig()

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

Defaults: """ + SHAPES["train"] + """ The preamble names every default derived from your data or method."""


def _train_options(func):
    opts = [
        click.option("--model", default=_D.model, show_default=True,
                     help="Preset name (random weights), a local Hugging Face checkpoint folder, or a Hub id "
                     "(org/name: fetched into the Hugging Face cache; HF_TOKEN for gated models)."),
        click.option("--data", default=None, help=".txt, .jsonl (text or prompt/completion) or a folder; "
                     "default: the corpus shipped with memfit."),
        click.option("--tokenizer", default=None, help="Tokenizer folder, or 'byte'; default: the model's."),
        *data_options(),
        click.option("--lr", type=float, default=None,
                     help=f"Peak learning rate; default by method: {fmt_lr(DEMO_LR)} from random weights (a preset, "
                     f"the demo), {fmt_lr(LORA_LR)} for LoRA, {fmt_lr(FULL_LR)} for a full fine-tune."),
        click.option("--weight-decay", type=float, default=_D.weight_decay, show_default=True),
        click.option("--warmup-steps", type=int, default=_D.warmup_steps, show_default=True),
        click.option("--max-steps", type=int, default=None,
                     help=f"Optimizer steps (with --epochs: whichever ends first); default: {DEMO_STEPS} for the "
                     "demo, else 1 epoch."),
        click.option("--epochs", type=int, default=None, help="Passes over the training data (never capped by a "
                     "default --max-steps)."),
        click.option("--truncate", is_flag=True, help="Keep conversations longer than --seq-len cut to it (when the "
                     "cut keeps a reply token) instead of dropping them."),
        click.option("--batch", type=int, default=None,
                     help="Effective batch in sequences per optimizer step (sets --grad-accum)."),
        click.option("--seed", type=int, default=_D.seed, show_default=True),
        click.option("--no-packing", is_flag=True, hidden=True, help="Old spelling of --packing none."),
        click.option("--eval-every", type=int, default=_D.eval_every, show_default=True,
                     help="Evaluate on the held-out split every N steps (0: never)."),
        click.option("--eval-fraction", type=float, default=_D.eval_fraction, show_default=True),
        click.option("--log-every", type=int, default=_D.log_every, show_default=True),
        click.option("--save-every", type=int, default=None,
                     help="Checkpoint every N steps (and at the end); default: ten times per run; 0: never."),
        click.option("--keep-last", type=int, default=_D.keep_last, show_default=True,
                     help="Checkpoints kept (older ones go only once a newer one is complete)."),
        click.option("--state-dict", type=click.Choice(["sharded", "full"]), default=_D.state_dict,
                     show_default=True, help="Checkpoints of a sharded run: each rank's shards, or the full state "
                     "gathered on rank 0 (resumes on any number of processes, --sharding ddp on 1 included)."),
        click.option("--init", type=click.Choice(["pretrained", "random"]), default=_D.init, show_default=True,
                     help="random: train a model folder that holds only config.json from random weights."),
        click.option("--max-grad-norm", type=float, default=_D.max_grad_norm, show_default=True,
                     help="Gradient clipping (0: off)."),
        click.option("--output", default=None, help="Run folder; default: a new runs/<model>-<YYYYmmdd-HHMMSS>. "
                     "A folder holding another run is refused unless --overwrite or --resume."),
        click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --output (required)."),
        click.option("--extend-schedule", is_flag=True,
                     help="With --resume and more --max-steps/--epochs than a finished run had: train on, the "
                     "learning-rate schedule recomputed over the new total (its lr rises again from 0)."),
        click.option("--overwrite", is_flag=True, help="Replace a previous run in --output."),
        click.option("--merge", is_flag=True, help="LoRA: also save the adapter merged into the base."),
        click.option("--trust-remote-code", is_flag=True, help="Allow the model's own Python code (local or Hub)."),
        click.option("--samples", type=int, default=_D.samples, show_default=True,
                     help="Samples printed at the end: the model continues the beginnings of held-out documents."),
        click.option("--eval-samples", type=click.IntRange(min=0), default=_D.eval_samples, show_default=True,
                     help="Also generate N samples at each --eval-every evaluation (samples.jsonl in --output)."),
        click.option("--budget", default=None,
                     help="Memory budget (24GiB): plan the fastest settings that fit, then train them. Full "
                     "fine-tune unless --lora-r; --dtype/--mixed-precision kept when given."),
        click.option("--tracker", type=click.Choice(list(TRACKERS)), default=None,
                     help="Also log metrics with an Accelerate tracker (files under --output; wandb/mlflow/"
                     "trackio/aim need their extra: pip install 'memfit[wandb]' and so on)."),
        click.option("--check-equivalence", is_flag=True,
                     help="Train 3 steps as E x 1 and E/k x k on your model and data; print the weight difference."),
        click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                     help="YAML file with any of these settings; flags typed here override it."),
        click.option("--json", "as_json", is_flag=True, help="Print the final summary as JSON on stdout."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch CPU threads; default: OMP_NUM_THREADS when set, else the cores idle and "
                     "available to this process (affinity, cgroup quota)."),
        click.option("--revision", default=None,
                     help="Branch, tag or commit of a Hub --model; default: its main branch (the run records the commit)."),
        click.option("--allow-pickle-weights", is_flag=True,
                     help="Accept a Hub model whose weights are PyTorch pickles (*.bin, *.pt), which can run code "
                     "when loaded; default: safetensors only."),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UserError(f"Config file {file} does not exist.")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{file} is not valid YAML ({str(err).splitlines()[0]}).") from None
    if not isinstance(data, dict):
        raise UserError(f"{file} must hold a mapping of settings (key: value), not a {type(data).__name__}.")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    return data.get("config", data) if isinstance(data.get("config"), dict) else data  # plan.yaml nests it


def build_config(ctx: click.Context, kwargs: dict[str, Any]) -> TrainConfig:
    """Defaults < ``--config`` YAML < flags typed on the command line."""
    config_file = kwargs.pop("config_file")
    if kwargs.pop("no_packing", False):
        kwargs["packing"] = "none"
        ctx.set_parameter_source("packing", click.core.ParameterSource.COMMANDLINE)
    typed = explicit(ctx, kwargs)
    from_file = _read_yaml(config_file) if config_file else {}
    if from_file.get("trust_remote_code") is True and "trust_remote_code" not in typed:
        click.echo(f"warning: {config_file} turns on trust_remote_code: the model folder's own Python code will "
                   "run; remove it from the file unless you trust that code.", err=True)
    if from_file:  # every value in the file is checked, even one a typed flag overrides
        TrainConfig.from_flat({**{k: v for k, v in kwargs.items() if k != "as_json"}, **from_file})
    merged = {**kwargs, **from_file, **typed}
    merged["json"] = merged.pop("as_json", False)
    chosen = set(typed) | set(from_file)
    check_lora_options(chosen, "lora_r" in chosen)
    if "mixed_precision" not in chosen:
        from memfit.training.setup import default_precision

        merged["mixed_precision"] = default_precision().value  # bf16 autocast on a GPU that has it
    merged["pinned"] = tuple(sorted(k for k in chosen if k in RunConfig.__dataclass_fields__))
    merged["explicit"] = tuple(sorted(chosen))  # --resume restores the saved run's value of the others
    return TrainConfig.from_flat(merged)


# train's own, demo-sized defaults for the shared memory flags (shown in --help, not "typed").
_RUN_DEFAULTS = {"seq_len": _D.run.seq_len, "micro_batch": _D.run.micro_batch}


@click.command(name="train", epilog=EPILOG,
               context_settings={"help_option_names": ["-h", "--help"], "default_map": _RUN_DEFAULTS})
@_train_options
@memory_options
@click.pass_context
def command(ctx: click.Context, **kwargs: Any) -> None:
    """Train or fine-tune a causal LM on Accelerate and report measured against predicted memory.

    With no arguments it trains the `tiny` preset on the corpus shipped with memfit and prints the
    held-out loss next to the unigram baseline it must beat.
    """
    config = build_config(ctx, kwargs)
    if config.check_equivalence:
        from memfit.training.equivalence import check_equivalence
        from memfit.training.summary import json_safe

        result = check_equivalence(config)
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
    import contextlib

    from memfit.training.loop import run_training

    # --json: stdout carries the summary only. Libraries print there during the run (DeepSpeed's logger,
    # bound to the stdout of the moment Accelerate's unwrap_model imports it when installed: "Setting
    # accelerator to CPU"), so the run's stdout goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if config.json else contextlib.nullcontext():
        summary = run_training(config).summary
    import accelerate

    if not accelerate.PartialState().is_main_process:
        return
    if config.json:
        click.echo(json.dumps(summary.to_dict(), indent=2, default=str))
    else:
        from memfit.training.progress import print_summary

        print_summary(summary)


# --seq-len's shown default: the demo's value is not what a real run gets (memfit.defaults)
next(p for p in command.params if p.name == "seq_len").show_default = f"from the data; {DEMO_SEQ_LEN} for the demo"
