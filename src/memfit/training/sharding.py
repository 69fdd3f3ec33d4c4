"""Sharded training (``--sharding fsdp|zero3|zero2``) on PyTorch FSDP2, and its checkpoints.

**Engine.** Every sharding runs on FSDP2 (``torch.distributed.fsdp.fully_shard``):
``fsdp`` and ``zero3`` shard parameters, gradients and optimizer state and free the gathered
parameters after each layer's forward (``reshard_after_forward=True``); ``zero2`` keeps them
gathered from forward to backward (``False``: ZeRO-2's memory for parameters, one all-gather per
layer fewer). Auto-wrap is per transformer layer (the model's ``_no_split_modules``, i.e. each
decoder layer), then Accelerate's extra units (input embedding; final norm + output head, kept
gathered between forward and backward), then the root. Under a DeepSpeed launch (an Accelerate config
with ``distributed_type: DEEPSPEED``, DeepSpeed installed) ``zero2``/``zero3`` run on DeepSpeed ZeRO-2/3
instead: ``training.deepspeed_engine``, whose hooks below are marked "DeepSpeed".

**Two ways to the same FSDP2.**

- GPU: Accelerate's FSDP plugin (``FullyShardedDataParallelPlugin(fsdp_version=2, ...)``);
  ``accelerator.prepare`` shards the model and re-points the optimizer at the sharded parameters.
- CPU (gloo): Accelerate 1.15 turns an FSDP request on CPU into DDP (``MULTI_CPU``), and forcing its
  state to FSDP breaks ``save_state``. So on CPU memfit calls Accelerate's own ``fsdp2_prepare_model``
  (same units, same plugin) through a small holder of the plugin, *before* the optimizer is built (the optimizer then holds the sharded DTensor parameters), and passes only
  the optimizer and scheduler to ``accelerator.prepare``. The loop is otherwise the same:
  ``accelerator.accumulate``/``backward``/``clip_grad_norm_`` (DTensor-aware) and the token
  normalisation of ``training.step`` (FSDP2 averages gradients over ranks like DDP does).

**Checkpoints** of sharded runs are written with ``torch.distributed.checkpoint`` (DCP) on both
devices: each rank writes its shards of model and optimizer state (``dcp/``), and Accelerate's
``save_accelerator_state`` writes the scheduler and each rank's RNG. DCP reshards on load, so a
sharded checkpoint resumes on any number of ranks of a sharded run; it cannot be resumed by an
unsharded (DDP or single-process) run.

**QLoRA**: a 4-bit base is sharded like any frozen weight, its packed bytes stored as the compute dtype
(``quant_support.shards_packed_weights``); an 8-bit base is refused (``engines.quantized_refusal``).

**Export** gathers the full state dict (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``, a collective: every rank takes part, rank 0 receives it) and loads it into a
plain, unsharded copy of the model built on rank 0's CPU, which the normal export and sample
generation then use.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    gather_object,
)
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from memfit.errors import UserError
from memfit.memory.host_loading import LoadedFrom
from memfit.memory.outside import outside_step
from memfit.settings.config import Offload, Quantize, RunConfig
from memfit.spec.engines import deepspeed_requested, is_sharded, refusal, reshard_after_forward
from memfit.spec.model import load_spec
from memfit.training import deepspeed_engine, multinode
from memfit.units import fmt_bytes

DCP_DIR = "dcp"
SHARDED_MARKER = "sharded.json"


def check_run(run: RunConfig, *, cuda: bool) -> None:
    """Refuse, in one sentence, a sharding/offload combination no engine here runs (before any launch work)."""
    reason = refusal(run, cuda=cuda)
    if reason:
        raise UserError(reason)


def check_launch(run: RunConfig, num_processes: int, env: dict | None = None) -> None:
    """The launch must provide what the flags ask: >= 2 processes for sharding, and an Accelerate
    config (seen through the ``ACCELERATE_*``/``FSDP_*`` variables ``accelerate launch`` sets) that
    agrees with ``--sharding``/``--offload``."""
    env = os.environ if env is None else env
    flag = str(run.sharding)
    use_deepspeed = deepspeed_requested(env)
    if use_deepspeed:
        deepspeed_engine.check_launch(run, env)
    multinode.refuse_one_of_several(num_processes, env)
    if is_sharded(run) and num_processes < 2:
        raise UserError(f"--sharding {flag} needs 2 or more processes, but 1 was launched; start it with "
                        f"`accelerate launch --num_processes 2 -m memfit train ...` or torchrun --nproc_per_node 2, "
                        "or use --sharding ddp.")
    config_fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if use_deepspeed:
        return
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


def fsdp2_plugin(run: RunConfig, *, cuda: bool, ram_efficient: bool = False):
    """Accelerate's FSDP2 plugin for ``run``: transformer-layer auto-wrap (``_no_split_modules``),
    ``reshard_after_forward`` from the sharding, CPU offload of parameters (with their gradients and
    optimizer state) for ``--offload params``; pinned host memory only where there is a GPU."""

    offload = CPUOffloadPolicy(pin_memory=cuda) if run.offload is Offload.PARAMS else OffloadPolicy()
    extra = {"cpu_ram_efficient_loading": True} if ram_efficient else {}
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=reshard_after_forward(run), auto_wrap_policy="transformer_based_wrap",
        cpu_offload=offload, state_dict_type="SHARDED_STATE_DICT", **extra)


def accelerator_kwargs(run: RunConfig, *, cuda: bool) -> dict:
    """``Accelerator(**kwargs)``: for a sharded run on GPU, Accelerate's FSDP2 plugin (nothing on CPU,
    where Accelerate would fall back to DDP; see the module docstring); for an unsharded run, DDP with
    ``gradient_as_bucket_view=True``. DeepSpeed: ``deepspeed_engine.accelerator_kwargs``.

    Why bucket views: torch's DDP ``Reducer`` allocates flat bucket buffers the size of all trainable
    gradients when DDP is built and, with ``gradient_as_bucket_view=False`` (the default of torch and of
    Accelerate's ``DistributedDataParallelKwargs``), copies every gradient into its bucket to all-reduce
    it and back, so the buckets and ``param.grad`` are two copies of the gradients. With views each
    ``param.grad`` is a view into its bucket (the gradient autograd accumulated is copied in once and
    freed), one copy in all (``memory.states.ddp_bucket_bytes``). Accelerate passes the kwargs to
    ``DistributedDataParallel`` in ``prepare_model`` (only on 2+ processes; ignored otherwise). The sum is
    the same, so the weights are too (tests/test_train_dp.py: 2 processes within 1e-6 of 1).
    """
    if deepspeed_requested():
        return deepspeed_engine.accelerator_kwargs(run, cuda=cuda)
    if is_sharded(run):  # hybrid on 2+ nodes: Accelerate's ParallelismConfig builds HSDP's 2-D mesh (multinode)
        hybrid = multinode.hybrid_parallelism(run) if cuda else None
        return {"fsdp_plugin": fsdp2_plugin(run, cuda=True), **({"parallelism_config": hybrid} if hybrid else {})} \
            if cuda else {}

    return {"kwargs_handlers": [DistributedDataParallelKwargs(gradient_as_bucket_view=True)]}


def shards_itself(accelerator, run: RunConfig) -> bool:
    """True where memfit applies FSDP2 itself (a sharded run Accelerate does not shard: CPU; DeepSpeed shards its own)."""

    return is_sharded(run) and accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)


@dataclass
class _PluginHolder:
    """The few attributes of an ``Accelerator`` that Accelerate's ``fsdp2_prepare_model`` reads.

    The shim that lets CPU runs use Accelerate's own FSDP2 wrapping (the same units as on GPU: each
    decoder layer, the input embedding, [final norm, output head] kept gathered, then the root)
    without switching the real Accelerator's state to FSDP (which breaks ``save_state`` on CPU).
    """

    fsdp_plugin: object
    is_main_process: bool
    mixed_precision: str = "no"
    torch_device_mesh: object = None  # --sharding hybrid: the 2-D mesh and Accelerate's ParallelismConfig naming it
    parallelism_config: object = None
    device: str = "cpu"
    """Where ``cpu_ram_efficient_loading`` re-registers the non-persistent buffers (rotary ``inv_freq``)."""

    @property
    def state(self):
        return self


def builds_empty(accelerator, run: RunConfig) -> bool:
    """Whether this rank builds its model without weights (parameters on the meta device): the ranks
    other than 0 of a run memfit shards itself, which receive their shards from rank 0 in ``shard_model``
    (Accelerate's ``cpu_ram_efficient_loading``), so no rank but 0 ever holds the whole model.
    Not a quantized base: Accelerate skips that broadcast for ``Params4bit`` models, so every rank
    quantizes the same weights itself (``quant_support.quantized_copy``) and keeps its shard of them."""
    return not accelerator.is_main_process and weight_holders(accelerator, run) == 1


def filled_from_rank0(module, accelerator, run: RunConfig):
    """``module``, a copy of the model made before sharding (DPO's frozen reference), with rank 0's weights on
    every rank: the ranks that built the model empty (``builds_empty``) copied meta tensors, so they
    materialise the copy and receive each tensor from rank 0, one broadcast per tensor (parameters and
    buffers, in the same order on every rank). Elsewhere ``module`` is returned as it is."""
    if weight_holders(accelerator, run) == accelerator.num_processes:
        return module

    if not accelerator.is_main_process:
        module = module.to_empty(device=accelerator.device)
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)
    return module


def weight_holders(accelerator, run: RunConfig) -> int:
    """How many ranks build the model with its weights during setup: 1 (rank 0) where the others build it
    empty (``builds_empty``), else every rank."""
    return 1 if shards_itself(accelerator, run) and run.quantize is Quantize.NONE else accelerator.num_processes


def shard_model(model, run: RunConfig, accelerator):
    """CPU: FSDP2 through Accelerate's ``fsdp2_prepare_model`` (call before building the optimizer).
    Elsewhere the model is returned untouched (``accelerator.prepare`` shards it).

    With Accelerate's ``cpu_ram_efficient_loading`` (FSDP2's form of ``sync_module_states``): every rank's
    model goes to the meta device and is sharded there, then rank 0 broadcasts its full weights one tensor
    at a time and each rank keeps its shard (``fsdp2_load_full_state_dict``). Ranks > 0 built theirs empty
    (``builds_empty``), so only rank 0 holds a full model during setup, and every rank ends with rank 0's
    weights (the same as before for a preset's seeded random init or a checkpoint).
    """
    if not shards_itself(accelerator, run):
        return model

    _layer_types(model)  # a model without decoder-layer classes: one sentence, not Accelerate's ValueError
    parallelism, mesh = multinode.hybrid_mesh(run, "cpu")  # None, None unless hybrid on 2+ nodes
    holder = _PluginHolder(fsdp2_plugin(run, cuda=False, ram_efficient=True), accelerator.is_main_process,
                           torch_device_mesh=mesh, parallelism_config=parallelism)
    with multinode.quiet_mesh_slicing():
        return fsdp2_prepare_model(holder, model)


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


def reshard_all(model) -> None:
    """Free every FSDP2 unit's gathered parameters (``FSDPModule.reshard``); nothing for other models.

    After a no-grad forward (evaluation) units with ``reshard_after_forward=False`` (``--sharding zero2``,
    and the tail unit of every sharding) stay gathered, as no backward comes to reshard them: measured on
    the tiny preset, ZeRO-2 on 2 CPU ranks, every layer's parameters (+25 MB) still held by the save that
    follows. The next forward gathers them again as it would anyway.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class _ModelAndOptimizer:
    """DCP ``Stateful``: the sharded model and optimizer state dicts (torch's distributed state_dict API)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # unwrap Accelerate's AcceleratedOptimizer


def state_saver(accelerator, run: RunConfig, model, optimizer, scheduler,
                state_dict: str = "sharded") -> Callable[[str], None] | None:
    """What writes a checkpoint's training state into a folder: ``None`` (Accelerate's ``save_state``)
    for unsharded runs; for sharded ones DCP (``state_dict="sharded"``) or the full state gathered on
    rank 0 into the files an unsharded run writes (``"full"``)."""
    if state_dict not in ("sharded", "full"):
        raise UserError(f"--state-dict must be sharded or full, not {state_dict!r}.")
    if deepspeed_engine.active(accelerator):  # DeepSpeed: Accelerate's save_state, DeepSpeed's format
        return deepspeed_engine.state_saver(accelerator, run)
    if not is_sharded(run):
        return None
    if state_dict == "full":
        return lambda folder: _save_full(folder, accelerator, model, optimizer, scheduler)

    def save(folder: str) -> None:
        dcp.save({"app": _ModelAndOptimizer(model, _inner(optimizer))}, checkpoint_id=str(Path(folder) / DCP_DIR))
        save_accelerator_state(folder, [], [], [scheduler], [], accelerator.process_index, accelerator.step)
        if accelerator.is_main_process:
            (Path(folder) / SHARDED_MARKER).write_text(json.dumps(
                {"sharding": str(run.sharding), "num_processes": accelerator.num_processes}))

    return save


class _Given:
    """Hands a ready state dict to Accelerate's ``save_accelerator_state`` (which calls ``.state_dict()``)."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def _save_full(folder: str, accelerator, model, optimizer, scheduler) -> None:
    """A sharded run's full checkpoint: the files ``accelerator.save_state`` writes for one process.

    ``get_state_dict(full_state_dict=True, cpu_offload=True)`` (a collective) gathers model and optimizer
    state to rank 0's CPU; rank 0 writes them with Accelerate's ``save_accelerator_state``
    (``model.safetensors``, ``optimizer.bin`` in torch's own numbering, ``scheduler.bin``), every rank its
    RNG file. An unsharded run resumes it with ``accelerator.load_state``; a sharded one with
    ``_load_full`` (any number of ranks).
    """

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, _inner(optimizer), options=options)
    main = accelerator.is_main_process
    Path(folder).mkdir(parents=True, exist_ok=True)  # save_state makes it; save_accelerator_state does not
    # OrderedDict: Accelerate's save then drops a tied weight's second name, as safetensors requires
    save_accelerator_state(folder, [OrderedDict(model_sd)] if main else [],
                           [_Given(_by_index(optim_sd))] if main else [],
                           [scheduler], [], accelerator.process_index, accelerator.step)


