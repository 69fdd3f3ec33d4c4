"""``memfit train`` with ``--loss chunked`` and ``--optimizer-in-backward``: same training, less memory."""

from __future__ import annotations

import pytest
import torch

from _train_helpers import max_diff, metrics, tiny_config
from memfit.errors import UserError
from memfit.settings.config import RunConfig
from memfit.training.loop import run_training
from memfit.training.runfolder import checkpoint


def _losses(out):
    return [r["loss"] for r in metrics(out) if "loss" in r]


def test_chunked_loss_trains_like_the_standard_path(tmp_path):
    std = run_training(tiny_config(tmp_path / "std"), show=False)
    chunked = run_training(tiny_config(tmp_path / "chunk", run={"loss": "chunked"}), show=False)
    a, b = _losses(tmp_path / "std" / "out"), _losses(tmp_path / "chunk" / "out")
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
    assert max_diff(std.model, chunked.model) <= 1e-5


def test_chunked_loss_keeps_exact_accumulation(tmp_path):
    # 4 x 1 and 1 x 4 hold different target-token counts per micro-batch (QA data): equal only if the
    # chunked loss divides by the step's tokens like the standard one.
    one = run_training(tiny_config(tmp_path / "one", run={"loss": "chunked"}), show=False)
    acc = run_training(tiny_config(tmp_path / "acc", run={"loss": "chunked", "micro_batch": 1, "grad_accum": 4}),
                       show=False)
    assert max_diff(one.model, acc.model) <= 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_optimizer_in_backward_gives_the_plain_step_s_weights(tmp_path, optimizer):
    run = {"optimizer": optimizer}
    plain = run_training(tiny_config(tmp_path / "plain", run=run, lr=1e-2), show=False)
    inbw = run_training(tiny_config(tmp_path / "inbw", run={**run, "optimizer_in_backward": True}, lr=1e-2),
                        show=False)
    assert max_diff(plain.model, inbw.model) <= 1e-6
    assert max_diff(plain.model, inbw.model) < max_diff(plain.model, _untrained(tmp_path))


def _untrained(tmp_path):
    from memfit.training.setup import build_model

    cfg = tiny_config(tmp_path / "zero")
    return build_model(cfg, cfg.run).model


def test_optimizer_in_backward_resumes_exactly(tmp_path, monkeypatch):
    kw = dict(max_steps=4, lr=1e-2, warmup_steps=2)
    run = {"optimizer": "adamw", "optimizer_in_backward": True}
    full = run_training(tiny_config(tmp_path / "a", run=run, **kw), show=False)
    cfg = tiny_config(tmp_path / "b", save_every=2, run=run, **kw)
    real_save = checkpoint.save_checkpoint

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, show=False)
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)
    resumed = run_training(cfg.replace(resume=True), show=False)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_refusals_are_one_sentence(tmp_path):
    with pytest.raises(UserError, match="--grad-accum 1"):
        RunConfig.of(optimizer_in_backward=True, grad_accum=2)
    with pytest.raises(UserError, match="cannot clip"):
        run_training(tiny_config(tmp_path / "c", run={"optimizer_in_backward": True}, max_grad_norm=1.0), show=False)
    with pytest.raises(UserError, match="CUDA"):
        run_training(tiny_config(tmp_path / "o", run={"offload": "activations"}), show=False)
    with pytest.raises(UserError, match="CUDA"):
        run_training(tiny_config(tmp_path / "l", run={"loss": "liger"}), show=False)
    assert not (tmp_path / "c" / "out").exists() and not (tmp_path / "o" / "out").exists()
