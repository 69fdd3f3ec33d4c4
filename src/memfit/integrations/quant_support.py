"""Where bitsandbytes runs, and in which dtype it computes: the one place memfit decides both.

Read by ``training.setup.preflight`` (``--quantize``), ``optimizers.check_device`` (``--optimizer
adamw-8bit``), ``training.budget`` (whether ``memfit train --budget`` may be offered QLoRA), the model
builder (``bnb_config``) and the estimator (``compute_bytes``), so none of them keeps its own copy.

Facts (bitsandbytes 0.50.2, read in its source and run on this project's CPU-only machine with torch
2.13 CPU):

- CPU: since the multi-backend release bitsandbytes ships ``libbitsandbytes_cpu.so`` and registers CPU
  kernels for its ops (``bitsandbytes/backends/cpu/ops.py``; ``bitsandbytes.supported_torch_devices``
  lists ``cpu``). ``Linear4bit`` (NF4, double quantization), ``Linear8bitLt`` (which on CPU trains through
  ``MatMul8bitFp``: it dequantizes the int8 weight and runs a float matmul, ``autograd/_functions.py``
  ``matmul``) and ``bnb.optim.AdamW8bit`` all run and train there. memfit verified 0.50; older releases
  are refused on CPU with the version needed.
- CUDA: every release memfit supports (``>=0.43``) runs.
- Compute dtype: ``Linear4bit.forward`` casts its input to ``bnb_4bit_compute_dtype`` and its output back
  to the input's dtype. memfit sets it to the run's compute dtype (``compute_dtype``): the autocast dtype
  under ``--mixed-precision bf16|fp16``, else the stored ``--dtype``. On CPU memfit's default is fp32 (no
  autocast), so a CPU QLoRA computes in fp32; a GPU run with bf16 autocast computes in bf16 as before.
- CPU inference path: on a CPU with AVX512-BF16, ``Linear4bit.forward`` outside training (``not
  self.training`` and an input without grad: every evaluation and sample) repacks its weight in place
  for a fused bf16 kernel (``functional._convert_weight_packed_for_cpu``), which asserts ``out_features %
  32 == 0`` ("N must be divisible by block_n"; an intermediate size of 176 fails) and leaves the weight
  in that layout, so later training steps run through the same inference kernel too
  (``autograd/_functions.py`` ``matmul_4bit``). memfit keeps every layer on the path training uses
  (``keep_training_path``): any shape runs, and evaluation computes what the estimate priced.
"""

# Inside functions: bitsandbytes (optional: the quant extra; 6.7 s to import; python -X importtime, 2026-12-06, this shared 2-core machine), torch (2.6 s),
# transformers and safetensors.torch (1.1 s): the support checks run on torch-free paths.
from __future__ import annotations

import math
import tempfile

from memfit.errors import UserError
from memfit.integrations.hf_compat import no_loading_bar
from memfit.integrations.versions import installed_version as version_of
from memfit.units import torch_dtype_name

#: The extra that installs bitsandbytes (``pyproject.toml``: ``quant``; ``cuda`` is kept as an alias).
EXTRA = "quant"

#: The oldest bitsandbytes memfit runs on CPU (``major.minor``): the release verified here.
MIN_CPU_VERSION = (0, 50)

#: The oldest bitsandbytes memfit runs on CUDA.
MIN_CUDA_VERSION = (0, 43)


def installed_version() -> str | None:
    """The installed bitsandbytes version, or None (read from package metadata: nothing is imported)."""

    return version_of("bitsandbytes")


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return ()


def refusal(device: str, what: str, version: str | None = None, *, probe: bool = True) -> str | None:
    """Why ``what`` (``--quantize 4bit``, ``--optimizer adamw-8bit``) cannot run on ``device`` (``cuda``
    or ``cpu``), in one sentence; None when it can.

    ``version``: the bitsandbytes version to judge (default: the installed one; tests pass others).
    """
    version = installed_version() if version is None else version
    if not version:
        return (f"{what} needs bitsandbytes, which is not installed; install it with "
                f"pip install 'memfit[{EXTRA}]'.")
    need = MIN_CUDA_VERSION if device == "cuda" else MIN_CPU_VERSION
    if _release(version) < need:
        where = "a CUDA GPU" if device == "cuda" else "the CPU"
        return (f"{what} on {where} needs bitsandbytes >= {'.'.join(map(str, need))} (installed: {version}); "
                f"upgrade it with pip install -U 'memfit[{EXTRA}]'.")
    if probe and device not in _supported_devices():
        return f"{what} cannot run here: the installed bitsandbytes {version} has no {device.upper()} backend."
    return None


def _supported_devices() -> set[str]:
    """Device types the installed bitsandbytes registers kernels for (``supported_torch_devices``)."""
    try:
        import bitsandbytes
    except Exception:  # noqa: BLE001 - a broken install (missing native library) runs nowhere
        return set()
    return set(getattr(bitsandbytes, "supported_torch_devices", {"cuda"}))


