"""The OOM rollback snapshot: kept only where an out-of-memory error can leave an optimizer step half
applied, and counted where it lives (CPU: the host is the device) by the prediction ``memfit train``
prints and by the planner behind ``memfit train --budget``."""

from __future__ import annotations

import pytest
import torch

from memfit.memory.estimate import estimate, rollback_snapshot_bytes
from memfit.memory.snapshot import with_rollback_snapshot
from memfit.settings.config import RunConfig
from memfit.spec.model import load_spec
from memfit.training.rollback import OptimizerSnapshot, snapshot_needed

RUN = RunConfig.of(seq_len=32, micro_batch=1, grad_accum=1, optimizer="adamw")


# --------------------------------------------------------------------------------- the prediction
def test_cpu_prediction_adds_12_bytes_per_trainable_parameter_for_adamw():
    # Hand check: fp32 AdamW copies each trainable parameter (4 B) and its two moments (8 B) every step.
    spec = load_spec("tiny")
    cpu = estimate(spec, RUN, device="cpu")
    with_copy = with_rollback_snapshot(spec, RUN, cpu, "cpu")
    assert rollback_snapshot_bytes(spec, RUN) == 12 * spec.trainable_params(RUN)
    assert with_copy.peak_bytes - cpu.peak_bytes == 12 * spec.trainable_params(RUN)
    assert all(with_copy.phase_peaks[k] - cpu.phase_peaks[k] == 12 * spec.trainable_params(RUN) for k in cpu.phase_peaks)
    assert any("rollback snapshot" in note for note in with_copy.notes)
    gpu = estimate(spec, RUN)  # on a GPU the copy is host RAM: not in the device's peak
    assert with_rollback_snapshot(spec, RUN, gpu, "cuda") is gpu


def test_no_snapshot_is_predicted_where_none_is_kept():
    spec = load_spec("tiny")
    for run in (RUN.replace(optimizer="sgd"), RUN.replace(optimizer_in_backward=True)):
        cpu = estimate(spec, run, device="cpu")
        assert with_rollback_snapshot(spec, run, cpu, "cpu").peak_bytes == cpu.peak_bytes


def test_fused_adamw_pays_a_parameter_copy_in_its_first_optimizer_step_only():
    # The first step copies the parameters (4 B each, no state yet) during its optimizer phase; the
    # steady-state optimizer phase holds the same bytes otherwise (fused: no temporaries).
    spec = load_spec("tiny")
    run = RUN.replace(optimizer="adamw-fused")
    cpu = estimate(spec, run, device="cpu")
    got = with_rollback_snapshot(spec, run, cpu, "cpu")
    first = cpu.phase_peaks["optimizer"] + 4 * spec.trainable_params(run)
    assert got.peak_bytes == max(cpu.peak_bytes, first) and got.phase_peaks["optimizer"] == first
    assert got.phase_peaks["forward"] == cpu.phase_peaks["forward"]


def test_train_prediction_on_cpu_and_the_cpu_planner_count_the_snapshot():
    from memfit.planning.gpus import gpu_by_name
    from memfit.planning.search import REFERENCE_GPU, evaluate
    from memfit.training.session import predict

    spec = load_spec("tiny")
    copy = rollback_snapshot_bytes(spec, RUN)
    assert predict("tiny", RUN, "cpu").peak_bytes == estimate(spec, RUN, device="cpu").peak_bytes + copy
    assert predict("tiny", RUN, "cuda").peak_bytes == estimate(spec, RUN).peak_bytes
    gpu = gpu_by_name(REFERENCE_GPU)
    on_cpu = evaluate(spec, RUN, gpu, 2**30, cpu=True)
    assert on_cpu.peak_bytes == estimate(spec, RUN, device="cpu").peak_bytes + copy
    assert evaluate(spec, RUN, gpu, 2**30).peak_bytes == estimate(spec, RUN).peak_bytes


# ------------------------------------------------------------------------------- the live decision
def _stepped(optimizer_factory, steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    opt = optimizer_factory(groups)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        if _ < steps - 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return opt  # gradients present: the next step is about to run


@pytest.mark.parametrize(("factory", "first", "later"), [
    (lambda g: torch.optim.AdamW(g, lr=0.1), True, True),  # single-tensor on CPU: mutates, then allocates
    (lambda g: torch.optim.AdamW(g, lr=0.1, foreach=True), True, True),
    (lambda g: torch.optim.AdamW(g, lr=0.1, fused=True), True, False),  # in place once the state exists
    (lambda g: torch.optim.SGD(g, lr=0.1), False, False),
    (lambda g: torch.optim.SGD(g, lr=0.1, weight_decay=0.1), True, True),  # grad.add(param) per parameter
])
def test_snapshot_is_taken_only_where_a_step_can_half_apply(factory, first, later):
    assert snapshot_needed(_stepped(factory, 1)) is first
    opt = _stepped(factory, 2)
    assert snapshot_needed(opt) is later
    snapshot = OptimizerSnapshot()
    snapshot.take(opt)
    assert bool(snapshot.buffers()) is later  # no host memory held where none is needed


def test_fused_adamw_first_step_snapshot_is_released_once_the_state_exists():
    opt = _stepped(lambda g: torch.optim.AdamW(g, lr=0.1, fused=True), 1)
    snapshot = OptimizerSnapshot()
    with snapshot.guard(opt):
        assert len(snapshot.buffers()) == 4  # 2 weights + 2 biases/norm, no state before the first step
        opt.step()
    opt.zero_grad(set_to_none=True)
    for p in (q for g in opt.param_groups for q in g["params"]):
        p.grad = torch.ones_like(p)
    snapshot.take(opt)
    assert snapshot.buffers() == [] and snapshot.available


def test_offload_on_cpu_moves_nothing_off_the_device():
    # Measured (bench/README.md): smollm2-135m fsdp on 2 and 4 CPU ranks holds the same bytes with
    # --offload params as without; on a GPU the offloaded state leaves the device.
    from memfit.memory.snapshot import device_estimate

    spec = load_spec("tiny")
    fsdp = RUN.replace(sharding="fsdp", num_processes=2)
    offload = fsdp.replace(offload="params")
    assert device_estimate(spec, offload, "cpu").peak_bytes == device_estimate(spec, fsdp, "cpu").peak_bytes
    assert device_estimate(spec, offload, "cuda").peak_bytes < device_estimate(spec, fsdp, "cuda").peak_bytes