def _by_index(optim_sd: dict) -> dict:
    """torch.distributed's optimizer state dict (keyed by parameter name) in ``Optimizer.state_dict()``'s
    numbering: parameters counted from 0 across the param groups, in group order (what a plain
    optimizer built by ``training.setup.build_optimizer`` over the same model has)."""
    order = [name for group in optim_sd["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {"state": {index[name]: value for name, value in optim_sd["state"].items()},
            "param_groups": [{**group, "params": [index[n] for n in group["params"]]}
                             for group in optim_sd["param_groups"]]}


def _by_name(optim_sd: dict, model, optimizer) -> dict:
    """``Optimizer.state_dict()``'s numbering back to parameter names, for ``set_state_dict``: number
    ``i`` is the ``i``-th parameter of ``optimizer``'s groups (the same build order on every run)."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[int(i)]: value for i, value in optim_sd["state"].items()},
            "param_groups": [{**group, "params": [order[int(i)] for i in group["params"]]}
                             for group in optim_sd["param_groups"]]}


def _load_full(folder: str, accelerator, model, optimizer, scheduler) -> None:
    """A full checkpoint (an unsharded run's, or a sharded run's ``--state-dict full``) into a sharded run
    on any number of ranks: every rank reads the full files and ``set_state_dict(full_state_dict=True)``
    keeps its own shard of each tensor; then the scheduler and this rank's RNG (a rank the saving run
    did not have keeps its own: Accelerate skips a missing RNG file)."""

    opt = _inner(optimizer)
    model_sd = load_file(str(Path(folder) / "model.safetensors"))
    optim_sd = torch.load(Path(folder) / "optimizer.bin", map_location="cpu", weights_only=True)
    # an unsharded run's checkpoint keeps one name of a tied pair (safetensors keeps one name per storage);
    # a sharded run's full checkpoint holds both (tests/test_shard_tied.py). torch 2.13's set_state_dict
    # already accepts one name for a shared parameter (the test passes with strict=True too): the
    # non-strict load for tied models is a margin for other torch versions.
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=_by_name(optim_sd, model, opt),
                   options=StateDictOptions(full_state_dict=True, strict=not tied))
    load_accelerator_state(folder, [], [], [scheduler], [], accelerator.process_index)


def state_loader(accelerator, run: RunConfig, model, optimizer, scheduler) -> Callable[[str], None]:
    """What restores a checkpoint folder into the prepared objects. A full checkpoint (no DCP shards)
    loads into any run; a sharded one only into a sharded run (DCP reshards it onto any number of
    ranks); an unsharded run given a sharded checkpoint is refused in one sentence."""

    def load(folder: str) -> None:
        deepspeed = deepspeed_engine.active(accelerator)
        deepspeed_engine.check_resumable(folder, run, getattr(accelerator, "num_processes", 1), deepspeed=deepspeed)
        if deepspeed:
            accelerator.load_state(folder)
            return
        saved_sharded = (Path(folder) / SHARDED_MARKER).is_file()
        if saved_sharded and not is_sharded(run):
            raise UserError(f"{folder} is a sharded (FSDP) checkpoint, which only a sharded run can resume: resume "
                            "it with --sharding fsdp/zero2/zero3 on 2 or more processes (save with --state-dict "
                            "full to resume on any number of processes).")
        if not is_sharded(run):
            accelerator.load_state(folder)
            return
        if not saved_sharded:
            _load_full(folder, accelerator, model, optimizer, scheduler)
            return

        dcp.load({"app": _ModelAndOptimizer(model, _inner(optimizer))}, checkpoint_id=str(Path(folder) / DCP_DIR))
        load_accelerator_state(folder, [], [], [scheduler], [], accelerator.process_index)

    return load


def gathered_model(accelerator, run: RunConfig, model, build_plain: Callable[[], object]):
    """The model to export and sample from: ``model`` itself (unwrapped) when unsharded; when sharded, on rank 0 a
    plain copy built by ``build_plain()`` holding the gathered full weights (``None`` on other ranks).

    Collective for sharded runs: every rank must call it.
    """
    if not is_sharded(run):
        return accelerator.unwrap_model(model, keep_torch_compile=False)  # DDP's wrapper has no generate(): samples need the model
    if deepspeed_engine.active(accelerator):
        full = deepspeed_engine.full_state_dict(accelerator, model)
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not accelerator.is_main_process:
        return None
    plain = build_plain()
    plain.load_state_dict(full)
    return plain


def per_rank_line(model_name, run: RunConfig, predicted, device: str = "cuda", why: str = "",
                  loaded_from: LoadedFrom | None = None) -> str:
    """The preamble's prediction: the step's peak and the peaks outside it, "per rank" only where there
    is more than one (several processes, or a sharded run); one process says "predicted peak". ``loaded_from``:
    where a quantized base comes from (``memory.outside.outside_step``'s)."""

    several = run.num_processes > 1 or is_sharded(run)
    label = "predicted per-rank peak" if several else "predicted peak"
    if predicted is None:
        return f"{label}: n/a (estimator unavailable for this model{': ' + why if why else ''})"
    line = f"{label} {fmt_bytes(predicted.peak_bytes)} ({predicted.phase}"
    if several:
        # the prediction models the launch's engine (memory.deepspeed_layout under DeepSpeed): name it
        engine = " (DeepSpeed)" if is_sharded(run) and deepspeed_requested() else ""
        spread = f"{run.num_processes} processes" + (f" on {run.nodes} nodes" if run.nodes > 1 else "")
        line += f"; {run.sharding}{engine} over {spread}" if is_sharded(run) else f"; {spread}, unsharded"
    line += ")"
    try:
        outside = outside_step(load_spec(model_name), run, "cpu" if device == "cpu" else "cuda", loaded_from)
    except Exception:  # noqa: BLE001 - a prediction must never stop a training run
        return line
    line += f"; evaluation {fmt_bytes(outside.evaluation)}"
    if several:
        line += f", full-state save {fmt_bytes(outside.save_device)}"
    if outside.save_host:
        line += f" (+ {fmt_bytes(outside.save_host)} host RAM on rank 0)"
    return line


def rank_peaks(accelerator, peak_bytes: int) -> list[int]:
    """Every rank's measured peak, in rank order (a collective: all ranks call it)."""
    if accelerator.num_processes == 1:
        return [int(peak_bytes)]

    return [int(v) for v in gather_object([int(peak_bytes)])]


def stop_on_rank_oom(accelerator, step: int) -> None:
    """An out-of-memory error on one rank of several: stop with one sentence (a fallback that
    changes the micro-batch on one rank only would desynchronise the ranks' collectives and hang).
    The launcher (torchrun / accelerate launch) then ends the other ranks."""
    if accelerator.num_processes > 1:
        raise UserError(f"Rank {accelerator.process_index} ran out of memory at step {step}; all "
                        f"{accelerator.num_processes} ranks stop. Lower --micro-batch, turn on "
                        "--grad-checkpointing, or use --sharding fsdp (or more processes).")