def runs_on(device: str) -> bool:
    """Whether memfit can run bitsandbytes (QLoRA, 8-bit AdamW) on ``device`` (``cuda`` or ``cpu``)."""
    return refusal(device, "bitsandbytes", probe=True) is None


def check(device: str, what: str) -> None:
    """Raise ``UserError`` (one sentence) when ``what`` cannot run on ``device``."""
    reason = refusal(device, what)
    if reason:
        raise UserError(reason)


def compute_dtype(run) -> str:
    """The dtype quantized layers compute in (``bnb_4bit_compute_dtype``): ``bf16``/``fp16`` under that
    autocast, else the stored ``--dtype`` (``fp32`` by default; memfit's CPU default has no autocast)."""
    precision = str(run.mixed_precision)
    return precision if precision in ("bf16", "fp16") else str(run.dtype)


def compute_bytes(run) -> int:
    """Bytes per element of ``compute_dtype(run)``."""
    return 4 if compute_dtype(run) == "fp32" else 2


def upcasts_fully(run) -> bool:
    """Whether a quantized base of ``run`` is prepared by PEFT's ``prepare_model_for_kbit_training`` with its
    fp32 cast (``--qlora-upcast full``), rather than memfit's lean preparation (the default)."""
    return str(run.quantize) != "none" and str(run.qlora_upcast) == "full"


def unquantized_dtype(run) -> str:
    """The dtype of a quantized base's unquantized parameters (embeddings, norms, output head, biases), hence
    of its residual stream, which starts at the embedding: the one rule the builder (``memfit.builder.parts``), the
    estimate (``memory.states``, ``memory.activations``, ``memory.quantized``) and plan read.

    - ``full``: PEFT's ``prepare_model_for_kbit_training`` casts every fp16/bf16 parameter that is not a
      ``Params4bit`` to fp32 (peft 0.21 ``utils/other.py``): ``fp32`` whatever ``--dtype`` says, and every
      activation the stream feeds is fp32 (the issue's llama-2-7b case: 10.53 GB of activations vs LoRA's 6.98).
    - ``lean`` (the default; litgpt and Unsloth keep the stream in the compute dtype too): the parameters stay
      in ``--dtype``, as in plain LoRA. No fp32 exception is needed for stability: the LoRA adapters, the
      only trained weights, stay fp32 (PEFT's ``autocast_adapter_dtype=True``, as in LoRA); RMSNorm/LayerNorm
      compute their statistics in fp32 whatever their weight's dtype (transformers' norms upcast the hidden
      states), attention's softmax and the loss's log-softmax run in fp32 (``memfit.spec.losses``). Measured: the
      demo's loss curve, lean vs full, in bench/README.md ("Lean QLoRA"), within the tolerance stated there.
    """
    return "fp32" if upcasts_fully(run) else str(run.dtype)


def unquantized_bytes(run) -> int:
    """Bytes per element of ``unquantized_dtype(run)``."""
    return 4 if unquantized_dtype(run) == "fp32" else 2


def shards_packed_weights(run) -> bool:
    """Whether FSDP2 shards the packed 4-bit weights of ``run`` (a 4-bit base under ``--sharding
    fsdp|zero2|zero3``): their bytes are then stored as the compute dtype (``bnb_4bit_quant_storage``; the
    same bytes, 2 weights per byte, viewed as floats), which FSDP2 shards and all-gathers like any frozen
    parameter; uint8 storage it cannot shard (Accelerate's ``fsdp2_prepare_model`` leaves such
    ``Params4bit`` out: "set bnb_4bit_quant_storage to a floating dtype"). Each layer keeps its quantization
    state whole (``Linear4bit.quant_state``) and bitsandbytes re-attaches it to the gathered weight
    (``fix_4bit_weight_quant_state_from_module``: "the quant state got lost ... for example for fsdp").
    The compute dtype keeps the storage out of FSDP2's mixed-precision cast (its ``param_dtype``)."""
    return str(run.quantize) == "4bit" and str(run.sharding) != "ddp" and run.num_processes > 1


def bnb_config(run):
    """transformers' ``BitsAndBytesConfig`` for ``run.quantize``: NF4 with double quantization computing in
    ``compute_dtype(run)`` (QLoRA's recipe, Dettmers et al. 2023), or LLM.int8()."""
    import torch
    from transformers import BitsAndBytesConfig

    if str(run.quantize) == "4bit":
        compute = getattr(torch, torch_dtype_name(compute_dtype(run)))
        storage = compute if shards_packed_weights(run) else torch.uint8
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=storage)
    return BitsAndBytesConfig(load_in_8bit=True)


