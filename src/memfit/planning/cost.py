"""Step-time model: seconds per optimizer step of a ``RunConfig`` on a ``GPU``, and tokens/s.

The planner only needs to *rank* configurations that fit, so this is a simple additive roofline:
each term is what the step must do divided by how fast the device does it, and the terms are
summed (no overlap assumed, so the model is pessimistic where real kernels overlap, by up to ~2x at
the compute/bandwidth crossover and much less away from it). Per micro-batch of ``t`` tokens:

1. **Matmul FLOPs** (Kaplan et al. 2020, "Scaling laws", sec. 2.1; PaLM, Chowdhery et al. 2022, app. B):
   forward ``2 N`` per token (``N`` = parameters in matmuls: the decoder projections plus the head)
   plus attention ``4 L H Q T`` (scores and weighted values; ``L`` layers, ``H`` heads of size ``Q``,
   ``T`` tokens of context; PaLM's count, which does not halve for the causal mask). Backward is
   twice the forward: ``4 N`` (input gradients ``2 N`` + weight gradients ``2 N``) + ``8 L H Q T``.
   So full training is ``6 N + 12 L H Q T`` per token, and ``8 N + 16 L H Q T`` with gradient
   checkpointing, which re-runs each decoder layer's forward in backward (not the head's).
   LoRA freezes the base, so its weight-gradient matmuls are skipped: ``4 N`` + the adapters'
   ``6 N_lora`` (Hu et al. 2021 report ~25% faster training than full fine-tuning of GPT-3; this
   model gives 1/3 fewer FLOPs, an upper bound on the gain).
   Time = FLOPs / (device peak x ``MATMUL_EFFICIENCY``), with the dense half-precision tensor-core
   peak when matmuls run in bf16/fp16 (AMP or half weights), and the plain FP32 peak otherwise
   (PyTorch leaves TF32 off by default). LLM.int8 (8-bit QLoRA base) runs at ``INT8_SLOWDOWN`` of that.
2. **Weight traffic** (device bandwidth x ``BANDWIDTH_EFFICIENCY``): every pass over the layers
   (forward, backward, recompute) reads the weights at their compute dtype; AMP on fp32 weights also
   reads 4 B and writes a 2 B copy per parameter each forward (autocast's cast); a 4-bit / 8-bit base
   is dequantised each pass (reads 0.5 / 1 B, writes 2 B per parameter); a full fine-tune reads and
   writes its gradients once per micro-batch (accumulation). This is why tiny micro-batches are slow:
   the weights are streamed once per micro-batch whatever its size.
3. **Loss**: the logits, their fp32 upcast and the gradient: ``LOGIT_BYTES`` per token per vocab entry;
   ``--loss chunked`` writes the same bytes chunk by chunk and recomputes the head's forward in backward
   (``2 H V`` FLOPs per token more, ``memfit.spec.losses.LOSSES``). ``--offload activations`` moves every
   saved tensor over PCIe twice per micro-batch.
4. **Kernel launches**: ``KERNELS_PER_LAYER`` per layer and micro-batch (x4/3 with checkpointing),
   plus ``KERNELS_PER_LORA_MODULE`` per adapted projection, ``LAUNCH_S`` each: the fixed cost per
   micro-batch that makes gradient accumulation of tiny micro-batches slower than one large one.

Once per optimizer step:

5. **Optimizer step**, bandwidth-bound (with ``optimizer_in_backward``: the same bytes, plus
   ``KERNELS_PER_PARAM_STEP`` launches per trainable tensor, stepped one by one in backward): bytes read and written per trainable parameter
   (``optimizer_bytes``); torch's foreach AdamW makes ~``memfit.spec.optimizers.FOREACH_PASSES`` passes over the state, fused
   one. With offload the step runs on the CPU at ``CPU_BANDWIDTH`` and gradients go down and
   weights come up over PCIe (ZeRO-Offload, Ren et al. 2021); offloading the parameters also streams
   the half-precision weights up over PCIe on every pass of every micro-batch.
6. **Collectives** with ``num_processes > 1`` (``planning.internode``: ring volumes per sharding, at the
   GPU-to-GPU link within a node and at the slower of it and the node's network across ``--nodes``):
   DDP all-reduces gradients once per step (Accelerate's ``accumulate`` skips the sync in between);
   ZeRO-2 reduce-scatters gradients per micro-batch and all-gathers weights after the step; FSDP /
   ZeRO-3 also all-gather the weights for forward and again for backward on every micro-batch; hybrid
   does FSDP's within a node and all-reduces the gradient shards across nodes.

Ignored (absorbed in ``MATMUL_EFFICIENCY``): norms, activations, softmax and other elementwise
kernels, the data loader, the Python overhead beyond launches. Expected accuracy: the absolute
tokens/s within about 2x of a measured run; the ranking is what matters, and it follows the terms above.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memfit.memory.activations import Precisions, layer_activations
from memfit.memory.preference_terms import pair_forward_run, reference_policy
from memfit.planning.gpus import GPU
from memfit.planning.internode import comm_seconds, gradient_bytes
from memfit.settings.config import DType, Offload, Precision, Quantize, RunConfig
from memfit.spec.engines import shard_group_size
from memfit.spec.losses import loss_impl
from memfit.spec.optimizers import row
from memfit.units import GB, dtype_bytes

#: Fraction of the dense peak that transformer matmuls reach in training (model FLOPs utilisation).
#: 0.45 is typical of well-fed Hugging Face training on A100/H100 (PaLM reports 46% MFU; nanoGPT ~40-50%).
MATMUL_EFFICIENCY = 0.45
#: Fraction of datasheet bandwidth that streaming kernels reach (STREAM-like copies get 80-90%).
BANDWIDTH_EFFICIENCY = 0.8
#: LLM.int8 matmuls with outlier decomposition run at about half the speed of bf16 (Dettmers et al. 2022
#: report 15-40% slower inference for large models, more for small ones; training is worse).
INT8_SLOWDOWN = 0.5
#: Bytes moved per logit element: bf16 logits written and read, fp32 upcast, softmax, fp32 grad, cast back.
LOGIT_BYTES = 20
#: Kernels per decoder layer for forward + backward (a Llama layer: ~20 forward, ~40 backward).
KERNELS_PER_LAYER = 60
#: Extra kernels per LoRA-wrapped projection per micro-batch (A, B, scale, add forward; ~6 backward).
KERNELS_PER_LORA_MODULE = 10
#: Seconds per kernel launch (CUDA launch + PyTorch dispatch, eager mode).
LAUNCH_S = 5e-6
#: Kernels per parameter tensor of a per-parameter (optimizer-in-backward) AdamW step (torch's
#: single-tensor path: ~10 elementwise ops), each paying ``LAUNCH_S``.
KERNELS_PER_PARAM_STEP = 10
#: Host memory bandwidth for an offloaded optimizer step (a workstation's DDR4/DDR5, bytes/s).
CPU_BANDWIDTH = 50 * GB


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by term (all ranks run in parallel; numbers are per rank)."""

    compute: float
    memory: float
    launch: float
    optimizer: float
    offload: float
    comm: float
    tokens_per_step: int

    @property
    def seconds(self) -> float:
        return self.compute + self.memory + self.launch + self.optimizer + self.offload + self.comm

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over all processes."""
        return self.tokens_per_step / self.seconds

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "seconds": self.seconds, "tokens_per_s": self.tokens_per_s}


def matmul_params(spec) -> tuple[int, int]:
    """``(N, N_layers)``: parameters in matmuls (decoder projections + head), and those in the layers."""
    layers = spec.linear_params
    return layers + spec.vocab_size * spec.hidden_size, layers


def flops_per_token(spec, run: RunConfig) -> float:
    """Training FLOPs per token (see the module docstring, item 1)."""
    n, n_layers = matmul_params(spec)
    attn = 4 * spec.num_layers * spec.num_heads * spec.head_dim * run.seq_len  # forward, per token
    forward = 2 * n + attn
    backward = 2 * n + 2 * attn  # input gradients (attention has no weights: all its backward is here)
    if run.is_lora():
        backward += 4 * spec.lora_params(run)  # adapters: forward is in 2N's rounding, backward 4 N_lora
    else:
        backward += 2 * n  # weight gradients
    recompute = 2 * n_layers + attn if run.grad_checkpointing else 0
    return float(forward + backward + recompute)


def _weight_bytes_per_pass(spec, run: RunConfig) -> float:
    """Bytes read (and written, for casts and dequantisation) per parameter per pass, times parameters."""
    n, _ = matmul_params(spec)
    half = run.compute_dtype() in ("bf16", "fp16")
    read = n * (2 if half else 4)
    if run.quantize is Quantize.Q4:
        read += spec.linear_params * (0.5 + 2)
    elif run.quantize is Quantize.Q8:
        read += spec.linear_params * (1 + 2)
    return read


def micro_batch_seconds(spec, run: RunConfig, gpu: GPU) -> tuple[float, float, float]:
    """``(compute, memory, launch)`` seconds of one micro-batch's forward + backward (items 1-4)."""

    policy = reference_policy(run)
    run = pair_forward_run(run)  # a preference method: 2B sequences (chosen and rejected) per forward
    tokens = run.micro_batch * run.seq_len
    half = run.compute_dtype() in ("bf16", "fp16")
    peak = gpu.flops(half) * MATMUL_EFFICIENCY * (INT8_SLOWDOWN if run.quantize is Quantize.Q8 else 1.0)
    compute = tokens * flops_per_token(spec, run) / peak

    passes = 3 if run.grad_checkpointing else 2
    forwards = passes - 1
    traffic = passes * _weight_bytes_per_pass(spec, run)
    if run.mixed_precision is not Precision.NO and run.dtype is DType.FP32:
        traffic += forwards * matmul_params(spec)[0] * (4 + 2)  # autocast's cast of fp32 weights
    if not run.is_lora():
        traffic += 2 * spec.params * dtype_bytes(run.dtype)  # gradient accumulate: read + write
    traffic += tokens * spec.vocab_size * LOGIT_BYTES
    if policy is not None:  # DPO's reference forward: per step, or once before training (the same FLOPs and
        compute += tokens * 2 * matmul_params(spec)[0] / peak  # weight reads per epoch, amortised over one)
        traffic += _weight_bytes_per_pass(spec, run)
    memory = traffic / (gpu.bytes_per_s("device") * BANDWIDTH_EFFICIENCY)
    # Chunked/CCE recompute each chunk's logits in backward: one more head matmul (memfit.spec.losses.LOSSES).
    compute += tokens * 2 * spec.hidden_size * spec.vocab_size * loss_impl(run).extra_head_matmuls / peak

    kernels = KERNELS_PER_LAYER * (4 / 3 if run.grad_checkpointing else 1) * spec.num_layers
    if run.is_lora():
        kernels += KERNELS_PER_LORA_MODULE * sum(lin.count for lin in spec.lora_linears(run.lora.targets))
    return compute, memory, kernels * LAUNCH_S


