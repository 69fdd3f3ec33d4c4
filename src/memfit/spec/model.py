"""Resolve a model argument (preset name, local checkpoint folder or config.json) into its config.

``resolve_config`` is what ``train`` and ``estimate`` share: configs are facts, weights are never
needed to estimate. Presets live in ``presets/architectures.yaml``.

Size: ``spec_from_config`` is over 60 lines because it is one constructor call naming every field of
``ModelSpec`` as read from the built meta model; the fields read best side by side.
"""

# Inside functions: torch (2.6 s), transformers' model classes (2.8 s) and spec.resolved (4.2 s; python -X importtime, 2026-12-06, this shared 2-core machine):
# spec.model names and checks models on torch-free paths (tests/test_faults_inputs.py).
from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from memfit.errors import UserError
from memfit.files import user_path
from memfit.integrations import hub
from memfit.integrations.hf_compat import config_value, tied_as_built
from memfit.settings import validate
from memfit.spec.linears import LinearShape

try:  # huggingface_hub >= 0.31 validates configs with strict dataclasses (transformers 5)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # older hub: transformers raises ValueError/TypeError only
    class StrictDataclassError(Exception):
        pass


@lru_cache(maxsize=1)
def load_presets() -> dict[str, dict[str, Any]]:
    """All architecture presets, keyed by name (lower case)."""
    text = resources.files("memfit.presets").joinpath("architectures.yaml").read_text()
    return {str(k).lower(): v for k, v in yaml.safe_load(text).items()}


def preset_names() -> list[str]:
    return sorted(load_presets())


def is_preset(name: str) -> bool:
    return str(name).lower() in load_presets()


def unknown_model_error(name: str) -> UserError:
    close = difflib.get_close_matches(str(name).lower(), preset_names(), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else " Run `memfit presets` to list them."
    return UserError(f"{name!r} is neither a preset, a local model folder or config.json, nor a Hugging Face Hub id "
                     f"(org/name).{hint}")


def model_kind(model: str, revision: str | None = None) -> str:
    """What a model argument names: ``"preset"``, ``"hub"`` (``org/name``), ``"config.json"`` (a JSON file) or
    ``"folder"`` (a local folder holding config.json); else one sentence. Nothing heavy is imported, so the CLI
    checks a typo here before torch and transformers load (seconds), and ``resolve_config`` branches on it.

    Raises:
        UserError: ``--revision`` for what is no Hub id, a folder without config.json, or a name that is none
            of the four.
    """

    if not str(model).strip():  # an unset shell variable: "" is the current folder to pathlib
        raise UserError("--model is empty; name a preset, a model folder, a config.json or a Hub id (org/name).")
    hub.check_revision(model, revision)
    if is_preset(model):
        return "preset"
    if hub.is_hub_id(model):
        return "hub"
    path = user_path(model)
    if path.is_file() and path.suffix == ".json":
        return "config.json"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json, so it is not a Hugging Face model folder.")
        return "folder"
    raise unknown_model_error(model)


def preset_config(name: str):
    """A transformers ``PretrainedConfig`` built from a preset (no download)."""
    from transformers import AutoConfig

    entry = load_presets()[str(name).lower()]
    cfg = dict(entry["config"])
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def resolve_config(model: str, trust_remote_code: bool = False, revision: str | None = None):
    """Preset name, checkpoint folder, ``config.json`` path or Hub id -> ``PretrainedConfig`` of a causal LM.

    A Hub id (``org/name``, ``revision`` optional) is read from the Hugging Face cache, fetching only its
    config.json when the cache lacks it (``memfit.integrations.hub``). Raises ``UserError`` (one sentence) for unknown
    names and configs that are not causal LMs.
    """

    kind = model_kind(model, revision)  # a typo refused before transformers loads (seconds)
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kind == "preset":
        config = preset_config(model)
    elif kind == "hub":
        folder = hub.fetch(model, revision, files="config", trust_remote_code=trust_remote_code).path
        config = _folder_config(folder, f"{model}'s config.json", trust_remote_code)
    else:
        path = user_path(model)
        if kind == "config.json":
            _check_json(path)  # one sentence for a file that is no model config
            # transformers' own reading: it decodes the floats JSON cannot hold (mamba2's time_step_limit
            # [0.0, {"__float__": "Infinity"}], as its save_pretrained writes them)
            data = dict(PretrainedConfig.get_config_dict(str(path))[0])
            validate.check_model_config(SimpleNamespace(**data), model)  # before transformers divides by it
            model_type = data.pop("model_type")
            if str(model_type) not in CONFIG_MAPPING:
                raise UserError(f"{path} has model_type {model_type!r}, which this transformers does not know.")
            try:
                config = AutoConfig.for_model(model_type, **data)
            except (ValueError, TypeError, StrictDataclassError) as err:
                raise UserError(f"{path} holds a config transformers cannot read: {_one_line(err)}") from None
        else:
            config = _folder_config(path, str(path), trust_remote_code)
    check_causal_lm(config, model)
    validate.check_model_config(config, model)
    validate.check_rope_with_transformers(config, model)
    return config


def _folder_config(path: Path, name: str, trust_remote_code: bool):
    """The config of a model folder (a local checkpoint or a Hub snapshot), or one sentence naming ``name``."""
    from transformers import AutoConfig

    data = _check_json(path / "config.json", name)
    validate.check_model_config(SimpleNamespace(**data), name)  # before transformers divides by it
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, StrictDataclassError) as err:
        raise UserError(f"{name} holds a config transformers cannot read: {_one_line(err)}") from None


