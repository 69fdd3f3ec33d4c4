"""Exact memory of one training step: the model's real code on fake tensors, every byte attributed.

``trace(model, run)`` builds the model from its config under ``FakeTensorMode`` (shapes, dtypes and
storage sizes, no data: a 7 B model costs no RAM), applies what ``memfit train`` would apply (dtype,
LoRA via PEFT, gradient checkpointing, the optimizer with the ``foreach``/``fused`` choice torch makes
on CUDA), and runs two full steps (forward under Accelerate's autocast wrapper, the transformers loss,
backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``). The second step is the steady state
(optimizer state exists) and is the one reported, run inside torch's ``MemTracker``; the first only
creates the optimizer state and runs outside it (half a trace's time), its state then handed to the
tracker (with ``optimizer_in_backward``, whose per-parameter optimizers step in MemTracker's hooks, both
steps run inside). Nothing else of the first step outlives it in a real run; an untracked first step
also drops what the tracker used to keep alive from it under LoRA + checkpointing.

This is the only module of memfit that imports torch's private APIs (``FakeTensorMode``,
``torch.distributed._tools.mem_tracker``); ``_private_api()`` turns their absence into a ``UserError``.
``dispatch_mode_base()`` hands ``TorchDispatchMode`` to ``memory.measure`` (the CPU tensor peak of a
real training step) through the same door.

Categories (same as the analytic estimate, see ``memory/breakdown.py``), derived from MemTracker's:

- ``weights`` = Parameter + Buffer; ``gradients`` = Gradient (``.grad`` of trainable parameters);
- ``optimizer`` = bytes of the tensors in ``optimizer.state`` (moments and step counters);
- ``logits`` = every live tensor of shape (..., V) with B*T*V elements: the LM-head output, its fp32
  upcast, log-softmax, Accelerate's fp32 copy of ``outputs.logits`` and their gradients;
- ``activations`` = MemTracker's Activation (created in forward or in checkpoint recompute) minus
  logits and autocast weight copies;
- ``temporary`` = MemTracker's Temp (backward buffers: gradients of activations) minus logits, plus the
  autocast half-precision weight copies (``aten._to_copy`` of a parameter), plus optimizer-step
  temporaries (what the step holds beyond ``optimizer.state``);
- ``other`` = CUDA context, cuBLAS workspace and allocator reserve (``device="cuda"`` only), the same
  constants the analytic estimator uses, so the two compare on tensor bytes.

For ``device="cuda"`` the kernels whose saved tensors differ on CUDA (SDPA with its flash and
memory-efficient backends, with and without dropout; ``nn.Dropout``'s mask; Liger/CCE's fused loss, traced as
the chunked one) run as CUDA-faithful stand-ins (``memory/cuda_kernels.py``), named in the notes. What a CPU
trace still cannot see (docs/exact.md, "What only a GPU can check"): CUDA's autocast fp32 op list (``pow``,
``softmax``, ``layer_norm``... run in fp32 on CUDA but in the input dtype on CPU; HF decoders upcast
explicitly, except GPT-2's ``gelu_new``), the attention kernels' backward workspaces, allocator block
rounding (512 B) and fragmentation.

Size: over 500 lines, with ``trace`` and ``_make_recorder`` over 60, because the tracer is the only user of
torch's private dispatch and fake-tensor APIs: keeping every such call in one module keeps the
version-sensitive surface in one place; the recorder's dispatch handler reads as one unit.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

import torch
from accelerate.utils import convert_outputs_to_fp32
from transformers import AutoModelForCausalLM, PretrainedConfig, masking_utils

from memfit.builder import parts as build
from memfit.builder import preference
from memfit.errors import UserError
from memfit.integrations import versions
from memfit.integrations.hf_compat import tied_as_built
from memfit.integrations.quant_support import check, logical_numel
from memfit.memory import preference_terms as pref
from memfit.memory.activations import MASKED_PACKING
from memfit.memory.alloc_stream import WORKSPACES, predicted_reserved, stream_recorder
from memfit.memory.allocator_config import settings_from_env
from memfit.memory.breakdown import CATEGORIES, MemoryBreakdown
from memfit.memory.compiled import compiled_saved_bytes, mask_path, with_compiled_saved_set
from memfit.memory.cuda_kernels import Substitutions, cuda_kernels
from memfit.memory.device_terms import cuda_other
from memfit.memory.experts_trace import traceable_experts
from memfit.memory.offload_trace import saved_tensors_off_device
from memfit.memory.preference_terms import reference_policy
from memfit.memory.quantized_trace import (
    dynamic_map_for,
    fake_params4bit,
    gemm_4bit_steps,
    hold_quant_state,
    is_params4bit,
    quantize_on_meta,
)
from memfit.memory.stack_terms import notes as stack_notes
from memfit.settings.config import (
    Attention,
    Loss,
    Offload,
    OptimSettings,
    Packing,
    Precision,
    Quantize,
    RunConfig,
    Sharding,
)
from memfit.spec.losses import chunk_tokens, chunked_micro_loss
from memfit.spec.model import ModelSpec, check_causal_lm, check_seq_len, resolve_config, spec_from_config
from memfit.spec.optimizers import row
from memfit.spec.resolved import ResolvedRun, resolve
from memfit.units import fmt_bytes

#: The learning rate the traced optimizer is built with: any positive value allocates the same.
_TRACE_LR = 1e-4


@dataclass
class Timeline:
    """Tensor bytes by category after every operator of the traced (second) step.

    ``samples[i]`` maps each category (``CATEGORIES`` but ``other``) to bytes after op ``i``;
    ``phases[i]`` is the phase op ``i`` ran in; ``other`` is added on top (constant over the step).
    """

    samples: list[dict[str, int]] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    other: int = 0
    title: str = ""
    layer_marks: list[tuple[int, str, int]] = field(default_factory=list)
    """``(layer index, "pre"|"post"|"grad", number of samples so far)``: "pre"/"post" at each decoder
    layer's forward hooks (not at a checkpoint's recompute), "grad" when backward reaches the layer's
    output (the start of that layer's backward); ``memory/derive.py`` reads one layer's bytes off them."""
    returned: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per decoder layer, bytes by category of what its forward left alive that died before the head ran:
    held only until the next layer's output replaced them, not kept by the layer (attention weights a layer
    returns, hidden states saved on the host under ``--offload activations``; ``Recorder.watch_layer``);
    ``memory/derive.py`` excludes them from a layer's bytes."""
    forward_only: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per decoder layer, bytes by category of what its forward left alive that died after the head ran and
    before backward: alive through the rest of the forward, gone in backward (autocast's cached weight copies
    of a checkpointed layer, freed when autocast exits); ``memory/derive.py`` holds them in forward only."""
    dropped_outputs: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per decoder layer, bytes by category of its output when that died before the head ran: the next layer
    did not keep it (OLMo 2's post-norm layers under LoRA + autocast save only their projections' half casts).
    The traced last layer's output is kept by the final norm whatever the layers do; ``memory/derive.py``
    charges it to each further layer only where the layer before it kept its own output.
    ``Recorder.watch_output``."""
    allocations: list[tuple] = field(default_factory=list)
    """The allocation stream of both steps, weights first, as ``memory/alloc_stream.py`` records it (a CUDA
    trace of two steps; empty otherwise): what ``memory.allocator.replay`` takes."""

    def totals(self) -> list[int]:
        return [sum(s.values()) + self.other for s in self.samples]

    def peak_index(self) -> int:
        totals = self.totals()
        return max(range(len(totals)), key=totals.__getitem__) if totals else 0

    def phase_bounds(self) -> dict[str, tuple[int, int]]:
        """First and last op index (inclusive) of each phase, in step order."""
        bounds: dict[str, tuple[int, int]] = {}
        for i, phase in enumerate(self.phases):
            start = bounds.get(phase, (i, i))[0]
            bounds[phase] = (start, i)
        return bounds


# ------------------------------------------------------------------------------------------------
# torch's private tools, behind one door
# ------------------------------------------------------------------------------------------------
def _private_api() -> dict[str, Any]:
    """Import FakeTensorMode, MemTracker and TorchDispatchMode, or raise a one-sentence ``UserError``."""
    try:
        fake = importlib.import_module("torch._subclasses.fake_tensor")
        tracker = importlib.import_module("torch.distributed._tools.mem_tracker")
        dispatch = importlib.import_module("torch.utils._python_dispatch")
        common = importlib.import_module("torch.distributed._tools.common_utils")
        api = {
            "FakeTensorMode": fake.FakeTensorMode,
            "MemTracker": tracker.MemTracker,
            "RefType": tracker._MemRefType,
            "TorchDispatchMode": dispatch.TorchDispatchMode,
            "get_untyped_storages": common.get_untyped_storages,
            "tree_leaves": importlib.import_module("torch.utils._pytree").tree_leaves,
        }
    except (ImportError, AttributeError) as err:
        raise UserError(
            f"--exact needs torch's FakeTensorMode and MemTracker, which torch {torch.__version__} lacks "
            f"({err}); install torch >= 2.5 or use the analytic estimate."
        ) from None
    return api


def dispatch_mode_base():
    """torch's ``TorchDispatchMode`` (the base class of ``memory.measure``'s live-tensor counter), or
    None when this torch lacks it. Imported here so torch's private modules keep one door."""
    try:
        return importlib.import_module("torch.utils._python_dispatch").TorchDispatchMode
    except (ImportError, AttributeError):
        return None


# ------------------------------------------------------------------------------------------------
# what the run would build
# ------------------------------------------------------------------------------------------------
def _hf_config(model: Any):
    """A transformers ``PretrainedConfig`` from a preset name/path, a ``ModelSpec`` or a config."""

    if isinstance(model, PretrainedConfig):
        check_causal_lm(model, getattr(model, "model_type", "model"))
        return model
    for attr in ("hf_config", "config"):
        inner = getattr(model, attr, None)
        if isinstance(inner, PretrainedConfig):
            return inner
    if isinstance(model, str):
        return resolve_config(model)
    raise UserError(f"Cannot trace {model!r}: give a preset name, a model folder or a transformers config.")


def _spec(model: Any, config):
    """The ``ModelSpec`` of what is traced (given, or counted from the config on the meta device)."""

    if isinstance(model, ModelSpec):
        return model
    return spec_from_config(config, model if isinstance(model, str) else getattr(config, "model_type", "model"))


def check_supported(run: RunConfig, device: str = "cpu") -> None:
    """Raise ``UserError`` for settings a single-process CPU trace cannot reproduce (``--loss liger``/``cce``
    are traced for a CUDA target, as ``chunked``: ``_traced_loss``)."""
    if run.quantize is Quantize.Q8:
        raise UserError("--quantize 8bit is not supported in exact mode (its layers keep their inputs outside "
                        "autograd's saved tensors and run int8 kernels on CUDA); use the analytic estimate, or 4bit.")
    if run.quantize is Quantize.Q4:
        check("cpu", "--quantize 4bit --exact")  # bitsandbytes' ops (and their fake kernels) are imported
    if not row(run.optimizer).traceable:
        raise UserError(f"--optimizer {run.optimizer.value} is not supported in exact mode (its kernels cannot run "
                        "on fake tensors); use the analytic estimate.")
    if run.offload not in (Offload.NONE, Offload.ACTIVATIONS):  # activations: memory/offload_trace.py
        raise UserError(f"--offload {run.offload} is not supported in exact mode; use the analytic estimate.")
    if run.loss.value == "trl":
        raise UserError("--loss trl prices TRL's SFTTrainer, whose step exact mode does not run; use the analytic "
                        "estimate (or --loss chunked).")
    if run.loss.value in ("liger", "cce") and device != "cuda":
        raise UserError(f"--loss {run.loss.value} runs Triton kernels that cannot be traced on CPU; use the "
                        "analytic estimate, or --loss chunked.")
    if run.compile and (run.loss.value != "standard" or run.optimizer_in_backward or run.offload is not Offload.NONE
                        or run.quantize is not Quantize.NONE):
        raise UserError("--compile in exact mode prices the model's own loss with a plain step on an unquantized "
                        "base; drop --loss, --optimizer-in-backward, --offload and --quantize, or use the analytic "
                        "estimate.")
    if run.num_processes > 1 or run.sharding is not Sharding.DDP:
        raise UserError("Exact mode traces a single process; drop --num-processes/--sharding or use the analytic "
                        "estimate for per-rank numbers.")


def _build_model(config, resolved: ResolvedRun):
    """The model as ``memfit train`` builds it, on the meta device: dtype, attention, then ``memfit.builder.parts``'s
    ``adapt`` (checkpointing, LoRA on the resolved targets, training mode), the function train calls.

    Built on meta, not under FakeTensorMode, because ``Module.to()`` on fake parameters fails in torch
    (it swaps tensors, and fake tensors carry weak references); ``_to_fake`` then gives every parameter
    and buffer a fake CPU storage. The attention is the resolved one, except that flash attention (a
    CUDA kernel) is traced as SDPA, which saves the same tensors (output + logsumexp).
    """

    run = resolved.run
    attn = "sdpa" if run.attn_implementation is Attention.FLASH else run.attn_implementation.value
    with torch.device("meta"):
        model = tied_as_built(AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                               **build.model_kwargs(run, attn, resolved.experts)))
        if run.quantize is Quantize.Q4:  # as from_pretrained quantizes: before checkpointing and PEFT
            model = quantize_on_meta(model, run)
        return build.adapt(model, run, resolved.lora.peft_targets if run.is_lora() else ())


