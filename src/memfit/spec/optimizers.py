"""The optimizer table: one row per ``Optimizer`` member, read by estimate, trace, plan and train.

A row says everything memfit needs to know about one optimizer: the state it keeps per trainable
parameter, the temporaries its step allocates, the bytes one step moves (for the planner's cost model),
how ``memfit train`` (and the exact tracer) builds it, and the devices it runs on. Adding an optimizer
is adding its ``Optimizer`` member and one row here; ``tests/test_resolved.py`` fails for a member
without a row and checks that every consumer reads the row instead of a copy of its numbers.

Sources of the numbers are on each builder/row; bytes are for one trainable parameter whose dtype takes
``p`` bytes (LoRA adapters: 4, PEFT keeps them fp32).
"""

# Inside functions: bitsandbytes (optional), torch (2.6 s) and transformers.optimization (python -X importtime, 2026-12-06, this shared 2-core machine): the
# optimizer table is read on torch-free paths.
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.errors import UserError
from memfit.settings.config import Optimizer

#: bitsandbytes 8-bit Adam: two uint8 moments + one fp32 absmax per 2048-element block per moment
#: (blockwise quantization, Dettmers et al. 2022): 2 + 2*4/2048 bytes/param. Tensors under 4096
#: elements keep 32-bit state (``min_8bit_size``); ignored (norm weights: < 0.01% of params).
ADAM8BIT_BYTES_PER_PARAM = 2 + 8 / 2048

#: Passes over parameters/gradients/moments of torch's foreach AdamW relative to the fused kernel
#: (foreach runs one kernel per elementwise op over all tensors; fused does the update in one).
FOREACH_PASSES = 2.5

#: Device types on which torch's optimizers, given neither ``foreach`` nor ``fused``, run the foreach
#: (multi-tensor) implementation; elsewhere (CPU) they run the single-tensor loop. Source: torch 2.13
#: ``torch/optim/optimizer.py`` ``_default_to_fused_or_foreach`` (foreach only where every parameter is on a
#: device of ``torch/utils/_foreach_utils.py`` ``_get_foreach_kernels_supported_devices``: cuda, xpu, mtia,
#: the privateuse1 backend; never cpu; fused is never the default). DTensor parameters (FSDP2) count as
#: plain tensors there (``torch/distributed/tensor/__init__.py`` registers DTensor as foreach-supported).
FOREACH_DEFAULT_DEVICES = ("cuda",)


def torch_default_is_foreach(device: str) -> bool:
    """Whether torch's default optimizer implementation on ``device`` (``cuda`` or ``cpu``) is foreach.

    The one place memfit decides it: the estimator's step temporaries (``OptimizerRow.step_temporary_on``)
    and the builders' ``cuda_like`` flag (the exact tracer runs CPU kernels but models a CUDA run) read it.
    """
    return device in FOREACH_DEFAULT_DEVICES


