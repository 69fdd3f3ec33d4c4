"""One description of a run: what gets built for a ``RunConfig`` on a model, read by every path.

``resolve(spec, run)`` turns the flags into the facts estimate, trace, plan and train must agree on:

- the LoRA target modules: one matcher (``lora_targets``), case-insensitive, ``all-linear`` expanded
  the way PEFT expands it, combinations de-duplicated, validated against the model's real module names
  (``ModelSpec.module_names``, from its meta-device build);
- the attention implementation transformers will run (``attention``), asked of transformers itself
  by building the model on the meta device with the implementation requested (``auto``: none, so
  transformers picks: SDPA where the model supports it, else eager, e.g. Gemma 2 with soft-capping);
- the experts kernel of a mixture-of-experts model (``experts``): transformers' ``experts_implementation``,
  chosen so that the weights' dtype runs on it (torch's grouped_mm kernel takes bf16 only), and checked
  by transformers itself on a meta build;
- the optimizer's row of ``memfit.spec.optimizers.OPTIMIZERS``.

``ResolvedRun.run`` is the ``RunConfig`` with those answers written in (a concrete attention, the
target list handed to PEFT), so code that reads ``run.attn_implementation`` or ``run.lora.targets``
after resolution sees what is built.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from memfit.errors import UserError
from memfit.settings import validate
from memfit.settings.config import Attention, Experts, LoraSettings, RunConfig
from memfit.spec.linears import LinearShape
from memfit.spec.lora import wrap_lora
from memfit.spec.optimizers import OptimizerRow, check_device, row

#: PEFT's shorthand for every Linear/Conv1D but the output head (``peft.utils.INCLUDE_LINEAR_LAYERS_SHORTHAND``).
ALL_LINEAR = "all-linear"


# --------------------------------------------------------------------------------------------------
# LoRA targets
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraTargets:
    """The projections LoRA wraps, and how PEFT is told to wrap exactly those."""

    shapes: tuple[tuple[str, int, int], ...]
    """``(full module name, in_features, out_features)`` of every wrapped projection."""
    peft_targets: tuple[str, ...]
    """``target_modules`` for ``peft.LoraConfig``: the projections' last name components when those
    select exactly ``shapes`` under PEFT's suffix match, else their full names."""
    linears: tuple[Any, ...] = ()
    """The wrapped projections grouped like ``ModelSpec.linears`` (``LinearShape`` by last name and shape)."""
    names: tuple[str, ...] = ()
    """Last name components of the wrapped projections, sorted (``q_proj``, ``v_proj``)."""

    def describe(self) -> str:
        return f"{', '.join(self.names)} ({len(self.shapes)} modules)"


def _suffix_match(key: str, target: str) -> bool:
    """PEFT's rule for a list of ``target_modules`` (``check_target_module_exists``): the module's full
    name equals the target or ends with ``.target``. memfit applies it to lower-cased names."""
    return key == target or key.endswith("." + target)


_LORA: dict[int, tuple[Any, dict[tuple[str, ...], LoraTargets]]] = {}
"""Per spec object (kept alive here so its id stays unique): targets -> resolution. Keyed by identity,
because hashing a 7 B model's spec (hundreds of module names) costs more than the estimate."""


def lora_targets(spec, targets: tuple[str, ...]) -> LoraTargets:
    """Resolve ``--lora-targets`` against ``spec``'s projections (the one LoRA matcher of memfit).

    Case-insensitive; ``all-linear`` is every projection (PEFT's ``_maybe_include_all_linear_layers``:
    each Linear/Conv1D but the output head, ``ModelSpec.linear_modules``); any other target selects the
    projections whose full name equals it or ends with ``.target`` (PEFT's suffix rule). Targets may be
    combined (``all-linear,q_proj``); a module is wrapped once.

    Raises:
        UserError: a target matches no projection (the message names the projections that exist).
    """
    if len(_LORA) > 256:
        _LORA.clear()
    _held, answers = _LORA.setdefault(id(spec), (spec, {}))
    targets = tuple(targets)
    if targets not in answers:
        answers[targets] = _match(spec, targets)
    return answers[targets]


