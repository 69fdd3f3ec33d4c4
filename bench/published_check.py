"""Peak memory that other projects published for real fine-tuning runs, against memfit's analytic estimate.

Reads ``bench/published_runs.yaml`` (source, GPU, what was measured and the exact setting of each run),
predicts each with ``memfit.memory.estimate.estimate`` on the CUDA target, and prints published,
predicted and the error per run, then the median and worst absolute error and the share of runs memfit
under-estimates (the unsafe direction: a plan that "fits" and then runs out of memory).

What is compared with what (what each kind of figure counts):

- ``allocated`` (``torch.cuda.max_memory_allocated``) and ``unstated``: the step's tensor peak, the estimate without
  its ``other`` term (CUDA context, cuBLAS workspace, allocator overhead); where the source reads
  ``max_memory_allocated`` once at the end of a run that never reset it (``peak_of: run``: litgpt's scripts), the
  largest tensor peak of the run's phases, loading to the last save (``memory.phases``);
- ``reserved`` (``max_memory_reserved``): the predicted reserved memory of the run's worst phase, loading to the last
  save (``memory.phases.device_phases``: the caching allocator gives nothing back between phases, so what a trainer
  reads off ``max_memory_reserved`` during training still holds what loading reserved), without the CUDA context;
- ``nvidia-smi`` and ``fits`` (the longest context that fit a card, whose peak is taken to be the card's memory):
  the same plus the CUDA context and NCCL's buffers (``DevicePhases.needed``: what the fit rule reads).

Each run names the stack that ran it (``stack``: trainer and versions, ``memfit.settings.stack.Stack``), which
the estimate prices as ``estimate --from`` does (adapters' dtype, bitsandbytes' kept inputs, litgpt's 4-bit
head), and, where it ran on DeepSpeed, ``engine: deepspeed`` (``memory.deepspeed_layout``; FSDP2 otherwise).
What memfit still has no setting for (torch.compile, LoRA on the head, FSDP1's flat parameters...) is listed per run under ``missing`` and left out of the prediction; the error is then what a user of memfit
would be told for that run, and each run's ``note`` says in a sentence why it is off (printed under the
row). Corrections of the set itself cite their source line (``corrections``); rows a source contradicts
are listed under ``dropped`` with the reason. The estimator is never tuned to these figures.

For the rows whose figure spans the run (``reserved``, ``nvidia-smi``, ``fits``; ``allocated`` with ``peak_of: run``)
the column "step alone" gives the step's own figure (the tensor peak; + cuBLAS workspace + the allocator's fitted
overhead for reserved, + the context for nvidia-smi and fits), with its own summary line over the reserved kinds:
what the phases outside the step add.

``published_heldout.yaml`` holds figures of the same schema that memfit was never tuned on (other sources, other
runs): ``--runs`` reads it instead, with the same table and summary, an honest figure of the estimator's error on runs
it has not seen. ``problems`` checks a file of either kind before anything is predicted.

    python bench/published_check.py                  # the table, then the summary
    python bench/published_check.py --markdown       # the table as bench/README.md shows it
    python bench/published_check.py --out -          # JSON rows and summary to stdout
    python bench/published_check.py --runs bench/published_heldout.yaml   # the held-out set
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

RUNS_FILE = Path(__file__).resolve().parent / "published_runs.yaml"
MEASURED = ("allocated", "reserved", "nvidia-smi", "unstated", "fits")
RESERVED_KINDS = ("reserved", "nvidia-smi", "fits")  # figures of the run's whole life: every phase's reserved memory
PEAK_OF = ("step", "run")  # an allocated figure's span: the step (the default), or the run since the process began
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
    step_predicted: int = 0
    """For a figure of ``RESERVED_KINDS``: the step's own figure (``predicted_bytes``), the run's phases left out; else 0."""
    phase: str = ""
    """For a figure of ``RESERVED_KINDS``: the phase whose reserved memory is the run's largest."""

    @property
    def step_error(self) -> float:
        return (self.step_predicted - self.published) / self.published if self.step_predicted else 0.0


def load(path: Path = RUNS_FILE) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The file's ``models`` (inline architectures) and ``runs``."""
    data = yaml.safe_load(Path(path).read_text())
    return data.get("models") or {}, data["runs"]