@dataclass(frozen=True)
class OptimizerRow:
    """What one optimizer costs and how it is built.

    The memory numbers are for the steady state (second step: state exists) and follow torch's (or
    bitsandbytes' / transformers') implementation as ``build`` constructs it.
    """

    member: Optimizer
    label: str
    """Human name used in notes (``AdamW moments``)."""
    moments: int
    """Parameter-sized state tensors kept in the parameter's dtype (AdamW: ``exp_avg``, ``exp_avg_sq``)."""
    fixed_state_bytes: float = 0.0
    """State bytes per parameter independent of its dtype (8-bit AdamW's quantized moments)."""
    factored: bool = False
    """Adafactor's factored second moment: one row and one column vector per matrix, numel per vector."""
    step_temporary: str = "none"
    """What ``step()`` allocates beyond the state: ``"group"`` (foreach: one parameter-sized tensor for
    every parameter of the group at once), ``"largest-x2"`` (per-tensor update: two copies of the largest
    trainable tensor), or ``"none"`` (in place). For a row whose builder leaves the implementation to
    torch (``torch_default``), this is the foreach implementation's; see ``step_temporary_on``."""
    single_tensor_temporary: str = "none"
    """What the single-tensor loop torch runs instead of foreach (on CPU) allocates: ``"per-tensor"`` for
    AdamW's ``_single_tensor_adam``, which computes ``denom = exp_avg_sq.sqrt() / bias_correction2_sqrt``
    per parameter (the square root and the quotient coexist) while the previous parameter's ``denom``
    is still bound to the loop variable: previous + 2 x current, in parameter order."""
    torch_default: bool = False
    """The builder passes neither ``foreach`` nor ``fused`` (except under ``cuda_like``): torch picks by device."""
    traffic: Callable[[float], float] = lambda p: 0.0
    """Bytes read + written per trainable parameter by one step (cost model), given ``p``."""
    rollback: str = "every-step"
    """When an out-of-memory error inside ``step()`` can leave the step half applied, so that memfit's
    rollback snapshot (``training/rollback.py``) must copy what it mutates first (``memory/snapshot.py``
    prices it). torch 2.13, ``torch/optim/adam.py``:

    - ``"every-step"``: the step mutates, then allocates. ``_multi_tensor_adam`` (foreach) adds 1 to every
      step count, decays every parameter and updates both moments in place, then allocates
      ``_foreach_sqrt(exp_avg_sqs)`` for the whole group; ``_single_tensor_adam`` (torch's default on CPU)
      does the same per parameter (``step_t += 1``, ``param.mul_``, ``exp_avg.lerp_``, ``exp_avg_sq.mul_``)
      and then allocates ``denom = exp_avg_sq.sqrt() / ...``, after every earlier parameter has been
      updated. Adafactor and bitsandbytes loop over parameters the same way.
    - ``"first-step"``: ``_fused_adam`` adds 1 to the step counts and runs one in-place kernel per
      device/dtype group (``torch._fused_adamw_``): nothing is allocated once the state exists. Only the
      step that creates it can half apply: ``Adam.step`` runs ``_init_group`` (``zeros_like`` moments)
      group by group, after the earlier param groups have stepped.
    - ``"never"``: plain SGD (momentum 0, no weight decay: ``param.add_(grad, alpha=-lr)``, nothing
      allocated and no state). With weight decay ``_single_tensor_sgd`` allocates ``grad.add(param, ...)``
      per parameter, so the live check (``rollback.snapshot_needed``) keeps the snapshot then."""
    devices: tuple[str, ...] = ("cuda", "cpu")
    """Devices the optimizer's kernels run on."""
    needs_bitsandbytes: bool = False
    """Built from bitsandbytes: whether this machine runs it is ``memfit.integrations.quant_support``'s rule."""
    traceable: bool = True
    """Whether the exact tracer can run it on fake tensors (bitsandbytes kernels cannot)."""
    build: Callable[..., Any] | None = None
    """``build(groups, lr, cuda_like)`` -> the optimizer. ``cuda_like``: pick the implementation torch
    picks on CUDA (the tracer runs CPU kernels but models a CUDA run)."""

    def state_bytes_per_param(self, p: float) -> float:
        """State bytes per trainable parameter (0 for the factored part, counted from shapes)."""
        return self.moments * p + self.fixed_state_bytes

    def step_temporary_on(self, device: str) -> str:
        """``step_temporary`` of the implementation that runs on ``device`` (``cuda`` or ``cpu``)."""
        if self.torch_default and not torch_default_is_foreach(device):
            return self.single_tensor_temporary
        return self.step_temporary


def _adamw(flags: dict[str, bool]):
    def build(groups, lr: float, cuda_like: bool = False):
        import torch

        kwargs = dict(flags)
        if cuda_like and not kwargs:
            # torch's default on CUDA; on CPU tensors it would pick single-tensor
            kwargs["foreach"] = torch_default_is_foreach("cuda")
        return torch.optim.AdamW(groups, lr=lr, **kwargs)

    return build


def _sgd(groups, lr: float, cuda_like: bool = False):
    """Plain SGD, momentum 0: no state (``momentum_buffer`` stays None)."""
    import torch

    return torch.optim.SGD(groups, lr=lr, foreach=torch_default_is_foreach("cuda") if cuda_like else None)


