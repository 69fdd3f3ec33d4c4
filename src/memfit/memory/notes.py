"""One-line explanations appended to an estimate (``notes``): the terms that surprise people.

Read by ``memory.estimate`` and ``memory.derive`` (the same notes for a hand-written and a derived recipe).
"""

from __future__ import annotations

from memfit.memory import fragmentation
from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.device_terms import CUDA_CONTEXT_BYTES
from memfit.memory.states import model_states
from memfit.settings.config import Precision, RunConfig
from memfit.spec.engines import shard_group_size
from memfit.spec.model import ModelSpec
from memfit.spec.optimizers import row
from memfit.units import MiB, fmt_gb, fmt_gib


# ----------------------------------------------------------------------------------------------
# Notes
# ----------------------------------------------------------------------------------------------
def notes(spec: ModelSpec, run: RunConfig, out: MemoryBreakdown) -> list[str]:
    """One-line explanations of the terms that surprise people."""
    lines = []
    n = out.trainable_params
    if not run.is_lora() and run.dtype.value == "fp32" and n:
        # The full states, not their composition at the peak: at a backward peak the grads are partial.
        states = model_states(spec, run)
        shards = shard_group_size(run)
        per = (states.weights + states.gradients + states.buckets + states.optimizer) * shards / n
        opt = row(run.optimizer)
        state = opt.state_bytes_per_param(4)
        lines.append(f"model states: {per:.1f} bytes/param (weights 4 + grads 4 + {opt.label} {state:g})."
                     if state and not opt.factored else f"model states: {per:.1f} bytes/param.")
    if (run.mixed_precision is Precision.NO and run.dtype.value == "fp32" and not run.is_lora()
            and row(run.optimizer).moments == 2):
        lines.append(f"AMP (--mixed-precision bf16) would not shrink these: autocast keeps fp32 weights, grads and "
                     f"moments, so model states stay 16 B/param = {fmt_gb(16 * n)}, not the 12 B/param "
                     f"({fmt_gb(12 * n)}) often quoted for mixed precision; it only shrinks activations.")
    if run.mixed_precision is not Precision.NO and run.dtype.value == "fp32":
        lines.append("AMP does not shrink model states: autocast casts on the fly, so weights, grads and moments "
                     "stay fp32 (16 B/param with AdamW); it shrinks activations and adds half weight copies.")
    if out.phase == "backward" and out.logits > out.activations and str(run.loss) == "trl":
        lines.append("TRL's fused LM head (its projection buffer of up to 4,096 tokens x 32,768 columns, the fp32 "
                     "gradients of the hidden states and the head) is the largest term at the peak.")
    elif out.phase == "backward" and out.logits > out.activations:
        lines.append(f"the logits ({spec.vocab_size:,} vocab x {run.micro_batch * run.seq_len:,} tokens, fp32 for "
                     "the loss, plus their gradient) are the largest term at the peak.")
    if out.other:
        lines.append(f"other = CUDA context ~{CUDA_CONTEXT_BYTES // MiB} MiB (varies by GPU/driver) + 2 cuBLAS "
                     f"workspaces (forward's and backward's threads) + {fragmentation.describe()}.")
    if run.num_processes > 1:
        on = f" on {run.nodes} nodes" if run.nodes > 1 else ""
        lines.append(f"per-rank numbers for {run.num_processes} processes{on} with {run.sharding.value}; activations "
                     "are never sharded.")
    if run.compile:
        lines.append("--compile: this analytic estimate prices eager autograd's saved tensors (inductor's min-cut "
                     "partition usually saves fewer); --exact prices the compiled graph's.")
    if out.peak_bytes:
        lines.append(f"peak {fmt_gib(out.peak_bytes)} ({fmt_gb(out.peak_bytes)}) in the {out.phase} phase.")
    return lines
