"""Unsloth's own layer and loss (``memory.unsloth_layer``), priced from Unsloth's source, checked by hand.

Shape: a Llama config built here (never downloaded): hidden H = 64, MLP I = 128, 4 heads of 16 (Q = 64), 2 kv
heads (K = 32), 2 layers, vocabulary V = 256, 2,048 positions; LoRA r 8 on all seven projections, no dropout;
a bf16 model (c = 2) on a 4-bit base; 1 x 100 tokens (N = 100). Every golden number below is worked out in the
comments next to it from the tensors Unsloth's code saves and allocates (the module's docstrings cite the lines).
Unsloth itself cannot run here (no CUDA): these hold the arithmetic to the source as read, not to a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from memfit.memory import unsloth_layer as unsloth
from memfit.memory.activations import Precisions
from memfit.memory.estimate import estimate
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack
from memfit.spec.model import spec_from_config

ALL_SEVEN = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
UNSLOTH = Stack(trainer="unsloth")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import published_check as pc  # noqa: E402


@pytest.fixture(scope="module")
def spec():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=256, max_position_embeddings=2048, tie_word_embeddings=False)
    return spec_from_config(config, "test-unsloth-llama")


def _run(**changes) -> RunConfig:
    base = dict(seq_len=100, micro_batch=1, dtype="bf16", mixed_precision="no", lora_r=8, lora_targets=ALL_SEVEN,
                quantize="4bit", qlora_upcast="lean", grad_checkpointing=True, offload="activations", loss="cce",
                optimizer="adamw", attn_implementation="sdpa", packing="none")
    return RunConfig.of(**{**base, **changes})


def _prec(run: RunConfig) -> Precisions:
    return Precisions.of(run)


def test_a_recomputed_layer_saves_what_unsloths_autograd_functions_save(spec):
    """Per token: first norm's fp32 r (4); its output, LoRA_QKV's X (c H = 128); Q, K, V kept by flash-attention
    (c (Q + 2K) = 2 x 128 = 256); the attention output, LoRA_W's X (c Q = 128); its fp32 log-sum-exp (4 n = 16);
    the residual sum, the second norm's X (128); its r (4); the second norm's output, LoRA_MLP's X (128); e and g
    (2 c I = 512). 4 + 128 + 256 + 128 + 16 + 128 + 4 + 128 + 512 = 1,304. With restarting position ids the RoPE path
    gathers and saves cos and sin for Q and for K: 4 x c x head_dim 16 = 128 more, 1,432."""
    assert unsloth.recomputed_saved(spec, _run(), _prec(_run())) == 1_304
    assert unsloth.recomputed_saved(spec, _run(packing="documents"), _prec(_run())) == 1_432


def test_the_mlp_backward_holds_two_i_wide_products_or_the_dequantized_weight(spec):
    """Beside the saved set: dY and the recomputed output (2 c H = 256 per token) and DW (c I = 256). Then the
    larger of the LoRA product added into DW (c I + c r = 256 + 16 = 272 per token) and the dequantized down weight
    (c I H = 2 x 128 x 64 = 16,384 B), which is deleted before that product exists.
    N = 100: 100 x 512 + max(100 x 272 = 27,200, 16,384) = 51,200 + 27,200 = 78,400.
    N = 50: 50 x 512 + max(50 x 272 = 13,600, 16,384) = 25,600 + 16,384 = 41,984 (the weight is the larger)."""
    assert unsloth.mlp_backward_moment(spec, _run(), _prec(_run())) == 78_400
    assert unsloth.mlp_backward_moment(spec, _run(seq_len=50), _prec(_run())) == 41_984


def test_attention_backward_is_below_the_mlps_here(spec):
    """Alive at flash-attention's backward, per token: dY, the output and the residual sum's gradient (3 c H = 384),
    the attention output's gradient (c Q = 128), dq, dk, dv (c (Q + 2K) = 256), fp32 dq_accum (4 Q = 256) and
    softmax_d (4 n = 16), dk/dv expanded to every head (2 c Q = 256): 1,296; freed by then, the MLP's e, g, X, the
    residual sum and r (2 c I + 2 c H + 4 = 772): net 524 x 100 = 52,400, below the MLP's 78,400."""
    assert unsloth.attention_backward_moment(spec, _run(), _prec(_run())) == 52_400


def test_one_layer_keeps_its_input_and_recomputes_its_saved_set(spec):
    """Kept: the layer's input, c H x N = 128 x 100 = 12,800 per layer (2 layers: 25,600). Backward: the recomputed
    set 1,304 x 100 = 130,400 + the MLP moment 78,400 = 208,800."""
    acts = unsloth.layer(spec, _run(), _prec(_run()))
    assert (acts.saved, acts.all_layers, acts.backward_transient) == (12_800, 25_600, 208_800)


def test_every_layer_holds_its_own_rotary_cache(spec):
    """Each attention's cos and sin caches: min(32,768, 2,048 positions) = 2,048 rows of head_dim 16 in bf16, which
    100 tokens do not regrow; two tensors, two layers: 2 x 2 x 2,048 x 16 x 2 = 262,144 B. 10,000 tokens regrow them
    to the next multiple of 8,192 rows, 16,384: 2,097,152 B."""
    assert unsloth.rope_cache_bytes(spec, _run(), _prec(_run())) == 262_144
    assert unsloth.rope_cache_bytes(spec, _run(seq_len=10_000), _prec(_run())) == 2_097_152