def _adafactor(groups, lr: float, cuda_like: bool = False):
    """transformers' Adafactor with a fixed learning rate (beta1=None: no first moment)."""
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


def _adamw_8bit(groups, lr: float, cuda_like: bool = False):
    """bitsandbytes' AdamW8bit: CUDA, and CPU from bitsandbytes 0.50 (``memfit.integrations.quant_support``)."""
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=lr)


def _adam_traffic(state: Callable[[float], float], passes: float) -> Callable[[float], float]:
    """AdamW: param r/w, grad r, two moments r/w: ``(2p + g + 4s) x passes`` with ``g = p``."""
    return lambda p: (2 * p + p + 4 * state(p)) * passes


#: One row per ``Optimizer`` member.
OPTIMIZERS: dict[Optimizer, OptimizerRow] = {
    # torch.optim.AdamW; moments zeros_like(p) (torch/optim/adam.py _init_group). The default picks
    # foreach on CUDA (_multi_tensor_adam's _foreach_sqrt: one param-sized temporary per group), the
    # single-tensor loop on CPU (per parameter: its sqrt and quotient, next to the previous quotient).
    Optimizer.ADAMW: OptimizerRow(Optimizer.ADAMW, "AdamW moments", moments=2, step_temporary="group",
                                  single_tensor_temporary="per-tensor", torch_default=True,
                                  traffic=_adam_traffic(lambda p: p, FOREACH_PASSES), build=_adamw({})),
    Optimizer.ADAMW_FOREACH: OptimizerRow(Optimizer.ADAMW_FOREACH, "AdamW moments", moments=2,
                                          step_temporary="group", traffic=_adam_traffic(lambda p: p, FOREACH_PASSES),
                                          build=_adamw({"foreach": True})),
    # fused=True updates each tensor in place in one kernel: no temporary.
    Optimizer.ADAMW_FUSED: OptimizerRow(Optimizer.ADAMW_FUSED, "AdamW moments", moments=2, rollback="first-step",
                                        traffic=_adam_traffic(lambda p: p, 1.0), build=_adamw({"fused": True})),
    Optimizer.ADAMW_8BIT: OptimizerRow(Optimizer.ADAMW_8BIT, "8-bit AdamW moments", moments=0,
                                       fixed_state_bytes=ADAM8BIT_BYTES_PER_PARAM,
                                       traffic=_adam_traffic(lambda p: 1, 1.0), needs_bitsandbytes=True,
                                       traceable=False, build=_adamw_8bit),
    # SGD without momentum: param r/w + grad r.
    Optimizer.SGD: OptimizerRow(Optimizer.SGD, "no state", moments=0, rollback="never", traffic=lambda p: 3 * p,
                                build=_sgd),
    # Adafactor reads/writes the update once on top of param and grad (factored moments: negligible);
    # its per-tensor update holds two copies of the largest tensor.
    Optimizer.ADAFACTOR: OptimizerRow(Optimizer.ADAFACTOR, "Adafactor factored second moment", moments=0,
                                      factored=True, step_temporary="largest-x2", traffic=lambda p: 4 * p,
                                      build=_adafactor),
}


def inner_optimizer(optimizer):
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def row(optimizer: Optimizer | str) -> OptimizerRow:
    """The table row of ``optimizer``; a member without a row is a bug, said in one sentence."""
    member = optimizer if isinstance(optimizer, Optimizer) else Optimizer(str(optimizer))
    try:
        return OPTIMIZERS[member]
    except KeyError:
        raise UserError(f"--optimizer {member.value} has no row in memfit's optimizer table "
                        "(memfit/spec/optimizers.py), so memfit cannot estimate or build it.") from None


def check_device(optimizer: Optimizer | str, device: str) -> None:
    """Raise ``UserError`` when ``optimizer`` cannot run on ``device`` (``cuda`` or ``cpu``)."""
    r = row(optimizer)
    if device not in r.devices:
        needs = " or ".join(d.upper() for d in r.devices)
        raise UserError(f"--optimizer {r.member.value} runs on {needs} only, not on {device.upper()}; "
                        "use adamw here.")
