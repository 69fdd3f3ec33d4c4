"""What a training run shows: the live progress bar (stderr) and the end summary (stdout). Render only."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from memfit.units import fmt_bytes, fmt_count, fmt_gib

if TYPE_CHECKING:
    from memfit.training.summary import RunSummary


class LiveProgress:
    """rich progress bar: step, loss, lr, tokens/s, memory in use, fp16 skipped steps."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=self.console, disable=not enabled, transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, info="")

    def __enter__(self) -> LiveProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, *, loss: float, lr: float, tokens_per_s: float, memory: int, skipped: int,
               eval_loss: float | None) -> None:
        info = f"loss {loss:.3f}  lr {lr:.2e}  {fmt_count(tokens_per_s)} tok/s  mem {fmt_bytes(memory)}"
        if eval_loss is not None and not math.isnan(eval_loss):
            info += f"  eval {eval_loss:.3f}"
        if skipped:
            info += f"  skipped {skipped}"
        self.progress.update(self.task, completed=step, info=info)

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)


def _loss(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f} nats/token"


def summary_table(summary: RunSummary) -> Table:
    """The end-of-run table: losses against the unigram baseline, speed, memory measured vs predicted."""
    table = Table(title="memfit train: summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("steps", f"{summary.steps} optimizer steps, {summary.sequences:,} sequences")
    if summary.plan:
        table.add_row("plan", f"{summary.plan['description']} (for {summary.plan['budget']})")
    table.add_row("final eval loss", _loss(summary.final_eval_loss))
    table.add_row("best eval loss", _loss(summary.best_eval_loss))
    table.add_row("unigram baseline", _loss(summary.unigram_loss))
    table.add_row("final train loss", _loss(summary.final_train_loss))
    table.add_row("throughput", f"{summary.tokens_per_s:,.0f} tokens/s")
    table.add_row("wall time", f"{summary.wall_s:.1f} s (training loop {summary.train_s:.1f} s)")
    mem = summary.peak_memory
    if mem.device == "cuda":
        table.add_row("peak memory (measured)", f"{fmt_gib(mem.cuda_max_allocated)} max allocated, "
                      f"{fmt_gib(mem.cuda_max_reserved)} max reserved")
    else:
        table.add_row("peak memory (measured)", f"{fmt_bytes(mem.cpu_peak_rss)} CPU peak RSS "
                      "(includes the Python/torch runtime)")
    if len(summary.rank_peak_bytes) > 1:
        table.add_row("peak per rank (measured)", ", ".join(fmt_bytes(b) for b in summary.rank_peak_bytes))
    predicted = summary.predicted_peak_bytes
    table.add_row("peak memory (predicted)", fmt_bytes(predicted) if predicted else "n/a (estimator unavailable)")
    if summary.skipped_steps:
        table.add_row("fp16 skipped steps", str(summary.skipped_steps))
    for fb in summary.fallbacks:
        table.add_row("OOM fallback", fb.describe())
    table.add_row("output", summary.output)
    return table


def print_summary(summary: RunSummary, console: Console | None = None) -> None:
    console = console or Console()
    console.print(summary_table(summary))
    for i, sample in enumerate(summary.samples, start=1):
        console.print(Text.assemble((f"sample {i}: ", "bold"), (sample["prompt"], "bold cyan"),
                                    sample["completion"]))
