"""``memfit plan``: parse flags, call ``memfit.plan`` (or ``memfit.maximize``), render a table / JSON / YAML."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import yaml
from rich.console import Console

import memfit  # the public API, each name imported on first use (memfit.plan: ~0.85 s, on a call only)
from memfit.cli.interop import from_options, read_from, show_reading
from memfit.cli.options import explicit, flags, memory_options, with_options
from memfit.cli.plan_nodes import cluster_shape, node_payload, print_node_launch, print_nodes
from memfit.errors import UserError, printable
from memfit.files import write_text_atomic
from memfit.report.fit import dropped_note
from memfit.report.plan_table import emit_header, plan_table, ranking_note
from memfit.report.runs import describe, shell_lines
from memfit.settings.config import Loss, Offload, RunConfig, TrainConfig, check_lora_options
from memfit.settings.defaults import SHAPE
from memfit.settings.validate import check_writable_target, number
from memfit.units import fmt_gib, parse_size

_DEFAULT = click.core.ParameterSource.DEFAULT

EPILOG = """\b
Examples:
  memfit plan llama-3-8b --gpu rtx-4090 --seq-len 2048 --batch 16
  memfit plan qwen2.5-0.5b --budget 8GiB --seq-len 1024 --batch 32
  memfit plan llama-3-8b --budget 24GiB --lora-r 64 --no-quantize --top 5
  memfit plan mistral-7b --gpu a100-40gb --num-processes 4 --batch 64 --full
  memfit plan qwen2.5-1.5b --gpu auto --output plan.yaml && memfit train --config plan.yaml
  memfit plan llama-3-8b --gpu h100-sxm --num-processes 8 --full --accelerate-config fsdp.yaml
  memfit plan llama-2-70b --gpu a100-40gb --num-processes 2 --seq-len 2048 --batch 8 --host-memory 128GiB
  memfit plan llama-3.1-8b --budget 24GiB --maximize seq-len
  memfit plan llama-3.1-70b --budget 80GiB --gpus-per-node 8 --full --batch 64 --internode-gbs 50
\b
Settings not given are chosen by the planner; the effective batch (--batch sequences per optimizer
step) is kept exact: micro-batch x grad-accum x processes = batch. Plans whose predicted peak plus
the safety margin (--margin) fits the budget are ranked by a step-time model (tokens/s).

