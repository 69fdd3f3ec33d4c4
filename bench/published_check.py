"""Peak memory that other projects published for real fine-tuning runs, against memfit's analytic estimate.

Reads ``bench/published_runs.yaml`` (source, GPU, what was measured and the exact setting of each run),
predicts each with ``memfit.memory.estimate.estimate`` on the CUDA target, and prints published,
predicted and the error per run, then the median and worst absolute error and the share of runs memfit
under-estimates (the unsafe direction: a plan that "fits" and then runs out of memory).

What is compared with what (the terms memfit has, ``memory/device_terms.py``):

- ``allocated`` (``torch.cuda.max_memory_allocated``) and ``unstated``: the estimate's tensor peak,
  without its ``other`` term (CUDA context, cuBLAS workspace, allocator reserve);
- ``reserved`` (``max_memory_reserved``): the tensor peak plus the cuBLAS workspace and the allocator
  reserve, without the CUDA context;
- ``nvidia-smi`` and ``fits`` (the longest context that fit a card, whose peak is taken to be the card's
  memory): the whole estimate, CUDA context included.

Each run names the stack that ran it (``stack``: trainer and versions, ``memfit.settings.stack.Stack``), which
the estimate prices as ``estimate --from`` does (adapters' dtype, bitsandbytes' kept inputs, litgpt's 4-bit
head). What memfit still has no setting for (torch.compile, LoRA on the head, FSDP1's flat parameters...)
is listed per run under ``missing`` and left out of the prediction; the error is then what a user of memfit
would be told for that run, and each run's ``note`` says in a sentence why it is off (printed under the
row). Corrections of the set itself cite their source line (``corrections``); rows a source contradicts
are listed under ``dropped`` with the reason. The estimator is never tuned to these figures.

For the rows that count reserved memory or nvidia-smi a second column compares what memfit's fit decision reads
(``memory.phases``): the predicted reserved memory of the run's worst phase, loading to the last save (for
nvidia-smi + the CUDA context and NCCL's buffers), with its own summary line.

    python bench/published_check.py                  # the table, then the summary
    python bench/published_check.py --markdown       # the table as bench/README.md shows it
    python bench/published_check.py --out -          # JSON rows and summary to stdout
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

RUNS_FILE = Path(__file__).resolve().parent / "published_runs.yaml"
MEASURED = ("allocated", "reserved", "nvidia-smi", "unstated", "fits")
RESERVED_KINDS = ("reserved", "nvidia-smi")  # figures the caching allocator's reserved memory is compared with
UNITS = {"GB": 10**9, "GiB": 2**30}
_SPECS: dict[str, Any] = {}  # the file's own models, built once per process (a meta-device model each)


@dataclass
class Row:
    """One published run and memfit's prediction of it (bytes; ``error`` as a fraction of published)."""

    id: str
    project: str
    gpu: str
    measured: str
    published: int
    predicted: int
    error: float
    missing: list[str]
    note: str
    stack: str = "memfit"
    reserved_predicted: int = 0
    """For a figure that counts reserved memory or nvidia-smi: the predicted reserved memory of the run's worst
    phase (``memory.phases``: loading to the last save; + CUDA context and NCCL for nvidia-smi), else 0."""
    reserved_phase: str = ""

    @property
    def reserved_error(self) -> float:
        return (self.reserved_predicted - self.published) / self.published if self.reserved_predicted else 0.0


def load(path: Path = RUNS_FILE) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The file's ``models`` (inline architectures) and ``runs``."""
    data = yaml.safe_load(Path(path).read_text())
    return data.get("models") or {}, data["runs"]


def dropped(path: Path = RUNS_FILE) -> list[dict[str, Any]]:
    """The published rows left out of the set, each with its ``reason``."""
    return yaml.safe_load(Path(path).read_text()).get("dropped") or []


def spec_for(name: str, models: dict[str, Any]):
    """A preset name, or a model of the file's ``models`` section: a preset's config (``base``) updated
    with ``config``, built by transformers like any preset (``memfit.spec.model.spec_from_config``)."""
    from memfit.spec.model import load_presets, load_spec, spec_from_config

    if name not in models:
        return load_spec(name)  # cached by memfit
    if name in _SPECS:
        return _SPECS[name]
    entry = models[name]
    config = dict(load_presets()[entry["base"]]["config"]) if "base" in entry else {}
    config.update(entry.get("config") or {})
    from transformers import AutoConfig

    _SPECS[name] = spec_from_config(AutoConfig.for_model(config.pop("model_type"), **config), name)
    return _SPECS[name]


def predicted_bytes(breakdown, measured: str) -> int:
    """The part of a CUDA estimate that a figure of kind ``measured`` counts (see the module docstring)."""
    from memfit.memory.device_terms import CUDA_CONTEXT_BYTES

    if measured in ("allocated", "unstated"):
        return breakdown.peak_bytes - breakdown.other
    if measured == "reserved":
        return breakdown.peak_bytes - CUDA_CONTEXT_BYTES
    return breakdown.peak_bytes


