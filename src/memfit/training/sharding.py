"""Sharded training (``--sharding fsdp|zero3|zero2``) on PyTorch FSDP2, and its checkpoints.

**Engine.** Every sharding runs on FSDP2 (``torch.distributed.fsdp.fully_shard``):
``fsdp`` and ``zero3`` shard parameters, gradients and optimizer state and free the gathered
parameters after each layer's forward (``reshard_after_forward=True``); ``zero2`` keeps them
gathered from forward to backward (``False``: ZeRO-2's memory for parameters, one all-gather per
layer fewer). Auto-wrap is per transformer layer (the model's ``_no_split_modules``, i.e. each
decoder layer), then the root. DeepSpeed is not used (not a dependency); an Accelerate config that
asks for it is refused.

**Two ways to the same FSDP2.**

- GPU: Accelerate's FSDP plugin (``FullyShardedDataParallelPlugin(fsdp_version=2, ...)``);
  ``accelerator.prepare`` shards the model and re-points the optimizer at the sharded parameters.
- CPU (gloo): Accelerate 1.15 turns an FSDP request on CPU into DDP (``MULTI_CPU``), and forcing its
  state to FSDP breaks ``save_state``. So on CPU memfit applies ``fully_shard`` itself, *before*
  the optimizer is built (the optimizer then holds the sharded DTensor parameters), and passes only
  the optimizer and scheduler to ``accelerator.prepare``. The loop is otherwise the same:
  ``accelerator.accumulate``/``backward``/``clip_grad_norm_`` (DTensor-aware) and the token
  normalisation of ``training.step`` (FSDP2 averages gradients over ranks like DDP does).

**Checkpoints** of sharded runs are written with ``torch.distributed.checkpoint`` (DCP) on both
devices: each rank writes its shards of model and optimizer state (``dcp/``), and Accelerate's
``save_accelerator_state`` writes the scheduler and each rank's RNG. DCP reshards on load, so a
sharded checkpoint resumes on any number of ranks of a sharded run; it cannot be resumed by an
unsharded (DDP or single-process) run.

**Export** gathers the full state dict (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``, a collective: every rank takes part, rank 0 receives it) and loads it into a
plain, unsharded copy of the model built on rank 0's CPU, which the normal export and sample
generation then use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from memfit.config import Offload, Precision, RunConfig, Sharding
from memfit.errors import UserError

DCP_DIR = "dcp"
SHARDED_MARKER = "sharded.json"


def is_sharded(run: RunConfig) -> bool:
    return run.sharding is not Sharding.DDP


def reshard_after_forward(run: RunConfig) -> bool:
    """ZeRO-3/FSDP free the gathered parameters after each layer's forward; ZeRO-2 keeps them."""
    return run.sharding is not Sharding.ZERO2


def check_run(run: RunConfig, *, cuda: bool) -> None:
    """Refuse, in one sentence, a sharding/offload combination no engine here runs (before any launch work)."""
    if run.offload is not Offload.NONE and not is_sharded(run):
        raise UserError(f"--offload {run.offload} runs under FSDP2 only; add --sharding fsdp (or zero2/zero3) "
                        "and launch 2 or more processes.")
    if run.offload is Offload.OPTIMIZER:
        raise UserError("FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy); "
                        "use --offload params, or --offload none.")
    if is_sharded(run) and not cuda and run.mixed_precision is not Precision.NO:
        raise UserError("Sharded training on CPU runs in fp32; use --mixed-precision no (or train on a GPU).")
    if is_sharded(run) and run.quantize.value != "none" and not cuda:
        raise UserError("--quantize needs a CUDA GPU.")


def check_launch(run: RunConfig, num_processes: int, env: dict | None = None) -> None:
    """The launch must provide what the flags ask: >= 2 processes for sharding, and an Accelerate
    config (seen through the ``ACCELERATE_*``/``FSDP_*`` variables ``accelerate launch`` sets) that
    agrees with ``--sharding``/``--offload``."""
    env = os.environ if env is None else env
    flag = str(run.sharding)
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise UserError("The Accelerate config asks for DeepSpeed, which memfit does not run (it is not installed "
                        f"here); use a config with distributed_type FSDP (fsdp_version 2) and --sharding {flag}.")
    if is_sharded(run) and num_processes < 2:
        raise UserError(f"--sharding {flag} needs 2 or more processes, but 1 was launched; start it with "
                        f"`accelerate launch --num_processes 2 -m memfit train ...` or torchrun --nproc_per_node 2, "
                        "or use --sharding ddp.")
    config_fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if config_fsdp and not is_sharded(run):
        raise UserError("The Accelerate config asks for FSDP but --sharding is ddp; pass --sharding fsdp "
                        "(or zero2/zero3), or launch with a config without FSDP.")
    if not config_fsdp:
        return
    if env.get("FSDP_VERSION", "2") != "2":
        raise UserError("The Accelerate config asks for FSDP version 1; memfit runs FSDP2: set fsdp_version: 2.")
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD")
    if reshard is not None and _truthy(reshard) != reshard_after_forward(run):
        raise UserError(f"The Accelerate config sets fsdp_reshard_after_forward: {reshard} but --sharding {flag} "
                        f"means {reshard_after_forward(run)}; make them agree (zero2 = false, fsdp/zero3 = true).")
    offload = env.get("FSDP_OFFLOAD_PARAMS")
    if offload is not None and _truthy(offload) != (run.offload is Offload.PARAMS):
        raise UserError(f"The Accelerate config sets fsdp_offload_params: {offload} but --offload is {run.offload}; "
                        "make them agree.")


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "y", "on")


