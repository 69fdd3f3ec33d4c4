"""What a training run shows: the live progress line (stderr) and the end summary (stdout). Render only.

Both fit an 80-column terminal without cutting a field. The progress line is built by
``progress_line`` for the console's width: step/total and the ETA are always there; the other fields
join in order of importance (loss, fp16 skipped steps, held-out loss, elapsed time, tokens/s, memory,
the bar, the learning rate) while they fit, so a narrow terminal drops the least important ones whole
instead of truncating the line with an ellipsis.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress, ProgressColumn
from rich.table import Table
from rich.text import Text

from memfit.training.summary import FallbackRecord
from memfit.units import fmt_bytes, fmt_count

#: Separator between the progress line's fields.
SEP = "  "
#: The bar is shown only when it can be at least this wide; it grows up to BAR_MAX into spare room.
BAR_MIN, BAR_MAX = 10, 30


@dataclass
class StepFields:
    """What the progress line reports after a step (``None``: not known yet)."""

    step: int
    total: int
    loss: float | None = None
    eval_loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    memory: int | None = None
    memory_label: str = "mem"
    skipped: int = 0
    elapsed_s: float | None = None
    remaining_s: float | None = None


def clock(seconds: float | None) -> str:
    """``"1:05"`` (m:ss), ``"2:03:04"`` (h:mm:ss) past an hour, ``"-:--"`` when unknown."""
    if seconds is None or math.isnan(seconds):
        return "-:--"
    s = int(round(seconds))
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _known(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def _parts(f: StepFields) -> list[tuple[str, int, str]]:
    """(name, priority, text) in display order; priority 0 is never dropped, higher drops first."""
    parts = [("step", 0, f"step {f.step}/{f.total}"), ("bar", 7, "")]
    if _known(f.loss):
        parts.append(("loss", 1, f"loss {f.loss:.3f}"))
    if _known(f.eval_loss):
        parts.append(("eval", 3, f"eval {f.eval_loss:.3f}"))
    if f.skipped:
        parts.append(("skipped", 2, f"skipped {f.skipped}"))
    if _known(f.tokens_per_s):
        parts.append(("tok/s", 5, f"{fmt_count(f.tokens_per_s)} tok/s"))
    if f.memory is not None:
        parts.append(("mem", 6, f"{f.memory_label} {fmt_bytes(f.memory, digits=0)}"))
    if _known(f.lr):
        parts.append(("lr", 8, f"lr {f.lr:.1e}"))
    parts.append(("elapsed", 4, clock(f.elapsed_s)))
    parts.append(("eta", 0, f"eta {clock(f.remaining_s)}"))
    return parts


def progress_line(f: StepFields, width: int) -> Text:
    """The progress line for a terminal ``width`` columns wide (see the module docstring)."""
    parts = _parts(f)
    kept = {name for name, prio, _ in parts if prio == 0}

    def length(names: set[str], bar: int) -> int:
        texts = [text if name != "bar" else "x" * bar for name, _, text in parts if name in names]
        return sum(map(len, texts)) + len(SEP) * (len(texts) - 1)

    for name, _, _ in sorted(parts, key=lambda p: p[1]):
        if name not in kept and length(kept | {name}, BAR_MIN) <= width:
            kept.add(name)
    bar = 0
    if "bar" in kept:
        bar = min(BAR_MAX, BAR_MIN + width - length(kept, BAR_MIN))
    line = Text()
    for name, _, text in parts:
        if name not in kept:
            continue
        if line:
            line.append(SEP)
        if name == "bar":
            done = round(bar * f.step / f.total) if f.total else bar
            line.append("━" * done, style="magenta")
            line.append("━" * (bar - done), style="grey23")
        else:
            line.append(text, style="bold" if name in ("step", "loss") else None)
    return line


class _LineColumn(ProgressColumn):
    """The whole progress line as one column, sized to the console's width at every refresh."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def render(self, task) -> Text:
        fields: StepFields = task.fields["stats"]
        fields.elapsed_s = task.elapsed
        fields.remaining_s = task.time_remaining
        return progress_line(fields, self.console.width)


if TYPE_CHECKING:
    from memfit.training.summary import RunSummary


class LiveProgress:
    """The live progress line: step, loss, held-out loss, lr, tokens/s, memory in use, fp16 skipped steps.

    It also watches the step time (``threads.LoadWatch``) and says once when the machine seems loaded.
    """

    def __init__(self, total: int, start: int, enabled: bool, console: Console | None = None) -> None:
        from memfit.training.threads import LoadWatch

        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.progress = Progress(_LineColumn(self.console), console=self.console, disable=not enabled,
                                 transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start,
                                           stats=StepFields(step=start, total=total))
        self.watch = LoadWatch()
        self._last_eval: float | None = None

    def __enter__(self) -> LiveProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, *, loss: float, lr: float, tokens_per_s: float, memory: int, skipped: int,
               eval_loss: float | None, memory_label: str = "mem") -> None:
        stats = StepFields(step=step, total=self.progress.tasks[0].total or step, loss=loss, eval_loss=eval_loss,
                           lr=lr, tokens_per_s=tokens_per_s, memory=memory, memory_label=memory_label,
                           skipped=skipped)
        evaluated = _known(eval_loss) and eval_loss != self._last_eval  # this step's time includes an evaluation
        self._last_eval = eval_loss
        message = self.watch.observe(step, time.perf_counter(), skip=evaluated)
        if message:
            self.note(message)
        self.progress.update(self.task, completed=step, stats=stats)

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)