def _check_json(path: Path, name: str | None = None) -> dict:
    """A config.json's contents: a JSON object with a model_type, or a one-sentence ``UserError``."""
    name = name or str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        what = "empty" if not err.doc.strip() else f"not valid JSON ({err.msg} at line {err.lineno})"
        raise UserError(f"{name} is {what}, so it is not a model config.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{name} cannot be read ({getattr(err, 'strerror', None) or err}).") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"{name} has no model_type, so it is not a transformers model config.")
    return dict(data)


def _one_line(err: Exception, limit: int = 200) -> str:
    """An exception's message on one line (validation errors put their cause on the next), cut to ``limit``."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_seq_len(seq_len: int, max_positions: int | None) -> None:
    """Raise ``UserError`` when ``seq_len`` exceeds the model's positions (``None``/0: no limit known).

    ``estimate``, ``plan`` and ``train`` share it, so no command answers for a run ``train`` refuses.
    """
    if max_positions and seq_len > max_positions:
        raise UserError(f"--seq-len {seq_len} is beyond the model's {max_positions} positions; "
                        f"use --seq-len {max_positions} or less.")


def check_causal_lm(config, name: str) -> None:
    """Raise ``UserError`` unless transformers has a causal-LM class for this config.

    Encoder families (BERT, RoBERTa, ...) also have a ``*LMHeadModel`` in transformers' causal-LM
    mapping, but it only masks future tokens when the config says ``is_decoder=True``; otherwise each
    position sees the token it must predict, so such a config is refused too.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(
            f"{name!r} is a {config.model_type!r} model, which transformers cannot build as a causal language model."
        )
    if type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False):
        raise UserError(
            f"{name!r} is a {config.model_type!r} encoder without is_decoder=true, so it would see the tokens it "
            "predicts; set is_decoder to true in its config to train it as a causal language model."
        )


# --------------------------------------------------------------------------------------------------
# ModelSpec: the architecture numbers the estimator needs, counted exactly from a meta-device build.
# --------------------------------------------------------------------------------------------------