def accelerator_kwargs(run: RunConfig, *, cuda: bool) -> dict:
    """``Accelerator(**kwargs)`` for a sharded run on GPU: Accelerate's FSDP2 plugin. Nothing on CPU
    (where Accelerate would fall back to DDP; see the module docstring)."""
    if not (cuda and is_sharded(run)):
        return {}
    from accelerate.utils import FullyShardedDataParallelPlugin

    return {"fsdp_plugin": FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=reshard_after_forward(run),
        auto_wrap_policy="transformer_based_wrap", cpu_offload=run.offload is Offload.PARAMS,
        state_dict_type="SHARDED_STATE_DICT")}


def shards_itself(accelerator, run: RunConfig) -> bool:
    """True where memfit applies ``fully_shard`` (a sharded run Accelerate does not shard: CPU)."""
    from accelerate.utils import DistributedType

    return is_sharded(run) and accelerator.distributed_type is not DistributedType.FSDP


def shard_model(model, run: RunConfig, accelerator):
    """CPU: FSDP2 on each transformer layer, then the root (call before building the optimizer).
    Elsewhere the model is returned untouched (Accelerate's ``prepare`` shards it)."""
    if not shards_itself(accelerator, run):
        return model
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy(pin_memory=False) if run.offload is Offload.PARAMS else OffloadPolicy()
    kwargs = {"reshard_after_forward": reshard_after_forward(run), "offload_policy": offload}
    layer_types = _layer_types(model)
    for module in list(model.modules()):
        if isinstance(module, layer_types):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    del torch
    return model


def _layer_types(model) -> tuple[type, ...]:
    """The decoder-layer classes (transformers' ``_no_split_modules``, also on a PEFT-wrapped model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    found = tuple({type(m) for m in base.modules() if type(m).__name__ in names})
    if not found:
        raise UserError(f"{type(base).__name__} names no transformer layer class (_no_split_modules) to shard by.")
    return found


def prepare(accelerator, run: RunConfig, model, optimizer, scheduler):
    """``accelerator.prepare``, leaving a model memfit sharded itself out (Accelerate would wrap it in DDP)."""
    if shards_itself(accelerator, run):
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        return model, optimizer, scheduler
    return accelerator.prepare(model, optimizer, scheduler)


class _ModelAndOptimizer:
    """DCP ``Stateful``: the sharded model and optimizer state dicts (torch's distributed state_dict API)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # unwrap Accelerate's AcceleratedOptimizer


def state_saver(accelerator, run: RunConfig, model, optimizer, scheduler) -> Callable[[str], None] | None:
    """What writes a checkpoint's training state into a folder: ``None`` (Accelerate's ``save_state``)
    for unsharded runs, DCP for sharded ones."""
    if not is_sharded(run):
        return None

    def save(folder: str) -> None:
        import json

        import torch.distributed.checkpoint as dcp
        from accelerate.checkpointing import save_accelerator_state

        dcp.save({"app": _ModelAndOptimizer(model, _inner(optimizer))}, checkpoint_id=str(Path(folder) / DCP_DIR))
        save_accelerator_state(folder, [], [], [scheduler], [], accelerator.process_index, accelerator.step)
        if accelerator.is_main_process:
            (Path(folder) / SHARDED_MARKER).write_text(json.dumps(
                {"sharding": str(run.sharding), "num_processes": accelerator.num_processes}))

    return save


def state_loader(accelerator, run: RunConfig, model, optimizer, scheduler) -> Callable[[str], None]:
    """What restores a checkpoint folder into the prepared objects; refuses a sharded checkpoint for an
    unsharded run and the other way round, in one sentence."""

    def load(folder: str) -> None:
        saved_sharded = (Path(folder) / SHARDED_MARKER).is_file()
        if saved_sharded and not is_sharded(run):
            raise UserError(f"{folder} is a sharded (FSDP) checkpoint; resume it with --sharding fsdp/zero2/zero3 "
                            "on 2 or more processes.")
        if is_sharded(run) and not saved_sharded:
            raise UserError(f"{folder} was saved by an unsharded run; resume it with --sharding ddp.")
        if not is_sharded(run):
            accelerator.load_state(folder)
            return
        import torch.distributed.checkpoint as dcp
        from accelerate.checkpointing import load_accelerator_state

        dcp.load({"app": _ModelAndOptimizer(model, _inner(optimizer))}, checkpoint_id=str(Path(folder) / DCP_DIR))
        load_accelerator_state(folder, [], [], [scheduler], [], accelerator.process_index)

    return load


def gathered_model(accelerator, run: RunConfig, model, build_plain: Callable[[], object]):
    """The model to export and sample from: ``model`` itself when unsharded; when sharded, on rank 0 a
    plain copy built by ``build_plain()`` holding the gathered full weights (``None`` on other ranks).

    Collective for sharded runs: every rank must call it.
    """
    if not is_sharded(run):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not accelerator.is_main_process:
        return None
    plain = build_plain()
    plain.load_state_dict(full)
    return plain
