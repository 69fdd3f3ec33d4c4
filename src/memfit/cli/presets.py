"""``memfit presets``: the architecture presets (and the GPU table when the planner is installed)."""

from __future__ import annotations

import json

import click


def preset_rows() -> list[dict]:
    """Name, parameter count (real checkpoint's), family and description of every preset."""
    from memfit.modelspec import load_presets

    rows = []
    for name, entry in sorted(load_presets().items()):
        cfg = entry.get("config", {})
        rows.append({"name": name, "params": entry.get("params"), "model_type": cfg.get("model_type"),
                     "vocab_size": cfg.get("vocab_size"), "description": entry.get("description", ""),
                     "source": entry.get("source")})
    return rows


def gpu_rows() -> list[dict]:
    try:
        from memfit.planning.gpus import load_gpus
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
    from rich.console import Console
    from rich.table import Table

    from memfit.units import fmt_count, fmt_gib

    table = Table(title="Architecture presets (config facts only; no weights are downloaded)", title_justify="left")
    for col in ("name", "params", "type", "vocab", "description"):
        table.add_column(col, justify="right" if col in ("params", "vocab") else "left")
    for r in models:
        params = f"{fmt_count(r['params'])} ({r['params']:,})" if r["params"] else "-"
        table.add_row(r["name"], params, str(r["model_type"]), f"{r['vocab_size']:,}", r["description"])
    console = Console()
    console.print(table)
    if gpus:
        gt = Table(title="GPUs (memory in GiB, as sold)", title_justify="left")
        for col in ("name", "memory", "bf16 TFLOP/s", "bandwidth GB/s"):
            gt.add_column(col, justify="left" if col == "name" else "right")
        for g in gpus:
            gt.add_row(g["name"], fmt_gib(g["memory_bytes"], 0), f"{g['half_tflops']:g}", f"{g['bandwidth_gbs']:g}")
        console.print(gt)
