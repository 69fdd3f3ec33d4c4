"""Which engine runs a run's sharding, and what each engine refuses: rules about a run, read by
estimate (the layout it models), plan (it proposes only what train runs) and train (its preflight).

They live here, below ``memory/``, ``planning/`` and ``training/``, because all three read them and
``memory/`` and ``planning/`` never import ``training/``. The engines themselves (FSDP2 in
``training.sharding``, DeepSpeed in ``training.deepspeed_engine``) say why each rule holds.
"""

# Inside a function: accelerate.utils (accelerate: 2.5 s to import; python -X importtime, 2026-12-06, this shared 2-core machine): spec/ is on torch-free paths.
from __future__ import annotations

import os

from memfit.settings.config import DType, Loss, Offload, Optimizer, Precision, Quantize, RunConfig, Sharding

DEEPSPEED_STAGES = {Sharding.ZERO2: 2, Sharding.ZERO3: 3}
"""The DeepSpeed ZeRO stage each ``--sharding`` runs on under a DeepSpeed launch."""
DEEPSPEED_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.ADAMW_FOREACH)
"""torch's AdamW (single-tensor or foreach), which DeepSpeed steps on its flat fp32 partitions."""
DEEPSPEED_EXTRA = "pip install 'memfit[deepspeed]'"


def is_sharded(run: RunConfig) -> bool:
    return run.sharding is not Sharding.DDP


def shard_group_size(run: RunConfig) -> int:
    """Ranks each parameter, gradient and optimizer state is sharded over: every rank for ``fsdp``/``zero2``/
    ``zero3`` (across all nodes), the ranks of one node for ``hybrid`` (FSDP2's HSDP: a 2-D device mesh of
    ``nodes`` replicas x ``processes_per_node`` shards, ``training.multinode``), 1 for ``ddp`` (replicated)."""
    if run.sharding is Sharding.DDP:
        return 1
    return run.processes_per_node() if run.sharding is Sharding.HYBRID else run.num_processes


def replica_count(run: RunConfig) -> int:
    """How many full copies of the sharded states the ranks hold together: ``num_processes / shard_group_size``
    (``hybrid``: one per node; ``ddp``: one per rank; the others: one)."""
    return run.num_processes // shard_group_size(run)


def hybrid_refusal(run: RunConfig) -> str | None:
    """Why ``--sharding hybrid`` cannot run this layout (one sentence), or None. One process per node would
    shard nothing: FSDP2's HSDP then is plain replication, which Accelerate's ``ParallelismConfig`` refuses
    (``dp_shard_size`` 1 with ``dp_replicate_size`` > 1)."""
    if run.sharding is Sharding.HYBRID and 1 < run.nodes == run.num_processes:  # (1 process: left to the launch)
        return (f"--sharding hybrid shards within a node, but {run.nodes} nodes of 1 process each leave nothing to "
                "shard; run 2 or more processes per node, or use --sharding fsdp (or ddp).")
    return None


def reshard_after_forward(run: RunConfig) -> bool:
    """ZeRO-3/FSDP free the gathered parameters after each layer's forward; ZeRO-2 keeps them."""
    return run.sharding is not Sharding.ZERO2