def run_config(run: dict[str, Any]):
    """The run's ``memfit`` flags (spelled as ``memfit estimate`` takes them) as a ``RunConfig``; a flag that
    is not a memory setting is refused (``RunConfig.from_flat`` would drop it silently)."""
    from memfit.settings.config import RunConfig

    flat = {str(k).replace("-", "_"): v for k, v in run["memfit"].items()}
    unknown = sorted(set(flat) - set(RunConfig().to_flat()))
    if unknown:
        raise ValueError(f"{run['id']}: not memfit memory settings: {', '.join(unknown)}")
    return RunConfig.from_flat(flat)


def predict(run: dict[str, Any], models: dict[str, Any]) -> Row:
    """memfit's analytic estimate of one published run."""
    from memfit.memory.estimate import estimate
    from memfit.settings.stack import Stack

    if run["measured"] not in MEASURED:
        raise ValueError(f"{run['id']}: measured must be one of {', '.join(MEASURED)}, got {run['measured']!r}")
    stack = Stack.of(run.get("stack"))
    breakdown = estimate(spec_for(run["model"], models), run_config(run), device="cuda", stack=stack)
    published = int(round(float(run["published"]) * UNITS[run["unit"]]))
    predicted = predicted_bytes(breakdown, run["measured"])
    row = Row(run["id"], run["project"], run["gpu"], run["measured"], published, predicted,
              (predicted - published) / published, list(run.get("missing") or []), run.get("note") or "",
              stack.describe())
    if run["measured"] in RESERVED_KINDS:
        from memfit.memory.phases import device_phases

        phases = device_phases(spec_for(run["model"], models), run_config(run), breakdown, stack=stack)
        row.reserved_phase = phases.worst.name
        row.reserved_predicted = phases.needed() if run["measured"] == "nvidia-smi" else phases.worst.reserved
    return row


def check(path: Path = RUNS_FILE) -> list[Row]:
    """Every run of the file, predicted."""
    models, runs = load(path)
    return [predict(run, models) for run in runs]


def summary(rows: list[Row]) -> dict[str, Any]:
    """Median and worst absolute error, and the share of runs memfit under-estimates."""
    errors = [abs(r.error) for r in rows]
    worst = max(rows, key=lambda r: abs(r.error))
    return {"runs": len(rows), "projects": len({r.project for r in rows}),
            "median_abs_error": statistics.median(errors), "worst_abs_error": abs(worst.error),
            "worst_run": worst.id, "under_share": sum(r.error < 0 for r in rows) / len(rows)}


def reserved_summary(rows: list[Row]) -> dict[str, Any] | None:
    """``summary`` of the predicted reserved memory (every phase) against the rows that count reserved memory or
    nvidia-smi; None when there are none."""
    picked = [r for r in rows if r.reserved_predicted]
    if not picked:
        return None
    worst = max(picked, key=lambda r: abs(r.reserved_error))
    return {"runs": len(picked), "median_abs_error": statistics.median(abs(r.reserved_error) for r in picked),
            "worst_abs_error": abs(worst.reserved_error), "worst_run": worst.id,
            "under_share": sum(r.reserved_error < 0 for r in picked) / len(picked)}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def render(rows: list[Row], stats: dict[str, Any], markdown: bool, left_out: list[dict[str, Any]] = ()) -> str:
    head = ["run", "GPU", "stack", "measured", "published", "memfit", "error", "reserved (phase), error",
            "memfit lacks"]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        reserved = (f"{_gib(r.reserved_predicted)} ({r.reserved_phase}), {r.reserved_error:+.1%}"
                    if r.reserved_predicted else "-")
        cells = [r.id, r.gpu, r.stack, r.measured, _gib(r.published), _gib(r.predicted), f"{r.error:+.1%}", reserved,
                 "; ".join(m.split(" (")[0] for m in r.missing) or "-"]
        lines.append("| " + " | ".join(cells) + " |" if markdown else "  ".join(cells))
        if not markdown and r.note:
            lines.append(f"    note: {r.note}")
    lines.append("")
    for d in left_out:
        lines.append(f"dropped {d['id']}: {d['reason']}")
    lines.append(f"{stats['runs']} runs from {stats['projects']} projects: median |error| "
                 f"{stats['median_abs_error']:.1%}, worst {stats['worst_abs_error']:.1%} ({stats['worst_run']}), "
                 f"memfit under-estimates {stats['under_share']:.0%} of the runs")
    reserved = stats.get("reserved")
    if reserved:
        lines.append(f"reserved memory of every phase, on the {reserved['runs']} runs that count reserved memory or "
                     f"nvidia-smi: median |error| {reserved['median_abs_error']:.1%}, worst "
                     f"{reserved['worst_abs_error']:.1%} ({reserved['worst_run']}), memfit under-estimates "
                     f"{reserved['under_share']:.0%} of them")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=RUNS_FILE, help="the data file (default: %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--out", help="write JSON rows and summary to this file ('-' for stdout)")
    args = parser.parse_args(argv)
    rows = check(args.runs)
    stats = summary(rows)
    stats["reserved"] = reserved_summary(rows)
    if args.out:
        payload = json.dumps({"rows": [asdict(r) for r in rows], "summary": stats}, indent=2)
        if args.out == "-":
            print(payload)
            return 0
        Path(args.out).write_text(payload + "\n")
    print(render(rows, stats, args.markdown, dropped(args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
