"""litgpt's LoRA loop keeps the previous micro-batch's outputs, and through them its graph, into the next forward
(``memory.litgpt_loop``); bitsandbytes 0.42.0's ``MatMul4Bit`` keeps each 4-bit layer's input in that graph.

Model: the ``tiny`` preset (Llama family, 8 layers, hidden H = 256, MLP I = 768, vocabulary V = 384, untied head),
micro-batch 2 x 64 = 128 tokens, pure bf16, LoRA r 8 on q and v without dropout, a 4-bit base, no checkpointing, on
the CUDA target. Golden numbers worked out by hand next to each test.
"""

from __future__ import annotations

import gc
import weakref

import torch

from memfit.memory.estimate import estimate
from memfit.memory.litgpt_loop import previous_outputs
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack
from memfit.spec.model import load_spec

LOGITS = 128 * 384  # N = tokens x vocabulary = 49,152 logits


def _run(**changes) -> RunConfig:
    base = dict(seq_len=64, micro_batch=2, dtype="bf16", mixed_precision="no", lora_r=8, lora_targets="q_proj,v_proj",
                optimizer="adamw", attn_implementation="sdpa", packing="concat", quantize="4bit")
    return RunConfig.of(**{**base, **changes})


def test_the_previous_chunks_are_alive_when_the_next_ones_are_converted():
    """At Fabric's output conversion: the new chunks in bf16 (2 N) and fp32 (4 N), the previous fp32 ones (4 N):
    10 x 49,152 = 491,520 B; while the head runs its last chunk, the new bf16 and previous fp32 ones: 6 N = 294,912 B.
    Only litgpt's LoRA loop: transformers' Trainer keeps only the loss, and a full fine-tune is another script."""
    spec = load_spec("tiny")
    previous = previous_outputs(spec, _run(), Stack(trainer="litgpt"), held=7)
    assert (previous.held, previous.logits, previous.logits_in_head) == (7, 491_520, 294_912)
    assert previous_outputs(spec, _run(), Stack(trainer="hf"), held=7) is None
    assert previous_outputs(spec, _run(lora_r=0, quantize="none"), Stack(trainer="litgpt"), held=7) is None


def test_bitsandbytes_0_42_keeps_the_previous_graphs_inputs_into_the_next_forward():
    """With bitsandbytes 0.42.0 the forward peaks while the head runs the next micro-batch's last chunk; against
    0.43.2, which keeps no 4-bit input, it holds (per token, bf16):

    - this graph's new kept inputs: the second norm's output and the MLP product (2 H + 2 I = 2,048 B; q/k/v's input
      is lora_A's saved one, o_proj's the SDPA output): 8 layers x 128 tokens x 2,048 = 2,097,152 B; and the head's
      chunks' inputs (2 H = 512 B): 65,536 B;
    - the previous graph's kept inputs, all of them now (its saved tensors were freed by its backward): per layer
      q/k/v's input, o_proj's, the MLP's (gate and up share it) and down's, 2 x (256 + 256 + 256 + 768) = 3,072 B, in
      8 layers, less layer 0's q/k/v input (it needs no gradient: 512 B): 8 x 128 x 3,072 - 128 x 512 = 3,080,192 B,
      and its head's chunks' inputs, 65,536 B: 3,145,728 B.

    2,097,152 + 65,536 + 3,145,728 = 5,308,416 B more activations; beside them the previous fp32 and the new bf16
    chunks (6 N = 294,912 B) and the head dequantized to fp16 and bf16 (2 x 2 x V x H = 393,216 B)."""
    old = estimate("tiny", _run(), device="cuda", stack=Stack(trainer="litgpt", bitsandbytes="0.42.0"))
    new = estimate("tiny", _run(), device="cuda", stack=Stack(trainer="litgpt", bitsandbytes="0.43.2"))
    assert old.phase == "forward"
    assert old.activations - new.activations == 2_097_152 + 65_536 + 3_145_728
    assert (old.logits, old.temporary) == (294_912, 393_216)


class _KeepsInput(torch.autograd.Function):
    """bitsandbytes 0.42.0's ``MatMul4Bit`` in miniature: the input kept as a plain ``ctx`` attribute (L523)."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.tensors = (a, w)
        return a @ w.t()

    @staticmethod
    def backward(ctx, grad):
        _, w = ctx.tensors
        return grad @ w, None


def test_an_input_kept_on_ctx_outlives_backward_while_the_output_is_held():
    """The fact ``memory.litgpt_loop`` rests on, on the installed torch: backward frees what ``save_for_backward``
    saved, not a ``ctx`` attribute; that lives as long as something (litgpt's ``logits``) reaches the graph."""
    x = torch.randn(4, 8, requires_grad=True)
    a = x * 2
    alive = weakref.ref(a)
    out = _KeepsInput.apply(a, torch.randn(8, 8))
    del a
    out.sum().backward()
    gc.collect()
    assert alive() is not None
    del out
    gc.collect()
    assert alive() is None
