"""``--exact`` with ``--quantize 4bit``: bitsandbytes' own ``Linear4bit`` traced on fake tensors.

Nothing here stands in for bitsandbytes: the trace runs its modules, its autograd function and its ops.
bitsandbytes (>= 0.45, verified on 0.50.2) defines every op as a ``torch.library`` custom op with a fake
(shape-only) implementation (``bitsandbytes/_ops.py``: ``quantize_4bit``, ``dequantize_4bit``,
``quantize_blockwise``, ``dequantize_blockwise``, ``gemm_4bit``), so ``Linear4bit`` and ``MatMul4Bit`` run
under ``FakeTensorMode`` as they run in training. What the trace adds is what a real load does and a dispatch
mode cannot see:

- **The quantized base** (``quantize_on_meta``, ``fake_params4bit``): transformers' bitsandbytes quantizer
  replaces the decoder's ``Linear`` modules by ``Linear4bit`` on the meta model (``HfQuantizer.preprocess_model``,
  the call ``from_pretrained`` makes, with its own list of modules kept unquantized: the head, tied weights,
  ``_keep_in_fp32_modules``), then each weight is quantized by ``Params4bit._quantize`` from a fake tensor in
  ``--dtype`` (the dtype ``from_pretrained(dtype=...)`` loads it in, which ``QuantState.dtype`` records and
  backward dequantizes to): the packed uint8 payload, the uint8 absmax, the nested fp32 absmax, the code
  tables and the offset are bitsandbytes' own tensors.
- **The quantization state as weights** (``hold_quant_state``): those tensors are attributes of a
  ``QuantState``, neither parameters nor buffers, so torch's memory tracker would not count them; they are
  registered on their module as non-persistent buffers (held from load to the end, like a buffer; the trace's
  model is never saved).
- **The forward's dequantized weight** (``gemm_4bit_steps``): ``gemm_4bit`` is one custom op whose fake
  implementation allocates only its output, so the weight it dequantizes inside never shows. While tracing,
  the op runs as bitsandbytes' own default implementation (``backends/default/ops.py``
  ``_gemm_4bit_default_impl``: the nested absmax dequantized to fp32, the weight dequantized to the input's
  dtype, ``linear``), each step of it an op the tracker sees. That is what the CPU runs, and what CUDA runs for
  a training batch: its fused ``cgemm_4bit`` kernel is chosen only for few rows (``backends/cuda/ops.py``
  ``_gemm_4bit_use_custom_cuda``: M, the tokens of a micro-batch, up to a few hundred at most on sm90), beyond
  which it falls back to the same dequantize + ``linear``. Known error: a micro-batch of few tokens on CUDA
  may run the fused kernel, which dequantizes nothing (the trace then over-counts one weight's transient).

Backward needs nothing: ``MatMul4Bit.backward`` calls ``F.dequantize_4bit`` (Python: the nested absmax, then
the weight in ``QuantState.dtype``) and ``.to(grad_output.dtype)``, ops the tracker sees. 8-bit bases are not
traced (``Linear8bitLt`` keeps its inputs as ``ctx`` attributes on the CPU and runs int8 kernels on CUDA).
"""

# Inside functions: bitsandbytes (optional: the quant extra; 6.7 s to import; python -X importtime, 2026-12-06, this shared 2-core machine).
from __future__ import annotations

import contextlib

import torch
from transformers.quantizers import AutoHfQuantizer

from memfit.builder.parts import torch_dtype
from memfit.integrations.quant_support import bnb_config, quant_state_tensors

#: The buffer names ``hold_quant_state`` gives the quantization state's tensors (prefix + index).
_HELD = "_memfit_quant_state_"


def quantize_on_meta(model, run):
    """Replace ``model``'s quantizable ``Linear`` modules (meta device) by bitsandbytes' ``Linear4bit``,
    as ``from_pretrained(quantization_config=...)`` does before it loads the weights; unquantized parameters
    the new modules bring (biases) get ``--dtype``, as a load gives them."""

    quantizer = AutoHfQuantizer.from_config(bnb_config(run), pre_quantized=False)
    quantizer.preprocess_model(model, device_map=None, dtype=torch_dtype(run))
    for module in model.modules():
        if _is_4bit(module) and module.bias is not None:
            module.bias.data = module.bias.data.to(torch_dtype(run))
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)  # is_loaded_in_4bit and config.quantization_config, as after a load
    return model