Defaults: """ + SHAPE + "\n"


#: plan's flags that are no setting of the schema: the machine, the search and its output.
_MACHINE = [
    click.option("--gpu", help="A listed GPU (memfit presets shows them) or 'auto' for the device present; "
                               "its speed ranks the plans (default: a100-80gb as reference)."),
    click.option("--margin", type=float, default=None, help="Safety margin: fits iff peak x (1 + margin) <= budget "
                                                            "[default: 0.05]."),
    click.option("--full", is_flag=True, help="Full fine-tune only (no LoRA)."),
    click.option("--no-quantize", "no_quantize", is_flag=True, help="Do not consider QLoRA."),
    click.option("--no-offload", "no_offload", is_flag=True, help="Do not consider CPU offload."),
    click.option("--maximize", type=click.Choice(["seq-len", "micro-batch"]),
                 help="Instead of the fastest plan at --seq-len: the longest sequence (one per micro-batch; "
                      "--seq-len unused) or the largest micro-batch at --seq-len (one per step; --batch unused) "
                      "that fits, with its tokens/s."),
    click.option("--host-memory", help="Host RAM of the machine, e.g. 128GiB: drop plans whose offloaded state and "
                                       "rollback snapshot need more (default: not checked)."),
    click.option("--gpus-per-node", type=click.IntRange(min=1), default=None,
                 help="GPUs per node: plan 1, 2, 4, ... up to --max-nodes nodes of them (or exactly --nodes) and "
                      "say how many the fastest plan needs (--num-processes unused)."),
    click.option("--max-nodes", type=click.IntRange(min=1), default=None,
                 help="With --gpus-per-node: the most nodes to consider [default: 8]."),
    click.option("--internode-gbs", type=float, default=None,
                 help="A node's network bandwidth to the others, GB/s per direction, all its NICs together "
                      "[default: 50, i.e. 400 Gb/s]: what traffic between nodes is charged at."),
]
_OUTPUT = [
    click.option("--top", type=int, default=10, show_default=True, help="Plans to show (0: all)."),
    click.option("--output", "-o", type=click.Path(dir_okay=False), help="Write the chosen plan as YAML for "
                                                                          "memfit train --config."),
    click.option("--accelerate-config", type=click.Path(dir_okay=False),
                 help="Write the chosen plan's Accelerate config file (the launch command uses it)."),
    click.option("--json", "as_json", is_flag=True, help="Print the ranked plans as JSON."),
    click.option("--emit", nargs=2, type=(click.Choice(("trl", "axolotl", "llamafactory", "torchtune")),
                                          click.Path(dir_okay=False)), metavar="TOOL FILE", default=None,
                 help="Write the chosen plan as TOOL's config (trl, axolotl, llamafactory, torchtune); the plan "
                      "is searched among what TOOL runs."),
]


@click.command("plan", epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False)
@flags(TrainConfig, "plan")  # --batch, --budget, --revision
@with_options(_MACHINE)
@memory_options("plan")  # --seq-len, --num-processes: the problem; the others pin the search (no default)
@with_options(_OUTPUT)
@from_options
def command(model, revision, budget, gpu, seq_len, batch, num_processes, margin, top, output, as_json,
            accelerate_config, maximize, emit, from_path, from_format, gpus_per_node, max_nodes, internode_gbs,
            **pins):
    """The fastest configuration of a training run that fits a memory budget (of MODEL, or of --from FILE)."""
    margin = _checked_inputs(top, margin, output, emit, pins)
    reading = read_from(from_path, from_format)
    if reading is not None:
        seq_len, batch, num_processes, pins = _shape_from(reading, seq_len, batch, num_processes, pins)
    elif model is None:
        raise UserError("Give MODEL (a preset, a model folder or a Hub id) or --from FILE.")
    adapt, engine_of, stack = _as_the_tool_runs(emit, reading)
    method = pins.pop("method")  # given, like --seq-len: the objective the plans train
    cluster = cluster_shape(pins.pop("nodes"), num_processes, gpus_per_node, max_nodes, internode_gbs, maximize)
    data, tokenizer = pins.pop("data", None), pins.pop("tokenizer", None)  # --from: the file's shape
    if cluster and reading is None and click.get_current_context().get_parameter_source("batch") is _DEFAULT:
        batch = None  # across nodes: train's micro-batch on every rank (memfit.plan_nodes says so)
    constraints = memfit.Constraints.from_flat(pins)
    device = memfit.detect_gpu() if gpu and gpu.lower() == "auto" else gpu
    with memfit.progress_bars(not as_json):  # a Hub MODEL: its config.json, fetched once into the Hugging Face cache
        # reading the architecture is not part of the search
        spec = memfit.load_spec(model, revision=revision) if model else reading.spec()
    note = None
    if reading is None and maximize != "seq-len" and click.get_current_context().get_parameter_source("seq_len") is _DEFAULT:
        seq_len, note = _length_as_train(model, spec, RunConfig.of(seq_len=seq_len, method=method), data, tokenizer,
                                         revision, quiet=as_json)
    memfit.check_seq_len(seq_len, spec.max_position_embeddings)  # a plan train would refuse is no plan
    started = time.perf_counter()
    result = _search(spec, budget, maximize, dict(seq_len=seq_len, batch=batch, num_processes=num_processes,
                     gpu=device, constraints=constraints, safety_margin=margin, adapt=adapt, method=method,
                     engine_of=engine_of, stack=stack), cluster)
    across, result = (result, result.result) if cluster else (None, result)  # a NodesResult: every count tried
    elapsed = time.perf_counter() - started
    if output:
        write_plan_yaml(result, Path(output), revision)
    if emit:
        _write_emitted(emit, result, model or reading.model, reading)
    config_file = accelerate_config or memfit.ACCELERATE_CONFIG_FILE
    written = memfit.write_accelerate_config(result.best.config, Path(accelerate_config)) if accelerate_config else []
    command_line = memfit.launch_command(model or reading.model, result.best.config, config_file, revision=revision)
    if result.best.config.loss is Loss.TRL:  # priced for TRL's SFTTrainer; memfit train does not run TRL's loss
        command_line = None
    if as_json:
        click.echo(json.dumps({**result.to_dict(top=top or None), "launch": command_line,
                               "accelerate_config": memfit.accelerate_config(result.best.config),
                               **(node_payload(across, model or reading.model, revision) if across else {})},
                              indent=2))
        return
    _print(result, top or None, elapsed, output, maximize)
    if note:
        click.echo(note)
    if reading is not None:
        show_reading(Console(), reading, reading.run.replace(num_processes=num_processes))
    if emit:
        click.echo(f"Wrote {printable(emit[1])} ({emit[0]} config of the chosen plan).")
    if across:
        print_nodes(across)
    _print_launch(command_line, accelerate_config, config_file, written)
    if across and command_line is not None:
        print_node_launch(across, model or reading.model, revision)


def _as_the_tool_runs(emit, reading):
    """``(adapt, engine_of, stack)``: with --emit or --from, the candidates as that tool runs them, each on the tool's
    engine and priced on its stack; else memfit's own (None each)."""
    if not emit and reading is None:
        return None, None, None
    tool = emit[0] if emit else reading.tool
    return memfit.config_realizer(tool), memfit.config_engine(tool), memfit.config_stack(tool, reading)