def deepspeed_requested(env=None) -> bool:
    """Whether the launch asks for DeepSpeed (an Accelerate config with ``distributed_type: DEEPSPEED``)."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def estimator_engine(env=None) -> str:
    """The engine the estimator models for this launch (``memory.deepspeed_layout.ENGINES``): DeepSpeed's
    layout under a DeepSpeed launch, FSDP2's otherwise; read by train's prediction and its planner."""
    return "deepspeed" if deepspeed_requested(env) else "fsdp2"


def deepspeed_available() -> bool:
    from accelerate.utils import is_deepspeed_available

    return is_deepspeed_available()


def refusal(run: RunConfig, *, cuda: bool) -> str | None:
    """Why no engine here runs ``run``'s sharding/offload (one sentence), or None. Read by ``memfit train``'s
    preflight and by the planner, which proposes only what train runs."""
    if deepspeed_requested():  # DeepSpeed: what memfit runs under it (deepspeed_refusal)
        return deepspeed_refusal(run, cuda=cuda)
    if hybrid_refusal(run):
        return hybrid_refusal(run)
    if run.offload is Offload.ACTIVATIONS:
        return None  # saved tensors to host memory: any engine, CUDA only (training.setup.preflight)
    if run.offload is not Offload.NONE and not is_sharded(run):
        return (f"--offload {run.offload} runs under FSDP2 only; add --sharding fsdp (or zero2/zero3) "
                "and launch 2 or more processes.")
    if run.offload is Offload.OPTIMIZER:
        return ("FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy); "
                "use --offload params, or --offload none.")
    if run.offload is Offload.PARAMS and not reshard_after_forward(run):
        # The estimator's offload saving (weights off the device) does not hold for ZeRO-2.
        return ("--offload params with --sharding zero2 saves nothing at the peak (FSDP2 keeps every layer's "
                "gathered parameters on the device from forward to backward); use --sharding fsdp or zero3.")
    if is_sharded(run) and not cuda and run.mixed_precision is not Precision.NO:
        return "Sharded training on CPU runs in fp32; use --mixed-precision no (or train on a GPU)."
    if is_sharded(run) and run.quantize is Quantize.Q8:
        return quantized_refusal(run)
    return None


def quantized_refusal(run: RunConfig) -> str:
    """Why an 8-bit base is not sharded: FSDP2's ``fully_shard`` turns each parameter into a plain DTensor
    parameter, and bitsandbytes' ``Int8Params`` lose their row scales (``SCB``), which, unlike the 4-bit
    quantization state, no module keeps a copy of. A 4-bit base shards (``quant_support.shards_packed_weights``)."""
    return (f"--quantize 8bit cannot be combined with --sharding {run.sharding}: FSDP2 cannot shard bitsandbytes' "
            "8-bit weights (their row scales are lost); use --quantize 4bit, which shards, or --sharding ddp.")


def deepspeed_refusal(run: RunConfig, *, cuda: bool) -> str | None:
    """Why a DeepSpeed launch cannot run ``run`` here (one sentence), or None. Only what was tested runs:
    a full fine-tune with torch's AdamW, fp32 weights, no offload, the standard loss."""
    flag = str(run.sharding)
    if not deepspeed_available():
        return ("The Accelerate config asks for DeepSpeed, which is not installed; install the extra "
                f"({DEEPSPEED_EXTRA}) or launch with an FSDP config (memfit runs --sharding zero2|zero3 on FSDP2 without it).")
    if run.sharding not in DEEPSPEED_STAGES:
        return (f"The Accelerate config asks for DeepSpeed but --sharding is {flag}; pass --sharding zero2 or zero3 "
                "(DeepSpeed ZeRO-2/3), or launch with an FSDP config for --sharding fsdp or without one for ddp.")
    if run.is_lora() or run.quantize is not Quantize.NONE:
        return ("memfit runs DeepSpeed for full fine-tunes only (LoRA/QLoRA under DeepSpeed is untested); launch with "
                f"an FSDP config (fsdp_version 2) for LoRA with --sharding {flag}.")
    if run.optimizer_in_backward:
        return "--optimizer-in-backward cannot run under DeepSpeed, which steps the optimizer itself; drop the flag."
    if run.loss is not Loss.STANDARD:
        return f"--loss {run.loss} is untested under DeepSpeed; use --loss standard (or an FSDP config)."
    if run.offload is not Offload.NONE:
        return f"--offload {run.offload} is untested under DeepSpeed here; use --offload none (or an FSDP config)."
    if run.optimizer not in DEEPSPEED_OPTIMIZERS:
        return (f"--optimizer {run.optimizer} is untested under DeepSpeed; use "
                f"{' or '.join(str(o) for o in DEEPSPEED_OPTIMIZERS)}.")
    if run.dtype is not DType.FP32:
        return ("Under DeepSpeed the weights are given in fp32 (--dtype fp32): DeepSpeed keeps the fp32 master copy "
                "and makes its own bf16/fp16 copy from --mixed-precision.")
    if not cuda and run.mixed_precision is not Precision.NO:
        return "DeepSpeed on CPU runs in fp32; use --mixed-precision no (or train on a GPU)."
    return None
