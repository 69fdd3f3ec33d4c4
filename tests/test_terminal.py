"""What the terminal shows fits 80 columns without cutting a field; memory compares like with like;
the thread count follows the cores really available; a slowed-down run says so once."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console

from memfit.memory import measure
from memfit.report.summary import baseline_warning, measured_vs_predicted, print_summary
from memfit.training import threads
from memfit.training.progress import LiveProgress, StepFields, progress_line


def _console(width: int = 80) -> Console:
    return Console(width=width, record=True, file=io.StringIO(), force_terminal=False, color_system=None)


def _lines(console: Console) -> list[str]:
    return [line.rstrip() for line in console.export_text().splitlines() if line.strip()]


# --- the progress line ----------------------------------------------------------------------------
def _render_bar(width: int, **update) -> str:
    console = _console(width)
    with LiveProgress(3000, 0, True, console=console, live=True) as bar:  # the terminal's line, rendered
        bar.update(2999, **update)
    lines = _lines(console)
    assert len(lines) == 1, lines  # one line: nothing wrapped onto a second
    return lines[0]


UPDATE = dict(loss=0.6991, lr=1e-3, tokens_per_s=2305.0, memory=666 * 2**20, skipped=3, eval_loss=0.7104)


@pytest.mark.parametrize("width", [80, 60, 40])
def test_progress_line_keeps_step_and_eta_whole(width):
    line = _render_bar(width, **UPDATE)
    assert "…" not in line and len(line) <= width
    assert "step 2999/3000" in line and "eta " in line
    assert "loss 0.699" in line  # the next most important field fits even at 40 columns


def test_progress_line_at_80_columns_has_every_field_of_the_demo():
    line = _render_bar(80, **{**UPDATE, "skipped": 0})
    for field in ("step 2999/3000", "loss 0.699", "eval 0.710", "2.3 K tok/s", "mem 666 MiB", "eta "):
        assert field in line, (field, line)


def test_fields_are_dropped_whole_least_important_first():
    fields = StepFields(step=300, total=300, loss=0.7, eval_loss=0.71, lr=1e-3, tokens_per_s=2305, memory=2**29,
                        elapsed_s=3725, remaining_s=0)
    wide = progress_line(fields, 200).plain
    assert "━" in wide and "lr 1.0e-03" in wide and "1:02:05" in wide  # all fields, elapsed as h:mm:ss
    narrow = progress_line(fields, 50).plain
    assert narrow == "step 300/300  loss 0.700  eval 0.710  eta 0:00"  # lr, bar, mem, tok/s, elapsed went


# --- the summary ----------------------------------------------------------------------------------
def _summary(**over):
    base = {
        "steps": 300, "sequences": 1200, "final_eval_loss": 0.710, "best_eval_loss": 0.705, "unigram_loss": 3.036,
        "final_train_loss": 0.699, "tokens_per_s": 2305.2, "wall_s": 81.9, "train_s": 66.6, "skipped_steps": 0,
        "fallbacks": [], "output": "runs/tiny-20261130-123456", "plan": None, "samples": [],
        "predicted_peak_bytes": 173_119_488,
        "peak_memory": {"device": "cpu", "cuda_max_allocated": 0, "cuda_max_reserved": 0,
                        "cpu_peak_rss": 709_000_000, "cpu_tensor_peak": 171_016_788, "cpu_tensor_peak_step": 2,
                        "peak_bytes": 171_016_788},
    }
    base.update(over)
    return base


def test_summary_fits_80_columns_and_compares_tensors_with_tensors():
    console = _console()
    print_summary(_summary(), console)
    lines = _lines(console)
    assert all(len(line) <= 80 and "…" not in line for line in lines)
    text = "\n".join(lines)
    # Each row on one line (no value wrapped into a second row of the table).
    for label, value in [("peak tensors (measured)", "163.1 MiB (step 2, live tensors)"),
                         # 171,016,788 / 2^20 = 163.1 MiB; 173,119,488 / 2^20 = 165.1 MiB; 163.1/165.1 - 1 = -1.2%;
                         # 709,000,000 / 2^20 = 676.16 MiB
                         ("peak tensors (predicted)", "165.1 MiB (measured 1.2% lower)"),
                         ("process peak RSS", "676.2 MiB (tensors + Python/torch runtime)"),
                         ("held-out loss", "0.710 nats/token (best 0.705)"), ("unigram baseline", "3.036"),
                         ("throughput", "2,305 tokens/s"), ("output", "runs/tiny-20261130-123456")]:
        assert any(label in line and value in line for line in lines), (label, value, text)
    assert "warning" not in text  # 0.710 is far below the 3.036 baseline


def test_summary_of_a_resumed_run_shows_both_wall_times_within_80_columns():
    console = _console()
    print_summary(_summary(resumes=[{"event": "resume", "step": 120, "checkpoint": "step-120"}],
                           process_wall_s=40.25), console)
    lines = _lines(console)
    assert all(len(line) <= 80 for line in lines)
    assert any("wall time" in line and "81.9 s, whole run (training loop 66.6 s)" in line for line in lines)
    assert any("wall time (this process)" in line and "40.2 s, resumed from step 120" in line for line in lines)
    console = _console()
    print_summary(_summary(process_wall_s=81.9), console)  # not resumed: one row, as before
    text = "\n".join(_lines(console))
    assert "81.9 s (training loop 66.6 s)" in text and "this process" not in text


def test_summary_on_cuda_shows_max_allocated_next_to_the_prediction():
    mem = {"device": "cuda", "cuda_max_allocated": 3 * 2**30, "cuda_max_reserved": 3.5 * 2**30, "cpu_peak_rss": 0,
           "peak_bytes": 3 * 2**30}
    console = _console()
    print_summary(_summary(peak_memory=mem, predicted_peak_bytes=3 * 2**30), console)
    text = "\n".join(_lines(console))
    assert "3.00 GiB CUDA max allocated" in text and "3.00 GiB (measured the same, within 0.05%)" in text
    assert "RSS" not in text


def test_measured_against_predicted_says_which_way():
    # 110 measured vs 100 predicted: the measurement is 10% above the prediction, and the words say so.
    assert measured_vs_predicted(110, 100) == "measured 10.0% higher"
    assert measured_vs_predicted(90, 100) == "measured 10.0% lower"


def test_a_conversation_sample_shows_the_reply_apart_from_the_question():
    samples = [{"prompt": "Why is the sky blue?", "completion": "The sky is blue because", "reply": True},
               {"prompt": "Once upon a time", "completion": ", there was a fox."}]
    console = _console()
    print_summary(_summary(samples=samples), console)
    text = "\n".join(_lines(console))
    assert "sample 1: Why is the sky blue?\n  reply: The sky is blue because" in text
    assert "sky?The" not in text
    assert "sample 2: Once upon a time, there was a fox." in text  # a continuation stays one text


def test_baseline_warning_only_when_the_model_does_not_beat_unigram():
    assert baseline_warning(_summary()) is None
    assert baseline_warning(_summary(final_eval_loss=math.nan)) is None  # nothing held out: nothing to say
    warning = baseline_warning(_summary(final_eval_loss=3.1))
    assert warning.startswith("warning: the held-out loss 3.100 is not below the unigram baseline 3.036")
    console = _console()
    print_summary(_summary(final_eval_loss=3.1), console)
    assert "warning: the held-out loss 3.100" in " ".join(_lines(console))


# --- CPU tensor peak, counted on real tensors ----------------------------------------------------
def test_step_peak_counts_weights_gradient_and_activations_of_a_real_step():
    """A 512x512 fp32 linear layer, SGD (no state), x of 16x512: the peak holds the weight W (1 MiB),
    its gradient G (1 MiB, created in backward while W and x live) and x (32 KiB), plus at most a few
    (16, 512) activation/gradient buffers of 32 KiB each. Without the gradient it would be ~1.1 MiB."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"x": torch.randn(16, 512)}
    w = g = 512 * 512 * 4
    x = act = 16 * 512 * 4
    counter = measure.StepPeak("cpu", steps_to_run=1)
    with counter.watch(1, model, opt, [batch]):
        loss = model(batch["x"]).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert counter.measured_step == 1
    assert w + g + x <= counter.peak_bytes <= w + g + x + 4 * act


