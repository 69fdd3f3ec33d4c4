"""``memfit train --budget``: let the planner choose the run settings, then train with them."""

from __future__ import annotations

from typing import Any

from memfit.builder import optim_in_backward
from memfit.errors import NoCandidatesError, NothingFitsError, UserError
from memfit.integrations import quant_support
from memfit.planning.gpus import detect_gpu
from memfit.planning.search import plan
from memfit.planning.space import Constraints
from memfit.report.runs import describe
from memfit.settings.config import Quantize, RunConfig, TrainConfig
from memfit.spec.model import source_spec
from memfit.training.setup import cuda_available, preflight
from memfit.units import fmt_count, fmt_gib

# Settings that define the effective batch or the launch, not a choice the planner is bound by.
_NOT_PINNED = {"micro_batch", "grad_accum", "num_processes", "seq_len"}


def constraints_for(config: TrainConfig, run: RunConfig) -> dict[str, Any]:
    """The planner's constraints (train-flag names): what the user typed, plus what is trained.

    The planner ranks by speed only, so what changes *what is trained* is pinned: a full fine-tune
    unless the user gave ``--lora-r`` (then LoRA at that rank), and ``--dtype``/``--mixed-precision``
    only when typed (``config.pinned``). memfit train runs DDP without offload, and quantization where
    bitsandbytes runs (``memfit.integrations.quant_support.runs_on``: CUDA, or the CPU from bitsandbytes 0.50). The effective batch and the sequence length are passed to the planner separately.
    """

    flat = run.to_flat()  # by key (lora_r), values plain (enums' names)
    pinned = {k: flat[k] for k in config.pinned if k in flat and k not in _NOT_PINNED}
    if "lora_r" not in pinned and run.quantize is Quantize.NONE:
        pinned["lora_r"] = 0  # no --lora-r: a full fine-tune, as without --budget
    pinned.setdefault("sharding", "ddp")
    return {**pinned, "allow_offload": False, "allow_quantize": quant_support.runs_on("cuda" if cuda_available() else "cpu")}


#: Pinned first on a CPU, each unless the user typed it: memfit train's own CPU default (fp32 weights, no
#: autocast). CPUs without bf16 matrix units (AVX512-BF16, AMX) run torch's bf16 matmuls emulated:
#: ``python bench/cpu_precision.py`` (the tiny preset, 8 x 128 tokens, one thread, interleaved, best of 3) on
#: this project's 2-core AMD EPYC (AVX2) gave 0.89 s per step in fp32, 13.5 s in pure bf16 and 13.7 s under
#: bf16 autocast (15x), while the planner's speeds are a GPU's, where bf16 is the faster. A budget that no fp32
#: plan fits is planned again unpinned.
CPU_PRECISION = {"dtype": "fp32", "mixed_precision": "no"}


def plan_run(config: TrainConfig, run: RunConfig) -> tuple[RunConfig, Any]:
    """The fastest planned configuration that fits ``config.budget`` and that this machine can train.

    The effective batch (``run.effective_batch()``: the user's micro-batch x accumulation x processes,
    or ``--batch``) and the sequence length are kept. With CUDA present the plans are ranked for the
    device found (``detect_gpu``: fp16 instead of bf16 on a T4 or V100, its speed); without, the budget
    is this CPU's memory (``plan(..., cpu=True)``: CPU kernels, no CUDA context or allocator reserve, the
    rollback snapshot counted; speeds of the planner's reference GPU), and fp32 plans come first
    (``CPU_PRECISION``, but for a precision flag the user typed). A budget test that relied on the
    CUDA context to make a tiny model not fit (64 MiB) fits on CPU: its smallest plan needs a few MiB. Plans this machine cannot run (CUDA-only
    features on a CPU) are passed over: the first trainable one in rank order is taken.

    Raises:
        NothingFitsError: the planner's sentence (smallest peak reached, smallest GPU that holds it).
    """

    flat = constraints_for(config, run)
    gpu = detect_gpu() if cuda_available() else None
    pins = cpu_pins(config, cuda=gpu is not None)
    if pins:
        try:
            return _plan_once(config, run, {**flat, **pins}, gpu)
        except (NothingFitsError, NoCandidatesError, NoTrainablePlan):
            pass  # no fp32 plan fits, none is planned (QLoRA's regimes autocast) or none trains: bf16 allowed
    return _plan_once(config, run, flat, gpu)