def optimizer_bytes(run: RunConfig) -> float:
    """Bytes read + written per trainable parameter by one optimizer step: the ``traffic`` of the
    optimizer's row in ``memfit.spec.optimizers`` (AdamW ``(2p + g + 4s) x passes``: param r/w, grad r, two
    moments r/w, ``s`` the state bytes, ``FOREACH_PASSES`` for foreach; SGD without momentum ``2p + g``;
    Adafactor ``3p + g``), with ``p`` the parameter's bytes (LoRA adapters are fp32, PEFT's default).
    """
    p = 4 if run.is_lora() else dtype_bytes(run.dtype)
    return float(row(run.optimizer).traffic(p))


def _shard_divisor(run: RunConfig) -> int:
    return shard_group_size(run)


def step_seconds_once(spec, run: RunConfig, gpu: GPU) -> tuple[float, float, float]:
    """``(optimizer, offload, comm)`` seconds paid once per optimizer step and per micro-batch extras."""
    trainable = spec.trainable_params(run) / _shard_divisor(run)
    opt_bytes = trainable * optimizer_bytes(run)
    grad_b = gradient_bytes(run)
    offload = 0.0
    if run.offload is Offload.ACTIVATIONS:
        offload = _activation_offload_seconds(spec, run, gpu)
    if run.offload in (Offload.NONE, Offload.ACTIVATIONS):
        optimizer = opt_bytes / (gpu.bytes_per_s("device") * BANDWIDTH_EFFICIENCY)
    else:
        optimizer = opt_bytes / CPU_BANDWIDTH
        offload = trainable * (grad_b + 2) / (gpu.bytes_per_s("host") * BANDWIDTH_EFFICIENCY)
    if run.offload is Offload.PARAMS:
        passes = 3 if run.grad_checkpointing else 2
        streamed = passes * spec.params * 2 * run.grad_accum  # half weights up, every pass, every micro-batch
        offload += streamed / (gpu.bytes_per_s("host") * BANDWIDTH_EFFICIENCY)
    if run.optimizer_in_backward:  # the same bytes, stepped one tensor at a time
        optimizer += _trainable_tensors(spec, run) * KERNELS_PER_PARAM_STEP * LAUNCH_S
    return optimizer, offload, comm_seconds(spec, run, gpu, grad_b)


