"""The exact tracer on the conftest tiny Llama (2 layers, hidden 64, GQA 4/2 heads, vocab 384).

Golden numbers by hand for that model:
  params = embed 384*64 + head 384*64 + 2 layers * (q 64*64 + k 64*32 + v 64*32 + o 64*64
           + gate/up/down 3*64*128 + 2 norms 64) + final norm 64 = 24,576*2 + 2*36,992 + 64 = 123,200
  buffers = rotary inv_freq + original_inv_freq: 2 * (head_dim 16 / 2) fp32 = 64 bytes
  LoRA r=4 on all 7 linears: r*(in+out) = 4*(128 + 96 + 96 + 128 + 192 + 192 + 192) = 4,096 per layer,
           8,192 in all, over 2 * 7 = 14 adapter pairs = 28 tensors
  AdamW state = exp_avg + exp_avg_sq (fp32) per trainable element + one fp32 step scalar per tensor.
"""

from __future__ import annotations

import sys

import pytest

from memfit.errors import UserError
from memfit.memory.trace import trace
from memfit.settings.config import RunConfig

PARAMS = 123_200
BUFFERS = 64
N_TENSORS = 21  # embed, head, final norm, 2 x (7 linears + 2 norms)
LORA_PARAMS = 8_192
LORA_TENSORS = 28


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig

    # same as conftest's tiny_llama_config (a module-scoped copy so traces are shared between tests)
    return LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def full_fp32(tiny):
    return trace(tiny, RunConfig.of(seq_len=32, micro_batch=2), device="cpu", timeline=True)


@pytest.fixture(scope="module")
def lora_bf16(tiny):
    run = RunConfig.of(seq_len=32, micro_batch=2, dtype="bf16", lora_r=4)
    return trace(tiny, run, device="cpu", timeline=True)


def test_full_fp32_model_states_to_the_byte(full_fp32):
    out, line = full_fp32
    assert out.method == "exact"
    assert out.params == PARAMS and out.trainable_params == PARAMS
    assert out.weights == PARAMS * 4 + BUFFERS
    # On CPU torch's AdamW is the single-tensor loop, run once per parameter group (train's: matrices, then
    # norms; memfit.builder.parts.parameter_groups): the optimizer step holds all grads, the moments (+ one fp32 step
    # count per tensor) and the head's sqrt(exp_avg_sq) and quotient (384 x 64 each) while the quotient of the
    # matrix before it, the last layer's down_proj (128 x 64 = 8,192), is still bound to the loop variable:
    # (8,192 + 2 x 24,576) x 4 bytes. (One group, as the trace built it before, had the final norm (64) there.)
    # (The foreach golden on CUDA: the test below.)
    assert out.optimizer == 2 * PARAMS * 4 + N_TENSORS * 4
    assert out.phase_peaks["optimizer"] == out.weights + PARAMS * 4 + out.optimizer + (8_192 + 2 * 24_576) * 4
    assert out.other == 0  # device="cpu"
    assert out.peak_bytes == max(line.totals())


def test_second_step_is_traced(full_fp32):
    out, line = full_fp32
    bounds = line.phase_bounds()
    assert list(bounds) == ["forward", "backward", "optimizer"]
    assert bounds["forward"][0] == 0 and bounds["forward"][1] < bounds["backward"][0]
    assert bounds["backward"][1] < bounds["optimizer"][0] == bounds["optimizer"][0]
    # optimizer state already exists at the first op: this is step 2 (steady state)
    assert line.samples[0]["optimizer"] == 2 * PARAMS * 4 + N_TENSORS * 4
    # zero_grad(set_to_none=True) at the end frees every gradient
    assert line.samples[-1]["gradients"] == 0
    # logits (B*T*V fp32 = 2*32*384*4 = 98,304 B) appear in forward
    fwd = line.samples[bounds["forward"][0]: bounds["forward"][1] + 1]
    assert max(s["logits"] for s in fwd) >= 2 * 32 * 384 * 4
    assert out.activations_per_layer > 0


def test_layer_marks_bracket_each_layers_backward(full_fp32):
    """The "grad" marks (where backward reaches a layer's output) come top layer first, in backward, and
    between the top layer's and the first layer's lie exactly the top layer's weight gradients
    (36,992 parameters, fp32: see the module docstring), which memory/derive.py reads off them."""
    _, line = full_fp32
    grad = {i: n for i, when, n in line.layer_marks if when == "grad"}
    assert sorted(grad) == [0, 1] and grad[1] < grad[0]
    assert all(line.phases[n - 1] == "backward" for n in grad.values())
    between = line.samples[grad[0] - 1]["gradients"] - line.samples[grad[1] - 1]["gradients"]
    assert between == 36_992 * 4