def _to_fake(model, fake_mode, run: RunConfig) -> None:
    """Replace every meta parameter/buffer by a fake CPU tensor of the same shape/dtype (ties kept); a 4-bit
    weight is quantized by bitsandbytes from a fake ``--dtype`` weight (``memory/quantized_trace.py``)."""

    done: dict[int, Any] = {}
    quantized = run.quantize is Quantize.Q4
    with dynamic_map_for(fake_mode) if quantized else contextlib.nullcontext(), fake_mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) not in done and is_params4bit(p):
                    done[id(p)] = fake_params4bit(p, build.torch_dtype(run))
                if p is not None:
                    if id(p) not in done:
                        done[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
                    module._parameters[name] = done[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None:
                    if id(b) not in done:
                        done[id(b)] = torch.empty(b.shape, dtype=b.dtype)
                    module._buffers[name] = done[id(b)]


def _build_optimizer(model, run: RunConfig, device: str = "cuda"):
    """The optimizer ``memfit train`` builds (``memfit.builder.parts``: its parameter groups at train's default
    weight decay, the row's builder, one per parameter with ``optimizer_in_backward``), with the
    implementation torch picks on ``device`` (``cuda_like``: the fake tensors are CPU tensors, on which
    torch would pick single-tensor AdamW; a CUDA run gets foreach, ``optimizers.torch_default_is_foreach``).
    The decay's value allocates nothing (AdamW decays in place; SGD at train's default 0 skips it)."""
    groups = build.parameter_groups(model, OptimSettings.weight_decay)
    return build.make_optimizer(run, groups, _TRACE_LR, cuda_like=device == "cuda")


# ------------------------------------------------------------------------------------------------
# the recorder: MemTracker's running snapshot -> memfit's categories, after every operator
# ------------------------------------------------------------------------------------------------
class _Marks:
    """Storages memfit re-labels, with MemTracker's info object (whose ``reftype`` it may update later)."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[weakref.ref, Any]] = {}

    def add(self, storage, winfo) -> None:
        key = id(storage)
        if key in self.live and self.live[key][0]() is storage:
            return
        self.live[key] = (weakref.ref(storage, lambda _r, key=key: self.live.pop(key, None)), winfo)

    def __contains__(self, storage) -> bool:
        entry = self.live.get(id(storage))
        return entry is not None and entry[0]() is storage

    def by_reftype(self) -> dict[Any, int]:
        out: dict[Any, int] = {}
        for _ref, winfo in list(self.live.values()):
            out[winfo.reftype] = out.get(winfo.reftype, 0) + winfo.mem_consumed
        return out


def _make_recorder(api: dict[str, Any], tracker, shape: tuple[int, int], head_weight, rows: frozenset = frozenset()):
    """A dispatch mode above MemTracker that labels logits/casts and samples categories after each op.

    Logits are recognised by lineage and shape: an op output with B*T*V elements and last dimension V
    computed from the head's weight (or its autocast copy) or from a logits tensor. Autocast weight
    copies are ``aten._to_copy`` outputs whose input is a parameter.
    """

    ref = api["RefType"]
    storages_of = api["get_untyped_storages"]
    to_copy = torch.ops.aten._to_copy.default
    vocab = int(head_weight.shape[0])
    # (B, T, V) logits, or (chunked loss) one chunk's (rows, V)
    logits_numels = {shape[0] * shape[1] * vocab} | {r * vocab for r in rows}

    class Recorder(api["TorchDispatchMode"]):
        def __init__(self) -> None:
            super().__init__()
            self.logits, self.casts, self.head = _Marks(), _Marks(), _Marks()
            self.phase = "forward"
            self.recording = False
            self.state_bytes = 0
            self.timeline = Timeline()
            self.watched: list[weakref.ref] = []  # ``watch_layer``'s references (their callbacks need them)
            self._before: dict[int, set[int]] = {}  # per layer: ids of the storages alive at its forward's start
            self.head_ran = False  # the recorded step's (grad-enabled) forward has made logits
            for st in storages_of(head_weight):
                self.head.add(st, None)

        def _winfos(self, t):
            for st in storages_of(t):
                winfo, _ = tracker._WINFO.get(st, (None, None))
                if winfo is not None:
                    yield st, winfo

        def _classify(self, func, args, kwargs, out) -> None:
            inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if func is to_copy and any(w.reftype is ref.PARAM for _, w in self._winfos(inputs[0])):
                from_head = any(st in self.head for st in storages_of(inputs[0]))
                for st, winfo in self._winfos(outputs[0]):
                    self.casts.add(st, winfo)
                    if from_head:
                        self.head.add(st, None)
                return
            logits_like = [t for t in outputs if t.dim() >= 2 and t.shape[-1] == vocab and t.numel() in logits_numels]
            if not logits_like:
                return
            sources = [st for t in inputs for st in storages_of(t)]
            if any(st in self.head or st in self.logits for st in sources):
                for t in logits_like:
                    for st, winfo in self._winfos(t):
                        # A view of the head's autocast weight copy ((H, V).t()) has B*T*V elements when
                        # B*T == H: it is a weight copy (temporary), not logits.
                        if st not in self.casts:
                            self.logits.add(st, winfo)
                            self.head_ran = self.head_ran or (self.recording and torch.is_grad_enabled())

        def sample(self) -> dict[str, int]:
            snap = next(iter(tracker._curr_mem_snap.values()), {})
            logits, casts = self.logits.by_reftype(), self.casts.by_reftype()
            act, tmp, opt = snap.get(ref.ACT, 0), snap.get(ref.TEMP, 0), snap.get(ref.OPT, 0)
            optimizer = min(opt, self.state_bytes)
            relabelled = {r: logits.get(r, 0) + casts.get(r, 0) for r in (ref.ACT, ref.TEMP, ref.OPT, ref.OTH)}
            return {
                "weights": snap.get(ref.PARAM, 0) + snap.get(ref.BUFFER, 0),
                "gradients": snap.get(ref.GRAD, 0),
                "optimizer": optimizer,
                "activations": act - relabelled[ref.ACT],
                "logits": sum(logits.get(r, 0) for r in relabelled),
                "temporary": tmp - relabelled[ref.TEMP] + opt - optimizer - relabelled[ref.OPT]
                + snap.get(ref.OTH, 0) - relabelled[ref.OTH] + sum(casts.get(r, 0) for r in relabelled),
            }

        def watch_layer(self, layer: int) -> None:
            """At decoder layer ``layer``'s forward end: watch every storage its forward created that is still
            alive. One that dies in forward was not kept for backward by the layer: before the head runs, it
            was only returned (bloom's, mpt's, eager falcon's attention weights under checkpointing, which the
            decoder drops when the next layer returns; under ``--offload activations`` the hidden states
            themselves, whose device copy dies when the next layer's output replaces it: ``returned``); after
            the head ran, it lived through the forward only (autocast's cached weight copies of a checkpointed
            layer, freed when autocast exits: ``forward_only``). What the layers keep never dies in forward."""
            before = self._before.pop(layer, None)
            if not (self.recording and self.phase == "forward") or before is None or not torch.is_grad_enabled():
                return  # (a DPO reference forward runs under no_grad: it leaves nothing for backward anyway)
            for st, (winfo, _) in list(tracker._WINFO.items()):
                if id(st) in before:
                    continue
                category = self._category(st, winfo)
                self.watched.append(weakref.ref(st, lambda _r, args=(layer, category, winfo.mem_consumed):
                                                self._freed(*args)))

        def watch_output(self, layer: int, output) -> None:
            """At decoder layer ``layer``'s forward end: watch its output's storage; if it dies before the head
            runs, the next layer did not keep it (``Timeline.dropped_outputs``)."""
            if not (self.recording and self.phase == "forward") or not torch.is_grad_enabled():
                return
            st = output.untyped_storage()
            entry = tracker._WINFO.get(st)
            if entry is None:
                return
            winfo = entry[0]
            category = self._category(st, winfo)
            self.watched.append(weakref.ref(st, lambda _r, args=(layer, category, winfo.mem_consumed):
                                            self._output_dropped(*args)))

        def _category(self, st, winfo) -> str:
            """How ``sample`` counts a storage: autocast's casts and non-activation storages as temporaries."""
            return "temporary" if st in self.casts or winfo.reftype is not ref.ACT else "activations"

        def _output_dropped(self, layer: int, category: str, size: int) -> None:
            if self.recording and self.phase == "forward" and not self.head_ran:
                self.timeline.dropped_outputs.setdefault(layer, {})[category] = size

        def _freed(self, layer: int, category: str, size: int) -> None:
            if self.recording and self.phase == "forward":
                where = self.timeline.forward_only if self.head_ran else self.timeline.returned
                bytes_ = where.setdefault(layer, {})
                bytes_[category] = bytes_.get(category, 0) + size

        def mark(self, layer: int, when: str) -> None:
            if self.recording and self.phase == ("backward" if when == "grad" else "forward"):
                self.timeline.layer_marks.append((layer, when, len(self.timeline.samples)))
            if when == "pre" and self.recording and self.phase == "forward" and torch.is_grad_enabled():
                self._before[layer] = {id(st) for st in list(tracker._WINFO.keys())}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self._classify(func, args, kwargs or {}, out)
            if self.recording:
                self.timeline.samples.append(self.sample())
                self.timeline.phases.append(self.phase)
            return out

    return Recorder()


# ------------------------------------------------------------------------------------------------
# the step
# ------------------------------------------------------------------------------------------------
@dataclass
class _Traced:
    """What one traced run holds: the fake model, its optimizer, the modes and the batch shape."""

    model: Any
    optimizer: Any
    forward: Any
    tracker: Any
    recorder: Any
    run: RunConfig
    vocab: int
    resolved: ResolvedRun
    input_leaves: list = field(default_factory=list)
    """Weak references to this micro-batch's embedding outputs (``_watch_input_leaves``)."""


def _autocast_forward(model, run: RunConfig):
    """``model.forward`` wrapped the way ``Accelerator.prepare`` wraps it for mixed precision.

    Accelerate wraps forward in ``torch.autocast(device, dtype)`` and ``convert_outputs_to_fp32``
    (so ``outputs.logits`` gets an fp32 copy). The trace runs CPU kernels, hence ``autocast("cpu")``:
    on a CPU-only torch ``autocast("cuda")`` is inert (see DESIGN.md).
    """

    if run.mixed_precision is Precision.NO:
        return model.forward
    dtype = torch.bfloat16 if run.mixed_precision is Precision.BF16 else torch.float16
    return convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(model.forward))


def _one_step(t: _Traced, micro_batches: int, optimizer_step: bool = True) -> None:
    """Forward, loss, backward for each micro-batch, then optimizer step and zero_grad."""

    rec = t.recorder
    for _ in range(micro_batches):
        t.tracker.reset_mod_stats()  # MemTracker refuses a second forward of the root module otherwise
        rec.phase = "forward"
        # No attention mask: full-length rows (a mask's values cannot be read on fake tensors).
        input_ids = torch.randint(0, t.vocab, (t.run.micro_batch, t.run.seq_len))  # (B, T)
        labels = torch.randint(0, t.vocab, (t.run.micro_batch, t.run.seq_len))  # (B, T)
        # use_cache=False: a training step keeps no KV cache; only the loss is kept (outputs are dropped).
        with _saved_tensors_place(t.run):  # where training/step.py puts forward's saved tensors
            loss = _micro_loss(t, input_ids, labels)
        # accelerator.backward divides by the accumulation steps before backward.
        loss = loss / t.run.grad_accum if t.run.grad_accum > 1 else loss
        rec.phase = "backward"
        loss.backward()
        del loss, input_ids, labels
        _release_input_leaves(t.input_leaves)
    if not optimizer_step:
        return
    rec.phase = "optimizer"
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def _watch_input_leaves(model, leaves: list) -> None:
    """Append (weakly) the input embeddings' output of each forward to ``leaves``, for ``_release_input_leaves``."""

    def remember(_module, _args, output) -> None:
        leaves.append(weakref.ref(output))

    model.get_input_embeddings().register_forward_hook(remember)


def _release_input_leaves(leaves: list) -> None:
    """Drop what the memory tracker alone keeps alive after backward: the embedding output.

    With checkpointing on a frozen embedding (LoRA) transformers' ``enable_input_require_grads`` makes that
    output a leaf that requires a gradient. MemTracker's ModTracker hooks it (``register_multi_grad_hook``,
    whose closure holds the leaf's ``AccumulateGrad`` node, which holds the leaf): a reference cycle through
    C++ that the garbage collector cannot see, so the leaf and its gradient (2 x B T H stream bytes) would
    stay alive through the optimizer step, where a real run (no tracker) has freed both. Clearing the
    leaf's hooks and gradient frees the gradient; the leaf itself (B T H) is still held by something not
    found, so the trace's optimizer phase keeps it (docs/estimate.md: LoRA + checkpointing).
    """
    for ref in leaves:
        leaf = ref()
        if leaf is not None and leaf.is_leaf and leaf.requires_grad:
            leaf._backward_hooks = None
            leaf.grad = None
    leaves.clear()


#: What fake tensors raise where a model's code reads a tensor's values to decide a shape (``nonzero``,
#: ``.item()``, ``.tolist()``): dbrx's and jetmoe's expert dispatch. Matched by name: the classes live in torch's
#: private ``torch._subclasses.fake_tensor``.
DATA_DEPENDENT = ("DynamicOutputShapeException", "DataDependentOutputException")


@contextlib.contextmanager
def _data_dependent_refused(model_type: str):
    """One sentence, not a traceback, for a model whose code decides tensor shapes from tensor values."""
    try:
        yield
    except RuntimeError as err:
        if type(err).__name__ not in DATA_DEPENDENT:
            raise
        op = (str(err).strip().splitlines() or ["?"])[0][:80]
        raise UserError(f"{model_type}'s code decides a tensor's shape from tensor values ({op}, as routing tokens to "
                        "experts by index does), which a trace on fake tensors cannot run: memfit cannot estimate "
                        "it before it runs.") from None


@contextlib.contextmanager
def _module_hierarchy_quiet():
    """Silence ModTracker's "The module hierarchy tracking maybe be messed up" (and "Module is None. Skipping ...
    hook") while tracing, and undo the
    ``warnings.formatwarning`` it replaces process-wide before warning. It warns when a module's forward starts
    while the tracker still lists it as running (seen on Qwen2 with transformers 5.25: a module the tracker names
    ``Func``, entered from each layer's ``self_attn``, once per layer). memfit reads neither the tracker's module hierarchy nor its per-module peaks (its own
    recorder and layer marks time the step), so the warning says nothing about memfit's numbers."""
    formatwarning = warnings.formatwarning
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up",
                                    category=UserWarning)
            # the same tracker's backward hooks on a module it no longer holds (hybrid mamba layers: bamba, falcon_h1)
            warnings.filterwarnings("ignore", message="Module is None. Skipping", category=UserWarning)
            yield
    finally:
        warnings.formatwarning = formatwarning


@contextlib.contextmanager
def _freed_grads_unseen(run: RunConfig):
    """Silence MemTracker's warning about a freed ``.grad`` in the first tracked step of an
    optimizer-in-backward run: the optimizer's hooks run before MemTracker's (installed at the first
    forward), which then find the gradient already stepped and freed (None: nothing to count) and warn;
    re-installed after that step, they run after. ``derive`` traces one step (``steps=1``): its recorded one."""
    with warnings.catch_warnings():
        if run.optimizer_in_backward:
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass",
                                    category=UserWarning)
        yield


