"""An out-of-memory error in any phase of a step never corrupts it (issue 10, item 4).

Each test injects an OOM into step 2 of a 3-step AdamW run of the tiny Llama (fp32, CPU, clipping on,
weight decay on) and compares the final weights with an uninterrupted run that used the fallback
configuration from the start. AdamW with lr 1e-2 moves every weight by ~1e-2 per step, so a step
applied one and a half times, or moments/step counts advanced twice, shows as differences of order
1e-3, far above the 1e-6 bound; what remains below it is float rounding between accumulation splits
and between the foreach and fused kernels.
"""

from __future__ import annotations

import accelerate
import pytest
import torch

from _train_helpers import max_diff, tiny_config
from memfit.config import RunConfig
from memfit.errors import UserError
from memfit.training import oom
from memfit.training import step as step_module
from memfit.training.loop import run_training

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes. Error code 12"


def adamw_config(tmp, **run):
    return tiny_config(tmp, optimizer_lr=1e-2, weight_decay=0.1, max_grad_norm=1.0,
                       run={"optimizer": "adamw-foreach", **run})


def fail_on_call(real, calls: set[int], error: BaseException, *, after: bool):
    """``real`` wrapped to raise ``error`` on the given call numbers (1-based), before or after running it."""

    def wrapper(*args, **kwargs):
        wrapper.n += 1
        if wrapper.n in calls and not after:
            raise error
        out = real(*args, **kwargs)
        if wrapper.n in calls:
            raise error  # after the real work: the step's tensors were already mutated
        return out

    wrapper.n = 0
    return wrapper


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs with each fallback configuration from the start."""
    return {
        "2x2": run_training(adamw_config(tmp_path_factory.mktemp("ref22"), micro_batch=2, grad_accum=2), show=False),
        "fused": run_training(adamw_config(tmp_path_factory.mktemp("reffused"), optimizer="adamw-fused"), show=False),
    }


def _inject_forward(monkeypatch):
    # micro_loss runs once per step at 4 x 1: call 2 is step 2's forward.
    monkeypatch.setattr(step_module, "micro_loss",
                        fail_on_call(step_module.micro_loss, {2}, torch.OutOfMemoryError(CUDA_OOM), after=False))


def _inject_backward(monkeypatch):
    # Step 2's backward runs to the end (gradients written), then Python's MemoryError.
    monkeypatch.setattr(accelerate.Accelerator, "backward",
                        fail_on_call(accelerate.Accelerator.backward, {2}, MemoryError(), after=True))


def _inject_clip(monkeypatch):
    # Step 2's clipping scales the gradients in place, then the CPU allocator's error.
    monkeypatch.setattr(accelerate.Accelerator, "clip_grad_norm_",
                        fail_on_call(accelerate.Accelerator.clip_grad_norm_, {2}, RuntimeError(CPU_OOM), after=True))


def _inject_optimizer(monkeypatch):
    # Inside torch's foreach AdamW, where a real OOM happens: _foreach_sqrt(exp_avg_sq) allocates one
    # temporary per parameter after the step counts, weight decay and both moments were updated in
    # place. It runs once per param group (2 groups: matrices with decay, vectors without); call 4 is
    # step 2's second group, so the first group's parameters are fully updated when it raises.
    monkeypatch.setattr(torch, "_foreach_sqrt",
                        fail_on_call(torch._foreach_sqrt, {4}, torch.OutOfMemoryError(CUDA_OOM), after=False))


PHASES = {
    "forward": (_inject_forward, "2x2", {"micro_batch": 2, "grad_accum": 2}),
    "backward": (_inject_backward, "2x2", {"micro_batch": 2, "grad_accum": 2}),
    "clip": (_inject_clip, "fused", {"optimizer": "adamw-fused"}),
    "optimizer": (_inject_optimizer, "fused", {"optimizer": "adamw-fused"}),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_oom_in_each_phase_ends_with_the_fallback_runs_weights(phase, reference, tmp_path, monkeypatch):
    inject, ref_key, changed = PHASES[phase]
    inject(monkeypatch)
    res = run_training(adamw_config(tmp_path), show=False)
    assert res.summary.steps == 3 and res.summary.sequences == 12  # no step lost or counted twice
    [fb] = res.summary.fallbacks
    assert (fb.step, fb.phase) == (2, phase)
    assert {k: v for k, v in fb.after.items() if fb.before[k] != v} == changed
    assert max_diff(reference[ref_key].model, res.model) < 1e-6


def test_oom_in_a_fused_or_sgd_step_says_nothing_lower_is_available(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.optim.SGD, "step",
                        fail_on_call(torch.optim.SGD.step, {1}, torch.OutOfMemoryError(CUDA_OOM), after=False))
    with pytest.raises(UserError, match="optimizer phase of step 1 with --optimizer sgd, which has no lower-memory"):
        run_training(tiny_config(tmp_path), show=False)


def test_oom_after_the_loss_scaler_unscaled_is_redone(tmp_path, monkeypatch):
    # fp16 on CUDA: clipping unscales the gradients and marks the optimizer "unscaled"; a redo whose
    # scaler still says so raises "unscale_() has already been called". CPU Accelerate runs no scaler,
    # so give it torch's CPU GradScaler as it does for fp16 on CUDA.
    from memfit.training import session

    real_build = session.build_accelerator

    def with_scaler(*args, **kwargs):
        acc = real_build(*args, **kwargs)
        acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu", init_scale=2.0**10), True
        return acc

    monkeypatch.setattr(session, "build_accelerator", with_scaler)
    _inject_clip(monkeypatch)
    res = run_training(adamw_config(tmp_path), show=False)
    assert res.summary.steps == 3 and res.summary.skipped_steps == 0
    assert [fb.phase for fb in res.summary.fallbacks] == ["clip"]


def test_is_oom_recognises_cuda_cpu_allocator_and_python_errors():
    assert oom.is_oom(torch.OutOfMemoryError(CUDA_OOM))
    assert oom.is_oom(RuntimeError(CPU_OOM))
    assert oom.is_oom(MemoryError())
    assert not oom.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)"))
    assert not oom.is_oom(ValueError("out of memory."))


def test_the_fallback_lowers_the_phase_that_ran_out(tmp_path):
    from _train_helpers import write_model
    from memfit.memory.estimate import estimate

    model = write_model(tmp_path)
    run = RunConfig(seq_len=64, micro_batch=4, grad_accum=1, optimizer="adamw-foreach")
    predicted = lambda r: estimate(model, r, device="cpu")  # noqa: E731
    # Forward/backward: a smaller micro-batch (the estimator agrees it lowers those peaks).
    for phase in ("forward", "backward"):
        nxt = oom.next_config(run, phase=phase, device="cpu", estimate=predicted)
        assert (nxt.micro_batch, nxt.grad_accum, nxt.optimizer) == (2, 2, run.optimizer)
        assert predicted(nxt).phase_peaks[phase] < predicted(run).phase_peaks[phase]
    # Optimizer (and clipping, at the same floor): a smaller micro-batch leaves the step's peak where
    # it is; the fused kernel drops foreach's parameter-sized temporaries.
    smaller = run.replace(micro_batch=2, grad_accum=2)
    assert predicted(smaller).phase_peaks["optimizer"] == predicted(run).phase_peaks["optimizer"]
    for phase in ("clip", "optimizer"):
        assert oom.next_config(run, phase=phase, device="cpu", estimate=predicted) == run.replace(optimizer="adamw-fused")
    # Nothing lower to switch to live: fused AdamW, SGD, an estimator that predicts no gain.
    assert oom.next_config(run.replace(optimizer="adamw-fused"), phase="optimizer", device="cpu") is None
    assert oom.next_config(run.replace(optimizer="sgd"), phase="optimizer", device="cpu") is None
    assert oom.next_config(run, phase="forward", device="cpu", estimate=lambda r: predicted(run)) is None
