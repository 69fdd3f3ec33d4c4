"""One builder (#23.4): the model, LoRA adapters and optimizer ``--exact`` traces are the ones train builds.

Both sides are built here for the same tiny run (train: ``training.setup``'s builders from a config.json;
the trace: ``memory.trace``'s, on the meta device) and compared: parameters (names, shapes, dtypes, which
train), PEFT's LoRA config, checkpointing and training mode, and the optimizer's class and parameter groups
(which parameters, with which options). A builder that drifts on one side fails here.
"""

from __future__ import annotations

import pytest

from _train_helpers import tiny_config
from memfit.memory import trace
from memfit.spec.resolved import resolve
from memfit.training.setup import build_model, build_optimizer, resolve_model


def _train_side(tmp_path, run: dict):
    config = tiny_config(tmp_path, run=run)
    source = resolve_model(config, config.run)
    model = build_model(config, config.run, source).model
    return source, model, build_optimizer(model, config.run, config)


def _trace_side(source):
    resolved = resolve(source.spec, source.resolved.requested)  # as trace() resolves the run it is given
    model = trace._build_model(source.hf_config, resolved)
    return model, trace._build_optimizer(model, resolved.run, device="cpu")  # cpu: torch's own pick, as train


def _parameters(model) -> list[tuple]:
    return [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()]


def _groups(model, optimizer) -> list[tuple]:
    """Each param group: the names of its parameters and its options (the learning rate aside: train's
    comes from ``--lr``, the trace's is any positive value)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [([names[id(p)] for p in group["params"]],
             {k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")})
            for group in optimizer.param_groups]


def _lora(model) -> dict:
    """PEFT's config of the wrapped model, less where the adapter says its base came from (train only)."""
    if not hasattr(model, "peft_config"):
        return {}
    out = model.peft_config["default"].to_dict()
    for key in ("base_model_name_or_path", "revision"):
        out.pop(key, None)
    return out


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@pytest.mark.parametrize("run", [
    {"optimizer": "adamw"},  # full fine-tune: two weight-decay groups (matrices, norms)
    {"optimizer": "adamw", "lora_r": 4, "lora_targets": ("q_proj", "v_proj"), "grad_checkpointing": True},
    {"optimizer": "sgd", "optimizer_in_backward": True},  # one optimizer per parameter
], ids=["full", "lora-checkpointing", "in-backward"])
def test_trace_builds_what_train_builds(tmp_path, run):
    source, train_model, train_opt = _train_side(tmp_path, run)
    trace_model, trace_opt = _trace_side(source)
    assert _parameters(trace_model) == _parameters(train_model)
    assert _lora(trace_model) == _lora(train_model)
    checkpointing = run.get("grad_checkpointing", False)
    assert _base(trace_model).is_gradient_checkpointing == _base(train_model).is_gradient_checkpointing == checkpointing
    assert all(m.training for m in trace_model.modules()) and all(m.training for m in train_model.modules())
    assert type(trace_opt) is type(train_opt)
    assert _groups(trace_model, trace_opt) == _groups(train_model, train_opt)


def test_full_fine_tune_groups_are_matrices_then_vectors(tmp_path):
    # the structure the trace's optimizer-step numbers rest on (tests/test_trace.py's goldens): decay on the
    # 2-D parameters (embedding, 14 projections, head), none on the 5 norms, in that order
    source, _, _ = _train_side(tmp_path, {"optimizer": "adamw"})
    model, optimizer = _trace_side(source)
    (matrices, decay), (vectors, no_decay) = _groups(model, optimizer)
    assert len(matrices) == 16 and len(vectors) == 5 and all("norm" in name for name in vectors)
    assert decay["weight_decay"] == 0.0 == no_decay["weight_decay"]  # train's default --weight-decay
