"""Small builders for a training run: preflight checks, Accelerator, model, data, optimizer, scheduler.

Each builder does one job with the library that owns it (Accelerate, transformers, PEFT, torch);
``train.loop`` wires them together.

Size: ``build_model`` is over 60 lines because it carries the load options of every model source
(preset, folder, Hub snapshot, quantized base) through one ``from_pretrained``/``from_config`` call.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from memfit.builder import parts as build
from memfit.data import dataset as data
from memfit.data.pairs import load_pair_rows, prompt_example
from memfit.data.prep import data_note, load_for_run, run_tokenizer
from memfit.errors import UserError
from memfit.files import user_path
from memfit.integrations import hub, quant_support
from memfit.integrations.hf_compat import no_loading_bar
from memfit.integrations.hub import HubModel
from memfit.integrations.quant_support import (
    accept_own_quant_state,
    bnb_config,
    keep_training_path,
    logical_numel,
    quantized_copy,
)
from memfit.integrations.trackers import check_tracker
from memfit.memory.host_loading import LoadedFrom
from memfit.settings import validate
from memfit.settings.config import DType, Method, Precision, Quantize, RunConfig, TrainConfig
from memfit.settings.defaults import default_lr
from memfit.spec import model as modelspec
from memfit.spec.losses import check_loss_runnable, check_model_supports
from memfit.spec.model import ModelSpec
from memfit.spec.optimizers import check_device, row
from memfit.spec.resolved import ResolvedRun, resolve
from memfit.training import deepspeed_engine, sharding
from memfit.training.weights import check_weights, loading
from memfit.units import DTYPE_BYTES, dtype_bytes


def cuda_available() -> bool:
    return torch.cuda.is_available()


def default_precision() -> Precision:
    """What a run uses when the user did not choose: bf16 autocast on a GPU that supports it, else none."""

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return Precision.BF16
    return Precision.NO


def preflight(run: RunConfig) -> None:
    """Refuse, in one sentence, what cannot work on this machine before anything is built."""
    cuda = cuda_available()
    validate.check_attention_available(run.attn_implementation)
    if run.mixed_precision is Precision.FP16 and run.dtype is DType.FP16 and not run.is_lora():
        raise UserError("fp16 mixed precision cannot train weights stored in fp16 (the loss scaler cannot unscale "
                        "fp16 gradients); use --dtype fp32, or --mixed-precision bf16 where the device supports it.")
    if run.mixed_precision is Precision.FP16 and not cuda:
        raise UserError("fp16 mixed precision needs a CUDA GPU (Accelerate runs no loss scaler on CPU); "
                        "use --mixed-precision bf16 on this machine.")
    if cuda and Precision.BF16 in (run.mixed_precision, run.dtype) and not _bf16_ok():
        raise UserError("This GPU does not support bf16; use --mixed-precision fp16 with --dtype fp32.")

    if run.quantize is not Quantize.NONE:
        quant_support.check("cuda" if cuda else "cpu", f"--quantize {run.quantize}")
    if row(run.optimizer).needs_bitsandbytes:
        quant_support.check("cuda" if cuda else "cpu", f"--optimizer {run.optimizer.value}")
    if str(run.offload) == "activations" and not cuda:
        raise UserError("--offload activations moves saved tensors to pinned CPU memory, which only helps (and "
                        "only runs) on a CUDA GPU; drop it on this machine.")

    check_loss_runnable(run, cuda)

    check_device(run.optimizer, "cuda" if cuda else "cpu")

    sharding.check_run(run, cuda=cuda)


def _bf16_ok() -> bool:
    return torch.cuda.is_bf16_supported()


def build_accelerator(run: RunConfig, config: TrainConfig):
    """``Accelerator`` with memfit's choices.

    ``sync_with_dataloader=False``: a step's micro-batches are fetched before they are run, so the
    loader may be exhausted while the step is still accumulating; the step counter alone decides
    when gradients sync. ``step_scheduler_with_optimizer=False``: the loop steps the scheduler once per
    optimizer step itself (Accelerate would step it ``num_processes`` times), and not after an fp16
    step the scaler skipped.
    """

    check_tracker(config.tracker)  # before anything is built: a missing package is one sentence
    # One process may train twice (tests, --check-equivalence): forget the previous run's precision.
    AcceleratorState._reset_state()
    GradientState._reset_state()

    cuda = cuda_available()
    kwargs = {"cpu": not cuda, **sharding.accelerator_kwargs(run, cuda=cuda)}  # DeepSpeed on CPU: cpu=False, gloo
    with deepspeed_engine.without_cpu_flag():
        accelerator = Accelerator(
            mixed_precision=str(run.mixed_precision),
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=run.grad_accum,
                                                                    sync_with_dataloader=False),
            log_with=config.tracker,
            project_dir=config.folder.output,
            step_scheduler_with_optimizer=False,
            # --compile: Accelerate's prepare() wraps the model in torch.compile (inductor)
            dynamo_backend="inductor" if run.compile else None,
            **kwargs,
        )
    sharding.check_launch(run, accelerator.num_processes)
    deepspeed_engine.build_models_whole(accelerator)  # no deepspeed.zero.Init under transformers
    return accelerator


@dataclass
class ModelBundle:
    """The built model (checkpointing and LoRA applied, not yet prepared by Accelerate) and what the run reports of it."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    random_init: bool
    """Built from a config (preset or config.json) with random weights, not loaded from a checkpoint."""
    trainable_params: int
    params: int
    uses_model_loss: bool
    """The model's forward accepts ``num_items_in_batch`` (transformers' loss kwargs)."""
    attention: str = ""
    """The attention implementation the built model runs (read back from its config)."""
    lora_targets: tuple[str, ...] = ()
    """Last name components of the projections PEFT wrapped (empty for a full fine-tune)."""
    experts: str = ""
    """The experts kernel the built model runs (read back from its config; empty without MoE layers)."""