def cpu_pins(config: TrainConfig, cuda: bool) -> dict[str, str]:
    """What ``plan_run`` pins first: on a CPU, each of ``CPU_PRECISION`` the user did not type."""
    return {} if cuda else {k: v for k, v in CPU_PRECISION.items() if k not in config.pinned}


class NoTrainablePlan(UserError):
    """Plans fit, but each needs what this machine lacks (CUDA-only features on a CPU)."""


def _plan_once(config: TrainConfig, run: RunConfig, flat: dict[str, Any], gpu) -> tuple[RunConfig, Any]:
    """``plan_run`` under the constraints ``flat`` (train-flag keys): the first fitting plan this machine trains."""

    spec = source_spec(config.source)  # a Hub id: its pinned commit
    result = plan(spec, config.budget, seq_len=run.seq_len, batch=run.effective_batch(),
                  num_processes=run.num_processes, gpu=gpu, constraints=Constraints.from_flat(flat),
                  cpu=gpu is None, method=run.method, nodes=run.nodes)  # no CUDA: the budget is this CPU's memory
    refusal = None
    for index, candidate in enumerate(result.plans):
        if not candidate.fits:
            break
        try:
            preflight(candidate.config)
            optim_in_backward.check(candidate.config, config.optim.max_grad_norm)  # e.g. it cannot clip
        except UserError as err:
            refusal = refusal or str(err).rstrip(".")
            continue
        result.chosen = index
        return candidate.config.replace(num_processes=run.num_processes, nodes=run.nodes), result
    # The fastest fitting plan's refusal, which was "the fitting ones need CUDA-only features" whatever it was
    # (a 124 M GPT-2 in 1 GiB fits only with --optimizer-in-backward, which cannot clip at the default norm)
    raise NoTrainablePlan(f"No plan that fits {config.budget} can be trained on this machine (the fastest is "
                          f"refused: {refusal}); try a larger --budget.")


def plan_record(config: TrainConfig, result) -> dict[str, Any]:
    """What ``run.json`` keeps of the plan: the budget, the device ranked for, the chosen plan, one line."""

    chosen = result.best
    return {"budget": config.budget, "budget_bytes": int(result.budget_bytes),
            "safety_margin": result.safety_margin, "gpu": result.gpu.name if result.gpu else None,
            "candidates": len(result.plans), "fitting": len(result.fitting), "chosen": chosen.to_dict(),
            "description": describe(chosen.config)}


def plan_line(config: TrainConfig, result, cuda: bool) -> str:
    """The one line shown before training: the chosen plan, its predicted peak and speed."""

    record = plan_record(config, result)
    pins, chosen = cpu_pins(config, cuda), result.best.config.to_flat()
    first = ("" if not pins else "; fp32 plans first on a CPU" if all(chosen[k] == v for k, v in pins.items())
             else "; the planner has no fp32 plan that fits")
    speed_on = record["gpu"] if cuda else f"{record['gpu']} (the planner's reference: no CUDA device here{first})"
    picked = record["chosen"]  # the fit rule's need (every phase's reserved memory + context), where priced
    need = (f"predicted need {fmt_gib(picked['needed_bytes'])} ({picked['worst_phase']})" if "needed_bytes" in picked
            else f"predicted peak {fmt_gib(picked['peak_bytes'])}")
    return (f"plan for {config.budget}: {record['description']}; {need} of {fmt_gib(record['budget_bytes'])}, "
            f"~{fmt_count(record['chosen']['tokens_per_s'])} tokens/s on {speed_on}; "
            f"fastest of {record['fitting']} fitting plans")