def _is_4bit(module) -> bool:
    return type(module).__name__ == "Linear4bit"


def is_params4bit(param) -> bool:
    """Whether ``param`` is a bitsandbytes ``Params4bit`` (a 4-bit weight before ``fake_params4bit``)."""
    return type(param).__name__ == "Params4bit"


def fake_params4bit(param, dtype):
    """A fake 4-bit weight for ``param`` (a meta ``Params4bit``), quantized by bitsandbytes from a fake weight
    of its shape in ``dtype`` (``--dtype``), as ``Params4bit._quantize`` does on a load; call under the trace's
    ``FakeTensorMode``. Its module gets the same ``quant_state``.

    A ``Params4bit`` cannot wrap a fake tensor (``Tensor._make_subclass`` refuses one that is already a
    subclass), so the result is what ``nn.Parameter`` makes of a fake tensor (the fake tensor itself, marked a
    parameter) carrying ``Params4bit``'s attributes: everything ``Linear4bit.forward`` and ``MatMul4Bit`` read
    (``quant_state`` and the quantization settings)."""
    from bitsandbytes.functional import quantize_4bit

    weight = torch.empty(param.shape, dtype=dtype)  # (out, in): what from_pretrained hands bitsandbytes
    packed, state = quantize_4bit(weight, blocksize=param.blocksize, compress_statistics=param.compress_statistics,
                                  quant_type=param.quant_type, quant_storage=param.quant_storage)
    fake = torch.nn.Parameter(packed, requires_grad=False)  # ((out * in + 1) // 2, 1) uint8
    for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage", "module"):
        setattr(fake, name, getattr(param, name))
    fake.quant_state, fake.bnb_quantized = state, True
    if param.module is not None:
        param.module.quant_state = state
    return fake


@contextlib.contextmanager
def dynamic_map_for(fake_mode):
    """bitsandbytes' cached 8-bit dynamic map (the nested absmax's code, ``functional.name2qmap``) as a fake
    tensor while ``fake_params4bit`` quantizes: ``create_dynamic_map`` reads values (``.tolist()``), which a fake
    tensor has none of, and a real one may not meet fake tensors in an op. Built here for real, outside the fake
    mode; each layer's state then gets its own copy of it, as on a load (``quantize_blockwise``:
    ``code.to(A.device, copy=True)``). The cache is put back afterwards."""
    from bitsandbytes import functional

    before = functional.name2qmap.get("dynamic")
    real = before if before is not None else functional.create_dynamic_map()
    functional.name2qmap["dynamic"] = fake_mode.from_tensor(real)
    try:
        yield
    finally:
        if before is None:
            functional.name2qmap.pop("dynamic", None)
        else:
            functional.name2qmap["dynamic"] = before


def hold_quant_state(model) -> int:
    """Register each 4-bit layer's quantization-state tensors as non-persistent buffers of the layer, so the
    memory tracker counts them as weights (module docstring); returns their bytes (each storage once)."""

    held: dict[int, int] = {}
    for module in model.modules():
        if not _is_4bit(module):
            continue
        for i, tensor in enumerate(quant_state_tensors(module)):
            module.register_buffer(f"{_HELD}{i}", tensor, persistent=False)
            held[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
    return sum(held.values())


@contextlib.contextmanager
def gemm_4bit_steps(enabled: bool, mode_base):
    """While tracing: ``bitsandbytes::gemm_4bit`` runs as bitsandbytes' default implementation, op by op
    (module docstring). A dispatch mode entered above the tracker; every other op passes through.
    ``mode_base``: torch's ``TorchDispatchMode``, handed over by ``memory.trace`` (torch's private APIs keep
    one door there)."""
    if not enabled:
        yield
        return
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    gemm = torch.ops.bitsandbytes.gemm_4bit.default

    class Gemm4bitSteps(mode_base):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is gemm:
                return _gemm_4bit_default_impl(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Gemm4bitSteps():
        yield
