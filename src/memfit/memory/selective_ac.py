"""torchtitan's per-op selective activation checkpointing: what a decoder layer keeps, and what its recompute adds.

torchtitan wraps each transformer block in ``checkpoint_wrapper(block, context_fn=...)`` (non-reentrant) with
``create_selective_checkpoint_contexts`` and a policy over aten ops (``mode = "selective"``,
``selective_ac_option = "op"``, the default of ``llama3_8b.toml``). Source, the release its benchmarks ran
(pytorch/torchtitan 9dec370, ``torchtitan/parallelisms/parallelize_llama.py`` L213-276; unchanged at e7c0cae,
``torchtitan/models/llama3/parallelize_llama.py`` L218-280, bar ``aten.abs`` dropped from the list):

- ``_save_list``: ``aten.mm``, ``aten._scaled_dot_product_efficient_attention``,
  ``aten._scaled_dot_product_flash_attention``, ``_c10d_functional.reduce_scatter_tensor`` (tensor parallelism
  only), ``aten.max`` (and ``aten.abs`` at 9dec370: Float8's amax);
- ``_custom_policy``: ``MUST_SAVE`` for an op of the list, except every second ``aten.mm`` of the block
  (``meta["forward_mm_count"] % 2 == 0``), ``PREFER_RECOMPUTE`` for everything else.

torch's ``_CachingTorchDispatchMode`` (torch 2.13 ``utils/checkpoint.py`` L1355-1403) keeps a detached alias of
each saved op's outputs (the same storage) until the block's backward, whose recompute takes them from there
(``_CachedTorchDispatchMode``) and recomputes every other op. Everything autograd would otherwise save inside the
block is dropped by the checkpoint's hooks, as with whole-layer checkpointing; the block's input is held by the
checkpoint. So between forward and backward a layer keeps its input and those outputs.

memfit's layer model is transformers' (``memory.activations``): a bias-free ``nn.Linear`` on a contiguous 3-D input
runs one ``aten.mm`` (``linear`` -> ``matmul`` folds the batch into rows), in the order the layer calls its
projections (``ModelSpec.linears``: q, k, v, o, gate, up, down for Llama), so the 1st, 3rd, 5th and 7th are kept:
q (Q), v (K), gate (I) and down (H) wide, in the compute dtype. A biased projection runs ``aten.addmm`` (ATen's
``linear``: ``_flatten_nd_linear``), which the policy neither counts nor keeps. SDPA keeps its output (Q, compute
dtype) and log-sum-exp (fp32, one per head); flash's seed and offset are scalars, left out.

Known error: only where the policy's attention ops run. On CUDA SDPA lowers to the flash or efficient kernel
(kept); on the CPU to ``aten._scaled_dot_product_flash_attention_for_cpu``, which the list does not name
(recomputed); eager attention's ``bmm``s are neither. torchtitan's own Llama block (9dec370 model.py) keeps the
same bytes as transformers' layer, measured (tests/test_selective_ac.py), but expands k and v to every head
(``repeat_kv``, L201-202) where transformers passes ``enable_gqa``: its recompute's peak is larger by the
repeated k and v, ``2 (Q - K) c`` per token (measured on that test's block: 131,072 B, 7.9% of the top layer's
backward peak over its kept set), not priced. Adapters (torchtitan trains none) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class KeptOutputs:
    """Bytes per token of the outputs one decoder layer keeps under the policy (its input not included)."""

    total: int
    """Everything kept: the kept matmuls' outputs and, where kept, SDPA's output and log-sum-exp."""
    reached: int
    """Of ``total``, what the layer's recompute takes back before its backward peak, so that the recompute
    allocates it no second time: all but the last projection's output. The recompute hands each kept output to
    the op that reads it (``_CachedTorchDispatchMode`` marks the entry ``_CONSUMED``): SDPA's v, output and
    log-sum-exp and gate's output are then what the recompute saves (``memory.activations``' whole-layer set counts
    them), q's output is freed once RoPE has read it. The recompute stops (``early_stop``, torch's default) once
    the last tensor the layer saves is packed, the down projection's input, which autograd packs before it
    dispatches that ``mm``: down's kept output is never taken back and stays until the layer's backward ends."""


def kept_outputs(spec, compute_bytes: int, attention_kept: bool) -> KeptOutputs:
    """What torchtitan's op policy keeps of one decoder layer, bytes per token.

    Args:
        spec: the model (``ModelSpec``: its projections in call order, widths, heads).
        compute_bytes: bytes per element of the matmuls' and SDPA's outputs (the compute dtype).
        attention_kept: whether SDPA runs an op of the list (CUDA's flash or efficient kernel: True).

    Measured on the CPU (tests/test_selective_ac.py: a 3-layer transformers Llama in bf16, each layer under
    ``checkpoint(use_reentrant=False, context_fn=...)`` with torchtitan's policy, memfit's tensor counter): the kept
    bytes and the top layer's backward peak equal the prediction to the byte.
    """
    outputs = [lin.out_features for lin in spec.linears if not lin.bias]  # biased: aten.addmm, never counted
    kept = [width for count, width in enumerate(outputs, 1) if count % 2 == 1]  # every second mm recomputed
    total = compute_bytes * sum(kept)
    last_kept = compute_bytes * outputs[-1] if outputs and len(outputs) % 2 == 1 else 0
    sdpa = compute_bytes * spec.q_dim + FP32 * spec.num_heads if attention_kept else 0  # output, log-sum-exp
    return KeptOutputs(total=total + sdpa, reached=total - last_kept + sdpa)


def attention_kept(device: str) -> bool:
    """Whether SDPA's outputs are kept on ``device``: CUDA runs an attention op of torchtitan's list, the CPU
    ``_scaled_dot_product_flash_attention_for_cpu``, which the list does not name."""
    return device == "cuda"