def _length_as_train(model, spec, run, data, tokenizer, revision, *, quiet: bool):
    """``(seq_len, note)``: the length train would run (``memfit.settings.defaults.SHAPE``), and where it came from."""
    with memfit.progress_bars(not quiet):  # --data: its tokenizer and records, as train reads them
        shaped, note = memfit.seq_len_as_train(model, data, run, context=spec.max_position_embeddings,
                                               tokenizer=tokenizer, revision=revision)
    return shaped.seq_len, note


def _print_launch(command_line: str | None, accelerate_config: str | None, config_file: str,
                  written: list | None = None) -> None:
    """How to run the chosen plan (None: TRL's loss, which memfit prices but does not train with)."""
    if command_line is None:
        click.echo("Launch: with TRL's SFTTrainer (memfit prices its loss, --loss trl, but does not train with it; "
                   "--emit trl FILE writes the plan as its config).")
        return

    click.echo("Launch:\n" + shell_lines(command_line))
    if accelerate_config:
        names = ", ".join(printable(str(p)) for p in written or [accelerate_config])
        click.echo(f"Wrote {names} (Accelerate config{', one per node' if len(written or []) > 1 else ''}).")
    elif "accelerate launch" in command_line:
        click.echo(f"(add --accelerate-config {printable(config_file)} to write the file it names.)")


def _search(spec, budget, maximize: str | None, shape: dict, cluster: dict | None = None):
    """The planner's answer: the fastest plans that fit, or with ``--maximize`` the longest sequence
    (largest micro-batch) that fits per technique (``memfit.maximize``: no preference method, no --emit)."""
    if shape["safety_margin"] is None:
        shape["safety_margin"] = memfit.SAFETY_MARGIN
    if maximize:
        left_out = ("batch", "adapt", "method")  # engine_of and stack: --from FILE's, priced as its tool runs
        return memfit.maximize(spec, budget, maximize, **{k: v for k, v in shape.items() if k not in left_out})
    if cluster:  # several nodes, or a node count to find: every count planned, the fastest chosen
        shape.pop("num_processes")
        return memfit.plan_nodes(spec, budget, **cluster, **shape)
    return memfit.plan(spec, budget, **shape)