#: Families whose decoder layer the analytic estimator models op by op (see memory/estimate.py). Qwen3 is
#: not one: its per-head q/k RMSNorms save tensors the Llama recipe lacks (-6.5% on a tiny config), so it
#: is derived from traces (memory/derive.py).
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "phi3": "phi3",
    "gpt2": "gpt2",
}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of a causal LM, no weights. Built by ``spec_from_config``."""

    name: str
    model_type: str
    params: int
    """Exact total parameter count (a tied embedding matrix counted once, as checkpoints do)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    family: str = "llama"
    """Decoder-layer family the estimator models: llama, gemma, gemma2, phi3, gpt2 (else ``generic``)."""
    embedding_params: int = 0
    """Token embedding (and learned position embedding) parameters."""
    lm_head_params: int = 0
    """Output projection parameters when not tied to the embedding (0 when tied)."""
    linears: tuple[LinearShape, ...] = ()
    """Every linear/Conv1D projection inside the decoder layers (the LoRA / quantization targets)."""
    buffer_bytes: int = 0
    """Bytes of buffers (rotary ``inv_freq`` ...), at the dtype the model builds them in (fp32)."""
    gated_mlp: bool = True
    hidden_act: str = "silu"
    sliding_window: int | None = None
    final_logit_softcapping: float | None = None
    linear_modules: tuple[tuple[str, int, int], ...] = ()
    """Every projection LoRA can wrap, by full module name: ``(name, in_features, out_features)`` (the
    Linear/Conv1D modules but the output head: what PEFT's ``all-linear`` expands to)."""
    module_names: tuple[str, ...] = ()
    """Full names of all modules of the model (LoRA targets are matched against these)."""
    default_attention: str = ""
    """The attention implementation transformers chose when the meta build asked for none (``auto``)."""
    default_experts: str = ""
    """The experts kernel transformers chose when the meta build asked for none; empty for a model without
    mixture-of-experts layers (no module built by transformers' ``use_experts_implementation``)."""
    expert_params: int = 0
    """Parameters of the experts' stacked weights (every expert of every MoE layer: ``(E, out, in)`` tensors
    and their biases), a part of ``params``."""
    moe_layers: int = 0
    """Decoder layers with routed experts (deepseek_v3's first ``first_k_dense_replace`` are dense)."""
    num_experts: int = 0
    """Routed experts per MoE layer."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    expert_intermediate: int = 0
    """One expert's MLP width (its down projection's input)."""
    shared_expert_params: int = 0
    """Parameters of shared experts (qwen2_moe, deepseek_v3): dense MLPs every token runs."""
    layer_kinds: tuple[str, ...] = ()
    """Per decoder layer, its kind (``layer_kinds``): layers of one kind run the same code on the same
    shapes, so a derived recipe traces one of each (``memory/derive.py``); empty when not built from a model."""
    hf_config: Any = field(default=None, compare=False, repr=False)

    # derived --------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_params(self) -> int:
        """Weights (no biases) of the decoder-layer projections: what 4/8-bit quantization packs."""
        return sum(lin.weight_params for lin in self.linears)

    @property
    def linear_bias_params(self) -> int:
        return sum(lin.out_features * lin.count for lin in self.linears if lin.bias)

    def lora_linears(self, targets: tuple[str, ...]) -> list[LinearShape]:
        """The projections PEFT wraps for ``--lora-targets targets``, grouped like ``linears``.

        The matching is ``memfit.spec.resolved.lora_targets`` (the one matcher estimate, trace, plan and
        train share); it raises ``UserError`` for a target that matches no projection.
        """
        from memfit.spec.resolved import lora_targets

        return list(lora_targets(self, tuple(targets)).linears)

    def lora_params(self, run) -> int:
        """LoRA adapter parameters: ``r * (in + out)`` per wrapped projection (A is r x in, B is out x r).

        A mixture-of-experts model: PEFT's own count (``resolved.peft_adapter_params``), since PEFT with
        transformers' weight conversions wraps the stacked 3-D expert weights for the experts' projection
        names (``ParamWrapper``: ``r * E * (in + out)`` per tensor) and leaves the dense and shared-expert
        MLPs of those names alone (deepseek_v3: 21,696 by the formula, 35,008 built at r 8)."""
        if not run.lora.r:
            return 0
        if self.default_experts:  # PEFT maps expert names onto the stacked 3-D weights: ask it
            from memfit.spec.resolved import peft_adapter_params

            return run.lora.r * peft_adapter_params(self, tuple(run.lora.targets))
        return sum(run.lora.r * (lin.in_features + lin.out_features) * lin.count
                   for lin in self.lora_linears(run.lora.targets))

    def trainable_params(self, run) -> int:
        """All parameters for a full fine-tune, the adapters only for LoRA/QLoRA."""
        return self.lora_params(run) if run.lora.r else self.params

    def check_lora_targets(self, run) -> None:
        """Raise ``UserError`` when a LoRA target matches no projection (names the ones that exist)."""
        if run.lora.r:
            self.lora_linears(run.lora.targets)


def _linear_shapes(model) -> tuple[tuple[LinearShape, ...], Any, tuple[tuple[str, int, int], ...]]:
    """Every Linear/Conv1D but the output head, grouped by its last name component, the head, and the projections
    LoRA can wrap one by one with their full names (PEFT's ``all-linear``, less a router: a ``Linear`` subclass named
    ``...Router`` with a forward of its own, which returns the routing, not a tensor: llama4's ``Llama4Router``
    ``(scores, logits)``, phimoe's ``PhimoeTopKRouter``; PEFT's LoRA layer, wrapping it as a Linear, fails at the first
    forward. Other subclasses, falcon's ``FalconLinear``, return a tensor and stay)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    groups: dict[str, list] = {}
    modules = []
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear):
            shape = (module.in_features, module.out_features, module.bias is not None)
        elif isinstance(module, Conv1D):
            shape = (module.weight.shape[0], module.weight.shape[1], module.bias is not None)
        else:
            continue
        groups.setdefault(name.split(".")[-1], []).append(shape)
        if not _is_router(module):
            modules.append((name, shape[0], shape[1]))
    out = []
    for name, shapes in groups.items():
        for shape in sorted(set(shapes)):
            out.append(LinearShape(name, shape[0], shape[1], shape[2], shapes.count(shape)))
    return tuple(out), head, tuple(modules)


