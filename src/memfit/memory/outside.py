"""Peaks outside the training step, per rank: evaluation, saving the full state dict, exporting, generation.

Users hit these after hours of training (the step fit; the save or the evaluation did not), so
``memfit train`` prints them in its preamble and summary, and the planner keeps them under the budget
too. Every piece starts from what a rank holds between steps (``resident``): weights, optimizer state,
DDP's gradient buckets (gradients are freed by ``zero_grad(set_to_none=True)``) and, on CPU, where the
host is the device, ``memfit train``'s rollback snapshot (``memory.snapshot``). Per piece, as
``memfit train`` runs it (``training.step.evaluate``, ``training.sharding``, ``training.finish``):

- **evaluation** (no grad, batch ``eval_batch(run)``, every rank): resident + the largest of three
  moments (``_eval_transient``): a layer being gathered (FSDP2's unsharded parameters + ``2 B T H``
  elements of residual stream + the tail unit, kept gathered from the previous batch's head); a layer computing
  (its parameters when sharded + ``3 B T I + 4 B T H``
  elements at the matmul dtype: the gated MLP's gate, up and product, the residual stream, its norm and
  the attention output); the head (the tail unit twice when sharded + the forward-only logits and loss,
  ``activations.logits_terms(...).forward``). Gathered, as memfit's counter measured it (it follows FSDP2's
  storage resizes): ``fsdp``/``zero3`` hold one unsharded layer and two flat all-gather outputs (its
  own during copy-out and the prefetched next layer's): 3 layers. ``zero2`` keeps every layer gathered
  through a no-grad forward (no backward reshards it): all layers, the tail and 2 flat outputs
  (``training.sharding.reshard_all`` frees them after the evaluation, else the next save holds them too).
- **checkpoint, full state dict** (``--state-dict full``: ``get_state_dict(full_state_dict=True,
  cpu_offload=True)``) and **export** (``get_model_state_dict``, then a plain copy of the model on rank 0):
  the full model (and for the checkpoint the full optimizer state) is gathered one parameter at a time
  and copied to rank 0's host. On a GPU the device holds resident + the gather's transients: the largest
  parameter tensor gathered, ``GATHER_COPIES`` copies at once;
  rank 0's host RAM holds the full model + full optimizer state (checkpoint) or 2 x the full model
  (export: the gathered dict and the plain copy, or more while a quantized base's copy loads: ``_rebuilt_copy``)
  (``save_host``). On CPU the host is the device: rank 0
  holds resident + that host part, the other ranks resident + the transients. Unsharded runs save from
  the resident tensors (Accelerate's ``save_state``, ``save_pretrained``): no extra, but for a quantized base's
  state dict, which serializes its quantization state anew (``memory.quantized.state_dict_bytes``); a sharded
  4-bit base's gathered dict holds none (``_state_not_gathered``).
- **generation** (rank 0; ``training.samples``): on the model the step uses (unsharded), or on the plain
  copy rank 0 built on its CPU (sharded: host RAM on a GPU; on CPU resident + the full model): + the KV
  cache of one sample, ``(2 x layers + 1) x kv_heads x head_dim x positions`` elements at the matmul
  dtype (the cache grows by concatenation: one layer's keys exist twice for a moment), positions = a prompt of ``PROMPT_CHARS + 1`` tokens + ``MAX_NEW_TOKENS``,
  + the sampling's own tensors (``_sampling_transients``: three fp32 vocabulary vectors, the int64 ids and mask).

Known error (bench/README.md, "outside_memory.py"): on CPU (gloo), the tiny preset on 1 and 2 processes,
DDP, FSDP and ZeRO-2, every piece within 1% of the tensor peak counted on real tensors, except what the
counter cannot see (oneDNN scratch buffers, allocator overhead) and: the KV cache is sized for a
PROMPT_CHARS prompt (a prompt/completion record's whole prompt can be longer); a ``--state-dict full``
checkpoint is predicted whether or not the run saves one (the default, sharded DCP checkpoints, add nothing
measurable on CPU). Not yet checked on a GPU.
"""

# Inside a function: spec.model's load_spec, in a try: a model it cannot describe is no prediction, never a failure.
from __future__ import annotations

from dataclasses import dataclass

