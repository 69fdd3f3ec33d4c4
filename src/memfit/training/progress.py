"""What a training run shows: its progress (stderr) and the end summary (stdout). Render only.

Progress takes one of two forms, chosen by rich's own test of the console (``Console.is_interactive``:
stderr is a terminal that is not ``TERM=dumb``; the environment overrides it as rich documents:
``TTY_INTERACTIVE=0``/``1``, ``TTY_COMPATIBLE=0``/``1``, ``FORCE_COLOR``):

* on a terminal, one live line redrawn in place, built by ``progress_line`` for the console's width:
  step/total and the ETA are always there; the other fields join in order of importance (loss, fp16
  skipped steps, held-out loss, elapsed time, tokens/s, memory, the bar, the learning rate) while they
  fit, so a narrow terminal drops the least important ones whole instead of cutting the line;
* anywhere else (``nohup``, Slurm, CI, ``| tee``, a file), plain lines that are never redrawn, each
  flushed as it is written (``tail -f`` shows it): a step line (``plain_line``) every ``--log-every``
  steps, at least every ``LOG_SECONDS`` seconds and at the last step, and an evaluation line
  (``eval_line``) after each held-out evaluation. Their format is stable, for grep::

      step 40/300  loss 1.234  lr 9.5e-04  1.2 K tok/s  rss 243.6 MiB  elapsed 0:32  eta 3:40
      eval step 40/300  held-out loss 1.301
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
#: Without a live terminal, a step line is written at least this often (seconds; checked at the end of
#: each step), between the ``--log-every`` ones, so a log file never stays silent long on slow steps.
LOG_SECONDS = 30.0


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


def plain_line(f: StepFields) -> str:
    """The step line written without a live terminal: every known field, in a fixed order, never cut."""
    parts = [f"step {f.step}/{f.total}"]
    if _known(f.loss):
        parts.append(f"loss {f.loss:.3f}")
    if f.skipped:
        parts.append(f"skipped {f.skipped}")
    if _known(f.lr):
        parts.append(f"lr {f.lr:.1e}")
    if _known(f.tokens_per_s):
        parts.append(f"{fmt_count(f.tokens_per_s)} tok/s")
    if f.memory is not None:
        parts.append(f"{f.memory_label} {fmt_bytes(f.memory)}")
    parts.append(f"elapsed {clock(f.elapsed_s)}")
    parts.append(f"eta {clock(f.remaining_s)}")
    return SEP.join(parts)


def eval_line(step: int, total: int, eval_loss: float) -> str:
    """The line written after a held-out evaluation without a live terminal."""
    return f"eval step {step}/{total}{SEP}held-out loss {eval_loss:.3f}"


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
    """The run's progress: step, loss, held-out loss, lr, tokens/s, memory in use, fp16 skipped steps.

    A live line on a terminal, plain lines elsewhere (see the module docstring); ``live`` forces one or
    the other (None: rich's ``Console.is_interactive`` decides). ``note`` writes a line in both forms.
    It also watches the step time (``threads.LoadWatch``) and says once when the machine seems loaded.
    """

    def __init__(self, total: int, start: int, enabled: bool, console: Console | None = None, *,
                 log_every: int = 1, live: bool | None = None) -> None:
        from memfit.training.threads import LoadWatch

        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self.live = enabled and (self.console.is_interactive if live is None else live)
        self.progress = Progress(_LineColumn(self.console), console=self.console, disable=not self.live,
                                 transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start,
                                           stats=StepFields(step=start, total=total))
        self.total, self.start, self.log_every = total, start, max(log_every, 1)
        self._t0 = self._last_line = time.perf_counter()
        self.watch = LoadWatch()
        self._last_eval: float | None = None

    def __enter__(self) -> LiveProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, *, loss: float, lr: float, tokens_per_s: float, memory: int, skipped: int,
               eval_loss: float | None, memory_label: str = "mem", evaluated: bool | None = None) -> None:
        """After optimizer step ``step``; ``evaluated``: whether a held-out evaluation just ran (None:
        when ``eval_loss`` changed)."""
        stats = StepFields(step=step, total=self.progress.tasks[0].total or step, loss=loss, eval_loss=eval_loss,
                           lr=lr, tokens_per_s=tokens_per_s, memory=memory, memory_label=memory_label,
                           skipped=skipped)
        if evaluated is None:
            evaluated = _known(eval_loss) and eval_loss != self._last_eval
        self._last_eval = eval_loss
        now = time.perf_counter()
        message = self.watch.observe(step, now, skip=evaluated)  # this step's time includes an evaluation
        if message:
            self.note(message)
        if self.live:
            self.progress.update(self.task, completed=step, stats=stats)
        elif self.enabled:
            self._log(stats, now, evaluated)

    def _log(self, stats: StepFields, now: float, evaluated: bool) -> None:
        """The step line when due (``--log-every``, ``LOG_SECONDS``, the last step), then the evaluation's."""
        step = stats.step
        if step % self.log_every == 0 or step >= self.total or now - self._last_line >= LOG_SECONDS:
            stats.elapsed_s = now - self._t0
            done = step - self.start  # steps of this process: a resumed run's rate is its own
            stats.remaining_s = stats.elapsed_s / done * (self.total - step) if done > 0 else None
            self._write(plain_line(stats))
            self._last_line = now
        if evaluated and _known(stats.eval_loss):
            self._write(eval_line(step, stats.total, stats.eval_loss))

    def _write(self, line: str) -> None:
        # as written, never wrapped at the console's width (a file's is 80) nor read as rich markup, so grep
        # sees every line whole; rich flushes the stream after each print, so tail -f shows it at once
        self.console.print(line, soft_wrap=True, highlight=False, markup=False)

    def note(self, text: str) -> None:
        """A line of its own: wrapped to the terminal's width under the live line, whole in a log."""
        if self.live:
            self.console.print(text, highlight=False)
        elif self.enabled:
            self._write(text)


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
    pref = summary.get("preference")
    if pref and _known(summary["final_train_loss"]):  # the method's loss is per pair, not per token
        table.add_row("final train loss", f"{summary['final_train_loss']:.3f} ({pref['method']} loss, mean over "
                                          "the step's pairs)")
    else:
        table.add_row("final train loss", _loss(summary["final_train_loss"]))
    if pref and pref.get("first") and pref.get("last"):  # first step -> last steps pooled: the rise training made
        first, last = pref["first"], pref["last"]
        start, end = (f"step {a}" if a == b else f"steps {a}-{b}" for a, b in (first["steps"], last["steps"]))
        table.add_row(f"reward accuracy ({pref['method']})",
                      f"{first['reward_accuracy']:.0%} at {start} -> {last['reward_accuracy']:.0%} over {end} "
                      f"({last['pairs']:,} pairs)")
        table.add_row("reward margin", f"{first['reward_margin']:+.3f} -> {last['reward_margin']:+.3f} "
                                       "(chosen minus rejected reward, nats x beta)")
    table.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s")
    resumes = summary.get("resumes") or []
    resumed = bool(resumes) and summary.get("process_wall_s") is not None
    table.add_row("wall time", f"{summary['wall_s']:.1f} s{', whole run' if resumed else ''} "
                               f"(training loop {summary['train_s']:.1f} s)")
    if resumed:  # the row above adds up the parts of the run; this one is what this command took
        table.add_row("wall time (this process)",
                      f"{summary['process_wall_s']:.1f} s, resumed from step {resumes[-1]['step']}")
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
