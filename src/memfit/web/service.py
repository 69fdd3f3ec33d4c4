"""What the page asks, answered by the library API (the same calls ``memfit estimate`` and ``memfit plan`` make).

A request names the model (``Source``: a preset, a Hub id, an uploaded config.json, or another trainer's
config file read by ``memfit.read_config``, the readers of ``--from``) and the settings the user changed from
the page's baseline (the schema's defaults, or the file's values), as the CLI takes typed flags. The answers
are JSON: ``estimate`` carries exactly what ``memfit estimate --json`` prints (``model``, ``config`` and the
``MemoryBreakdown`` schema) plus what the page draws beside it (the GPUs it fits, the CLI line that gives the
same numbers). An error the user caused is a ``UserError``: its one sentence, as the CLI prints it, and the
form field it names (``field_of``).

Uploaded files are written to a private temporary folder for the readers, which take paths, and removed
after the request; the folder's name is taken out of any sentence shown, so the user reads their own file name.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import re
import shlex
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit import interop
from memfit.errors import UserError
from memfit.memory.estimate import estimate as analytic_estimate
from memfit.memory.phases import device_phases
from memfit.planning.gpus import load_gpus
from memfit.planning.launch import launch_command
from memfit.planning.search import SAFETY_MARGIN, fits
from memfit.planning.search import plan as search_plans
from memfit.planning.space import Constraints
from memfit.report.plan_table import emit_header
from memfit.report.timeline import plot_timeline
from memfit.settings.config import RunConfig, check_lora_options
from memfit.settings.defaults import DEMO_MICRO_BATCH
from memfit.settings.schema import own_defaults
from memfit.settings.validate import POSITIVE, whole
from memfit.spec.model import check_seq_len, load_spec
from memfit.web.form import flags_of, run_controls

KINDS = ("preset", "hub", "config", "tool")
MAX_FILE_CHARS = 1 << 20
"""An uploaded or pasted file larger than 1 MiB is no config.json or training config."""
TOOLS = interop.FORMATS  # as --from-format and --emit take them

_ONE_AT_A_TIME = threading.Lock()
"""The library answers one call at a time here: an estimate outside the verified versions derives its recipe by
tracing, and a trace uses process-wide state (torch's MemTracker hooks, transformers' attention registry);
two at once on the server's threads corrupt each other (seen: a ``KeyError`` in transformers' registry under
concurrent redraws). So while an exact trace runs, redraws wait for it."""


def one_at_a_time(func):
    @functools.wraps(func)
    def serialized(*args, **kwargs):
        with _ONE_AT_A_TIME:
            return func(*args, **kwargs)
    return serialized


@dataclass(frozen=True)
class Source:
    """The model, as the page names it."""

    kind: str
    """``preset``, ``hub`` (a Hub id: its config.json through the Hugging Face cache), ``config`` (an uploaded
    config.json) or ``tool`` (another trainer's config file)."""
    value: str
    """The preset's name, the Hub id, or the file's text."""
    filename: str = ""
    """The uploaded or pasted file's name (its suffix tells YAML from JSON)."""
    format: str | None = None
    """A tool file's format (``--from-format``); None: detected from its keys."""

    @classmethod
    def from_dict(cls, data: Any) -> Source:
        if not isinstance(data, dict) or data.get("kind") not in KINDS:
            raise UserError(f"Choose the model as one of: {', '.join(KINDS)}.")
        value, kind = data.get("value"), data["kind"]
        if not isinstance(value, str) or not value.strip():
            raise UserError({"preset": "Choose a preset.", "hub": "Give a Hugging Face Hub id (org/name).",
                             "config": "Upload a config.json.", "tool": "Paste or upload a training config."}[kind])
        if len(value) > MAX_FILE_CHARS:
            raise UserError(f"The file is over {MAX_FILE_CHARS:,} characters, so it is no model or training config.")
        fmt = data.get("format") or None
        if fmt is not None and fmt not in TOOLS:
            raise UserError(f"Unknown --from-format {fmt!r}; choose one of: {', '.join(TOOLS)}.")
        default = "config.json" if kind == "config" else "config.yaml"
        name = re.sub(r"[^\w.-]", "_", Path(str(data.get("filename") or default)).name)[:100] or default
        return cls(kind, value.strip() if kind in ("preset", "hub") else value, name, fmt)


@dataclass
class Model:
    """A resolved source: the architecture, the tool's reading (``tool`` only), and the names the CLI lines use."""

    spec: Any
    reading: Any
    argument: str
    """What ``memfit estimate``/``memfit train`` are given for it (``--from FILE`` for a tool's file)."""


@contextlib.contextmanager
def resolved(source: Source):
    """The ``Model`` of ``source``; a sentence naming the temporary copy names the user's file instead."""
    with tempfile.TemporaryDirectory(prefix="memfit-serve-") as folder:
        try:
            yield _resolve(source, Path(folder))
        except UserError as err:
            raise UserError(str(err).replace(str(Path(folder)) + "/", "")) from None


def _resolve(source: Source, folder: Path) -> Model:
    if source.kind in ("preset", "hub"):
        return Model(load_spec(source.value), None, source.value)
    path = folder / source.filename
    path.write_text(source.value, encoding="utf-8")
    if source.kind == "config":
        spec = dataclasses.replace(load_spec(str(path)), name=source.filename)  # not the temporary path
        return Model(spec, None, source.filename)
    reading = interop.read(str(path), source.format)
    return Model(reading.spec(), reading, f"--from {shlex.quote(source.filename)}")


def typed_settings(data: Any) -> dict[str, Any]:
    """The settings the user changed, by key (``seq_len``), as the page sends them: text, numbers or booleans."""
    if data is None:
        return {}
    known = {c["key"]: c for c in run_controls()}
    if not isinstance(data, dict):
        raise UserError("The settings must be a mapping of setting names to values.")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UserError(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} no setting of memfit estimate.")
    bad = [k for k, v in data.items() if not isinstance(v, (str, int, float, bool))]
    if bad:
        raise UserError(f"{known[bad[0]]['flag']} takes one value, got {type(data[bad[0]]).__name__}.")
    return dict(data)


def run_of(model: Model, typed: dict[str, Any]) -> RunConfig:
    """The run the page prices: the typed settings over ``memfit estimate``'s defaults, or over the tool's file (as
    ``memfit estimate`` builds it from its flags and ``--from``)."""
    if model.reading is None:
        check_lora_options(typed, "lora_r" in typed)
        return RunConfig.from_flat({**own_defaults(RunConfig, "estimate"), **typed})
    return model.reading.with_flags(typed)


def engine(model: Model) -> str:
    """The sharding engine whose layout is priced: a DeepSpeed launch's own, else FSDP2's (as ``--from``)."""
    return model.reading.engine if model.reading is not None else "fsdp2"


def cli_line(command: str, source: Source, typed: dict[str, Any], extra: str = "") -> str:
    """The command line that gives the same answer in a terminal (a file named by the name it was uploaded as)."""
    flags = flags_of()
    words = [f"memfit {command}"]
    words.append(f"--from {shlex.quote(source.filename)}" if source.kind == "tool"
                 else shlex.quote(source.filename if source.kind == "config" else source.value))
    for key, value in typed.items():
        if isinstance(value, bool):
            words.append(flags[key] if value else "--no-" + flags[key][2:])
        else:
            words.append(f"{flags[key]} {shlex.quote(str(value))}")
    return " ".join(words) + extra


def gpu_fits(needed_bytes: int) -> list[dict[str, Any]]:
    """Every listed GPU, smallest first, and whether the need (``planning.fit``: every phase's reserved memory +
    context) fits it with the planner's safety margin."""
    gpus = sorted(load_gpus().values(), key=lambda g: (g.memory_bytes, g.name))
    return [{"name": g.name, "memory_bytes": g.memory_bytes, "fits": fits(needed_bytes, g.memory_bytes)} for g in gpus]


@one_at_a_time
def estimate(request: dict[str, Any]) -> dict[str, Any]:
    """The analytic breakdown: ``memfit estimate --json``'s payload, plus the GPUs and the CLI line."""
    source, typed = Source.from_dict(request.get("model")), typed_settings(request.get("settings"))
    with resolved(source) as model:
        run = run_of(model, typed)
        check_seq_len(run.seq_len, model.spec.max_position_embeddings)  # what train refuses is not estimated
        stack = model.reading.stack if model.reading is not None else None  # the file's trainer, as --from
        breakdown = analytic_estimate(model.spec, run, device="cuda", engine=engine(model), stack=stack)
        phases = device_phases(model.spec, run, breakdown)  # loading to the last save: what the fit rule reads
        reading = model.reading.to_dict(run) if model.reading is not None else None
        baseline = model.reading.run.to_flat() if model.reading is not None else None
    return {"model": model.spec.name, "config": run.to_flat(), **breakdown.to_dict(), "phases": phases.to_dict(),
            "page": {"gpus": gpu_fits(phases.needed()), "cli": cli_line("estimate", source, typed) + " --json",
                     "reading": reading, "baseline": baseline, "params": model.spec.params}}


@one_at_a_time
def exact(request: dict[str, Any]) -> dict[str, Any]:
    """The exact trace (``memfit estimate --exact``) and its memory timeline as a PNG: seconds to minutes,
    so the page runs it as a job (``memfit.web.jobs``), never on the request path."""
    # torch's private tracing APIs (memory/trace.py) are opened only when a trace is asked for
    from memfit.memory.trace import trace

    source, typed = Source.from_dict(request.get("model")), typed_settings(request.get("settings"))
    with resolved(source) as model:
        run = run_of(model, typed)
        check_seq_len(run.seq_len, model.spec.max_position_embeddings)
        breakdown, line = trace(model.spec, run, device="cuda", timeline=True)
        with tempfile.TemporaryDirectory(prefix="memfit-serve-") as folder:
            png = Path(folder) / "timeline.png"
            plot_timeline(line, png)
            image = base64.b64encode(png.read_bytes()).decode("ascii")
    return {"model": model.spec.name, "config": run.to_flat(), **breakdown.to_dict(),
            "page": {"timeline_png": image, "cli": cli_line("estimate", source, typed) + " --exact --timeline step.png"}}


@one_at_a_time
def plan(request: dict[str, Any]) -> dict[str, Any]:
    """The fastest plan for a budget at the run's sequence length, processes and method (``memfit plan``), with
    its ``memfit train`` command and, when a tool is chosen, the plan as that tool's config (``--emit``)."""
    source, typed = Source.from_dict(request.get("model")), typed_settings(request.get("settings"))
    budget, tool = request.get("budget"), request.get("emit") or None
    if tool is not None and tool not in TOOLS:
        raise UserError(f"Unknown --emit tool {tool!r}; choose one of: {', '.join(TOOLS)}.")
    batch = whole("batch", request.get("batch") or DEMO_MICRO_BATCH, minimum=1, what=POSITIVE)  # plan's --batch
    with resolved(source) as model:
        run = run_of(model, typed)
        check_seq_len(run.seq_len, model.spec.max_position_embeddings)
        realized = tool or (model.reading.tool if model.reading is not None else None)
        adapt = interop.realize(realized) if realized else None
        engine_of = interop.engine_of(realized) if realized else None
        stack = interop.stack_of(realized, model.reading) if realized else None
        pins = model.reading.plan_pins() if model.reading is not None else {}
        result = search_plans(model.spec, budget or None, seq_len=run.seq_len, batch=batch,
                              num_processes=run.num_processes, constraints=Constraints.from_flat(pins),
                              safety_margin=SAFETY_MARGIN, adapt=adapt, method=run.method, engine_of=engine_of,
                              stack=stack)
        emitted = _emitted(tool, result, model) if tool else None
    train_model = model.reading.model if model.reading is not None else (
        "MODEL_DIR" if source.kind == "config" else source.value)
    launch = None if str(result.best.config.loss) == "trl" else launch_command(train_model, result.best.config)
    # the line spells out the shape planned (the page's length, which may come from a tool's file)
    shape = {"seq_len": run.seq_len, **{k: typed[k] for k in ("num_processes", "method") if k in typed}}
    extra = f" --budget {shlex.quote(str(budget))} --batch {batch}" + (f" --emit {tool} {emitted['filename']}"
                                                                      if emitted else "")
    return {**result.to_dict(top=10), "launch": launch, "emit": emitted,
            "page": {"cli": cli_line("plan", source, shape, extra)}}


def _emitted(tool: str, result, model: Model) -> dict[str, str]:
    """The chosen plan as ``tool``'s config file: its name and text (``memfit plan --emit TOOL FILE``)."""

    filename = f"{tool}.yaml"
    with tempfile.TemporaryDirectory(prefix="memfit-serve-") as folder:
        path = Path(folder) / filename
        name = model.reading.model if model.reading is not None else result.model
        interop.emit(tool, path, name, result.best.config, model.reading, emit_header(result))
        return {"tool": tool, "filename": filename, "text": path.read_text(encoding="utf-8")}


def field_of(sentence: str, default: str = "model") -> str:
    """The form field an error sentence is about: the first setting whose flag it names, else ``default``."""
    hits = [(match.start(), key) for key, flag in flags_of().items()
            for match in [re.search(re.escape(flag) + r"(?![\w-])", sentence)] if match]
    return min(hits)[1] if hits else default
