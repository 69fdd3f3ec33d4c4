"""A ``transformers.TrainerCallback`` (Trainer and TRL's trainers) that predicts the run's peak before the first
step, stops a run that cannot fit, and logs measured against predicted at the end.

    from memfit.interop.callback import attach
    trainer = SFTTrainer(model=model, args=args, train_dataset=data)
    attach(trainer, seq_len=512)          # or Trainer(..., callbacks=[MemfitCallback(seq_len=512)])
    trainer.train()

The prediction reads the run as ``estimate --from`` reads a TRL/Trainer file (``memfit.interop.trl``: the
same mapping, from ``args.to_dict()``), with what the live model says over it: its weight dtype, its PEFT
adapters, its quantization, its attention. Measured: the CUDA allocator's ``max_memory_allocated`` on a GPU,
memfit's tensor counter on real tensors on the CPU (``memfit.memory.measure.counted``: every storage live when
the measured step begins, plus every storage an operator creates, minus each one freed) over one steady-state
step (the third, or the last of a shorter run). Logged through ``trainer.log`` (its trackers) when attached
to the trainer, else into ``state.log_history``.

The callback never breaks the run it watches: what it cannot price (a model or setting memfit has no term for,
rows whose length it cannot find) is one logged warning, and the run goes on unwatched. Only a prediction that
does not fit the device stops it (``DoesNotFit``), before the first step.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from transformers import TrainerCallback

from memfit.errors import NothingFitsError, UserError
from memfit.interop import trl
from memfit.memory.estimate import estimate
from memfit.memory.measure import counted, reset_peak, resident_tensors
from memfit.planning.search import plan
from memfit.report.runs import describe
from memfit.spec.model import spec_from_config
from memfit.units import fmt_gib, parse_size

#: The step measured on the CPU: the first creates the optimizer state, so the third is a steady-state step.
MEASURED_STEP = 3

LOG = logging.getLogger("memfit")

#: TRL's preference trainers and configs (by class name) -> memfit's method (``--method``).
PREFERENCE_CLASSES = {"DPOTrainer": "dpo", "DPOConfig": "dpo", "ORPOTrainer": "orpo", "ORPOConfig": "orpo",
                      "CPOTrainer": "cpo", "CPOConfig": "cpo"}


class DoesNotFit(UserError):
    """The run's predicted peak does not fit the device (or the budget given)."""