@dataclass
class ResolvedModel:
    """What a run's model is, resolved before anything heavy is built or any folder is written."""

    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    random_init: bool
    """A preset or a bare config.json: the architecture only, built with random weights."""
    resolved: ResolvedRun | None = None
    """``memfit.spec.resolved.ResolvedRun``: the LoRA modules, attention and optimizer row estimate also uses."""
    path: Path | None = None
    """The local folder the weights and tokenizer load from: ``--model``, or a Hub model's cached snapshot."""
    hub: HubModel | None = None
    """``memfit.integrations.hub.HubModel`` when ``--model`` is a Hub id (the id, the commit, the snapshot folder)."""
    spec: ModelSpec | None = None
    """The ``ModelSpec`` every prediction of the run reads (resolved once, here)."""

    @property
    def base_name(self) -> str | None:
        """What a LoRA adapter names as its base: the Hub id, or the folder as an absolute path, so the adapter
        loads from any directory; None for random weights (the export saves them next to the adapter)."""
        if self.random_init or self.path is None:
            return None
        return self.hub.repo_id if self.hub is not None else str(self.path.resolve())

    @property
    def loaded_from(self) -> LoadedFrom:
        """What a quantized base's loading on a CPU holds (``memory.host_loading``): random weights, or a checkpoint
        in the dtype its config.json names (``save_pretrained`` writes the weights' own; a dtype memfit does not
        price, or none: ``--dtype``)."""
        if self.random_init:
            return LoadedFrom(random=True)
        name = str(getattr(self.hf_config, "dtype", None)).removeprefix("torch.")
        return LoadedFrom(dtype=name if name in DTYPE_BYTES else None)


def fetch_hub_model(config: TrainConfig, *, progress: bool = True):
    """``(config, HubModel)`` for a Hub ``--model`` (org/name), ``(config, None)`` for presets and folders.

    The snapshot is fetched into the Hugging Face cache once, before the run folder exists (a failed
    download leaves nothing there), with the weights only safetensors unless ``--allow-pickle-weights``.
    ``config.source.revision`` is pinned to the commit it resolved to: checkpoints save it, so ``--resume`` builds
    the same base, offline from the cache. ``progress``: huggingface_hub's bars on stderr (a terminal only).
    """

    source = config.source
    hub.check_revision(source.model, source.revision)
    if modelspec.is_preset(source.model) or not hub.is_hub_id(source.model):
        return config, None
    files = "tokenizer" if source.init == "random" else "model"  # random weights: the config and tokenizer only
    with hub.progress_bars(progress):
        model = hub.fetch(source.model, source.revision, files=files, allow_pickle=source.allow_pickle_weights,
                          trust_remote_code=source.trust_remote_code)
    return config.replace(revision=model.commit), model