def dropped(path: Path = RUNS_FILE) -> list[dict[str, Any]]:
    """The published rows left out of the set, each with its ``reason``."""
    return yaml.safe_load(Path(path).read_text()).get("dropped") or []


def problems(path: Path = RUNS_FILE) -> list[str]:
    """What is wrong with a runs file, one sentence each; empty when it is sound. Every run names its source (https),
    GPU, setting and model (a preset or one of the file's ``models``), a kind of figure of ``MEASURED`` in a unit of
    ``UNITS``, a positive figure, memfit flags ``RunConfig`` takes, a stack memfit knows, corrections that cite a source
    line (`` L``) and a note; every dropped row its source and reason; no id twice."""
    from memfit.spec.model import load_presets

    models, runs = load(path)
    left_out = dropped(path)
    ids = [str(r.get("id")) for r in [*runs, *left_out]]
    found = [f"{i}: id used twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    known_models = set(models) | set(load_presets())
    for run in runs:
        found += _run_problems(run, known_models)
    for row in left_out:
        if not str(row.get("source", "")).startswith("https://") or not str(row.get("reason") or "").strip():
            found.append(f"{row.get('id')}: a dropped row needs its https:// source and a reason")
    return found


def _run_problems(run: dict[str, Any], known_models: set[str]) -> list[str]:
    """``problems`` of one run (``known_models``: the presets and the file's own models)."""
    from memfit.errors import UserError
    from memfit.settings.stack import Stack

    rid = run.get("id")
    found = [f"{rid}: no {key}" for key in ("gpu", "setting", "model", "memfit", "note")
             if not str(run.get(key) or "").strip()]
    if not str(run.get("source", "")).startswith("https://"):
        found.append(f"{rid}: source must be an https:// address")
    if run.get("model") and run["model"] not in known_models:
        found.append(f"{rid}: model {run['model']!r} is neither a preset nor in the file's models")
    if run.get("measured") not in MEASURED or run.get("unit") not in UNITS:
        found.append(f"{rid}: measured must be one of {', '.join(MEASURED)} and unit one of {', '.join(UNITS)}")
    if run.get("peak_of", "step") not in PEAK_OF or (run.get("peak_of") == "run" and run.get("measured") != "allocated"):
        found.append(f"{rid}: peak_of must be one of {', '.join(PEAK_OF)}, and 'run' only for an allocated figure")
    try:
        if not float(run.get("published", 0)) > 0:
            found.append(f"{rid}: published must be positive")
    except (TypeError, ValueError):
        found.append(f"{rid}: published must be a number")
    try:
        if run.get("memfit"):
            run_config(run)
    except (ValueError, UserError) as exc:  # run_config's own sentence starts with the run's id
        found.append(str(exc) if str(exc).startswith(f"{rid}:") else f"{rid}: {exc}")
    try:
        Stack.of(run.get("stack"))
    except UserError as exc:
        found.append(f"{rid}: {exc}")
    found += [f"{rid}: a correction cites no source line: {fix[:60]}" for fix in run.get("corrections") or []
              if " L" not in fix]
    return found


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
    """The part of a step's CUDA estimate that a figure of kind ``measured`` counts, the phases outside the step left
    out: the tensor peak for ``allocated``/``unstated``, + cuBLAS's workspace and the allocator's overhead for
    ``reserved``, + the CUDA context for the others (see the module docstring)."""
    from memfit.memory.device_terms import CUDA_CONTEXT_BYTES

    if measured in ("allocated", "unstated"):
        return breakdown.peak_bytes - breakdown.other
    if measured == "reserved":
        return breakdown.peak_bytes - CUDA_CONTEXT_BYTES
    return breakdown.peak_bytes


def run_figure(phases, measured: str) -> tuple[int, str]:
    """What a figure of the run's whole life counts of its ``phases`` (``memory.phases.DevicePhases``), and the phase
    that decides it: for ``allocated`` (``peak_of: run``) the largest tensor peak; for ``reserved`` the worst phase's
    reserved memory; for ``nvidia-smi`` and ``fits`` that with the CUDA context and NCCL's buffers."""
    if measured == "allocated":
        top = max(phases.phases, key=lambda p: p.tensors)
        return top.tensors, top.name
    return (phases.worst.reserved if measured == "reserved" else phases.needed()), phases.worst.name


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
    breakdown = estimate(spec_for(run["model"], models), run_config(run), device="cuda", stack=stack,
                         engine=run.get("engine", "fsdp2"))
    published = int(round(float(run["published"]) * UNITS[run["unit"]]))
    predicted = step = predicted_bytes(breakdown, run["measured"])
    phase = ""
    if run["measured"] in RESERVED_KINDS or run.get("peak_of") == "run":
        from memfit.memory.phases import device_phases

        phases = device_phases(spec_for(run["model"], models), run_config(run), breakdown, stack=stack)
        predicted, phase = run_figure(phases, run["measured"])
    return Row(run["id"], run["project"], run["gpu"], run["measured"], published, predicted,
               (predicted - published) / published, list(run.get("missing") or []), run.get("note") or "",
               stack.describe(), step_predicted=step if phase else 0, phase=phase)


def check(path: Path = RUNS_FILE) -> list[Row]:
    """Every run of the file, predicted."""
    models, runs = load(path)
    return [predict(run, models) for run in runs]


def summary(rows: list[Row], error: Callable[[Row], float] = lambda r: r.error) -> dict[str, Any]:
    """Median and worst absolute ``error`` (the row's own by default), and the share of runs memfit under-estimates."""
    worst = max(rows, key=lambda r: abs(error(r)))
    return {"runs": len(rows), "projects": len({r.project for r in rows}),
            "median_abs_error": statistics.median(abs(error(r)) for r in rows), "worst_abs_error": abs(error(worst)),
            "worst_run": worst.id, "under_share": sum(error(r) < 0 for r in rows) / len(rows)}


def step_summary(rows: list[Row]) -> dict[str, Any] | None:
    """``summary`` of the step's own figure (the phases outside it left out) on the rows of ``RESERVED_KINDS``; None
    when there are none."""
    picked = [r for r in rows if r.step_predicted and r.measured in RESERVED_KINDS]
    return summary(picked, lambda r: r.step_error) if picked else None


def kind_summary(rows: list[Row], kinds: tuple[str, ...] = RESERVED_KINDS) -> dict[str, Any] | None:
    """``summary`` of the rows whose figure is of ``kinds`` (those that count reserved memory); None when none."""
    picked = [r for r in rows if r.measured in kinds]
    return summary(picked) if picked else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def render(rows: list[Row], stats: dict[str, Any], markdown: bool, left_out: list[dict[str, Any]] = ()) -> str:
    head = ["run", "GPU", "stack", "measured", "published", "memfit (phase)", "error", "step alone, error",
            "memfit lacks"]
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        step = f"{_gib(r.step_predicted)}, {r.step_error:+.1%}" if r.step_predicted else "-"
        predicted = f"{_gib(r.predicted)} ({r.phase})" if r.phase else _gib(r.predicted)
        cells = [r.id, r.gpu, r.stack, r.measured, _gib(r.published), predicted, f"{r.error:+.1%}", step,
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
    for key, what, which in (
            ("reserved", "every phase's reserved memory", "count reserved memory, nvidia-smi or a card's memory"),
            ("step", "the step alone", "count reserved memory, nvidia-smi or a card's memory"),
            ("measured", "every phase's reserved memory", "count max_memory_reserved or nvidia-smi (issue 36's set)"),
            ("tensors", "the step's tensors", "count tensors (allocated or unstated)")):
        part = stats.get(key)
        if part:
            lines.append(f"{what}, on the {part['runs']} runs that {which}: median |error| "
                         f"{part['median_abs_error']:.1%}, worst {part['worst_abs_error']:.1%} ({part['worst_run']}), "
                         f"memfit under-estimates {part['under_share']:.0%} of them")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=RUNS_FILE, help="the data file (default: %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--out", help="write JSON rows and summary to this file ('-' for stdout)")
    args = parser.parse_args(argv)
    rows = check(args.runs)
    stats = summary(rows)
    stats["reserved"], stats["step"] = kind_summary(rows), step_summary(rows)
    # a card's memory bounds the peak from above (the longest context that fit), so issue 36 leaves those rows out
    stats["measured"] = kind_summary(rows, ("reserved", "nvidia-smi"))
    stats["tensors"] = kind_summary(rows, ("allocated", "unstated"))
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
