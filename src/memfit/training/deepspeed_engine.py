"""DeepSpeed ZeRO-2/ZeRO-3 through Accelerate: an optional engine for ``--sharding zero2|zero3``.

**Who chooses it.** The launch, as everywhere in Accelerate: an Accelerate config with
``distributed_type: DEEPSPEED`` (``accelerate launch --config_file ds.yaml -m memfit train ...``), seen
by memfit as ``ACCELERATE_USE_DEEPSPEED=true`` plus the ``ACCELERATE_DEEPSPEED_*`` variables
``accelerate launch`` sets (with torchrun, set ``ACCELERATE_USE_DEEPSPEED=true`` yourself). memfit's
flags say the memory layout (``--sharding zero2|zero3``), the launch says the engine; without a
DeepSpeed launch, ``--sharding zero2|zero3`` runs on FSDP2 (``training.sharding``), the default. No
memfit flag: it would duplicate the Accelerate config, which must agree with the flags anyway.
``memfit plan`` never proposes DeepSpeed (it prints FSDP2 launches); under a DeepSpeed launch, what
DeepSpeed cannot run here is refused by ``engines.deepspeed_refusal``, read by ``engines.refusal`` (train's preflight
and the planner of ``memfit train --budget``).

**One config, from the run.** ``ds_config`` builds the whole DeepSpeed config from memfit's run
settings: micro-batch, accumulation steps, ``train_batch_size``, clipping (``--max-grad-norm``), the
ZeRO stage, bf16/fp16 from ``--mixed-precision`` (GPU; CPU runs fp32) and bucket sizes.
``configure`` puts it into Accelerate's ``DeepSpeedPlugin`` once the run is final (``--batch`` and
``--budget`` resolved); an Accelerate config that disagrees (stage, offload, accumulation, clipping,
a ``deepspeed_config_file``) is refused in one sentence before anything is written.

**The loop is memfit's.** ``accelerator.accumulate``/``backward`` as before: DeepSpeed's
``engine.backward`` divides the loss by its ``gradient_accumulation_steps`` and ZeRO averages
gradients over the data-parallel ranks, exactly what memfit's ``k x P`` loss scaling
(``training.step``) undoes for DDP and FSDP, so the token-normalised step is the same. DeepSpeed clips
and steps inside the last micro-batch's ``backward`` (Accelerate's ``DeepSpeedEngineWrapper``);
``optimizer.step()`` is then a no-op and ``clip_grad_norm_`` returns DeepSpeed's gradient norm.

**CPU (gloo).** Accelerate 1.15 ignores DeepSpeed when ``cpu=True`` (``AcceleratorState``: ``... and
not cpu``), and with ``cpu=False`` on a machine without a GPU ``PartialState._prepare_backend`` finds
no backend, so it lets DeepSpeed initialise torch.distributed but then records ``num_processes=1``,
``process_index=0`` on every rank (``if self.backend is None``), which would break data sharding and
every rank decision. Naming the backend with Accelerate's own ``InitProcessGroupKwargs(backend="gloo")``
fixes both: ``_prepare_backend`` keeps the named backend, DeepSpeed initialises gloo with it, and
PartialState reads rank and world size from torch.distributed. ``ACCELERATE_USE_CPU`` (which forces
``cpu=True``) is hidden while the Accelerator is built. On a GPU nothing is changed: the plain
Accelerate DeepSpeed path.

**Checkpoints** are Accelerate's ``save_state``/``load_state``, i.e. DeepSpeed's own format (each rank
its ZeRO partitions under ``pytorch_model/``), resumable on the same number of ranks with the same
stage (``deepspeed.json`` records them; a mismatch is refused in one sentence). **Export** gathers the
full weights with ``accelerator.get_state_dict`` (ZeRO-3: ``stage3_gather_16bit_weights_on_model_save``
is on in ``ds_config``; the gathered tensors have the module's dtype: fp32 on CPU, bf16/fp16 with
DeepSpeed's mixed precision on a GPU, where ``zero_to_fp32`` recovers the fp32 master weights from a
checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from accelerate.utils import DeepSpeedPlugin, DistributedType, InitProcessGroupKwargs
from transformers.integrations import unset_hf_deepspeed_config

from memfit.errors import UserError
from memfit.memory.deepspeed_layout import zero_sizes
from memfit.settings.config import Precision, RunConfig
from memfit.spec.engines import DEEPSPEED_STAGES, deepspeed_requested

MARKER = "deepspeed.json"
"""Written into each DeepSpeed checkpoint: the stage and rank count it can be resumed with."""


def active(accelerator) -> bool:
    """Whether ``accelerator`` runs DeepSpeed (its distributed type is ``DEEPSPEED``)."""

    return getattr(accelerator, "distributed_type", None) is DistributedType.DEEPSPEED


def check_launch(run: RunConfig, env=None) -> None:
    """The DeepSpeed variables ``accelerate launch`` sets from the Accelerate config must agree with the
    flags (called while the Accelerator is built; accumulation and clipping are checked by ``configure``)."""
    env = os.environ if env is None else env
    flag = str(run.sharding)
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None and run.sharding in DEEPSPEED_STAGES and stage.strip() != str(DEEPSPEED_STAGES[run.sharding]):
        raise UserError(f"The Accelerate config sets zero_stage: {stage} but --sharding {flag} means ZeRO stage "
                        f"{DEEPSPEED_STAGES[run.sharding]}; make them agree (zero2 = 2, zero3 = 3).")
    for key, what in (("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer_device"),
                      ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_param_device")):
        device = env.get(key, "none").strip().lower()
        if device not in ("", "none"):
            raise UserError(f"The Accelerate config sets {what}: {device}, but memfit runs DeepSpeed without offload "
                            f"(--offload {run.offload}); set it to none.")
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none") not in ("", "none"):
        raise UserError("The Accelerate config names a deepspeed_config_file, but memfit builds the DeepSpeed config "
                        "from its own flags; remove deepspeed_config_file and keep zero_stage in the config.")


def ds_config(run: RunConfig, *, max_grad_norm: float, hidden_size: int | None = None) -> dict:
    """The DeepSpeed config for ``run``: the one place it is written (``configure`` installs it).

    Bucket sizes: DeepSpeed's defaults (``reduce_bucket_size`` 5e8 elements, i.e. a 2 GB fp32 buffer per
    rank) dwarf a small model; these follow Accelerate's ``"auto"`` rule from the hidden size ``h``
    (``reduce_bucket_size = h^2``, ZeRO-3 prefetch ``0.9 h^2``, parameters of at most ``10 h``
    elements kept whole on every rank), the sizes Accelerate would fill in for a model it is given, from
    ``memory.deepspeed_layout.zero_sizes``: the numbers the estimator reads too.
    """

    stage = DEEPSPEED_STAGES[run.sharding]
    zero: dict = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False}
    if hidden_size:
        sizes = zero_sizes(hidden_size)
        zero["reduce_bucket_size"] = sizes.reduce_bucket_size
        zero["allgather_bucket_size"] = sizes.allgather_bucket_size
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = sizes.prefetch_bucket_size
            zero["stage3_param_persistence_threshold"] = sizes.param_persistence_threshold
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # the export gathers the full weights
    return {
        "train_micro_batch_size_per_gpu": run.micro_batch,
        "gradient_accumulation_steps": run.grad_accum,
        "train_batch_size": run.micro_batch * run.grad_accum * run.num_processes,
        "gradient_clipping": float(max_grad_norm) if max_grad_norm > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": run.mixed_precision is Precision.BF16},
        "fp16": {"enabled": run.mixed_precision is Precision.FP16},
        "zero_allow_untested_optimizer": True,  # memfit's torch optimizer, as Accelerate sets it too
        "steps_per_print": 2**31,  # no DeepSpeed progress lines under memfit's own
        "wall_clock_breakdown": False,
    }


def plugin(run: RunConfig):
    """Accelerate's ``DeepSpeedPlugin`` holding ``ds_config`` of the run as given (``configure`` replaces it with
    the final run's before ``prepare``). ``zero3_init_flag=False``: memfit builds the
    whole model on each rank and DeepSpeed partitions it in ``prepare`` (not under ``deepspeed.zero.Init``),
    so the same seeded build runs on every engine.

    ``accelerate launch --config_file`` exports the config's DeepSpeed fields (``zero_stage``, ...) and lists
    them in ``ACCELERATE_CONFIG_DS_FIELDS``; Accelerate refuses a full DeepSpeed config beside them
    (``DeepSpeedPlugin._deepspeed_config_checks``: a ValueError). ``check_launch`` holds those fields to the
    flags, and memfit's config is built from the same flags, so the list is dropped for this process.
    """

    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    return DeepSpeedPlugin(hf_ds_config=ds_config(run, max_grad_norm=0.0), zero3_init_flag=False)


def accelerator_kwargs(run: RunConfig, *, cuda: bool) -> dict:
    """``Accelerator(**kwargs)`` for a DeepSpeed launch: the plugin, and on CPU ``cpu=False`` with the gloo
    backend named (see the module docstring); on a GPU the plain Accelerate DeepSpeed path."""
    kwargs: dict = {"deepspeed_plugin": plugin(run), "cpu": False}
    if not cuda:
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return kwargs


def build_models_whole(accelerator) -> None:
    """Let transformers build models whole on every rank under DeepSpeed, as on every other engine.

    Selecting a ZeRO-3 plugin (``DeepSpeedPlugin.select``, when the Accelerator is made) registers its
    config with transformers whatever ``zero3_init_flag`` says (Accelerate 1.15's
    ``set_deepspeed_weakref``), and transformers then builds every model under ``deepspeed.zero.Init``,
    partitioned at construction: memfit's spec model, the run's model and the plain copy the export
    loads would all be partitioned, with the provisional batch config. Dropping that registration
    (transformers' ``unset_hf_deepspeed_config``) keeps model building engine-agnostic; DeepSpeed
    partitions the model in ``accelerator.prepare`` (with the final config, from ``configure``).
    Cost: each rank holds the whole model on its host until ``prepare``, like the FSDP2 path's rank 0.
    """
    if active(accelerator):
        unset_hf_deepspeed_config()


def partial_state_kwargs(cuda: bool) -> dict:
    """``PartialState(**kwargs)`` consistent with ``accelerator_kwargs`` (a state made before the
    Accelerator, e.g. to agree on an output folder, is the one the Accelerator then reuses)."""
    if deepspeed_requested() and not cuda:
        return {"cpu": False, "backend": "gloo"}
    return {"cpu": not cuda}


@contextlib.contextmanager
def without_cpu_flag() -> Iterator[None]:
    """Under a DeepSpeed launch, hide ``ACCELERATE_USE_CPU`` (which makes Accelerate drop DeepSpeed) while
    the Accelerator is built; otherwise nothing."""
    saved = os.environ.pop("ACCELERATE_USE_CPU", None) if deepspeed_requested() else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_CPU"] = saved


def configure(accelerator, run: RunConfig, config, hidden_size: int | None = None, env=None) -> None:
    """Install ``ds_config`` for the final run into the Accelerator's DeepSpeed plugin (before
    ``prepare``), after refusing an Accelerate config whose accumulation or clipping disagree."""
    if not active(accelerator):
        return
    env = os.environ if env is None else env
    gas = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if gas is not None and gas.isdigit() and int(gas) != run.grad_accum:
        raise UserError(f"The Accelerate config sets gradient_accumulation_steps: {gas} but the run accumulates "
                        f"{run.grad_accum} micro-batches per step; make them agree (or drop it from the config).")
    clip = env.get("ACCELERATE_GRADIENT_CLIPPING")
    if clip not in (None, "auto", "none") and float(clip) != float(config.optim.max_grad_norm):
        raise UserError(f"The Accelerate config sets gradient_clipping: {clip} but --max-grad-norm is "
                        f"{config.optim.max_grad_norm}; make them agree.")
    if config.checkpoints.state_dict != "sharded":
        raise UserError("--state-dict full is for FSDP2; DeepSpeed checkpoints are DeepSpeed's own partitioned "
                        "format (resumable on the same number of ranks): drop --state-dict.")
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds.clear()
    ds.update(ds_config(run, max_grad_norm=config.optim.max_grad_norm, hidden_size=hidden_size))


def state_saver(accelerator, run: RunConfig):
    """Accelerate's ``save_state`` (DeepSpeed's partitioned format), plus ``deepspeed.json``."""

    def save(folder: str) -> None:
        accelerator.save_state(folder)
        if accelerator.is_main_process:
            (Path(folder) / MARKER).write_text(json.dumps(
                {"stage": DEEPSPEED_STAGES[run.sharding], "num_processes": accelerator.num_processes}))

    return save


def check_resumable(folder: str, run: RunConfig, num_processes: int, *, deepspeed: bool) -> None:
    """A DeepSpeed checkpoint resumes only under DeepSpeed, with its stage and rank count; a DeepSpeed run
    resumes only a DeepSpeed checkpoint. One sentence otherwise."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        if deepspeed:
            raise UserError(f"{folder} was not written by DeepSpeed, so a DeepSpeed run cannot resume it; resume "
                            "it with the engine that wrote it (launch without the DeepSpeed config).")
        return
    saved = json.loads(marker.read_text())
    if not deepspeed:
        raise UserError(f"{folder} is a DeepSpeed checkpoint, which only a DeepSpeed launch can resume: use the "
                        "Accelerate config with distributed_type DEEPSPEED.")
    want = {"stage": DEEPSPEED_STAGES.get(run.sharding), "num_processes": num_processes}
    if saved != want:
        raise UserError(f"{folder} holds DeepSpeed ZeRO-{saved['stage']} partitions of {saved['num_processes']} "
                        f"ranks; resume it with the same stage and number of processes (this launch: "
                        f"ZeRO-{want['stage']}, {num_processes}).")


def full_state_dict(accelerator, model) -> dict:
    """The full weights gathered to rank 0 (a collective: every rank calls it; Accelerate's own path)."""
    return accelerator.get_state_dict(model)
