"""What litgpt's LoRA fine-tuning loop keeps of one micro-batch while the next one runs its forward.

litgpt@00af8b0 ``litgpt/finetune/lora.py`` L304 binds ``logits = model(input_ids, lm_head_chunk_size=128)`` in the
training loop; the name holds the previous micro-batch's list of fp32 head chunks until the new forward has returned
(``loss`` is rebound to a float at L319 with ``log_interval: 1``, every config hub file's setting). Those chunks
reach the previous micro-batch's whole graph through their ``grad_fn``. Its backward freed what it saved with
``save_for_backward``, but not what a custom autograd function keeps as a plain attribute: bitsandbytes before
0.43.2 keeps each 4-bit layer's input as ``ctx.tensors = (A, B)`` (0.42.0, litgpt's pin, ``autograd/_functions.py``
L523; dropped by commit 9e75374, PR #1270: "This is the bug that caused a lot of memory issues with QLoRA").
So the inputs every 4-bit layer kept (``memory.activations.int8_held``, the head's chunks' too:
``memory.stack_terms.quantized_head``) are alive twice at the end of the next forward: the previous micro-batch's
and the new one's. A bf16 LoRA run keeps none of them; only the previous fp32 chunks.

The moment: Lightning Fabric's ``_FabricModule.forward`` (``lightning/fabric/wrappers.py``) runs
``output = precision.convert_output(output)``: the module's bf16 chunks (2 bytes a logit) are still bound to
``output`` while their fp32 copies (4) are made, and the previous fp32 chunks (4) are still bound to ``logits``:
10 bytes per logit, with the previous graph's kept inputs. Earlier, while the head runs its last chunk: the new
bf16 chunks and the previous fp32 ones (6 bytes per logit) beside a 4-bit head's dequantized copies. Ignores: the
batches' lengths differ (each micro-batch is padded to its own longest row; both are priced at ``--seq-len``); the
last layer's dequantized projection (below the head's dequantized copies where the vocabulary is wider than the MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory.stack_terms import chunked_head_tokens
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack

#: Bytes per logit at the end of the next forward: the new bf16 chunks, their fp32 copies, the previous fp32 chunks.
LOGIT_BYTES_AT_CONVERT = 2 + 4 + 4
#: Bytes per logit while the head runs (its last chunk): the new bf16 chunks and the previous fp32 ones.
LOGIT_BYTES_IN_HEAD = 2 + 4


@dataclass(frozen=True)
class PreviousOutputs:
    """The previous micro-batch's outputs and graph, alive until the next forward returns."""

    held: int
    """Its 4-bit layers' kept inputs (bitsandbytes < 0.43.2), bytes."""
    logits: int
    """The logits at Fabric's output conversion: the new chunks in bf16 and fp32, the previous ones in fp32."""
    logits_in_head: int
    """The logits while the head runs its last chunk: the new chunks in bf16, the previous ones in fp32 (a 4-bit head
    is dequantized then: ``memory.stack_terms.quantized_head``)."""


def previous_outputs(spec, run: RunConfig, stack: Stack, held: int) -> PreviousOutputs | None:
    """What ``stack``'s loop still holds of the previous micro-batch at the end of a forward; ``held``: what one
    micro-batch's graph keeps to its end (the layers' and the head's kept inputs). None: a loop that rebinds nothing
    (memfit's, transformers' Trainer: only ``.loss`` is kept), or a run litgpt's LoRA script does not make."""
    if not stack.traits.keeps_outputs_until_next_forward or not chunked_head_tokens(run, stack):
        return None  # litgpt's LoRA script, whose chunked head hands the fp32 chunks back (memory.stack_terms)
    logits = run.micro_batch * run.seq_len * spec.vocab_size
    return PreviousOutputs(held=held, logits=LOGIT_BYTES_AT_CONVERT * logits,
                           logits_in_head=LOGIT_BYTES_IN_HEAD * logits)