def test_step_peak_measures_only_the_third_step_and_never_on_cuda():
    # the third step is the first to start with the whole rollback snapshot (see StepPeak); a 2-step run
    # measures its last
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = measure.StepPeak("cpu", steps_to_run=5)
    for step in (1, 2, 3, 4):
        with counter.watch(step, model, opt, []):
            model(torch.ones(2, 8)).sum().backward()
    assert counter.measured_step == 3 and counter.peak_bytes > 0
    short = measure.StepPeak("cpu", steps_to_run=2)
    for step in (1, 2):
        with short.watch(step, model, opt, []):
            model(torch.ones(2, 8)).sum().backward()
    assert short.measured_step == 2
    cuda = measure.StepPeak("cuda", steps_to_run=5)
    for step in (1, 2):
        with cuda.watch(step, model, opt, []):
            pass
    assert cuda.peak_bytes == 0


# --- threads --------------------------------------------------------------------------------------
def test_thread_choice_order(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    monkeypatch.setattr(threads, "idle_cores", lambda cpus, seconds=0.2: 1.1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose_threads(2).threads == 2  # --threads wins
    assert threads.choose_threads().source == "OMP_NUM_THREADS" and threads.choose_threads().threads == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.choose_threads().threads == 1  # 4 cores, but only 1.1 idle: never more threads than idle cores
    monkeypatch.setattr(threads, "idle_cores", lambda cpus, seconds=0.2: 3.9)
    assert threads.choose_threads().threads == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads.choose_threads().threads == 2  # two local processes share the 4 cores


def test_cgroup_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.quota_cores(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.quota_cores(tmp_path) == 2.0


def test_load_watch_speaks_once_when_steps_slow_down():
    watch = threads.LoadWatch(factor=3.0, window=5)
    said, t = [], 0.0
    for step in range(1, 40):
        t += 0.1 if step <= 15 else 0.5  # 5x slower from step 16 on
        if step == 20:
            t += 5.0  # an evaluation: left out by the caller
        message = watch.observe(step, t, skip=step == 20)
        if message:
            said.append((step, message))
    assert len(said) == 1 and said[0][0] >= 18 and "5.0x as long" in said[0][1]
    steady = threads.LoadWatch()
    assert not any(steady.observe(step, step * 0.1 + (2.0 if step == 30 else 0)) for step in range(1, 60))
