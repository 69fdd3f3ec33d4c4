"""Peaks outside the training step, per rank: evaluation, saving the full state dict, generation.

Users hit these after hours of training (the step fit; the save or the evaluation did not), so
``memfit train`` prints them in its preamble and the planner keeps them under the budget too.
All three start from the model states resident between steps (``estimate.model_states``):
weights and optimizer state (gradients are freed by ``zero_grad(set_to_none=True)``).

- **evaluation** (``training.step.evaluate``, no grad, batch ``eval_batch(run)``): resident states +
  FSDP's gathered layers + the forward-only logits and loss terms of that batch
  (``activations.logits_terms(...).forward``); layer activations die layer by layer without grad
  and are left out (a few ``B x T x hidden`` tensors, well under the logits for any LM vocabulary).
- **save, device** (``training.sharding.gathered_model``: ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)``): each parameter is all-gathered on the device and copied to the host one at
  a time, so the device peak is the resident states + the largest full parameter (the embedding or
  output head). Unsharded runs save from the resident weights: no extra.
- **save, host of rank 0** (sharded runs): the gathered full state dict plus the unsharded copy of
  the model memfit exports and samples from: 2 x the full weights in host RAM.
- **generation** runs on rank 0's unsharded model (the step's model for unsharded runs); with
  ``use_cache`` the KV cache of a few short samples is negligible next to the weights.

Known error: these formulas are not yet checked against measurement (the step's peak is; see
bench/README.md); they are upper-bound-minded and ignore allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.config import RunConfig, Sharding


def eval_batch(run: RunConfig) -> int:
    """Sequences per evaluation batch: the training micro-batch.

    Not 2x, although evaluation keeps no activations for backward: with a large vocabulary the logits
    dominate, and a no-grad forward holds about 10 bytes per logit (half-precision logits, their fp32
    copy and log_softmax) against the step's 12 at the start of backward, so a doubled batch peaks
    above the step (llama-3.2-1b LoRA, micro-batch 8 x 1024: 23 GiB against the step's 16 GiB).
    """
    return run.micro_batch


@dataclass(frozen=True)
class OutsideStep:
    """Predicted bytes per rank outside the training step."""

    evaluation: int
    save_device: int
    save_host: int
    """Host RAM rank 0 needs to gather and export a sharded model (0 when unsharded)."""

    def device_peak(self) -> int:
        return max(self.evaluation, self.save_device)


def outside_step(spec, run: RunConfig) -> OutsideStep:
    """``OutsideStep`` for ``run`` (per rank, like ``estimate``)."""
    from memfit.memory.activations import Precisions, logits_terms
    from memfit.memory.estimate import base_weight_bytes, model_states

    states = model_states(spec, run)
    resident = states.weights + states.optimizer + states.buckets  # DDP's buckets stay allocated
    prec = Precisions.of(run)
    eval_run = run.replace(micro_batch=eval_batch(run))
    evaluation = resident + states.gathered + logits_terms(spec, eval_run, prec).forward
    sharded = run.num_processes > 1 and run.sharding is not Sharding.DDP
    largest = max(spec.embedding_params, spec.lm_head_params) * prec.w
    save_device = resident + largest if sharded else resident
    save_host = 2 * base_weight_bytes(spec, run) if sharded else 0
    return OutsideStep(int(evaluation), int(save_device), int(save_host))