def _is_router(module) -> bool:
    """A mixture-of-experts router built as a ``Linear`` subclass (``_linear_shapes``)."""
    import torch

    kind = type(module)
    return (isinstance(module, torch.nn.Linear) and kind.forward is not torch.nn.Linear.forward
            and kind.__name__.endswith("Router"))


def expert_modules(model) -> list:
    """The modules whose forward transformers' ``use_experts_implementation`` dispatches (the stacked
    experts of a mixture-of-experts layer): its ``__init__`` gives each an ``_is_expert_parallel`` flag."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate")]


def _moe_numbers(model, config) -> dict[str, int]:
    """``ModelSpec``'s routing numbers, read off the built experts modules (none: zeros)."""
    experts = expert_modules(model)
    if not experts:
        return {}
    first = experts[0]
    down = first.down_proj  # (E, H, I), or (E, I, H) when transposed
    width = int(down.shape[1] if first.is_transposed else down.shape[2])
    shared = sum(p.numel() for name, p in model.named_parameters() if "shared_expert" in name)
    return {"moe_layers": len(experts), "num_experts": int(first.num_experts),
            "experts_per_token": _config_int(config, "num_experts_per_tok", "moe_topk", default=1),
            "expert_intermediate": width, "shared_expert_params": shared}


def _config_int(config, *names: str, default: int = 0) -> int:
    """The first of ``names`` the config has, as an int; a per-layer list (gemma3n's ``intermediate_size``) as its
    largest entry, the widest layer's (what a peak of one layer at a time reads)."""
    for name in names:
        value = config_value(config, name)
        if isinstance(value, list | tuple) and value:
            return int(max(value))
        if value is not None:
            return int(value)
    return default


def _embedding_params(model) -> int:
    """Parameters of the embedding tables outside the decoder layers: the tokens' and learned positions'
    (GPT-2's ``wpe``, OPT's ``embed_positions``), each table once. Matrices, so train's parameter groups
    put them with the projections, and the single-tensor optimizer loop meets the positions' right after
    the tokens' (``memory.states._per_tensor_peak``: OPT's optimizer phase was -4.9% without them)."""
    import torch

    layers = set(getattr(model, "_no_split_modules", None) or ())
    inside = {id(p) for m in model.modules() if type(m).__name__ in layers for p in m.parameters()}
    tables = {id(m.weight): m.weight.numel() for m in model.modules()
              if isinstance(m, torch.nn.Embedding) and id(m.weight) not in inside}
    return sum(tables.values())


