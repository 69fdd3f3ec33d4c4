"""What a training run shows while it runs: its progress (stderr). Render only; the end summary (stdout) is
``memfit.report.summary``'s.

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

from rich.console import Console
from rich.progress import Progress, ProgressColumn
from rich.text import Text

from memfit.report.summary import known
from memfit.training.threads import LoadWatch
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


def _parts(f: StepFields) -> list[tuple[str, int, str]]:
    """(name, priority, text) in display order; priority 0 is never dropped, higher drops first."""
    parts = [("step", 0, f"step {f.step}/{f.total}"), ("bar", 7, "")]
    if known(f.loss):
        parts.append(("loss", 1, f"loss {f.loss:.3f}"))
    if known(f.eval_loss):
        parts.append(("eval", 3, f"eval {f.eval_loss:.3f}"))
    if f.skipped:
        parts.append(("skipped", 2, f"skipped {f.skipped}"))
    if known(f.tokens_per_s):
        parts.append(("tok/s", 5, f"{fmt_count(f.tokens_per_s)} tok/s"))
    if f.memory is not None:
        parts.append(("mem", 6, f"{f.memory_label} {fmt_bytes(f.memory, digits=0)}"))
    if known(f.lr):
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
    if known(f.loss):
        parts.append(f"loss {f.loss:.3f}")
    if f.skipped:
        parts.append(f"skipped {f.skipped}")
    if known(f.lr):
        parts.append(f"lr {f.lr:.1e}")
    if known(f.tokens_per_s):
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


class LiveProgress:
    """The run's progress: step, loss, held-out loss, lr, tokens/s, memory in use, fp16 skipped steps.

    A live line on a terminal, plain lines elsewhere (see the module docstring); ``live`` forces one or
    the other (None: rich's ``Console.is_interactive`` decides). ``note`` writes a line in both forms.
    It also watches the step time (``threads.LoadWatch``) and says once when the machine seems loaded.
    """

    def __init__(self, total: int, start: int, enabled: bool, console: Console | None = None, *,
                 log_every: int = 1, live: bool | None = None) -> None:
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
            evaluated = known(eval_loss) and eval_loss != self._last_eval
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
        if evaluated and known(stats.eval_loss):
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