def _checked_inputs(top: int, margin, output, emit, pins: dict):
    """Check the flags before the search (a plan that cannot be written is not worth computing); turn the
    ``--no-*`` flags into the planner's allowances in ``pins``. Returns ``--margin`` checked."""
    if top < 0:
        raise UserError(f"--top must be 0 (all) or positive, got {top}.")
    if margin is not None:
        margin = number("margin", margin, low=0.0, high=10.0, what="a finite number from 0 to 10")

    # without --full (or with --lora-r) the planner may choose LoRA, with these options
    check_lora_options({k for k, v in pins.items() if v is not None},
                       pins.get("lora_r") is not None or not pins.get("full"))
    if output:  # before the search: a plan that cannot be written is not worth computing

        check_writable_target(Path(output), flag_name="--output", is_dir=False)

        memfit.check_not_a_run_file(Path(output), flag_name="--output")
    pins["allow_quantize"] = not pins.pop("no_quantize")
    pins["allow_offload"] = not pins.pop("no_offload")
    if pins.get("host_memory") is not None:
        pins["host_memory"] = parse_size(pins["host_memory"])
    if emit:
        check_writable_target(Path(emit[1]), flag_name="--emit", is_dir=False)
    return margin


def _shape_from(reading, seq_len, batch, num_processes, pins: dict):
    """``--from FILE``: the tool's shape (sequence, batch, processes) and settings, under what was typed."""
    typed = explicit(click.get_current_context(), {"seq_len": seq_len, "batch": batch,
                                                   "num_processes": num_processes})
    seq_len = typed.get("seq_len", reading.run.seq_len)
    num_processes = typed.get("num_processes", reading.run.num_processes)
    batch = typed.get("batch", reading.run.micro_batch * reading.run.grad_accum * num_processes)
    # only what was typed goes over the file's: a default (--method's sft) would plan a preference file as SFT
    given = {k: v for k, v in pins.items() if v is not None}
    pins = {**given, **reading.plan_pins(), **explicit(click.get_current_context(), given)}
    return seq_len, batch, num_processes, pins


def _write_emitted(emit, result, model, reading) -> None:
    """``--emit TOOL FILE``: the chosen plan as that tool's configuration, with a header saying how to check it."""
    memfit.write_config(emit[0], emit[1], model, result.best.config, reading, emit_header(result))


def _print(result, top, elapsed: float, output, maximize: str | None = None) -> None:
    console = Console()
    best = result.best
    tokens = best.config.tokens_per_step()
    table, dropped = plan_table(result, top or len(result.plans), console.width)
    console.print(table)
    note = None if maximize else ranking_note(result, top or len(result.plans))  # maximize: largest first
    if note:
        console.print(note, highlight=False)
    console.print(f"{len(result.fitting)} of {len(result.plans)} candidates fit; searched in {elapsed * 1000:.0f} ms; "
                  f"tokens per optimizer step: {tokens:,}.")
    console.print(f"Chosen: {describe(best.config)}: peak {fmt_gib(best.peak_bytes)} "
                  f"({best.breakdown.phase}), ~{best.tokens_per_s:,.0f} tokens/s.", highlight=False)
    for line in result.notes:  # a mixture-of-experts model's routing margin, LoRA parts, expert split
        console.print(line, highlight=False)
    if maximize:
        console.print(memfit.largest_note(result, maximize), highlight=False)
    if best.config.offload is not Offload.NONE:
        console.print(f"Host RAM: {fmt_gib(memfit.host_bytes(result.spec, best.config))} per machine (offloaded state and "
                      "rollback snapshot of all ranks; --host-memory checks it).", highlight=False)
    if result.gpu is not None and not result.gpu.listed:
        console.print(f"{result.gpu.name} is not in the GPU table: its speeds are the reference GPU's.")
    if dropped:
        console.print(dropped_note(dropped), style="dim")
    if output:
        train_with = "" if best.config.loss is Loss.TRL else f"; train with: memfit train --config {output}"
        console.print(f"Wrote {output}{train_with}", highlight=False)


def write_plan_yaml(result, path: Path, revision: str | None = None) -> None:
    """The chosen plan as flat train flags (``RunConfig.to_flat()`` + ``model``), written atomically."""
    best = result.best
    data = {"model": result.model, **({"revision": revision} if revision else {}), **best.config.to_flat()}
    header = (f"# memfit plan: predicted peak {fmt_gib(best.peak_bytes)} of a {fmt_gib(result.budget_bytes)} "
              f"budget, ~{best.tokens_per_s:,.0f} tokens/s on {result.gpu.name if result.gpu else '?'}.\n"
              "# Train with: memfit train --config THIS_FILE\n")
    write_text_atomic(path, header + yaml.safe_dump(data, sort_keys=False), what="--output")