# ------------------------------------------------------------------------------------------------
# the end-of-run summary
# ------------------------------------------------------------------------------------------------
def _loss(value: float | None) -> str:
    return "n/a" if not _known(value) else f"{value:.3f} nats/token"


def _plain(summary: RunSummary | dict[str, Any]) -> dict[str, Any]:
    """The summary's JSON form (``RunSummary.to_dict``), what the table renders, like run.json and --json."""
    return summary if isinstance(summary, dict) else summary.to_dict()


def baseline_warning(summary: RunSummary | dict[str, Any]) -> str | None:
    """One plain sentence when the held-out loss is not below the unigram baseline (None otherwise)."""
    summary = _plain(summary)
    held, unigram = summary.get("final_eval_loss"), summary.get("unigram_loss")
    if not (_known(held) and _known(unigram)) or held < unigram:
        return None
    return (f"warning: the held-out loss {held:.3f} is not below the unigram baseline {unigram:.3f} nats/token: "
            "the model predicts the held-out text no better than token frequencies do. Train longer, "
            "check --lr, or check that the data has structure to learn.")


def measured_vs_predicted(measured: float, predicted: float) -> str:
    """Which way the measurement went, in words: "measured 0.1% lower" (a bare "-0.1%" left it open
    whether the prediction or the measurement was the smaller)."""
    rel = (measured - predicted) / predicted
    if abs(rel) < 0.0005:
        return "measured the same, within 0.05%"
    return f"measured {abs(rel):.1%} {'higher' if rel > 0 else 'lower'}"


def _memory_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Measured next to predicted, like for like (tensor bytes vs tensor bytes); RSS on its own line."""
    mem = summary["peak_memory"]
    predicted = summary.get("predicted_peak_bytes")
    measured = mem.get("peak_bytes") or 0
    rows = []
    if mem["device"] == "cuda":
        rows.append(("peak tensors (measured)", f"{fmt_bytes(mem['cuda_max_allocated'])} CUDA max allocated"))
        rows.append(("CUDA max reserved", fmt_bytes(mem["cuda_max_reserved"])))
    elif mem.get("cpu_tensor_peak"):
        rows.append(("peak tensors (measured)", f"{fmt_bytes(mem['cpu_tensor_peak'])} "
                                                f"(step {mem.get('cpu_tensor_peak_step', '?')}, live tensors)"))
    if predicted:
        diff = f" ({measured_vs_predicted(measured, predicted)})" if measured and rows else ""
        rows.append(("peak tensors (predicted)", fmt_bytes(predicted) + diff))
    else:
        rows.append(("peak tensors (predicted)", "n/a (estimator unavailable)"))
    outside = summary.get("outside_step")
    if outside:
        host = f"; + {fmt_bytes(outside['save_host'])} host RAM on rank 0" if outside.get("save_host") else ""
        rows.append(("outside the step (predicted)", f"evaluation {fmt_bytes(outside['evaluation'])}, "
                     f"full-state checkpoint {fmt_bytes(outside['checkpoint_full'])}, export "
                     f"{fmt_bytes(outside['export'])}, samples {fmt_bytes(outside['generation'])}{host}"))
    if mem["device"] != "cuda":
        rows.append(("process peak RSS", f"{fmt_bytes(mem['cpu_peak_rss'])} (tensors + Python/torch runtime)"))
    return rows


def summary_table(summary: RunSummary | dict[str, Any]) -> Table:
    """The end-of-run table: losses against the unigram baseline, speed, memory measured vs predicted."""
    summary = _plain(summary)
    table = Table(title="memfit train: summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value")
    if summary.get("hub"):
        table.add_row("model", f"{summary['hub']['id']} (Hugging Face Hub, commit {summary['hub']['commit'][:12]})")
    table.add_row("steps", f"{summary['steps']} optimizer steps, {summary['sequences']:,} sequences")
    if summary.get("plan"):
        table.add_row("plan", f"{summary['plan']['description']} (for {summary['plan']['budget']})")
    table.add_row("held-out loss", f"{_loss(summary['final_eval_loss'])} (best "
                  f"{'n/a' if not _known(summary['best_eval_loss']) else format(summary['best_eval_loss'], '.3f')})")
    table.add_row("unigram baseline", _loss(summary["unigram_loss"]))
    table.add_row("final train loss", _loss(summary["final_train_loss"]))
    table.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s")
    table.add_row("wall time", f"{summary['wall_s']:.1f} s (training loop {summary['train_s']:.1f} s)")
    for row in _memory_rows(summary):
        table.add_row(*row)
    if len(summary.get("rank_peak_bytes") or []) > 1:
        table.add_row("peak per rank (measured)", ", ".join(fmt_bytes(b) for b in summary["rank_peak_bytes"]))
    if summary["skipped_steps"]:
        table.add_row("fp16 skipped steps", str(summary["skipped_steps"]))
    for fb in summary["fallbacks"]:
        table.add_row("OOM fallback", FallbackRecord.from_dict(fb).describe())
    table.add_row("output", summary["output"])
    return table


def print_summary(summary: RunSummary | dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    console.print(summary_table(summary))
    warning = baseline_warning(summary)
    if warning:
        console.print(Text(warning, style="bold yellow"))
    for i, sample in enumerate(_plain(summary).get("samples") or [], start=1):
        # A conversation's reply is its own text, not a continuation of the question: on its own line
        # (a plain log shows no colours, and "sky?The sky is" read as one sentence).
        joint = "\n  reply: " if sample.get("reply") else ""
        console.print(Text.assemble((f"sample {i}: ", "bold"), (sample["prompt"], "bold cyan"), joint,
                                    sample["completion"]))