def quantized_copy(build, run, device=None):
    """The model ``build()`` returns (random weights, built from a config) with its projections quantized for ``run``.

    transformers quantizes only in ``from_pretrained`` (``from_config`` refuses ``quantization_config``), so
    the random model is saved to a temporary folder and loaded back through bitsandbytes: the same path, and
    the same quantized weights, as a checkpoint on disk (on every rank of a DDP run: each quantizes the same
    seeded weights the same way). It is built here and dropped once saved, so it is never held beside the
    quantized copy as it loads (the loading phase is then a checkpoint's: ``memory.host_loading``, and on CUDA
    ``memory.loading``). ``device``: a CUDA device to load onto (else CPU).
    """

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="memfit-qlora-") as folder, no_loading_bar():
        model = build()
        # Written by hand, not with save_pretrained: under torch.distributed transformers writes only on rank 0
        # (distributed/mixin.py should_save_on_this_rank), and every rank needs its own copy here.
        model.config.save_pretrained(folder)
        save_model(model, f"{folder}/model.safetensors", metadata={"format": "pt"})  # tied weights once
        kwargs = {"device_map": {"": device}} if device is not None else {}
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        attention = model.config._attn_implementation
        del model  # the last reference: its weights are freed before the quantized copy loads
        return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                    attn_implementation=attention,
                                                    quantization_config=bnb_config(run), **kwargs)


#: The per-layer switch of bitsandbytes' CPU inference path (``Linear4bit.__init__``: ``has_avx512bf16()``).
CPU_INFERENCE_SWITCH = "support_avx512bf16_for_cpu"


def keep_training_path(model) -> int:
    """Keep every 4-bit layer of ``model`` on the dequantize-and-matmul path training uses, in evaluation
    and generation too (see the module docstring: the CPU inference path refuses shapes training accepts,
    such as an ``intermediate_size`` of 176, only after training has run, and changes the weight's layout
    in place). Returns the layers switched; on CUDA and on CPUs without AVX512-BF16 nothing changes."""
    switched = 0
    for module in model.modules():
        if getattr(module, CPU_INFERENCE_SWITCH, False):
            setattr(module, CPU_INFERENCE_SWITCH, False)
            switched += 1
    return switched


def logical_numel(param) -> int:
    """Parameters a tensor stands for: a 4-bit ``Params4bit`` packs two per byte of its uint8 storage (its
    ``quant_state.shape`` is the original weight's), every other tensor one per element."""
    state = getattr(param, "quant_state", None)
    shape = getattr(state, "shape", None)
    if shape is not None:
        return math.prod(shape)
    return param.numel()


def accept_own_quant_state(model) -> int:
    """Let ``model.load_state_dict`` take back a state dict it saved: returns the 4-bit layers hooked.

    bitsandbytes' ``Linear4bit._save_to_state_dict`` writes the quantization state beside the packed weight
    (``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``, ... from ``QuantState.as_dict``), but
    ``Linear4bit`` has no ``_load_from_state_dict`` to read them back, so a strict load (Accelerate's
    ``load_state`` on ``--resume``) calls them unexpected keys. The base is frozen, so a checkpoint's
    quantization state must be the one the rebuilt model already has: this pre-hook takes those keys out
    and records a load error when one differs (a checkpoint of another base), instead of ignoring them.
    """
    import torch

    hooked = 0
    for module in model.modules():
        if type(module).__name__ not in ("Linear4bit", "LinearNF4", "LinearFP4"):
            continue

        def pre_hook(state_dict, prefix, _meta, _strict, _missing, _unexpected, error_msgs, module=module):
            state = getattr(module.weight, "quant_state", None)
            own = state.as_dict(packed=True) if state is not None else {}
            for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
                name = key[len(prefix + "weight."):]
                value = state_dict.pop(key)
                mine = own.get(name)
                if mine is None or not torch.equal(mine.cpu(), value.cpu()):
                    error_msgs.append(f"{key}: the checkpoint's quantization state differs from this model's base")

        module._register_load_state_dict_pre_hook(pre_hook)
        hooked += 1
    return hooked


def quant_state_tensors(model) -> list:
    """The tensors bitsandbytes keeps beside its packed weights, which ``model.parameters()`` does not list:
    4-bit ``weight.quant_state`` (``absmax``: uint8 per 64-weight block under double quantization, its fp32
    ``state2.absmax`` per 256 of those, the 16-entry ``code`` tables, ``offset``) and 8-bit ``weight.SCB``
    (one fp32 scale per output row). Counted by the live-tensor measurement as held between steps.
    Under FSDP2 a 4-bit weight is a plain DTensor shard; its state is then the module's ``quant_state``
    (``Linear4bit`` keeps a reference to it, ``Params4bit._quantize``), read from there."""
    import torch

    out, seen = [], set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        states = (getattr(weight, "quant_state", None), getattr(module, "quant_state", None))
        for state in states:
            if state is None or id(state) in seen:
                continue
            seen.add(id(state))
            for holder in (state, getattr(state, "state2", None)):
                if holder is not None:
                    out += [v for v in vars(holder).values() if isinstance(v, torch.Tensor)]
        scb = getattr(weight, "SCB", None)
        if isinstance(scb, torch.Tensor):
            out.append(scb)
    return out