def _saved_tensors_place(run: RunConfig):
    """``--offload activations``: saved tensors off the device while saved (``memory/offload_trace.py``)."""
    if run.offload is Offload.ACTIVATIONS:
        return saved_tensors_off_device()
    return contextlib.nullcontext()


def _micro_loss(t: _Traced, input_ids, labels):
    """The loss as ``training/step.py`` computes it: the model's own, or (``--loss chunked``) memfit's."""

    if t.run.method.value != "sft":
        return _preference_loss(t, input_ids, labels)
    if t.run.loss.value == "standard":
        return t.forward(input_ids=input_ids, labels=labels, use_cache=False, **_packed_positions(t.run)).loss

    autocast = contextlib.nullcontext
    if t.run.mixed_precision is not Precision.NO:
        dtype = torch.bfloat16 if t.run.mixed_precision is Precision.BF16 else torch.float16
        autocast = lambda: torch.autocast("cpu", dtype=dtype)  # noqa: E731 - accelerator.autocast's CPU twin
    t.model.forward = t.forward  # as Accelerate's prepare patches it
    try:
        batch = {"input_ids": input_ids, "labels": labels, **_packed_positions(t.run)}  # no mask, as above
        return chunked_micro_loss(t.model, batch, input_ids.numel(), autocast, t.run.loss)
    finally:
        del t.model.forward