from memfit.memory import quantized
from memfit.memory.activations import Precisions, logits_terms
from memfit.memory.host_loading import LoadedFrom, host_loading_peak
from memfit.memory.snapshot import rollback_copy
from memfit.memory.states import (
    base_weight_bytes,
    gathered_layer_bytes,
    model_states,
    optimizer_state_bytes,
    unquantized_param_bytes,
)
from memfit.settings.config import Quantize, RunConfig, Sharding

#: The sample budget of ``training.samples`` (a plain-text prompt's characters, the tokens generated),
#: kept here so that the KV cache predicted and the samples generated read the same numbers.
PROMPT_CHARS = 16
MAX_NEW_TOKENS = 160

GATHER_COPIES = 4
"""Copies of the largest parameter tensor alive at once while a sharded state dict is gathered, on a rank
that does not keep it (measured with memfit's counter, tiny preset FSDP/ZeRO-2 on 2 CPU ranks: 3 or 4 x
786,432 B from one run to the next, for the model alone and for model + AdamW state: the all-gather
outputs in flight, the unpadded full tensor and its copy; the larger is taken)."""


RANK0_GATHER_COPIES = 2
"""Copies of a tensor being gathered on rank 0 of a CPU run, beside the full state already gathered: torch
2.13's ``_gather_state_dict`` (``torch/distributed/_state_dict_utils.py`` L267-286) redistributes each DTensor to
``Replicate()``, an all-gather into a flat buffer and the full tensor cut out of it, and keeps the result (with
``cpu_offload`` its ``.to("cpu")``, L182-183, is the same tensor on a CPU). Measured with memfit's counter on rank 0
at the end of the gather (FSDP2, 2 CPU ranks): the full state + 2 x the last tensor gathered (the head's second
AdamW moment: 2 x 98,304 B on a hidden-64 Llama, 2 x 393,216 B on the tiny preset). The largest tensor is taken,
for any gather order: known error, + 2 x (largest - last) where the largest is not gathered last (tiny preset:
+786,432 B, +0.5%).

The model is gathered before the optimizer (``get_state_dict``), so the peak is the larger of the weights gathered
with the model's last tensor in flight and the weights with the full optimizer state and its last tensor in flight;
the first wins for LoRA, whose adapters' moments are small (taken as none in flight: known error, 2 x the largest
adapter's moment). Measured (FSDP2 QLoRA, 2 CPU ranks, hidden-64 Llama, ``--state-dict full``): rank 0 696,592 B,
the head (384 x 64 fp32) in flight twice beside the gathered weights; this gives 696,656 B (761,936 B with the
optimizer state and the head both counted)."""


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
    """Predicted device bytes per rank outside the training step (rank 0 and the others, where they differ)."""

    evaluation: int
    """Every rank."""
    checkpoint_full: tuple[int, int]
    """(rank 0, any other rank): a ``--state-dict full`` checkpoint being gathered."""
    export: tuple[int, int]
    """(rank 0, any other rank): the end-of-run export (gathered full weights and rank 0's plain copy)."""
    generation: int
    """Rank 0, end-of-run samples."""
    save_host: int
    """Host RAM rank 0 needs to gather a sharded model on a GPU (0 when unsharded, or on CPU where it is
    part of the device figures above)."""
    loading: int = 0
    """Every rank, while the model is built and sharded: a sharded 4-bit base is loaded whole on every rank
    (Accelerate's ``fsdp2_prepare_model`` skips the rank-0 broadcast for ``Params4bit`` models, and memfit
    quantizes onto the rank's device: ``training.setup``), so each holds the whole packed base before FSDP2
    shards it. 0 where rank 0 alone builds the model in host memory (``sharding.builds_empty``)."""

    @property
    def save_device(self) -> int:
        """The largest save peak of any rank (full checkpoint or export)."""
        return max(*self.checkpoint_full, *self.export)

    def device_peak(self) -> int:
        return max(self.evaluation, self.save_device, self.generation, self.loading)

    def to_dict(self) -> dict[str, int]:
        """The figures ``run.json`` keeps (``summary["outside_step"]``): the largest of any rank per piece."""
        return {"evaluation": self.evaluation, "checkpoint_full": max(self.checkpoint_full),
                "export": max(self.export), "generation": self.generation, "save_host": self.save_host,
                "loading": self.loading}

    def per_rank(self, n: int) -> list[dict[str, int]]:
        """Each rank's figures, in the keys bench/outside_memory.py measures."""
        return [{"evaluation": self.evaluation, "checkpoint_full": self.checkpoint_full[rank > 0],
                 "export": self.export[rank > 0], "generation": self.generation if rank == 0 else 0}
                for rank in range(n)]