def _match(spec, targets: tuple[str, ...]) -> LoraTargets:
    projections = {name.lower(): (name, i, o) for name, i, o in spec.linear_modules}
    leaves = sorted({name.rsplit(".", 1)[-1] for name, _, _ in spec.linear_modules})
    chosen: dict[str, tuple[str, int, int]] = {}
    for target in targets:
        want = str(target).strip().lower()
        if want == ALL_LINEAR:
            hits = dict(projections)
        else:
            hits = {key: shape for key, shape in projections.items() if _suffix_match(key, want)}
        if not hits:
            raise UserError(f"--lora-targets {target} matches no projection of {spec.name}; its projections are: "
                            f"{', '.join(leaves) or 'none'}{' (or all-linear)' if leaves else ''}.")
        chosen.update(hits)
    shapes = tuple(sorted(chosen.values()))
    names = tuple(sorted({name.rsplit(".", 1)[-1] for name, _, _ in shapes}))
    return LoraTargets(shapes, _peft_targets(spec, shapes), _grouped(spec, shapes), names)


def _grouped(spec, shapes: tuple[tuple[str, int, int], ...]) -> tuple[Any, ...]:
    """``shapes`` as ``LinearShape`` groups (last name component, in, out), with their bias from ``spec``."""

    counts: dict[tuple[str, int, int], int] = {}
    for name, fan_in, fan_out in shapes:
        key = (name.rsplit(".", 1)[-1], fan_in, fan_out)
        counts[key] = counts.get(key, 0) + 1
    biases = {(lin.name, lin.in_features, lin.out_features): lin.bias for lin in spec.linears}
    return tuple(LinearShape(leaf, i, o, biases.get((leaf, i, o), False), n) for (leaf, i, o), n in counts.items())


def _peft_targets(spec, shapes: tuple[tuple[str, int, int], ...]) -> tuple[str, ...]:
    """Last name components when PEFT's suffix rule with them selects exactly ``shapes`` among all
    modules (not another module of the same name, such as an output head), else the full names."""
    wanted = {name for name, _, _ in shapes}
    leaves = sorted({name.rsplit(".", 1)[-1] for name in wanted})
    selected = {key for key in spec.module_names if any(_suffix_match(key, leaf) for leaf in leaves)}
    return tuple(leaves) if selected == wanted else tuple(sorted(wanted))


_ADAPTERS: dict[int, tuple[Any, dict[tuple[str, ...], int]]] = {}
"""Per spec object (kept alive here so its id stays unique): targets -> PEFT's adapter parameters at rank 1."""


def peft_adapter_params(spec, targets: tuple[str, ...]) -> int:
    """LoRA parameters PEFT creates at rank 1 for ``targets`` on ``spec``'s model (built on the meta
    device and wrapped by ``memfit.spec.lora.wrap_lora``, as train wraps it; ~0.3 s once per spec and
    targets). Every adapter matrix has one side of length r (r x in, out x r; PEFT's ``ParamWrapper``
    for a stacked (E, out, in) expert weight: r E x in and out x r E), so the count at rank r is r times
    this."""

    _held, answers = _ADAPTERS.setdefault(id(spec), (spec, {}))
    if targets not in answers:
        peft_targets = lora_targets(spec, targets).peft_targets
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(spec.hf_config))
            wrapped = wrap_lora(model, RunConfig(lora=LoraSettings(r=1, targets=peft_targets)), peft_targets)
        answers[targets] = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    return answers[targets]


# --------------------------------------------------------------------------------------------------
# Attention implementation
# --------------------------------------------------------------------------------------------------
_ATTENTION: dict[int, tuple[Any, dict[str, str]]] = {}
"""Per config object (kept alive here so its id stays unique): requested -> what transformers runs."""