def _loss_rows(run: RunConfig, vocab: int, hidden: int) -> frozenset:
    """Token rows of one chunk's logits (the last chunk may be shorter); empty for the standard loss."""
    if run.loss.value == "standard":
        return frozenset()

    tokens = run.micro_batch * run.seq_len
    chunk = chunk_tokens(tokens, vocab, hidden)
    return frozenset({chunk, tokens % chunk} - {0})


def _state_bytes(optimizer, storages_of) -> int:
    """Bytes of the tensors in ``optimizer.state`` (moments, step counters), each storage once."""

    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                for st in storages_of(value):
                    seen[id(st)] = st.nbytes()
    return sum(seen.values())


def _layer_activation_bytes(model, tracker) -> int:
    """Bytes one decoder layer leaves alive after its forward (saved tensors + its output), middle layer."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    deltas = []
    for module, stats in list(tracker.memory_tracking.items()):
        if type(module).__name__ not in names:
            continue
        pre = stats.snapshots.get(_state(tracker, "PRE_FW"), [])
        post = stats.snapshots.get(_state(tracker, "POST_FW"), [])
        if pre and post:
            total = _total_key()
            deltas.append(sum(d[total] for d in post[0].values()) - sum(d[total] for d in pre[0].values()))
    return sorted(deltas)[len(deltas) // 2] if deltas else 0


def _decoder_layers(model) -> list:
    """The decoder layer modules (the classes transformers never splits across devices), in order."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in base.modules() if type(m).__name__ in names]