def resolve_model(config: TrainConfig, run: RunConfig, hub_model=None) -> ResolvedModel:
    """The model's transformers config and the tokenizer, checked against the run (seq-len, vocabulary).

    Cheap (no weights read), so the loop calls it before it creates the output folder: a bad ``--model``,
    ``--tokenizer`` or ``--seq-len`` leaves nothing behind. ``hub_model``: the snapshot ``fetch_hub_model``
    resolved a Hub id to (fetched here when not given).
    """

    if hub_model is None:
        config, hub_model = fetch_hub_model(config)
    source = config.source
    folder = hub_model.path if hub_model is not None else user_path(source.model)
    hf_config = modelspec.source_config(source)
    modelspec.check_seq_len(run.seq_len, getattr(hf_config, "max_position_embeddings", None))
    tokenizer = run_tokenizer(source, hub_model)
    validate.check_tokenizer_fits(len(tokenizer), hf_config.vocab_size)
    hf_config.use_cache = False  # training: no KV cache
    random_init = modelspec.is_preset(source.model) or folder.is_file() or source.init == "random"
    if not random_init:
        check_weights(folder)  # a config-only folder or truncated weights: one sentence
    # The same resolution estimate and trace use: bad LoRA targets or an attention the model cannot run
    # are refused here, before the output folder exists.
    spec = modelspec.source_spec(source)
    _check_buildable(spec, run)
    return ResolvedModel(hf_config, tokenizer, random_init, resolve(spec, run), path=folder, hub=hub_model, spec=spec)


def _check_buildable(spec, run: RunConfig) -> None:
    """The weights in the dtype (or quantization) they are built in must fit this machine (``validate.check_buildable``)."""

    per_param = {Quantize.Q4: 0.5, Quantize.Q8: 1.0}.get(run.quantize, dtype_bytes(str(run.dtype)))
    what = str(run.dtype) if run.quantize is Quantize.NONE else str(run.quantize)
    validate.check_buildable(spec.name, spec.params, per_param, what)