class MemfitCallback(TrainerCallback):
    """Predict before the first step, refuse what cannot fit, log measured vs predicted at the end.

    Args:
        seq_len: tokens per row of the training batches; default: the first batch's (the dataset's first rows as
            the trainer's collator batches them), else ``args.max_length`` (TRL).
        budget: memory to fit in (bytes or ``"24GiB"``); default: the GPU's memory (no check on the CPU).
        trainer: the trainer whose ``log`` reports the figures (``attach`` sets it).
        full_rows: the rows hold no padding (fixed-length or packed rows), so transformers builds no padding mask
            (memfit's ``concat`` rows); False: batches are padded to their longest row and carry a (B, 1, T, T)
            mask (memfit's ``none`` packing, priced at ``seq_len``: an upper bound).
    """

    def __init__(self, seq_len: int | None = None, budget: int | str | None = None, trainer=None,
                 full_rows: bool = True) -> None:
        self.seq_len, self.budget, self.trainer, self.full_rows = seq_len, budget, trainer, full_rows
        self.prediction = None
        self.run = None
        self.spec = None
        self._counter = None
        self._stack: contextlib.ExitStack | None = None
        self._measured = 0
        self._target = MEASURED_STEP

    # -- before the first step --------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        try:
            self._predict(args, state, model, optimizer, kwargs.get("train_dataloader"))
        except DoesNotFit:
            raise
        except Exception as err:  # noqa: BLE001 - whatever memfit cannot price must not stop the user's run
            self.prediction = None
            LOG.warning("memfit: this run is not priced (%s); training goes on without memfit's prediction.",
                        str(err).rstrip(".") or type(err).__name__)

    def _predict(self, args, state, model, optimizer, dataloader) -> None:
        trainer_class = type(self.trainer).__mro__ if self.trainer is not None else ()
        names = {c.__name__ for c in trainer_class} | {type(args).__name__}
        length = self.seq_len or first_batch_length(dataloader)
        self.spec, self.run, reading = run_of(args, model, length, sft=_is_sft(self.trainer, args),
                                              full_rows=self.full_rows, method=_method(names, args))
        device = "cuda" if args.device.type == "cuda" else "cpu"
        # the Trainer's stack: under ZeRO-3 its model was built inside deepspeed.zero.Init (Trainer.zero3_init)
        self.prediction = estimate(self.spec, self.run, device=device, engine=reading.engine, stack=reading.stack)
        self._device, self._optimizer, self._model = device, optimizer, model
        self._target = min(MEASURED_STEP, state.max_steps) if state.max_steps > 0 else MEASURED_STEP
        budget = self._budget(device)
        if budget is not None and self.prediction.peak_bytes > budget:
            raise DoesNotFit(_refusal(self.spec, self.run, self.prediction.peak_bytes, budget, device))
        reset_peak(device)

    def _budget(self, device: str) -> int | None:
        if self.budget is not None:
            return parse_size(self.budget)
        if device == "cuda":
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return None

    # -- the measured step (CPU) ------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if self.prediction is None or self._device != "cpu" or state.global_step + 1 != self._target:
            return

        self._stack = contextlib.ExitStack()
        self._counter = self._stack.enter_context(counted(resident_tensors(self._model, self._optimizer)))

    def on_step_end(self, args, state, control, **kwargs):
        if self._stack is not None and self._counter is not None:
            self._stack.close()
            self._stack = None
            self._measured = self._counter.peak

    # -- at the end -------------------------------------------------------------------------------
    def on_train_end(self, args, state, control, **kwargs):
        if self.prediction is None:
            return
        logs = self.figures()
        if self.trainer is not None:
            self.trainer.log(logs)
        else:
            state.log_history.append({**logs, "step": state.global_step})

    def figures(self) -> dict[str, Any]:
        """``memfit/predicted_peak_bytes``, ``memfit/measured_peak_bytes`` and their ratio."""
        measured = self.measured_bytes()
        predicted = int(self.prediction.peak_bytes)
        out: dict[str, Any] = {"memfit/predicted_peak_bytes": predicted, "memfit/measured_peak_bytes": measured}
        if measured:
            out["memfit/predicted_over_measured"] = round(predicted / measured, 4)
        return out

    def measured_bytes(self) -> int:
        if self._device == "cuda":
            return int(torch.cuda.max_memory_allocated())
        return int(self._measured)


def attach(trainer, **options) -> MemfitCallback:
    """Add a ``MemfitCallback`` to ``trainer`` that reports through ``trainer.log``; returns it."""
    callback = MemfitCallback(trainer=trainer, **options)
    trainer.add_callback(callback)
    return callback


def first_batch_length(dataloader) -> int | None:
    """Tokens per row of the first batch: the dataset's first rows batched by the dataloader's own collator (no
    sampler is drawn from and the trainer's iterator is untouched, so the run's shuffling is not changed); None
    where the dataset cannot be indexed or the batch holds no ``input_ids``. A padding collator pads to the
    longest of these rows, so a later batch with longer rows needs more than this predicts."""
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    size = getattr(dataloader, "total_batch_size", None) or getattr(dataloader, "batch_size", None) or 1
    if dataset is None or collate is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None
    rows = [dataset[i] for i in range(min(int(size), len(dataset)))]
    if not rows:
        return None
    batch = collate(rows)
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if ids is None and hasattr(batch, "get") and batch.get("prompt_input_ids") is not None:  # TRL < 1.0's pairs
        sides = [batch.get(k) for k in ("chosen_input_ids", "rejected_input_ids") if batch.get(k) is not None]
        return int(batch["prompt_input_ids"].shape[-1]) + max((int(t.shape[-1]) for t in sides), default=0)
    return int(ids.shape[-1]) if ids is not None and hasattr(ids, "shape") else None


def _method(names: set[str], args) -> str:
    """memfit's method of the trainer (its class, or its arguments' class): sft, or TRL's dpo/orpo/cpo (SimPO
    with ``loss_type: simpo``)."""
    found = next((PREFERENCE_CLASSES[n] for n in names if n in PREFERENCE_CLASSES), "sft")
    if found == "cpo":
        return "simpo" if str(getattr(args, "loss_type", "")).lower() == "simpo" else "dpo"
    return found


def _is_sft(trainer, args) -> bool:
    if trainer is not None:
        return any(cls.__name__ == "SFTTrainer" for cls in type(trainer).__mro__)
    return hasattr(args, "max_length") and hasattr(args, "packing")