def _mark_layers(model, recorder) -> None:
    """Mark each decoder layer's forward (module hooks) and the start of its backward: a hook on the
    gradient of its output, which allocates nothing (it returns None) and fires once that gradient is
    complete, after the layers above finished their backward."""

    def after_forward(i: int, output) -> None:
        recorder.mark(i, "post")
        recorder.watch_layer(i)
        first = next((t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)), None)
        if first is not None:
            recorder.watch_output(i, first)
        if recorder.recording and first is not None and first.requires_grad:
            first.register_hook(lambda _grad, i=i: recorder.mark(i, "grad"))

    for i, layer in enumerate(_decoder_layers(model)):
        layer.register_forward_pre_hook(lambda *_args, i=i: recorder.mark(i, "pre"))
        layer.register_forward_hook(lambda _module, _args, output, i=i: after_forward(i, output))


def _state(tracker, name: str):
    return importlib.import_module("torch.distributed._tools.mem_tracker")._ModState[name]


def _total_key() -> str:
    return importlib.import_module("torch.distributed._tools.mem_tracker")._TOTAL_KEY


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen_grad_hooks(tracker, model) -> None:
    """MemTracker hooks every parameter for its gradient, which raises on frozen ones (LoRA's base).

    Pre-filling its handle table for frozen parameters makes it skip them (they never get a grad).
    """
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


