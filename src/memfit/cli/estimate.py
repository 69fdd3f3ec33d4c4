"""``memfit estimate``: where every byte of a training step goes (thin over ``memfit.estimate``)."""

# Inside functions: memfit.trace (memory.trace: 5.5 s to import; python -X importtime, 2026-12-06, this shared 2-core machine) and report.timeline, for --exact and --timeline
# only; an install without them gets one sentence.
from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

import memfit  # the public API, each name imported on first use (memfit.estimate: ~0.9 s, on a call only)
from memfit.cli.interop import from_options, read_from, show_reading
from memfit.cli.options import explicit, flags, memory_options, run_config_from
from memfit.errors import UserError
from memfit.report.fit import dropped_note
from memfit.report.node_tables import rank_layout_table
from memfit.report.plots import plot_breakdowns
from memfit.report.tables import breakdown_table, compare_table, legend, phases_table
from memfit.settings.config import TrainConfig, check_lora_options
from memfit.settings.defaults import PRECISION_ON_A_GPU, SHAPE
from memfit.settings.validate import check_writable_target
from memfit.units import fmt_count


@click.command("estimate", epilog="Defaults: " + SHAPE,
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("model", required=False)
@flags(TrainConfig, "estimate")  # --revision, --trust-remote-code
@memory_options("estimate")
@click.option("--compare", is_flag=True, help="Show fp32, AMP fp16/bf16, pure bf16, LoRA and QLoRA side by side.")
@click.option("--exact", is_flag=True, help="Trace the real model code on fake tensors (slower, exact).")
@click.option("--timeline", "timeline_path", type=click.Path(dir_okay=False),
              help="With --exact: plot memory over the step to this .png.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Stacked bar chart to this .png.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu drops the CUDA context/allocator terms and models CPU kernels.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (MemoryBreakdown schema) instead of a table.")
@from_options
def command(model, revision, compare, exact, timeline_path, plot_path, device, trust_remote_code, as_json,
            from_path, from_format, **kwargs):
    """Where every byte of one training step of MODEL goes, per GPU.

    MODEL is a preset (`memfit presets`), a local model folder or config.json, or a Hugging Face Hub
    id (org/name) whose config.json alone is fetched into the Hugging Face cache (read from there
    offline). Numbers are per rank, at the step's peak.

    \b
    Examples:
      memfit estimate llama-2-7b --mixed-precision no      # the textbook 16 bytes/param
      memfit estimate llama-3-8b --compare --seq-len 2048 --micro-batch 1
      memfit estimate qwen2.5-0.5b --mixed-precision bf16 --grad-checkpointing --json
      memfit estimate llama-2-7b --lora-r 16 --quantize 4bit --dtype bf16 --plot qlora.png
      memfit estimate tiny --exact --timeline step.png
      memfit estimate ./my-checkpoint --seq-len 1024 --micro-batch 4
      memfit estimate Qwen/Qwen2.5-0.5B-Instruct --lora-r 16 --seq-len 2048
      memfit estimate --from axolotl.yml        # also TRL/Trainer, LLaMA-Factory, torchtune files
    """
    reading = read_from(from_path, from_format)
    run, typed = _run_of(model, reading, kwargs)
    if timeline_path and not exact:
        raise UserError("--timeline plots the exact trace; add --exact.")
    if exact and compare:
        raise UserError("--exact and --compare cannot be combined; the comparison is analytic.")
    for flag_name, path in (("--plot", plot_path), ("--timeline", timeline_path)):
        if path:  # before the work: a figure that cannot be written is found out first
            check_writable_target(Path(path), flag_name=flag_name, is_dir=False)
    with memfit.progress_bars(not as_json):  # a Hub MODEL: its config.json, fetched once into the Hugging Face cache
        spec = (reading.spec(trust_remote_code, run, model, revision) if reading is not None
                else memfit.load_spec(model, trust_remote_code, revision))
        note = None
        if reading is None and "seq_len" not in typed:  # the length train would run (memfit.settings.defaults.SHAPE)
            run, note = memfit.seq_len_as_train(model, kwargs.get("data"), run, context=spec.max_position_embeddings,
                                                tokenizer=kwargs.get("tokenizer"), revision=revision,
                                                trust_remote_code=trust_remote_code)
    memfit.check_seq_len(run.seq_len, spec.max_position_embeddings)  # what train refuses is not estimated
    if reading is None and device == "cuda" and not compare and "mixed_precision" not in typed:
        note = " ".join(filter(None, (note, PRECISION_ON_A_GPU)))  # train's one GPU-dependent default
    engine = reading.engine if reading is not None else "fsdp2"  # a DeepSpeed launch: its own layout
    stack = reading.stack if reading is not None else None  # the trainer and versions that run the file
    if compare:
        rows = memfit.compare(spec, run, device=device, engine=engine, stack=stack)
    elif exact:
        rows = [("exact", _exact(model, spec, run, device, timeline_path, stack))]
    else:
        rows = [("analytic", memfit.estimate(spec, run, device=device, engine=engine, stack=stack))]
    if plot_path:
        plot_breakdowns(rows, plot_path, title=f"{spec.name}: seq {run.seq_len} x micro-batch {run.micro_batch}")
    phases = None if compare else memfit.device_phases(spec, run, rows[0][1], device, stack=stack)  # loading to the last save
    _render(spec, run, rows, compare, as_json, plot_path, reading, note, phases)


def _run_of(model, reading, kwargs):
    """``(run, typed)``: the run the flags (over ``--from``'s file) describe, and the flags the user typed."""
    typed = explicit(click.get_current_context(), kwargs)
    if reading is not None:
        return reading.with_flags(typed), typed
    if model is None:
        raise UserError("Give MODEL (a preset, a model folder or a Hub id) or --from FILE.")
    check_lora_options(typed, "lora_r" in typed)
    return run_config_from(kwargs), typed


def _exact(model, spec, run, device, timeline_path, stack=None):
    try:  # imported here: an install without memfit.memory.trace gets one sentence, not an ImportError
        from memfit import trace
    except ImportError:
        raise UserError("--exact needs memfit.memory.trace, which this install lacks.") from None
    if not timeline_path:
        return trace(spec, run, device=device, stack=stack)
    try:
        from memfit.report.timeline import plot_timeline
    except ImportError:
        raise UserError("--timeline needs memfit.report.timeline, which this install lacks.") from None
    breakdown, line = trace(spec, run, device=device, timeline=True, stack=stack)
    plot_timeline(line, timeline_path)
    return breakdown


def _render(spec, run, rows, compare, as_json, plot_path, reading=None, note=None, phases=None) -> None:
    if as_json:
        payload = {"model": spec.name, "config": run.to_flat(), **({"from": reading.to_dict(run)} if reading else {})}
        if compare:
            payload["regimes"] = [{"name": name, "config": _regime_config(run, name), **b.to_dict()}
                                  for name, b in rows]
        else:
            payload.update(rows[0][1].to_dict())
            payload["phases"] = phases.to_dict()
        if run.nodes > 1 and run.num_processes > run.nodes:
            payload["across_nodes"] = [t.to_dict() for t in memfit.rank_layouts(spec, run)]
        click.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    head = (f"{spec.name}: {fmt_count(spec.params)} params, seq {run.seq_len} x micro-batch {run.micro_batch} "
            f"= {run.seq_len * run.micro_batch:,} tokens per micro-batch")
    if compare:
        table, dropped = compare_table(rows, head + " (per rank, peak of one step)", console.width)
        console.print(table)
        console.print("[dim]GiB = 2^30 bytes (how GPU memory is sold). grad+opt: gradients and optimizer state; "
                      "act: activations; temp: temporaries; bwd: the largest total during backward, where "
                      "checkpointing saves; fits: the smallest of 16/24/40/80 GiB that holds the peak. The "
                      "categories are the composition at the peak.[/]")
        if dropped:
            console.print(f"[dim]{dropped_note(dropped)}[/]")
    else:
        name, b = rows[0]
        console.print(breakdown_table(b, f"{head} ({name})"))
        console.print(f"[dim]{legend(b)}[/]")
        for line in b.notes:
            console.print(f"  [dim]- {line}[/]")
        console.print(phases_table(phases))
        if run.nodes > 1 and run.num_processes > run.nodes:  # several nodes: each sharding's per-rank terms
            table, dropped = rank_layout_table(memfit.rank_layouts(spec, run), run, console.width)
            console.print(table)
            if dropped:
                console.print(f"[dim]{dropped_note(dropped)}[/]")
    if reading is not None:
        show_reading(console, reading, run)
    if note:
        console.print(f"[dim]{note}[/]")
    if plot_path:
        console.print(f"plot written to {plot_path}")


def _regime_config(run, name):
    return dict(memfit.classic_regimes(run))[name].to_flat()