def _trainable_tensors(spec, run: RunConfig) -> int:
    """Trainable tensors (LoRA: A and B per adapted projection; full: 2 norms + projections per layer + 3)."""
    if run.is_lora():
        return 2 * sum(lin.count for lin in spec.lora_linears(run.lora.targets))
    return sum(lin.count for lin in spec.linears) + 2 * spec.num_layers + 3


def _activation_offload_seconds(spec, run: RunConfig, gpu: GPU) -> float:
    """``--offload activations``: every saved tensor goes down to pinned host memory in forward and up
    in backward, per micro-batch, over PCIe (not overlapped with compute here: pessimistic)."""

    saved = layer_activations(spec, run, Precisions.of(run), "cuda").all_layers
    return run.grad_accum * 2 * saved / (gpu.bytes_per_s("host") * BANDWIDTH_EFFICIENCY)


def step_time(spec, run: RunConfig, gpu: GPU) -> StepTime:
    """Seconds of one optimizer step of ``run`` on ``gpu`` (all terms; see the module docstring)."""
    compute, memory, launch = micro_batch_seconds(spec, run, gpu)
    optimizer, offload, comm = step_seconds_once(spec, run, gpu)
    k = run.grad_accum
    return StepTime(compute=k * compute, memory=k * memory, launch=k * launch, optimizer=optimizer,
                    offload=offload, comm=comm, tokens_per_step=run.tokens_per_step())