class _NoStream(contextlib.nullcontext):
    """No allocation stream is recorded (a CPU trace, or ``steps=1``)."""

    recording = recorded = False

    def __init__(self) -> None:
        super().__init__()
        self.events: list = []


def _allocation_stream(api: dict[str, Any], tracker, device: str, steps: int):
    """The recorder of the allocation stream (``memory/alloc_stream.py``) for a CUDA trace of two steps, already
    holding the weights and buffers MemTracker tracks (in its order: the model's) and cuBLAS's workspaces."""
    if device != "cuda" or steps < 2:
        return _NoStream()

    stream = stream_recorder(api["TorchDispatchMode"], api["get_untyped_storages"], api["tree_leaves"])
    stream.recording = stream.recorded = True
    for storage in list(tracker._WINFO):  # what track_external registered: parameters, buffers, quant state
        stream.adopt(storage)
    stream.events.extend(WORKSPACES)
    return stream


def _with_reserved(breakdown: MemoryBreakdown, events) -> None:
    """Fill ``breakdown``'s predicted reserved memory from the replay of ``events`` (None: not recorded)."""
    if events is None:
        return

    settings = settings_from_env()
    result = predicted_reserved(events, settings)
    breakdown.allocator_settings = settings.describe()
    if result is None:
        breakdown.notes.append("allocator: backend cudaMallocAsync is not modelled; no reserved memory predicted.")
        return
    breakdown.reserved, breakdown.reserved_allocated = result.stats.peak_reserved, result.stats.peak_allocated
    breakdown.notes.append(
        f"allocator: predicted max_memory_reserved {fmt_bytes(breakdown.reserved)} (max_memory_allocated "
        f"{fmt_bytes(breakdown.reserved_allocated)}, cuBLAS workspaces included; {result.fragmentation_share:.1%} "
        f"of reserved is cached but unused at the peak; nvidia-smi adds the CUDA context), the step's allocations "
        f"replayed through the caching allocator under {settings.describe()} (memory/allocator.py).")


def other_bytes(peak_sample: dict[str, int], device: str) -> int:
    """Bytes the device holds that no tensor does (CUDA context, cuBLAS workspace, allocator reserve), for a step
    whose peak holds ``peak_sample`` (bytes by category).

    ``memfit.memory.device_terms.cuda_other``, the analytic estimator's documented constants, so that the
    trace and the estimate differ only in tensor bytes; 0 for ``device="cpu"``.
    """
    if device == "cpu":
        return 0
    if device != "cuda":
        raise UserError(f"device must be 'cuda' or 'cpu', got {device!r}.")
    return int(cuda_other(sum(peak_sample.values()), peak_sample.get("optimizer", 0), peak_sample.get("logits", 0)))


