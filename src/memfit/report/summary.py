"""The end-of-run summary of ``memfit train``, rendered from its JSON form. Render only.

``training.summary.RunSummary`` is built once at the end of a run; this table, ``run.json`` and
``memfit train --json`` all show its ``to_dict()`` form, so the three never disagree on a number or a key.
The renderers take that plain dict (or anything with a ``to_dict()``: a ``RunSummary``), so report/ stays
below training/ in the layers and ``memfit train`` prints it through the public API.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memfit.units import fmt_bytes


def known(value: float | None) -> bool:
    """A loss or speed that was measured: not ``None`` (not measured) and not NaN (nothing to measure)."""
    return value is not None and not math.isnan(value)


def json_safe(value: Any) -> Any:
    """NaN becomes ``None`` (JSON has no NaN), recursively."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def fallback_line(record: dict[str, Any]) -> str:
    """One line of an out-of-memory fallback (``FallbackRecord.to_dict()`` form):
    ``step 2 (forward): micro-batch 4 x 1 -> 2 x 2``."""
    a, b, step, phase = record["from"], record["to"], record["step"], record.get("phase", "forward")
    if a.get("optimizer") != b.get("optimizer"):
        return f"step {step} ({phase}): optimizer {a.get('optimizer')} -> {b.get('optimizer')}"
    change = f"micro-batch {a['micro_batch']} x {a['grad_accum']} -> {b['micro_batch']} x {b['grad_accum']}"
    if b["grad_checkpointing"] and not a["grad_checkpointing"]:
        change += " + checkpointing"
    return f"step {step} ({phase}): {change}"


def _loss(value: float | None) -> str:
    return "n/a" if not known(value) else f"{value:.3f} nats/token"


def _plain(summary: Any) -> dict[str, Any]:
    """The summary's JSON form (``RunSummary.to_dict``), what the table renders, like run.json and --json."""
    return summary if isinstance(summary, dict) else summary.to_dict()


def baseline_warning(summary: Any) -> str | None:
    """One plain sentence when the held-out loss is not below the unigram baseline (None otherwise)."""
    summary = _plain(summary)
    held, unigram = summary.get("final_eval_loss"), summary.get("unigram_loss")
    if not (known(held) and known(unigram)) or held < unigram:
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
    at_rows = summary.get("predicted_at_measured_rows")
    if predicted and at_rows and measured and rows:
        # the measured step's rows were shorter (or fewer) than the full rows the prediction is sized for
        shape = mem.get("cpu_tensor_peak_rows") or ("?", "?")
        rows.append(("peak tensors (predicted)", f"{fmt_bytes(predicted)} at full rows; "
                     f"{fmt_bytes(at_rows)} at step {mem.get('cpu_tensor_peak_step', '?')}'s {shape[0]} x "
                     f"{shape[1]} tokens ({measured_vs_predicted(measured, at_rows)})"))
    elif predicted:
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
        phases = {k[len("phase_"):]: v for k, v in outside.items() if k.startswith("phase_")}
        if phases:  # memory.phases: what the fit rule reads
            cuda = bool(outside.get("device_context"))
            extra = " + CUDA context" + (" and NCCL" if summary.get("num_processes", 1) > 1 else "") if cuda else ""
            rows.append(("reserved by phase (predicted)" if cuda else "peak by phase (predicted)",
                         ", ".join(f"{k} {fmt_bytes(v)}" for k, v in phases.items())
                         + f"; device {fmt_bytes(outside['device_needed'])} at the worst{extra}"))
            measured_phases = _measured_phases(summary, phases)
            if measured_phases:
                rows.append(("peak by phase (measured)", measured_phases))
    if mem["device"] != "cuda":
        rows.append(("process peak RSS", f"{fmt_bytes(mem['cpu_peak_rss'])} (tensors + Python/torch runtime)"))
    return rows


def _measured_phases(summary: dict[str, Any], predicted: dict[str, int]) -> str:
    """Each phase a CPU run measured (``measured_phases``: live tensors, rank 0's) next to its prediction, in the
    predicted row's order; "" where none was measured (CUDA)."""
    measured = summary.get("measured_phases") or {}
    return ", ".join(f"{name} {fmt_bytes(measured[name])} ({measured_vs_predicted(measured[name], figure)})"
                     for name, figure in predicted.items() if measured.get(name) and figure)


def summary_table(summary: Any) -> Table:
    """The end-of-run table: losses against the unigram baseline, speed, memory measured vs predicted."""
    summary = _plain(summary)
    table = Table(title="memfit train: summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value")
    if summary.get("hub"):
        table.add_row("model", f"{summary['hub']['id']} (Hugging Face Hub, commit {summary['hub']['commit'][:12]})")
    unit = "pairs" if summary.get("preference") else "sequences"  # a preference step's rows are pairs
    table.add_row("steps", f"{summary['steps']} optimizer steps, {summary['sequences']:,} {unit}")
    if summary.get("plan"):
        table.add_row("plan", f"{summary['plan']['description']} (for {summary['plan']['budget']})")
    table.add_row("held-out loss", f"{_loss(summary['final_eval_loss'])} (best "
                  f"{'n/a' if not known(summary['best_eval_loss']) else format(summary['best_eval_loss'], '.3f')})")
    table.add_row("unigram baseline", _loss(summary["unigram_loss"]))
    pref = summary.get("preference")
    if pref and known(summary["final_train_loss"]):  # the method's loss is per pair, not per token
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
        table.add_row("OOM fallback", fallback_line(fb))
    table.add_row("output", summary["output"])
    return table


def print_summary(summary: Any, console: Console | None = None) -> None:
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