def run_of(args, model, seq_len: int | None = None, *, sft: bool = False, full_rows: bool = True,
           method: str = "sft"):
    """(ModelSpec, RunConfig, reading) of a Trainer run: ``args`` read as a TRL/Trainer file, the live model over
    it, on the launch's processes (``args.world_size``); the reading's engine is ``deepspeed`` where
    ``args.deepspeed`` shards with ZeRO-2/3 (``memory.deepspeed_layout``), else ``fsdp2``, and its stack the
    Trainer's. ``method``: a TRL preference trainer's
    (``dpo``/``orpo``/``simpo``), priced as memfit prices its own preference runs."""

    data = {k: v for k, v in args.to_dict().items() if k in trl.SFT_KEYS | trl.TRAINER_KEYS | _RUN_KEYS}
    data = {k: v for k, v in data.items() if k not in ("model_init_kwargs",)}
    if not sft:
        data = {k: v for k, v in data.items() if k not in trl.SFT_KEYS}
    data["output_dir"] = data.get("output_dir") or "."
    reading = trl.read("the Trainer's arguments", data)
    run = reading.run
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    changes: dict[str, Any] = {"dtype": _dtype(base), "num_processes": max(int(args.world_size), 1),
                               "grad_checkpointing": bool(
        args.gradient_checkpointing or getattr(base, "is_gradient_checkpointing", False))}
    length = seq_len or getattr(args, "max_length", None)
    if not length:
        raise UserError("MemfitCallback found no rows' length (the first batch holds no input_ids and the "
                        "arguments have no max_length); pass seq_len=...")
    changes["seq_len"] = int(length)
    changes.update(_adapters(model))
    if method != "sft":  # pairs: one (2B, T) forward, the loss on the full logits (memory.preference_terms)
        changes.update(method=method, loss="standard", packing="none",
                       precompute_reference=method == "dpo" and bool(getattr(args, "precompute_ref_log_probs", False)))
    elif str(run.packing) == "none" and full_rows:
        changes["packing"] = "concat"  # all-ones attention mask: transformers runs plain causal attention
    attention = getattr(base.config, "_attn_implementation", None)
    if attention in ("sdpa", "eager", "flash_attention_2"):
        changes["attn_implementation"] = attention
    run = run.replace(**changes)
    spec = spec_from_config(base.config, getattr(base.config, "name_or_path", "") or type(base).__name__)
    return spec, run, reading


#: TrainingArguments keys the reader maps (beside the markers): read from ``args.to_dict()``.
_RUN_KEYS = frozenset({"bf16", "fp16", "gradient_checkpointing", "optim", "fsdp", "deepspeed", "use_liger_kernel",
                       "torch_compile", "activation_offloading", "padding_free"})


def _dtype(model) -> str:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point() and not p.requires_grad} or \
        {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _adapters(model) -> dict[str, Any]:
    """LoRA settings of a PEFT model (its active adapter's config), quantization of its base."""
    config = getattr(model, "peft_config", None)
    if not config:
        return {"lora_r": 0}
    lora = config[getattr(model, "active_adapter", "default")]
    targets = lora.target_modules
    targets = ("all-linear",) if targets == "all-linear" else tuple(sorted(targets))
    out = {"lora_r": int(lora.r), "lora_alpha": float(lora.lora_alpha), "lora_dropout": float(lora.lora_dropout),
           "lora_targets": targets}
    quant = getattr(getattr(model.get_base_model(), "config", None), "quantization_config", None)
    if quant is not None:
        bits = quant.get("load_in_4bit") if isinstance(quant, dict) else getattr(quant, "load_in_4bit", False)
        out["quantize"] = "4bit" if bits else "8bit"
    return out


def _refusal(spec, run, peak: int, budget: int, device: str) -> str:
    """One sentence: the predicted peak, the budget, and the fastest plan that fits (or that none does)."""

    head = f"This run needs {fmt_gib(peak)} at its peak, more than the {fmt_gib(budget)} it has"
    try:
        result = plan(spec, budget, seq_len=run.seq_len, batch=run.micro_batch * run.grad_accum,
                      constraints=None, cpu=device == "cpu")
    except NothingFitsError:
        return f"{head}, and no plan memfit knows fits it; use a larger device or shorter rows."
    return f"{head}; this plan fits ({fmt_gib(result.best.peak_bytes)}): {describe(result.best.config)}."