def _breakdown(config, t: _Traced, timeline: Timeline, other: int) -> MemoryBreakdown:
    """The peak sample of the traced step as a ``MemoryBreakdown`` (method ``exact``)."""

    peak = timeline.peak_index()
    sample = timeline.samples[peak] if timeline.samples else dict.fromkeys(CATEGORIES[:-1], 0)
    phase_peaks: dict[str, int] = {}
    for sample_i, phase in zip(timeline.samples, timeline.phases, strict=True):
        phase_peaks[phase] = max(phase_peaks.get(phase, 0), sum(sample_i.values()) + other)
    params = sum(logical_numel(p) for p in t.model.parameters())  # a 4-bit weight: the weights it stands for
    trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
    base = t.model.get_base_model() if hasattr(t.model, "get_base_model") else t.model
    ran = str(base.config._attn_implementation)  # what the traced model ran, read back from it
    notes = [f"attention: {ran}, as built by transformers for the traced model.",
             *([f"experts: {t.resolved.experts}" + (" (the per-expert loop traced on a balanced routing: "
                "memory/experts_trace.py)." if t.resolved.experts == "eager" else ".")]
               if t.resolved.experts else []),
             "exact: the model's code traced on fake tensors (CPU kernels); second step reported."]
    if t.run.attn_implementation is Attention.FLASH:
        notes.append("flash_attention_2 traced as SDPA (same saved tensors: output + logsumexp).")
    notes += versions.notes()
    return MemoryBreakdown(
        **{k: int(v) for k, v in sample.items()},
        other=other,
        phase=timeline.phases[peak] if timeline.phases else "backward",
        method="exact",
        params=params,
        trainable_params=trainable,
        activations_per_layer=_layer_activation_bytes(t.model, t.tracker),
        notes=notes,
        phase_peaks=phase_peaks,
        attn_implementation=t.resolved.attention if t.run.attn_implementation is Attention.FLASH else ran,
        experts_implementation=t.resolved.experts,
        lora_targets=t.resolved.lora.names if t.resolved.lora else (),
    )


def _compiled_saved(config, resolved: ResolvedRun, api: dict) -> int:
    """``--compile``: what the compiled forward saves (``memory.compiled``), on a fresh fake model of the run."""

    run = resolved.run
    net = _build_model(config, resolved)
    fake_mode = api["FakeTensorMode"](allow_non_fake_inputs=False)
    _to_fake(net, fake_mode, run)
    vocab = int(net.get_output_embeddings().weight.shape[0])
    with fake_mode:
        ids = torch.randint(0, vocab, (run.micro_batch, run.seq_len))  # (B, T)
        inputs = {"input_ids": ids, "labels": ids.clone(), **_packed_positions(run)}
    return compiled_saved_bytes(net, fake_mode, inputs, mask_path(run, _attention_path(run)))


def _traced_loss(resolved: ResolvedRun, device: str, substituted: Substitutions) -> ResolvedRun:
    """``--loss liger``/``cce`` for a CUDA target, traced as ``--loss chunked`` (their Triton kernels cannot
    run here). The analytic estimate prices all three alike (``activations.chunked_logits_terms``); Liger
    differs in when it allocates (the gradients of the hidden states and the head's weight in forward, not
    backward): docs/exact.md, "What only a GPU can check"."""

    if device != "cuda" or resolved.run.loss not in (Loss.LIGER, Loss.CCE):
        return resolved
    substituted[f"loss:--loss {resolved.run.loss.value} traced as --loss chunked (the same chunked logits and "
                "gradient buffers; Liger allocates the gradients in forward)"] += 1
    return replace(resolved, run=resolved.run.replace(loss=Loss.CHUNKED))


def _packed_positions(run: RunConfig) -> dict:
    """``position_ids`` of rows holding two documents each, as ``--packing documents`` gives the model
    (positions restart at 0; no attention mask), so transformers takes its packed-sequence path; the
    split point does not matter, only that the rows hold more than one document. Other packing modes
    pass none (the model numbers positions 0..T-1 itself)."""

    if run.packing is not Packing.DOCUMENTS or run.seq_len < 2:
        return {}
    half = run.seq_len // 2
    row = torch.cat([torch.arange(half), torch.arange(run.seq_len - half)])  # (T,)
    return {"position_ids": row.expand(run.micro_batch, -1)}  # (B, T)


@contextlib.contextmanager
def _attention_path(run: RunConfig):
    """The attention mask of the real run's peak: a (B, 1, T, T) mask for ``activations.MASKED_PACKING``
    (packed rows: transformers builds a block-causal one; padded rows: a padding one of the same shape,
    which the fake-tensor path's "packed" answer gives too), else ``_unpacked_sequences``."""

    if run.packing in MASKED_PACKING:
        yield
        return
    with _unpacked_sequences():
        yield


@contextlib.contextmanager
def _unpacked_sequences():
    """Take the attention path of a real unpadded (or packed, full-length) batch, not a fake-tensor one.

    ``--packing concat`` rows are full: ``memfit train`` passes an all-ones ``attention_mask``; transformers then reads its values, finds no
    padding and gives SDPA no mask (``is_causal=True``; GQA via ``enable_gqa``, k/v not repeated).
    Under fake tensors those values cannot be read, so transformers' ``find_packed_sequence_indices``
    would report "packed" and build a (B, 1, T, T) mask that the real run never has. Saying "no packed
    sequences" restores the real path. Eager attention builds its mask either way, as on the device.
    """

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def _preference_loss(t: _Traced, input_ids, labels):
    """The preference loss as ``training/step.py`` computes it (``input_ids``: 2B rows, chosen then rejected).

    DPO's reference forward runs under ``no_grad`` first: through the adapter switched off (LoRA), else
    through the traced model itself, standing in for the frozen copy (the same code and transient; the
    copy's weights are added by ``trace``); precomputed log-probabilities are a (2B,) tensor."""

    spec = preference.PreferenceLoss(t.run.method)
    policy = reference_policy(t.run)
    ref = None
    if policy == "precomputed":
        ref = torch.zeros(input_ids.shape[0])
    elif policy is not None:
        off = t.model.disable_adapter() if policy == "adapter-off" else contextlib.nullcontext()
        table = t.tracker._param_to_grad_hook_handles
        with torch.no_grad(), off:
            # PEFT freezes the adapters while they are off: no gradient hooks on them for this forward
            added = [p for p in t.model.parameters() if not p.requires_grad and p not in table]
            table.update({p: (_NoHook(), _NoHook()) for p in added})
            ref, _ = preference.sequence_logps(t.forward(input_ids=input_ids, use_cache=False).logits, labels)
        for p in added:
            del table[p]
        t.tracker.reset_mod_stats()  # the policy's forward is the root module's second call (DESIGN.md)
    logits = t.forward(input_ids=input_ids, use_cache=False).logits  # (2B, T, V)
    pairs = input_ids.shape[0] // 2
    norms = preference.Norms(torch.tensor(pairs), torch.tensor(pairs * input_ids.shape[1]))
    loss, _ = preference.micro_loss(spec, logits, labels, norms, ref)
    return loss


