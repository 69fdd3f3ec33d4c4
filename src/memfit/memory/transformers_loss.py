"""The causal-LM head and loss as older transformers releases run them (``Stack.transformers``).

memfit prices the loss of the installed transformers (``memory.activations.logits_terms``: since 4.49
``ForCausalLMLoss`` pads the labels instead of shifting the logits, so the loss holds the head's logits, one fp32
copy and ``log_softmax``'s saved fp32 output). A run on an older release holds more, read off each release's
``modeling_llama.py`` (the other decoder families copied Llama's ``forward``):

- **4.31 to 4.45** (``LossEra.FP32_LOGITS``): ``LlamaForCausalLM.forward`` returns the logits in fp32
  (4.37.2 L1202 ``logits = logits.float()``, unconditional; 4.45.2 L1214 and L1219) and shifts a contiguous copy
  for the loss (4.37.2 L1207 ``shift_logits = logits[..., :-1, :].contiguous()``). Inside the loss: the fp32
  logits, the shifted copy and ``log_softmax``'s saved output, 12 bytes a logit (the head's half output dies
  as its fp32 copy is made; Accelerate's ``convert_outputs_to_fp32`` finds fp32 and copies nothing), against 10
  (half logits) or 8 (fp32) in 4.49.
- **4.46 to 4.48** (``LossEra.SHIFTED_COPY``): the logits come back in the head's dtype; ``ForCausalLMLoss``
  (4.46.0 ``loss/loss_utils.py`` L36-38) makes the fp32 copy and shifts a contiguous copy of it: the head's
  ``c`` bytes, 4 + 4 + 4 while the loss runs.
- **4.49 and later**: memfit's own pricing (4.49.0 ``loss_utils.py`` L39 pads the labels; no shifted copy).

Backward is the same in every era: ``log_softmax``'s saved output, its gradient and the gradient of its input,
12 bytes a logit, then the slice's zero-filled gradient (4) with the shifted one (4), below that.

What the trainer's loop keeps (``Trainer.keeps_output_through_backward``): Answer.AI's fsdp_qlora binds
``output = model(...)`` (e877dda ``train.py`` L841) and calls ``loss.backward()`` with it bound (L863), so the
returned logits live through backward and the optimizer step, and into the next micro-batch's forward until it
returns. transformers' ``Trainer.compute_loss`` returns the loss alone, so there the logits die with the forward.

Known error: before 4.31 the logits stay in the model's dtype and the shifted copy too (priced as 4.31);
preference losses and the chunked or fused heads do not read these logits and keep memfit's pricing.
"""

from __future__ import annotations

from memfit.memory.activations import LogitsTerms, Precisions
from memfit.settings.config import RunConfig
from memfit.settings.stack import LossEra, Stack

FP32 = 4


def logits_terms(spec, run: RunConfig, prec: Precisions, stack: Stack) -> LogitsTerms | None:
    """The head and loss of ``stack``'s transformers release where it differs from the installed one's, for the
    standard SFT loss; None: memfit's pricing (``memory.activations.logits_terms``). ``N = B * T * V`` logits, of
    which the shifted ones are ``N' = B * (T - 1) * V`` (the copy, ``log_softmax``'s output and the gradients).

    - FP32_LOGITS: forward 4 N + 8 N' (the fp32 logits, the shifted copy, the saved output), backward 12 N' (the saved
      output, its gradient and its input's);
    - SHIFTED_COPY: forward ``c`` N + 4 N + 8 N' (the head's logits and their fp32 copy beside the same two; in fp32
      ``.float()`` returns the logits themselves: 4 N + 8 N'), backward 12 N';
    - a loop that keeps the output (``keeps_output_through_backward``) adds the returned logits to both (the
      previous micro-batch's in forward, this one's in backward) and holds them after backward (``retained``).
    Gemma 2's soft-capping keeps ``tanh``'s output (``c`` N) in both, as in memfit's pricing. Measured to the byte on
    the CPU with both releases' code (tests/test_transformers_loss.py), less the shifted int64 labels and two fp32
    scalars, not priced.
    """
    era = stack.loss_era()
    if era is None or str(run.loss) != "standard" or str(run.method) != "sft":
        return None
    n = run.micro_batch * run.seq_len * spec.vocab_size
    shifted = run.micro_batch * max(run.seq_len - 1, 1) * spec.vocab_size
    returned = FP32 if era is LossEra.FP32_LOGITS else prec.c
    upcast = FP32 * n if era is LossEra.SHIFTED_COPY and prec.c != FP32 else 0
    kept = returned * n if stack.traits.keeps_output_through_backward else 0
    cap = prec.c * n if spec.final_logit_softcapping else 0
    forward = returned * n + upcast + 2 * FP32 * shifted
    return LogitsTerms(forward=forward + kept + cap, backward=3 * FP32 * shifted + kept + cap, retained=kept)