def test_lora_grads_only_for_adapters(lora_bf16):
    out, line = lora_bf16
    assert out.trainable_params == LORA_PARAMS
    # frozen base in bf16, adapters kept in fp32 by PEFT
    assert out.weights == PARAMS * 2 + LORA_PARAMS * 4 + BUFFERS
    assert max(s["gradients"] for s in line.samples) == LORA_PARAMS * 4
    assert out.optimizer == 2 * LORA_PARAMS * 4 + LORA_TENSORS * 4


def test_checkpointing_lowers_forward_peak(tiny, full_fp32):
    ckpt = trace(tiny, RunConfig.of(seq_len=32, micro_batch=2, grad_checkpointing=True), device="cpu")
    assert ckpt.phase_peaks["forward"] < full_fp32[0].phase_peaks["forward"]
    assert ckpt.activations_per_layer < full_fp32[0].activations_per_layer


def test_cuda_adds_the_estimators_other_term(tiny, full_fp32):
    from memfit.memory.device_terms import cuda_other

    out = trace(tiny, RunConfig.of(seq_len=32, micro_batch=2), device="cuda")
    # as on CUDA, torch's foreach AdamW: the peak of this tiny model is the step, with all grads alive,
    # the moments, and torch._foreach_sqrt(exp_avg_sq)'s temporary the size of one parameter group (fp32):
    # train's first group, the matrices, is all but the 5 norms (2 per layer + the final one, 64 each):
    # 123,200 - 320 = 122,880 parameters (one group, as the trace built it before, was PARAMS)
    assert out.phase == "optimizer"
    assert out.gradients == PARAMS * 4 and out.temporary == (PARAMS - 5 * 64) * 4
    assert out.optimizer == full_fp32[0].optimizer
    tensors = out.weights + out.gradients + out.optimizer + out.temporary
    assert out.other == cuda_other(tensors, out.optimizer, out.logits)
    assert out.peak_bytes == tensors + out.other


def test_timeline_plot(tmp_path, full_fp32):
    from memfit.report.timeline import plot_timeline

    path = tmp_path / "sub" / "timeline.png"
    plot_timeline(full_fp32[1], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_missing_private_api_is_a_user_error(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", None)
    with pytest.raises(UserError, match="FakeTensorMode and MemTracker"):
        trace(tiny, RunConfig.of(seq_len=8, micro_batch=1), device="cpu")


@pytest.mark.parametrize("changes, words", [
    ({"lora_r": 4, "quantize": "8bit"}, "not supported in exact mode"),
    ({"optimizer": "adamw-8bit"}, "not supported in exact mode"),
    ({"num_processes": 2}, "single process"),
    ({"offload": "optimizer"}, "not supported in exact mode"),
])
def test_unsupported_settings_are_user_errors(tiny, changes, words):
    with pytest.raises(UserError, match=words):
        trace(tiny, RunConfig.of(seq_len=8, micro_batch=1, **changes), device="cpu")


def test_bad_device_and_model_are_user_errors(tiny):
    with pytest.raises(UserError, match="device"):
        trace(tiny, RunConfig.of(seq_len=8, micro_batch=1), device="tpu")
    with pytest.raises(UserError):
        trace("no-such-model-xyz", RunConfig.of(seq_len=8, micro_batch=1), device="cpu")


def test_lora_checkpointing_leaves_no_embedding_gradient_in_the_optimizer_step(tiny):
    """With checkpointing on a frozen embedding, transformers makes the embedding output a leaf that needs a
    gradient; under the tracker its gradient (B x T x H fp32 = 2 x 64 x 64 x 4 = 32,768 bytes here) used to
    outlive backward through a hook cycle, which a real run does not have. The optimizer step holds no
    temporaries (AdamW's are under 1 KiB here: 28 adapter tensors, foreach over them)."""
    run = RunConfig.of(seq_len=64, micro_batch=2, lora_r=4, grad_checkpointing=True)
    _, line = trace(tiny, run, device="cpu", timeline=True)
    first, _ = line.phase_bounds()["optimizer"]
    assert line.samples[first]["temporary"] < 32_768, line.samples[first]