def outside_step(spec, run: RunConfig, device: str = "cuda", loaded_from: LoadedFrom | None = None) -> OutsideStep:
    """``OutsideStep`` for ``run`` on ``device`` (``cuda`` or ``cpu``: the host is the device); ``loaded_from``:
    where a quantized base comes from, which decides what rebuilding it for a sharded export holds
    (``_rebuilt_copy``)."""
    cpu = device == "cpu"
    prec = Precisions.of(run)
    states = model_states(spec, run, device)
    resident = states.weights + states.optimizer + states.buckets + _cpu_snapshot(spec, run, cpu)
    eval_run = run.replace(micro_batch=eval_batch(run))
    evaluation = resident + _eval_transient(spec, eval_run, prec)
    sharded = run.num_processes > 1 and run.sharding is not Sharding.DDP
    full_weights = base_weight_bytes(spec, run) + (spec.lora_params(run) * 4 if run.is_lora() else 0)
    trainable = spec.trainable_params(run)
    grad_bytes = 4 if run.is_lora() else prec.w
    full_optimizer = optimizer_state_bytes(spec, run, trainable, grad_bytes)
    kv = _kv_cache(spec, prec) + _sampling_transients(spec)
    if not sharded:  # a quantized base's state dict packs its quantization state anew
        saved = resident + quantized.state_dict_bytes(spec, run)
        return OutsideStep(int(evaluation), (saved, saved), (saved, saved), int(resident + kv), 0)
    transient = GATHER_COPIES * _largest_tensor(spec) * prec.w
    gathered = full_weights - _state_not_gathered(spec, run)
    host_checkpoint = gathered + full_optimizer
    host_export = gathered + _rebuilt_copy(spec, run, full_weights, loaded_from)
    loading = int(full_weights) if run.quantize is not Quantize.NONE else 0
    if cpu:
        in_flight = RANK0_GATHER_COPIES * _largest_tensor(spec) * prec.w  # rank 0 keeps what it gathers
        gather = gathered + max(in_flight, full_optimizer + (0 if run.is_lora() else in_flight))  # RANK0_GATHER_COPIES
        return OutsideStep(int(evaluation), (resident + gather, resident + transient),
                           (resident + host_export, resident + transient), int(resident + full_weights + kv), 0,
                           loading)
    return OutsideStep(int(evaluation), (resident + transient,) * 2, (resident + transient,) * 2, int(resident),
                       int(max(host_checkpoint, host_export)), loading)


def _state_not_gathered(spec, run: RunConfig) -> int:
    """Bytes of a sharded 4-bit base's quantization state (absmax, codes: ``quantized.packed_bytes -
    quantized.storage_bytes``), which a gathered full state dict leaves out: under FSDP2 the weight is a DTensor
    that has lost its ``quant_state`` (the module keeps it), and ``Linear4bit._save_to_state_dict`` (bitsandbytes
    0.50.2 ``nn/modules.py`` L598-607) writes the state only from ``self.weight.quant_state``. Measured (FSDP2, 2 CPU
    ranks, tiny Llama, QLoRA): the export's gathered dict held 16,304 B less than the full weights; this is 16,496.
    Known error: DeepSpeed's gather is taken to leave it out too."""
    if run.quantize is not Quantize.Q4:
        return 0
    return quantized.packed_bytes(spec, run) - quantized.storage_bytes(spec, run)


def _rebuilt_copy(spec, run: RunConfig, full_weights: int, loaded_from: LoadedFrom | None) -> int:
    """What rank 0's plain copy holds at most while it is built for a sharded export, beside the gathered state
    dict (``training.sharding.gathered_model``: ``get_model_state_dict`` first, then ``build_model``, then
    ``load_state_dict``): the full weights, or more while a quantized base loads, on the host
    (``memory.host_loading``: a random base's unquantized model, or the tensor being quantized)."""
    return max(full_weights, host_loading_peak(spec, run, loaded_from))