def attention(spec, requested: Attention | str, compute_dtype: str = "bf16") -> str:
    """The attention implementation transformers runs for ``spec`` when ``requested`` (cached per config).

    Asked of transformers: the model is built on the meta device (no memory, ~0.1 s) with
    ``attn_implementation=requested`` (``auto``: None, transformers' own default, which the spec's own
    meta build already asked: ``ModelSpec.default_attention``), and its ``config._attn_implementation``
    is read back. transformers refuses what the model cannot run (SDPA
    for Gemma 2, whose soft-capping SDPA cannot apply); that refusal becomes one sentence. Flash
    attention without its package is refused before (``validate.check_attention_available``, the one
    sentence ``memfit train``'s preflight also says), and it needs half-precision compute.
    """
    requested = Attention(str(requested).lower())
    validate.check_attention_available(requested.value)  # the flash-attn package: refused in one place
    config = getattr(spec, "hf_config", None)
    if config is None:  # a hand-made spec: nothing to ask, take the request (auto: transformers' default)
        return "sdpa" if requested is Attention.AUTO else requested.value
    held, answers = _ATTENTION.setdefault(id(config), (config, {}))
    if requested is Attention.AUTO and getattr(spec, "default_attention", ""):
        answers.setdefault(requested.value, spec.default_attention)  # the spec's own meta build asked for none
    if requested.value not in answers:
        answers[requested.value] = _ask_transformers(spec, config, requested)
    chosen = answers[requested.value]
    if "flash" in chosen and compute_dtype == "fp32":
        raise UserError(f"--attn-implementation {requested.value} runs in fp16/bf16 only; add --mixed-precision bf16 "
                        "(or --dtype bf16), or use sdpa.")
    return chosen


def _ask_transformers(spec, config, requested: Attention) -> str:
    wanted = None if requested is Attention.AUTO else requested.value
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=wanted)
    except (ValueError, ImportError) as err:
        reason = _first_sentence(err)
        raise UserError(f"{spec.name} cannot run --attn-implementation {requested.value} ({reason}); "
                        "use --attn-implementation auto to let transformers choose, or eager.") from None
    return str(model.config._attn_implementation)


def _first_sentence(err: Exception, limit: int = 160) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_attention(implementation: str) -> Attention:
    """The ``Attention`` member for an implementation transformers reports (flash kernels -> flash)."""
    if "flash" in implementation:
        return Attention.FLASH
    try:
        return Attention(implementation)
    except ValueError:
        return Attention.SDPA  # other fused kernels (flex, paged) save what SDPA saves in memfit's model


# --------------------------------------------------------------------------------------------------
# Experts implementation (mixture-of-experts models)
# --------------------------------------------------------------------------------------------------
_EXPERTS: dict[int, tuple[Any, dict[str, str]]] = {}
"""Per config object (kept alive here so its id stays unique): requested kernel -> what transformers runs."""


def experts(spec, requested: Experts | str, weight_dtype: str) -> str:
    """The experts kernel transformers runs for ``spec`` with weights in ``weight_dtype`` (``""``: no MoE layer).

    transformers' default is ``grouped_mm`` (``PreTrainedModel.get_correct_experts_implementation``), whose
    kernel (``torch.nn.functional.grouped_mm``) takes bf16 only on CUDA (SM80+), and transformers casts the
    tokens to the *weights'* dtype before it (the kernel is not autocast-enabled), so fp32 weights fail
    under AMP too ("Expected inputs of BF16 type"); torch's fake-tensor kernel, which ``--exact`` and the
    derived recipes trace, has the same rule. ``auto`` therefore chooses grouped_mm for bf16 weights and
    the model's own per-expert loop (``eager``: any dtype, autocast applies) otherwise; the same choice on
    CPU, where grouped_mm's kernel would run fp32 but could not be traced. A model transformers cannot
    switch (its default is not grouped_mm) keeps its default. The kernel asked for is checked by
    transformers on a meta build (cached per config).

    Raises:
        UserError: grouped_mm with weights that are not bf16, or a kernel the model cannot run.
    """
    default = getattr(spec, "default_experts", "")
    if not default:
        return ""
    requested = Experts(str(requested).lower())
    bf16 = str(weight_dtype) == "bf16"
    if requested is Experts.GROUPED_MM and not bf16:
        raise UserError(f"--experts-implementation grouped_mm runs bf16 expert weights only (torch's grouped_mm "
                        f"kernel; these are {weight_dtype}); add --dtype bf16, or use eager.")
    if requested is Experts.AUTO:
        if default != Experts.GROUPED_MM.value:
            return default
        requested = Experts.GROUPED_MM if bf16 else Experts.EAGER
    config = getattr(spec, "hf_config", None)
    if config is None or requested.value == default:
        return requested.value
    _held, answers = _EXPERTS.setdefault(id(config), (config, {}))
    if requested.value not in answers:
        answers[requested.value] = _ask_experts(spec, config, requested)
    return answers[requested.value]