def build_model(config: TrainConfig, run: RunConfig, source: ResolvedModel | None = None,
                device=None, *, empty: bool = False) -> ModelBundle:
    """The causal LM (preset with random weights, or a local checkpoint), with checkpointing and LoRA.

    ``device``: a CUDA device builds the model there directly (random init under ``torch.device``,
    checkpoints with ``device_map``), which for a 1.5 B model saves building it in CPU memory and
    copying it over; ``None`` or a CPU device builds on the CPU (Accelerate's ``prepare`` moves it).
    ``empty``: the architecture only, parameters on the meta device (buffers real; Accelerate's
    ``init_empty_weights``), no weights read: a rank that receives its shards from rank 0
    (``training.sharding.builds_empty``).
    """

    source = source or resolve_model(config, run)
    resolved = source.resolved
    on_gpu = device is not None and torch.device(device).type == "cuda"
    kwargs = build.model_kwargs(run, resolved.attention, resolved.experts)
    torch.manual_seed(config.seed)  # presets: the same random init on every rank and every run
    if source.random_init or empty:
        def random_model():
            with init_empty_weights() if empty else torch.device(device) if on_gpu else contextlib.nullcontext():
                return AutoModelForCausalLM.from_config(source.hf_config,
                                                        trust_remote_code=config.source.trust_remote_code, **kwargs)

        if run.quantize is not Quantize.NONE:  # from_config cannot quantize: saved, dropped, loaded quantized
            model = quantized_copy(random_model, run, device=device if on_gpu else None)
        else:
            model = random_model()
    else:
        if run.quantize is not Quantize.NONE:
            kwargs["quantization_config"] = bnb_config(run)
        if on_gpu:
            kwargs["device_map"] = {"": torch.device(device)}
        if source.hub is not None and not config.source.allow_pickle_weights:
            kwargs["use_safetensors"] = True  # a pickle another tool cached next to them is never unpickled

        with loading(source.path), no_loading_bar():
            model = AutoModelForCausalLM.from_pretrained(source.path, config=source.hf_config, local_files_only=True,
                                                         trust_remote_code=config.source.trust_remote_code, **kwargs)
    if run.quantize is not Quantize.NONE:
        accept_own_quant_state(model)  # --resume: a strict load of the checkpoint's 4-bit quantization state
        keep_training_path(model)  # evaluation and samples on training's path: bitsandbytes' CPU one fails late
    # Checkpointing, LoRA and training mode: the steps --exact's trace takes too (memfit.builder.parts).
    model = build.adapt(model, run, resolved.lora.peft_targets if run.is_lora() else (),
                        revision=source.hub.commit if source.hub is not None else None)
    if run.is_lora():
        _name_base(model, source.base_name)
    if str(run.loss) != "standard":
        check_model_supports(model)  # a head chunked CE can use, and a forward that can skip the logits
    uses_model_loss = _accepts_loss_kwargs(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    total = sum(logical_numel(p) for p in model.parameters())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    wrapped = tuple(sorted({name.rsplit(".", 1)[-1] for name, module in base.named_modules() if hasattr(module, "lora_A")}))
    experts = str(base.config._experts_implementation) if resolved.experts else ""
    return ModelBundle(model, source.tokenizer, source.random_init, trainable, total, uses_model_loss,
                       str(base.config._attn_implementation), wrapped, experts)


def _name_base(wrapped, base: str | None) -> None:
    """What the saved adapter names as its base model (``ResolvedModel.base_name``; the Hub commit is given
    at the wrap). PEFT would take the path the weights were loaded from, which for a relative ``--model``
    only resolves from the directory train ran in."""
    if base is not None:
        for cfg in wrapped.peft_config.values():
            cfg.base_model_name_or_path = base


def _accepts_loss_kwargs(model) -> bool:
    """Whether the model computes its loss with ``num_items_in_batch`` (the rule transformers' Trainer uses:
    an explicit ``accepts_loss_kwargs`` attribute, else a ``**kwargs`` in ``forward``).

    Every model built on transformers' ``GenericForCausalLM``/``ForCausalLMLoss`` (Llama, Qwen2/3,
    Mistral, Gemma, Phi-3, GPT-NeoX and most others in transformers 5) does; for the rest memfit
    computes the same loss from the logits with ``transformers.loss.loss_utils.ForCausalLMLoss``.
    """

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclass
class DataBundle:
    """Tokenized training and held-out sequences, the unigram baseline, and the held-out documents."""

    train: list[dict]
    eval: list[dict]
    unigram: float
    prompt_docs: list
    """Documents whose beginnings prompt the end-of-run samples: held-out ``Example`` records (training
    ones when nothing is held out), evenly spread over the corpus."""
    note: str = ""
    """A line for the user before training: packing, padding share, conversations dropped."""


def build_data(config: TrainConfig, run: RunConfig, tokenizer) -> DataBundle:
    """Load, check and tokenize the data (every data error surfaces here, before the output folder exists)."""

    if run.method is not Method.SFT:
        return _pair_data(config, run, tokenizer)
    examples, tokenized = load_for_run(config, run, tokenizer)
    train_idx, held = data.split_indices(len(examples), config.eval_fraction, config.seed)  # tokenize's split
    count = max(config.cadence.samples, config.cadence.eval_samples)
    docs = [examples[int(i)] for i in spread(held if len(held) else train_idx, count)]

    return DataBundle(tokenized.train, tokenized.eval, data.unigram_loss(tokenized), docs,
                      note=data_note(tokenized, run, config.truncate))


def _pair_data(config: TrainConfig, run: RunConfig, tokenizer) -> DataBundle:
    """The preference pairs of ``--method dpo|orpo|simpo`` (``memfit.data.pairs``): one row per pair."""

    pairs, train, held_rows, held = load_pair_rows(config, run, tokenizer)
    if not train:
        raise UserError(f"The data {config.data} yields no training pair.")
    count = max(config.cadence.samples, config.cadence.eval_samples)
    picked = spread(list(held) if len(held) else list(range(len(pairs))), count)
    docs = [prompt_example(pairs[int(i)]) for i in picked]
    unigram = data.unigram_loss(data.TokenizedData(train=train, eval=held_rows))
    note = (f"{len(pairs):,} preference pair(s), {run.method}: each micro-batch of B pairs is one forward of 2B "
            "sequences (chosen, then rejected), loss on the completions")
    return DataBundle(train, held_rows, unigram, docs, note=note)


def spread(items: list, count: int) -> list:
    """``count`` items evenly spaced over ``items`` (all of them when there are fewer): documents from
    all over the corpus (e.g. both files of a data folder), not only from the first file."""
    if count <= 0:
        return []
    if count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def build_optimizer(model, run: RunConfig, config: TrainConfig):
    """The optimizer named by ``run.optimizer`` over the trainable parameters, in weight-decay groups
    (``memfit.builder.parts``, which --exact's trace calls too). ``sgd`` is plain SGD without momentum (no state);
    torch picks the implementation for the device the parameters are on."""
    lr = config.optim.lr
    if lr is None:  # a library caller that builds without a session (which derives it): the method's default
        lr = default_lr(random_init=False, lora=run.is_lora())[0]
    return build.make_optimizer(run, build.parameter_groups(model, config.optim.weight_decay), lr)


def build_scheduler(optimizer, config: TrainConfig, total_steps: int):
    """Linear warmup then cosine decay to 0 over the run (transformers' schedule)."""
    # imported here: transformers.optimization imports transformers.trainer_utils, which imports PEFT and with it
    # bitsandbytes (13 s in all; python -X importtime, 2026-12-06), whose import-time notice must come inside the
    # run's quiet_import_notices (training.loop.built)
    from transformers import get_cosine_schedule_with_warmup

    warmup = min(config.optim.warmup_steps, max(total_steps - 1, 0))
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
