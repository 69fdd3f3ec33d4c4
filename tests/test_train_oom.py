"""An out-of-memory error in any phase of a step never corrupts it (issue 10, item 4).

Each test injects an OOM into one step of a 3-step AdamW run of the tiny Llama (fp32, CPU, clipping
on, weight decay on) and compares the final weights with a run that used the fallback configuration
without being interrupted:

- OOM in step 1: the reference is the fallback configuration from the start, and the bound is 1e-6.
- OOM in step 2 (moments and step counts exist and are mutated by the failed step): the reference
  runs step 1 with the first configuration, then the fallback configuration, and the weights must be
  equal bit for bit. (Against the fallback configuration from the
  start the weights differ by ~5e-6 here whatever the fallback does: AdamW's m / sqrt(v) amplifies
  the rounding difference between a 4 x 1 and a 2 x 2 first step for weights whose v is tiny.)

AdamW with lr 1e-2 moves every weight by ~1e-2 per step, so a step applied one and a half times,
gradients of the failed attempt added to the redo, or moments and step counts advanced twice show as
differences of order 1e-3, far above either bound.
"""

from __future__ import annotations

import accelerate
import pytest
import torch

from _train_helpers import max_diff, tiny_config
from memfit.errors import UserError
from memfit.settings.config import RunConfig
from memfit.training import oom
from memfit.training import step as step_module
from memfit.training.loop import run_training

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes. Error code 12"
FALLBACK = {"2x2": {"micro_batch": 2, "grad_accum": 2}, "fused": {"optimizer": "adamw-fused"}}


def adamw_config(tmp, *, run: dict | None = None, **overrides):
    return tiny_config(tmp, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0,
                       run={"optimizer": "adamw-foreach", **(run or {})}, **overrides)


def fail_on_call(real, call: int, error: BaseException, *, after: bool):
    """``real`` wrapped to raise ``error`` on its ``call``-th call (1-based), before or after running it."""

    def wrapper(*args, **kwargs):
        wrapper.n += 1
        if wrapper.n == call and not after:
            raise error
        out = real(*args, **kwargs)
        if wrapper.n == call:
            raise error  # after the real work: the step's tensors were already mutated
        return out

    wrapper.n = 0
    return wrapper


def _inject_forward(monkeypatch, step: int):
    # micro_loss runs once per step at 4 x 1: call k is step k's forward.
    monkeypatch.setattr(step_module, "micro_loss",
                        fail_on_call(step_module.micro_loss, step, torch.OutOfMemoryError(CUDA_OOM), after=False))


def _inject_backward(monkeypatch, step: int):
    # The step's backward runs to the end (gradients written), then Python's MemoryError.
    monkeypatch.setattr(accelerate.Accelerator, "backward",
                        fail_on_call(accelerate.Accelerator.backward, step, MemoryError(), after=True))


def _inject_clip(monkeypatch, step: int):
    # The step's clipping scales the gradients in place, then the CPU allocator's error.
    monkeypatch.setattr(accelerate.Accelerator, "clip_grad_norm_",
                        fail_on_call(accelerate.Accelerator.clip_grad_norm_, step, RuntimeError(CPU_OOM), after=True))


def _inject_optimizer(monkeypatch, step: int):
    # Inside torch's foreach AdamW, where a real OOM happens: _foreach_sqrt(exp_avg_sq) allocates one
    # temporary per parameter after the step counts, weight decay and both moments were updated in
    # place. It runs once per param group (2 groups: matrices with decay, vectors without); call 2k is
    # step k's second group, so the first group's parameters are fully updated when it raises.
    monkeypatch.setattr(torch, "_foreach_sqrt",
                        fail_on_call(torch._foreach_sqrt, 2 * step, torch.OutOfMemoryError(CUDA_OOM), after=False))