def _ask_experts(spec, config, requested: Experts) -> str:
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation=requested.value)
    except (ValueError, ImportError, KeyError) as err:
        raise UserError(f"{spec.name} cannot run --experts-implementation {requested.value} "
                        f"({_first_sentence(err)}); use --experts-implementation auto.") from None
    return str(model.config._experts_implementation)


def experts_reason(chosen: str, requested: Experts, weight_dtype: str) -> str:
    """Why ``chosen`` runs, for the line every estimate and training preamble prints."""
    if requested is not Experts.AUTO:
        return f"as requested ({requested.value})"
    if chosen == Experts.EAGER.value and str(weight_dtype) != "bf16":
        return f"the model's per-expert loop: grouped_mm takes bf16 weights only, these are {weight_dtype}"
    return "grouped kernel for bf16 weights" if chosen == Experts.GROUPED_MM.value else "transformers' default"


# --------------------------------------------------------------------------------------------------
# The resolved run
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResolvedRun:
    """A ``RunConfig`` resolved against one model: what estimate, trace, plan and train build."""

    run: RunConfig
    """The run with the answers written in: concrete attention, PEFT's target list."""
    requested: RunConfig
    """The run as the user gave it."""
    attention: str
    """What transformers runs (``sdpa``, ``eager``, ``flash_attention_2``, ...)."""
    lora: LoraTargets | None
    """Wrapped projections (None for a full fine-tune)."""
    optimizer: OptimizerRow
    trainable_params: int
    experts: str = ""
    """The experts kernel transformers runs (``grouped_mm``, ``eager``, ...); empty without MoE layers."""

    def describe(self) -> list[str]:
        """The lines every estimate and training preamble prints."""
        asked = self.requested.attn_implementation.value
        how = "chosen by transformers" if asked == Attention.AUTO.value else f"as requested ({asked})"
        lines = [f"attention: {self.attention}, {how}."]
        if self.experts:
            why = experts_reason(self.experts, self.requested.experts_implementation, str(self.run.dtype))
            lines.append(f"experts: {self.experts} ({why}).")
        if self.lora is not None:
            lines.append(f"LoRA targets: {self.lora.describe()}, {self.trainable_params:,} trainable parameters.")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"attn_implementation": self.attention,
                "lora_targets": list(self.lora.names) if self.lora else [],
                "lora_modules": len(self.lora.shapes) if self.lora else 0,
                "experts_implementation": self.experts,
                "optimizer": self.optimizer.member.value,
                "trainable_params": int(self.trainable_params)}


def _with(run, **changes: Any):
    """``run`` (a ``RunConfig``, or a nested group of it) with ``changes`` written in, without ``RunConfig.__post_init__``'s checks: the values are
    already valid members, and the planner resolves hundreds of runs per search (``replace`` re-validates
    every field, ~0.5 ms each)."""
    if all(getattr(run, k) == v for k, v in changes.items()):
        return run
    out = copy.copy(run)
    for key, value in changes.items():
        object.__setattr__(out, key, value)
    return out


def resolve(spec, run: RunConfig, device: str | None = None) -> ResolvedRun:
    """Resolve ``run`` against ``spec`` (a ``ModelSpec``); ``device`` (``cuda``/``cpu``) also checks the
    optimizer runs there. Raises ``UserError`` (one sentence) for what the model or device cannot run."""
    opt = row(run.optimizer)
    if device is not None:
        check_device(run.optimizer, device)
    chosen = attention(spec, run.attn_implementation, run.compute_dtype())
    kernel = experts(spec, run.experts_implementation, str(run.dtype))
    lora = lora_targets(spec, tuple(run.lora.targets)) if run.is_lora() else None
    resolved = _with(run, attn_implementation=as_attention(chosen),
                     experts_implementation=Experts(kernel) if kernel in {e.value for e in Experts} else run.experts_implementation,
                     lora=_with(run.lora, targets=lora.peft_targets if lora else run.lora.targets))
    trainable = spec.trainable_params(resolved)
    return ResolvedRun(resolved, run, chosen, lora, opt, trainable, kernel)