def trace(model: Any, run: RunConfig, *, device: str = "cuda", timeline: bool = False, steps: int = 2,
          stack=None):
    """Trace two training steps of ``model`` under ``run`` on fake tensors; report the second.

    Args:
        model: preset name, model folder or config.json path, a ``ModelSpec`` or a ``PretrainedConfig``.
        run: the memory settings of the run.
        device: ``"cuda"`` adds the estimator's ``other`` term (CUDA context, workspace, reserve);
            ``"cpu"`` reports tensor bytes only.
        timeline: also return the ``Timeline`` of the traced step.
        steps: 2 (default) reports the steady state; 1 records only the first step's forward and backward,
            which allocate the same as the second's but without optimizer state (``memory/derive.py``
            fits activation recipes from them at under half the cost).
        stack: the trainer and versions the run is for (``memfit.settings.stack``); the trace runs memfit's own
            (transformers, PEFT, the installed bitsandbytes) and says so where ``stack`` holds other tensors.

    Returns:
        ``MemoryBreakdown`` with ``method="exact"``, or ``(breakdown, timeline)``.

    Known error: CPU kernels stand in for CUDA ones (see the module docstring); tensor bytes are exact
    for what the CPU kernels allocate, to the byte, without allocator rounding.
    """
    check_supported(run, device)
    other_bytes({}, device)  # validates device before minutes of work
    api = _private_api()
    config = _hf_config(model)
    check_seq_len(run.seq_len, getattr(config, "max_position_embeddings", None))
    spec = _spec(model, config)
    resolved = resolve(spec, run)  # the run estimate and train build, asked once
    substituted = Substitutions()
    resolved = _traced_loss(resolved, device, substituted)

    run = pref.pair_forward_run(resolved.run)  # a preference method: one forward of chosen and rejected
    fake_mode = api["FakeTensorMode"](allow_non_fake_inputs=False)
    net = _build_model(config, resolved)
    _to_fake(net, fake_mode, run)
    hold_quant_state(net)  # a 4-bit base's absmax and code tables: weights, as the estimate counts them
    with fake_mode:
        optimizer = _build_optimizer(net, run, device)
    head_weight = net.get_output_embeddings().weight
    vocab = int(head_weight.shape[0])
    tracker = api["MemTracker"]()
    # MemTracker updates every module's peak after every op (O(ops x modules): most of a 7 B trace's
    # time); memfit takes its own peak from the recorder's samples, so that bookkeeping is skipped.
    tracker._update_peak_stats = lambda _state: None
    _skip_frozen_grad_hooks(tracker, net)
    tracker.track_external(net, optimizer)
    rows = _loss_rows(run, vocab, int(head_weight.shape[1]))
    recorder = _make_recorder(api, tracker, (run.micro_batch, run.seq_len), head_weight, rows)
    _mark_layers(net, recorder)
    stream = _allocation_stream(api, tracker, device, steps)
    traced = _Traced(net, optimizer, _autocast_forward(net, run), tracker, recorder, run, vocab, resolved)
    _watch_input_leaves(net, traced.input_leaves)
    micro_batches = min(run.grad_accum, 2)  # the second micro-batch accumulates into existing grads
    four_bit = run.quantize is Quantize.Q4
    untracked_warm_up = steps > 1 and not run.optimizer_in_backward
    model_type = str(getattr(config, "model_type", "the model"))
    if untracked_warm_up:
        # The first step only creates the optimizer state the second one holds: run it without the
        # tracker and the recorder (about half a trace's time), then hand the state to the tracker.
        with (_data_dependent_refused(model_type), _attention_path(run), traceable_experts(),
              cuda_kernels(device == "cuda", substituted), fake_mode, stream,
              gemm_4bit_steps(four_bit, api["TorchDispatchMode"]), _module_hierarchy_quiet()):
            _one_step(traced, micro_batches)
        tracker.track_external(optimizer)
    with (_data_dependent_refused(model_type), _attention_path(run),
          traceable_experts(), cuda_kernels(device == "cuda", substituted), fake_mode, tracker, recorder, stream,
          gemm_4bit_steps(four_bit, api["TorchDispatchMode"]), _module_hierarchy_quiet()):
        if steps > 1 and not untracked_warm_up:
            with _freed_grads_unseen(run):
                _one_step(traced, micro_batches)
        if run.optimizer_in_backward:
            optimizer.install_hooks()
        recorder.state_bytes = _state_bytes(optimizer, api["get_untyped_storages"])
        substituted.new_step()  # count the reported step's calls only
        recorder.recording = True
        if stream.recorded:  # the allocated peak: the reported step's (alloc_stream.py)
            stream.events.append(("reset_peaks",))
        with _freed_grads_unseen(run) if steps == 1 else contextlib.nullcontext():  # its first tracked step
            _one_step(traced, micro_batches, optimizer_step=steps > 1)
        recorder.recording = False
    stream.recording = False
    line = recorder.timeline
    other = other_bytes(line.samples[line.peak_index()] if line.samples else {}, device)
    line.other = other
    line.allocations = stream.events
    line.title = f"{getattr(config, 'model_type', 'model')}: seq {run.seq_len} x batch {run.micro_batch}"
    breakdown = _breakdown(config, traced, line, other)
    ref_copy = pref.reference_copy_bytes(spec, run)  # DPO's frozen copy: the same weights again, never traced twice
    if ref_copy:
        breakdown.weights += ref_copy
        breakdown.phase_peaks = {k: v + ref_copy for k, v in breakdown.phase_peaks.items()}
    breakdown.notes[2:2] = substituted.notes()
    _with_reserved(breakdown, stream.events if stream.recorded else None)
    if four_bit:
        breakdown.notes.insert(2, "4-bit base: bitsandbytes' Linear4bit and its ops traced on fake tensors, the "
                               "forward's gemm_4bit as dequantize + linear (memory/quantized_trace.py).")
    if run.compile:
        breakdown = with_compiled_saved_set(breakdown, line, _compiled_saved(config, resolved, api))

    breakdown.notes += stack_notes(stack, derived=True, traced=True) if stack is not None else []
    return (breakdown, line) if timeline else breakdown