PHASES = {"forward": (_inject_forward, "2x2"), "backward": (_inject_backward, "2x2"),
          "clip": (_inject_clip, "fused"), "optimizer": (_inject_optimizer, "fused")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per fallback: 3 steps with it from the start; step 1 without it, then 2 steps with it."""
    from memfit.training import loop

    out = {}
    for key, change in FALLBACK.items():
        out[key, 1] = run_training(adamw_config(tmp_path_factory.mktemp(f"{key}1"), run=change), show=False)
    # 2 x 2 from step 2 on: a checkpoint of step 1 resumed with it.
    folder = tmp_path_factory.mktemp("2x22")
    run_training(adamw_config(folder, save_every=1, max_steps=1), show=False)
    out["2x2", 2] = run_training(adamw_config(folder, resume=True, extend_schedule=True, run=FALLBACK["2x2"]),
                                 show=False)  # the finished 1-step run trained on to 3 steps
    # Fused from step 2 on: switched after step 1 (a resumed run would not do: the optimizer's
    # load_state_dict takes the saved param groups' foreach/fused flags, so it would stay foreach).
    real_record = loop.record_step

    def switch_after_step_1(s, result, t_step):
        real_record(s, result, t_step)
        if s.state.step == 1:
            fused = s.run.replace(**FALLBACK["fused"])
            oom.switch_live(s.accelerator, s.model, s.optimizer, s.run, fused)
            s.run = fused

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "record_step", switch_after_step_1)
        out["fused", 2] = run_training(adamw_config(tmp_path_factory.mktemp("fused2")), show=False)
    return out


def _run_with_oom(phase: str, step: int, tmp_path, monkeypatch):
    inject, key = PHASES[phase]
    inject(monkeypatch, step)
    res = run_training(adamw_config(tmp_path), show=False)
    assert res.summary.steps == 3 and res.summary.sequences == 12  # no step lost or counted twice
    [fb] = res.summary.fallbacks
    assert (fb.step, fb.phase) == (step, phase)
    assert {k: v for k, v in fb.after.items() if fb.before[k] != v} == FALLBACK[key]
    return res, key


@pytest.mark.parametrize("phase", list(PHASES))
def test_oom_in_step_1_ends_with_the_weights_of_the_fallback_from_the_start(phase, reference, tmp_path, monkeypatch):
    res, key = _run_with_oom(phase, 1, tmp_path, monkeypatch)
    assert max_diff(reference[key, 1].model, res.model) < 1e-6


@pytest.mark.parametrize("phase", list(PHASES))
def test_oom_in_step_2_is_undone_exactly(phase, reference, tmp_path, monkeypatch):
    res, key = _run_with_oom(phase, 2, tmp_path, monkeypatch)
    assert max_diff(reference[key, 2].model, res.model) == 0.0


def test_oom_in_a_fused_or_sgd_step_says_nothing_lower_is_available(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.optim.SGD, "step",
                        fail_on_call(torch.optim.SGD.step, 1, torch.OutOfMemoryError(CUDA_OOM), after=False))
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
    _inject_clip(monkeypatch, 2)
    res = run_training(adamw_config(tmp_path), show=False)
    assert res.summary.steps == 3 and res.summary.skipped_steps == 0
    assert [fb.phase for fb in res.summary.fallbacks] == ["clip"]


def test_is_oom_recognises_cuda_cpu_allocator_and_python_errors():
    assert oom.is_oom(torch.OutOfMemoryError(CUDA_OOM))
    assert oom.is_oom(RuntimeError(CPU_OOM))
    assert oom.is_oom(MemoryError())
    assert oom.is_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"))
    assert not oom.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)"))
    assert not oom.is_oom(ValueError("out of memory."))


def test_the_fallback_lowers_the_phase_that_ran_out(tmp_path):
    from _train_helpers import write_model
    from memfit.memory.estimate import estimate

    model = write_model(tmp_path)
    run = RunConfig.of(seq_len=64, micro_batch=4, grad_accum=1, optimizer="adamw-foreach")
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


def test_snapshot_puts_back_what_a_failed_adamw_step_mutated(monkeypatch):
    from memfit.training.rollback import OptimizerSnapshot

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}], lr=1e-2,
                            foreach=True)
    snapshot = OptimizerSnapshot()

    def backward():
        for p in params:
            p.grad = torch.randn_like(p)

    def failing_step():  # the real foreach step up to its first temporary, on the second group
        monkeypatch.setattr(torch, "_foreach_sqrt", fail_on_call(torch._foreach_sqrt, 2, MemoryError(), after=False))
        with pytest.raises(MemoryError), snapshot.guard(opt):
            opt.step()
        monkeypatch.undo()

    # Step 1 fails after the first group's state was created and its weights updated: no state is left.
    backward()
    before = [p.detach().clone() for p in params]
    failing_step()
    assert len(opt.state) == 0 and all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    with snapshot.guard(opt):
        opt.step()
    # Step 2 fails after step counts, weights and moments of the first group moved: all are put back.
    backward()
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    failing_step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    for p in params:
        assert opt.state[p].keys() == state[id(p)].keys()
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[id(p)].items()), opt.state[p]


def test_without_room_for_the_snapshot_an_optimizer_oom_stops_the_run(tmp_path, monkeypatch):
    from memfit.training.rollback import OptimizerSnapshot

    def no_room(self, key, tensor):
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(OptimizerSnapshot, "_copy", no_room)
    _inject_optimizer(monkeypatch, 1)
    with pytest.raises(UserError, match="host had no room for the copy"):
        run_training(adamw_config(tmp_path), show=False)
