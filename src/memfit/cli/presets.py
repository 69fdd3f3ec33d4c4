"""``memfit presets``: the architecture presets (and the GPU table when the planner is installed)."""

# Inside a function: memfit.load_gpus, so an install without planning/ still lists the presets.
from __future__ import annotations

import json

import click
from rich.console import Console

import memfit
from memfit.report.fit import Col, dropped_note, fitted_table
from memfit.units import fmt_count, fmt_gib


def preset_rows() -> list[dict]:
    """Name, parameter count (real checkpoint's), family and description of every preset."""

    rows = []
    for name, entry in sorted(memfit.load_presets().items()):
        cfg = entry.get("config", {})
        rows.append({"name": name, "params": entry.get("params"), "model_type": cfg.get("model_type"),
                     "vocab_size": cfg.get("vocab_size"), "description": entry.get("description", ""),
                     "source": entry.get("source")})
    return rows


def gpu_rows() -> list[dict]:
    try:
        from memfit import load_gpus
    except ImportError:
        return []
    return [{"name": g.name, "memory_bytes": g.memory_bytes, "half_tflops": g.half_tflops,
             "bandwidth_gbs": g.bandwidth_gbs} for g in load_gpus().values()]


@click.command("presets", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def command(as_json):
    """List the architecture presets (exact parameter counts) and the GPU table.

    \b
    Examples:
      memfit presets
      memfit presets --json
    """
    models, gpus = preset_rows(), gpu_rows()
    if as_json:
        click.echo(json.dumps({"models": models, "gpus": gpus}, indent=2))
        return
    console = Console()
    cols = [Col("name"), Col("params", "right"), Col("exact", "right", 2), Col("type", priority=3),
            Col("vocab", "right", 1), Col("description", priority=4, wrap_min=36)]
    rows = [[r["name"], fmt_count(r["params"]) if r["params"] else "-", f"{r['params']:,}" if r["params"] else "-",
             str(r["model_type"]), f"{r['vocab_size']:,}", r["description"]] for r in models]
    table, dropped = fitted_table("Architecture presets (config facts only; no weights are downloaded)", cols, rows,
                                  console.width)
    console.print(table)
    if dropped:
        console.print(dropped_note(dropped), style="dim")
    if gpus:
        gcols = [Col("name"), Col("memory", "right"), Col("bf16 TFLOP/s", "right"), Col("bandwidth GB/s", "right")]
        grows = [[g["name"], fmt_gib(g["memory_bytes"], 0), f"{g['half_tflops']:g}", f"{g['bandwidth_gbs']:g}"]
                 for g in gpus]
        console.print(fitted_table("GPUs (memory in GiB, as sold)", gcols, grows, console.width)[0])