def predicted_outside(model, run: RunConfig, device: str, loaded_from: LoadedFrom | None = None) -> OutsideStep | None:
    """``outside_step`` for a model name (or a ``ModelSpec``), or None where the estimator cannot describe
    the model (a prediction never stops a training run)."""
    try:
        from memfit.spec.model import load_spec

        return outside_step(load_spec(model), run, "cpu" if device == "cpu" else "cuda", loaded_from)
    except Exception:  # noqa: BLE001
        return None


def _cpu_snapshot(spec, run: RunConfig, cpu: bool) -> int:
    """The rollback snapshot's buffers, kept for the run (``memory.snapshot``), where the host is the device."""

    kind, copy = rollback_copy(spec, run)
    return copy if cpu and kind == "every-step" else 0


def _eval_transient(spec, run: RunConfig, prec) -> int:
    """What a no-grad forward adds to the resident bytes at its peak (module docstring): the larger of
    the moment a layer is gathered (FSDP2's gathered units ``G`` + the residual stream and a layer input,
    ``2 B T H``), the moment a layer computes (its own parameters when sharded + ``3 B T I + 4 B T H``) and
    the head's (the tail unit twice when sharded + the logits and loss)."""

    tokens = run.micro_batch * run.seq_len
    layer_compute = (3 * spec.intermediate_size + 4 * spec.hidden_size) * tokens * prec.c
    logits = logits_terms(spec, run, prec).forward
    if run.num_processes < 2 or run.sharding is Sharding.DDP:
        return max(layer_compute, logits)
    head = 0 if spec.tie_word_embeddings else (spec.lm_head_params or spec.vocab_size * spec.hidden_size)
    tail = head + spec.hidden_size + (spec.embedding_params if spec.tie_word_embeddings else 0)
    layer = gathered_layer_bytes(spec, run)  # as stored: a 4-bit base's projections packed
    tail *= unquantized_param_bytes(run)
    # the tail unit (final norm + head) is sharded with reshard_after_forward=False (Accelerate 1.16
    # utils/fsdp_utils.py L895-897) and evaluate reshards only after its last batch: from the second batch on it is
    # gathered while the layers run (measured, 2 CPU ranks, 2 eval batches: +98,560 B, the tail of a hidden-64 Llama)
    gathered = ((spec.num_layers + 2) * layer if run.sharding is Sharding.ZERO2 else 3 * layer) + tail
    return max(gathered + 2 * spec.hidden_size * tokens * prec.c, layer + layer_compute, 2 * tail + logits)


def largest_tensor_bytes(spec, run: RunConfig) -> int:
    """Bytes of the model's largest parameter tensor in the weights' dtype (one gathered or broadcast at a time)."""

    return _largest_tensor(spec) * Precisions.of(run).w


def _largest_tensor(spec) -> int:
    """Elements of the model's largest parameter tensor (a projection, the embedding or the head)."""
    linears = [lin.in_features * lin.out_features for lin in spec.linears]
    embed = spec.embedding_params or spec.vocab_size * spec.hidden_size
    return max([embed, spec.lm_head_params, *linears])


def _sampling_transients(spec) -> int:
    """What one sampled token adds beside the KV cache at the longest sample (bytes), transformers 5.25's
    ``GenerationMixin._sample`` (``generation/utils.py``): the last position's logits copied to fp32 (L3251),
    divided by the temperature (``TemperatureLogitsWarper``, ``logits_process.py`` L302) and softmaxed (L3278):
    three fp32 vectors of the vocabulary; and the int64 ``input_ids`` and ``attention_mask``, one entry per
    position, each grown by ``torch.cat`` (L3289, L1291). Measured with memfit's counter (2-layer hidden-64 Llama,
    vocabulary 384, fp32, a full-length sample): 3 x 1,536 B + 2 x 1,408 B beside the cache; the rest (one
    token's hidden states, the prompt's ids) is under 1.5 KiB."""
    positions = PROMPT_CHARS + 1 + MAX_NEW_TOKENS - 1
    return 3 * spec.vocab_size * 4 + 2 * positions * 8


def _kv_cache(spec, prec) -> int:
    """One sample's KV cache at its longest, one layer's copy more (module docstring)."""
    positions = PROMPT_CHARS + 1 + MAX_NEW_TOKENS - 1  # the last token's keys are never cached
    return (2 * spec.num_layers + 1) * spec.num_kv_heads * spec.head_dim * positions * prec.c