def test_cut_cross_entropy_allocates_a_frozen_heads_gradient(spec):
    """Forward: valids built from int64 nonzero (16 N) + an int32 copy (8 N) = 2,400, or the kept valids, lse, the
    negated dot (16 N = 1,600) + the vocabulary's fp32 average (4 V = 1,024) = 2,624: 2,624. Backward: valids, lse
    and locks (16 N = 1,600), the average, the vocabulary order and the head's locks (12 V = 3,072), de (c H N =
    12,800) and dc, zeros_like(head) although it is frozen (c V H = 32,768): 50,240."""
    terms = unsloth.loss_terms(spec, _run(), _prec(_run()))
    assert (terms.forward, terms.backward, terms.retained) == (2_624, 50_240, 0)


def test_unsloths_own_loss_keeps_bf16_logits_and_their_fp32_copy(spec):
    """--loss standard: bf16 logits (c V N = 51,200) and Accelerate's fp32 copy (4 V N = 102,400), an fp32 loss per
    row and one log-sum-exp per 65,536-word chunk (4 N x (1 + 1) = 800): 154,400 in forward. Backward: the logits
    turned into their gradient in place (51,200), the hidden states' gradient (c H N = 12,800) and 800: 64,800."""
    terms = unsloth.loss_terms(spec, _run(loss="standard"), _prec(_run()))
    assert (terms.forward, terms.backward) == (154_400, 64_800)


def test_the_head_side_and_what_stays(spec):
    """Freed by the loss' and final norm's backward: the final norm's X and r (c H + 4 = 132 per token) and the
    head's input CCE saved (c H = 128): 260 x 100 = 26,000; the int64 labels stay (800): 26,800 saved outside."""
    run = _run()
    assert unsloth.head_side(spec, run, _prec(run)) == 26_000
    assert unsloth.outside(spec, run, _prec(run)) == 26_800


def test_the_unsloth_stack_prices_its_layer_in_the_estimate(spec):
    """The whole estimate, unsloth against transformers' Trainer with PEFT (hf), on the same run:

    - weights: + the rotary caches (262,144 B), nothing else;
    - the backward peak is one layer in, above the resident weights and optimizer state: the layer above's LoRA
      gradients (8,192 adapter weights a layer: q 8 x 128, k and v 8 x 96, o 8 x 128, gate, up, down 8 x 192 each;
      fp32: 32,768 B), the labels still saved (800), the layer's input copied back from the host (12,800) and its
      recompute (208,800): 32,768 + 800 + 12,800 + 208,800 = 255,168 B."""
    run = _run()
    ours = estimate(spec, run, device="cuda", stack=UNSLOTH)
    hf = estimate(spec, run, device="cuda", stack=Stack(trainer="hf"))
    assert ours.weights - hf.weights == 262_144
    assert ours.phase_peaks["backward"] - ours.weights - ours.optimizer == 255_168
    assert any("memory/unsloth_layer.py" in note for note in ours.notes)


def test_checkpoints_kept_on_the_device_cost_the_forward_not_the_layers_backward(spec):
    """use_gradient_checkpointing=True (torch's reentrant checkpoint, no offload): both layers' inputs stay on the
    device, 2 x 12,800 = 25,600 B more at forward's end. One layer into backward the same 255,168 B: the layer
    above has freed its input (12,800) where the offloaded run copies this layer's back (12,800)."""
    offloaded = estimate(spec, _run(), device="cuda", stack=UNSLOTH)
    kept = estimate(spec, _run(offload="none"), device="cuda", stack=UNSLOTH)
    assert kept.phase_peaks["forward"] - offloaded.phase_peaks["forward"] == 25_600
    assert kept.phase_peaks["backward"] - kept.weights - kept.optimizer == 255_168


def test_where_unsloths_kernels_do_not_run_transformers_layer_is_priced_and_said(spec):
    """LoRA dropout keeps Unsloth off its LoRA kernels (llama.py L2337): the estimate is the hf one, and says so."""
    run = _run(lora_dropout=0.1)
    ours = estimate(spec, run, device="cuda", stack=UNSLOTH)
    hf = estimate(spec, run, device="cuda", stack=Stack(trainer="hf"))
    assert ours.peak_bytes == hf.peak_bytes
    assert any("priced as transformers' layers" in note for note in ours.notes)


def test_the_published_unsloth_row_is_priced_by_its_stack():
    """Unsloth's Llama 3.1 8B row at 78,475 tokens: its stack (unsloth) prices Unsloth's layer, not transformers':
    the layer's backward holds far less than transformers' recompute at that length."""
    models, rows = pc.load()
    row = next(r for r in rows if r["id"] == "unsloth-table-unsloth-llama3.1-8b-qlora-24gb")
    assert Stack.of(row["stack"]) == UNSLOTH
    model, run = pc.spec_for(row["model"], models), pc.run_config(row)
    ours = estimate(model, run, device="cuda", stack=UNSLOTH)
    hf = estimate(model, run, device="cuda", stack=Stack(trainer="hf"))
    assert ours.peak_bytes < hf.peak_bytes / 1.5
    assert any("memory/unsloth_layer.py" in note for note in ours.notes)