def layer_kinds(model, config) -> tuple[str, ...]:
    """Each decoder layer's kind: its class, its ``layer_types`` entry where the config has one (lfm2's
    ``conv``/``full_attention``, gemma's sliding/full), and the classes of its direct submodules where layers of
    one class differ in them (jamba's mamba layers with an MoE or a dense MLP; deepseek_v3's dense first layer)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    types = getattr(config, "layer_types", None)
    types = list(types) if isinstance(types, list | tuple) and len(types) == len(layers) else None
    labels = [type(m).__name__ + (f" ({types[i]})" if types else "") for i, m in enumerate(layers)]
    parts = [{type(c).__name__ for c in m.children()} for m in layers]
    out = []
    for label, own in zip(labels, parts, strict=True):
        shared = set.intersection(*(p for lab, p in zip(labels, parts, strict=True) if lab == label))
        out.append(label + (f" with {', '.join(sorted(own - shared))}" if own - shared else ""))
    return tuple(out)


def spec_from_config(config, name: str, trust_remote_code: bool = False) -> ModelSpec:
    """Count a config's parameters exactly by building its model on the meta device (no memory).

    transformers builds the real module tree, so every architecture it knows is counted right
    (biases, norms, tied heads); ``model.parameters()`` yields a tied matrix once.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import __version__ as transformers_version

    try:
        with torch.device("meta"):
            # A copy: from_config writes the chosen dtype and attention implementation into the config.
            # attn_implementation=None: transformers' own choice for the model (``--attn-implementation auto``).
            model = tied_as_built(AutoModelForCausalLM.from_config(
                copy.deepcopy(config), trust_remote_code=trust_remote_code, attn_implementation=None))
    except (AttributeError, KeyError, TypeError, ValueError) as err:  # the modeling code on this config
        raise UserError(f"transformers {transformers_version} cannot build {name} from its config "
                        f"({_one_line(err)}).") from None
    linears, head, linear_modules = _linear_shapes(model)
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings()
    embedding_params = _embedding_params(model)
    tied = head is not None and head.weight is embed.weight
    head_params = 0 if tied or head is None else head.weight.numel()
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    num_heads = _config_int(config, "num_attention_heads", "n_head")
    hidden = _config_int(config, "hidden_size", "n_embd")
    head_dim = _config_int(config, "head_dim", default=hidden // max(num_heads, 1))
    act = str(config_value(config, "hidden_activation") or config_value(config, "hidden_act")
              or config_value(config, "activation_function") or "gelu")
    names = {lin.name for lin in linears}
    window = config_value(config, "sliding_window")
    if config_value(config, "use_sliding_window") is False:
        window = None
    return ModelSpec(
        name=name,
        model_type=config.model_type,
        params=params,
        vocab_size=_config_int(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_config_int(config, "intermediate_size", "n_inner", default=4 * hidden),
        num_layers=_config_int(config, "num_hidden_layers", "n_layer"),
        num_heads=num_heads,
        num_kv_heads=_config_int(config, "num_key_value_heads", default=num_heads),
        head_dim=head_dim,
        max_position_embeddings=_config_int(config, "max_position_embeddings", "n_positions"),
        tie_word_embeddings=tied,
        family=FAMILIES.get(config.model_type, "generic"),
        embedding_params=embedding_params,
        lm_head_params=head_params,
        linears=linears,
        buffer_bytes=buffer_bytes,
        gated_mlp=bool(names & {"gate_proj", "gate_up_proj", "w1"}),
        hidden_act=act,
        sliding_window=int(window) if window else None,
        final_logit_softcapping=config_value(config, "final_logit_softcapping"),
        linear_modules=linear_modules,
        module_names=tuple(name for name, _ in model.named_modules() if name),
        default_attention=str(model.config._attn_implementation or ""),
        default_experts=str(model.config._experts_implementation or "") if expert_modules(model) else "",
        expert_params=sum(p.numel() for m in expert_modules(model) for p in m.parameters()),
        **_moe_numbers(model, config),
        layer_kinds=layer_kinds(model, config),
        hf_config=config,
    )


def load_spec(model, trust_remote_code: bool = False, revision: str | None = None) -> ModelSpec:
    """Preset name, local folder, config.json or Hub id (at ``revision``) -> ``ModelSpec``; a ``ModelSpec`` is
    returned as it is (a run that resolved its model once passes it on)."""
    if isinstance(model, ModelSpec):
        return model
    return _load_spec(str(model), trust_remote_code, revision)


def source_config(source):
    """``resolve_config`` of a run's ``memfit.settings.config.ModelSource``: its model at its revision, its own
    code allowed or not (the three settings travel together; estimate and plan, with no ``ModelSource``, call
    ``resolve_config`` with them loose)."""
    return resolve_config(source.model, source.trust_remote_code, source.revision)


def source_spec(source) -> ModelSpec:
    """``load_spec`` of a run's ``memfit.settings.config.ModelSource`` (cached as ``load_spec`` is)."""
    return load_spec(source.model, source.trust_remote_code, source.revision)


@lru_cache(maxsize=64)
def _load_spec(model: str, trust_remote_code: bool, revision: str | None) -> ModelSpec:
    config = resolve_config(model, trust_remote_code, revision)
    name = model.lower() if is_preset(model) else model
    return spec_from_config(config, name, trust_remote_code)
