"""The candidate grid: every way to run one training step that ``plan`` considers.

A candidate is a ``RunConfig``. The grid is the product of

- a *regime*: weight dtype and autocast precision, and full fine-tune / LoRA / QLoRA
  (fp32 without AMP; AMP on fp32 weights; pure bf16; LoRA on a bf16 or fp32 base; QLoRA 4/8 bit),
- gradient checkpointing on / off,
- the optimizer variant (AdamW fused, foreach, 8-bit: the same update rule; SGD and Adafactor change
  the algorithm, so they are only used when the user pins them),
- offload of optimizer state or parameters to the CPU (full fine-tunes only: LoRA states are tiny),
- sharding across ranks (only when ``num_processes > 1``),
- the loss (standard, chunked: ``memfit.spec.losses``) and the optimizer step in backward or after it
  (only with one micro-batch per step and one process),
- the micro-batch: every divisor of ``batch / num_processes``, with
  ``grad_accum = batch / (micro_batch * num_processes)`` exactly, so the effective batch never changes.

``Constraints`` pins any of these to what the user asked for.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from memfit.errors import NoCandidatesError, UserError
from memfit.settings.config import (
    Attention,
    DType,
    LoraSettings,
    Loss,
    Method,
    Offload,
    Optimizer,
    Packing,
    Precision,
    QloraUpcast,
    Quantize,
    RunConfig,
    Sharding,
    parse_enum,  # the enum parser RunConfig uses, so constraint errors read the same
)
from memfit.settings.defaults import LORA_RANK
from memfit.settings.schema import flag_of, searched

#: Optimizers with AdamW's update rule, tried by default ("adamw" is torch's foreach on CUDA, so it is
#: the same candidate as "adamw-foreach" and is not tried twice).
ADAMW_VARIANTS = (Optimizer.ADAMW_FUSED, Optimizer.ADAMW_FOREACH, Optimizer.ADAMW_8BIT)


#: Losses the planner tries unless one is pinned: the fused kernels (Liger, CCE) need optional packages,
#: so a plan never proposes them by itself.
PLANNED_LOSSES = (Loss.STANDARD, Loss.CHUNKED)


@dataclass(frozen=True)
class Regime:
    """How weights are stored and computed and what is trained."""

    mixed_precision: Precision
    dtype: DType
    lora: bool
    quantize: Quantize = Quantize.NONE


@dataclass(frozen=True)
class Constraints:
    """What the user pinned; ``None`` leaves a setting to the planner (``packing``: documents).

    One field per setting the planner chooses (``memfit.settings.schema.searched``: every ``RunConfig`` setting
    but the sequence length, the processes and the method, which are the problem it is given), named by its flat
    key (``lora_r``) and typed as that setting or ``None``; then what only the planner is told. A setting added to
    ``RunConfig`` with ``plan="searched"`` needs its field here: ``tests/test_schema.py`` fails until it has one;
    ``candidates`` then passes it through (pinned, else ``RunConfig``'s default) unless ``ENUMERATED`` lists it.
    The other places a new setting may need are listed in docs/settings.md ("Adding a setting").
    ``--lora-r 0`` or ``full=True`` pins a full fine-tune; ``quantize="none"`` forbids quantization, like
    ``allow_quantize=False``.
    """

    micro_batch: int | None = None
    grad_accum: int | None = None
    mixed_precision: Precision | None = None
    dtype: DType | None = None
    grad_checkpointing: bool | None = None
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: tuple[str, ...] | None = None
    quantize: Quantize | None = None
    qlora_upcast: QloraUpcast | None = None
    optimizer: Optimizer | None = None
    offload: Offload | None = None
    sharding: Sharding | None = None
    attn_implementation: Attention | None = None
    packing: Packing | None = None
    loss: Loss | None = None
    optimizer_in_backward: bool | None = None
    precompute_reference: bool | None = None
    # what only the planner is told (no setting of a run): what it may not consider, and the machine
    full: bool = False
    """Full fine-tune only (same as ``lora_r=0``; ``--full``)."""
    allow_quantize: bool = True
    """False: no QLoRA candidates (``--no-quantize``)."""
    allow_offload: bool = True
    """False: no offload candidates (``--no-offload``)."""
    host_memory: int | None = None
    """Host RAM of the machine in bytes: plans whose offloaded state and rollback snapshot exceed it are dropped
    (``memory.snapshot.host_bytes``); None: not checked."""

    def __post_init__(self) -> None:
        for s in searched(RunConfig):  # the enum settings, read as RunConfig reads them
            value = getattr(self, s.key)
            if value is not None and isinstance(s.default, Enum):
                object.__setattr__(self, s.key, parse_enum(type(s.default), value, flag_of(s)))
        if self.lora_r is not None and self.lora_r < 0:
            raise UserError(f"--lora-r must be 0 (full fine-tune) or a positive rank, got {self.lora_r}.")
        if self.full and self.lora_r:
            raise UserError(f"--full and --lora-r {self.lora_r} contradict each other; pass one of them.")
        if self.full and self.quantize not in (None, Quantize.NONE):
            raise UserError("--full and --quantize contradict each other: a quantized base trains LoRA adapters only.")

    @classmethod
    def from_flat(cls, pinned: dict[str, Any]) -> Constraints:
        """From flags the user typed (train-flag names, e.g. ``explicit(ctx, kwargs)``); others ignored."""
        names = {f.name for f in fields(cls)}
        kwargs = {k.replace("-", "_"): v for k, v in pinned.items()}
        kwargs = {k: v for k, v in kwargs.items() if k in names and v is not None}
        if isinstance(kwargs.get("lora_targets"), str):
            kwargs["lora_targets"] = tuple(t.strip() for t in kwargs["lora_targets"].split(",") if t.strip())
        return cls(**kwargs)

    def wants_full(self) -> bool | None:
        """True: full only; False: LoRA only; None: either."""
        if self.full or self.lora_r == 0:
            return True
        if self.lora_r or self.quantize in (Quantize.Q4, Quantize.Q8):
            return False
        return None


def regimes(bf16_ok: bool = True, cpu: bool = False) -> list[Regime]:
    """The precision x method regimes, best-known practice first.

    On a device without bf16 (T4, V100) AMP uses fp16 and pure half-precision full training is left out
    (fp16 weights need loss scaling of fp32 master weights, which is what AMP on fp32 weights is). On a CPU
    (``cpu``: ``memfit train --budget`` without CUDA) LoRA on fp32 weights without autocast is one more, last:
    train's own CPU default, and what ``training.budget`` pins first there (a CPU without bf16 matrix units
    runs bf16 ~15x slower than fp32: ``bench/cpu_precision.py``); the reference GPU's speeds rank it below the
    autocast regimes, so unpinned it is chosen only when nothing else fits.
    """
    half = Precision.BF16 if bf16_ok else Precision.FP16
    half_dtype = DType.BF16 if bf16_ok else DType.FP16
    out = [
        Regime(Precision.NO, DType.FP32, lora=False),
        Regime(half, DType.FP32, lora=False),
        Regime(half, half_dtype, lora=True),
        Regime(half, DType.FP32, lora=True),
        Regime(half, half_dtype, lora=True, quantize=Quantize.Q4),
        Regime(half, half_dtype, lora=True, quantize=Quantize.Q8),
    ]
    if bf16_ok:
        out.insert(2, Regime(Precision.NO, DType.BF16, lora=False))
    if cpu:
        out.append(Regime(Precision.NO, DType.FP32, lora=True))
    return out


def _regime_allowed(r: Regime, c: Constraints) -> bool:
    full = c.wants_full()
    if full is not None and r.lora == full:
        return False
    if c.mixed_precision is not None and r.mixed_precision is not c.mixed_precision:
        return False
    if c.dtype is not None and r.dtype is not c.dtype:
        return False
    if c.quantize is not None and r.quantize is not c.quantize:
        return False
    return c.allow_quantize or r.quantize is Quantize.NONE


def micro_batches(batch: int, num_processes: int, c: Constraints) -> list[tuple[int, int]]:
    """``(micro_batch, grad_accum)`` pairs with ``micro_batch * grad_accum * num_processes == batch``."""
    if batch < 1 or num_processes < 1:
        raise UserError(f"--batch and --num-processes must be positive, got {batch} and {num_processes}.")
    if batch % num_processes:
        raise UserError(f"--batch {batch} is not divisible by --num-processes {num_processes}, "
                        "so the effective batch could not be kept exact.")
    per_rank = batch // num_processes
    pairs = [(m, per_rank // m) for m in range(1, per_rank + 1) if per_rank % m == 0]
    pairs = [(m, g) for m, g in pairs if c.micro_batch in (None, m) and c.grad_accum in (None, g)]
    if not pairs:
        raise UserError(f"No micro-batch x grad-accum x {num_processes} process(es) equals --batch {batch} "
                        "with the pinned --micro-batch/--grad-accum.")
    return pairs


def _in_backward_possible(accum: int, num_processes: int, offload: Offload, regime: Regime) -> bool:
    """Optimizer-in-backward needs one micro-batch per step, one process, the step on the GPU, and no fp16
    loss scaler (``builder/optim_in_backward.py`` says why); it is not tried for LoRA (nothing to gain)."""
    return (accum == 1 and num_processes == 1 and offload in (Offload.NONE, Offload.ACTIVATIONS)
            and regime.mixed_precision is not Precision.FP16 and not regime.lora)  # LoRA: its gradients are tiny


def _shardings(num_processes: int, nodes: int) -> tuple[Sharding, ...]:
    """The shardings worth trying: none for one process; hybrid only where it differs from fsdp and shards
    something (2+ nodes of 2+ processes: ``engines.hybrid_refusal``)."""
    if num_processes == 1:
        return (Sharding.DDP,)
    hybrid = nodes > 1 and num_processes // nodes > 1
    return tuple(s for s in Sharding if s is not Sharding.HYBRID or hybrid)


#: The searched settings ``candidates`` enumerates (each candidate sets them); every other searched setting is passed
#: through: the value the user pinned, else ``RunConfig``'s default. A setting added with ``plan="searched"`` needs
#: only its ``Constraints`` field to be pinnable in plan (``tests/test_plan.py`` pins each one).
ENUMERATED = ("micro_batch", "grad_accum", "mixed_precision", "dtype", "grad_checkpointing", "quantize", "optimizer",
              "offload", "sharding", "loss", "precompute_reference", "optimizer_in_backward",
              "lora_r", "lora_alpha", "lora_dropout", "lora_targets")


def passed_through(c: Constraints) -> dict[str, Any]:
    """The searched settings the grid does not enumerate, as pinned (``{key: value}``; unpinned: left out, so the
    candidates take ``RunConfig``'s default)."""
    return {s.key: getattr(c, s.key) for s in searched(RunConfig)
            if s.key not in ENUMERATED and getattr(c, s.key) is not None}


def _choices(pinned, default: tuple) -> tuple:
    return (pinned,) if pinned is not None else default


def candidates(seq_len: int, batch: int, num_processes: int = 1, constraints: Constraints | None = None,
               bf16_ok: bool = True, method: Method = Method.SFT, cpu: bool = False, nodes: int = 1) -> list[RunConfig]:
    """Every configuration the planner tries, in a fixed order (the ranking's last tie-break).

    ``method``: the objective (given, not searched); for DPO each candidate is tried with its reference
    computed during training (a frozen copy, or the LoRA adapter switched off) and, after it, precomputed
    (``--precompute-reference``): at equal speed the earlier wins, so precomputing is chosen when only it fits.
    ``cpu``: the plans are for a CPU (``regimes``: fp32 LoRA is one more regime there). ``nodes``: the machines the
    processes run on (``hybrid`` sharding is tried only on 2 or more, of 2 or more processes each)."""
    c = constraints or Constraints()
    method = parse_enum(Method, method, "--method")
    precompute = _choices(c.precompute_reference, (False, True) if method is Method.DPO else (False,))
    pairs = micro_batches(batch, num_processes, c)
    pinned_lora = {name: value for name, value in (("alpha", c.lora_alpha), ("dropout", c.lora_dropout),
                                                   ("targets", c.lora_targets)) if value is not None}
    lora_common = LoraSettings(r=c.lora_r or LORA_RANK, **pinned_lora)  # the rest: LoraSettings' defaults
    no_lora = LoraSettings()
    shardings = _choices(c.sharding, _shardings(num_processes, nodes))
    base = RunConfig.of(seq_len=seq_len, num_processes=num_processes, nodes=nodes, method=method, **passed_through(c))
    out = []
    for regime in (r for r in regimes(bf16_ok, cpu) if _regime_allowed(r, c)):
        # LoRA's optimizer state is small: only its frozen base is worth offloading (FSDP2's parameter offload,
        # under sharding; QLoRA's 4-bit base too, as FSDP-QLoRA does)
        lora_offloads = (Offload.NONE,) if regime.quantize is Quantize.Q8 else (Offload.NONE, Offload.PARAMS)
        offloads = ((Offload.NONE,) if not c.allow_offload else lora_offloads if regime.lora else tuple(Offload))
        grid = itertools.product(_choices(c.grad_checkpointing, (False, True)),
                                 _choices(c.optimizer, ADAMW_VARIANTS),
                                 _choices(c.offload, offloads), shardings, pairs,
                                 _choices(c.loss, PLANNED_LOSSES if method is Method.SFT else (Loss.STANDARD,)),
                                 _choices(c.optimizer_in_backward, (False, True)))
        for gc, opt, offload, sharding, (micro, accum), loss, in_bw in grid:
            if in_bw and not _in_backward_possible(accum, num_processes, offload, regime):
                continue
            if offload is not Offload.NONE and opt is Optimizer.ADAMW_8BIT and c.optimizer is None:
                continue  # offloaded steps run on the host: bitsandbytes' 8-bit AdamW there is not verified
            if (offload is Offload.PARAMS and regime.quantize is not Quantize.NONE
                    and (regime.quantize is Quantize.Q8 or sharding is Sharding.DDP)):
                continue  # bitsandbytes' weights stay on the GPU unless FSDP2 shards a 4-bit base
            lora = lora_common if regime.lora else no_lora
            out += [dataclasses.replace(
                base, micro_batch=micro, grad_accum=accum, mixed_precision=regime.mixed_precision, dtype=regime.dtype,
                grad_checkpointing=gc, quantize=regime.quantize, optimizer=opt, offload=offload, sharding=sharding,
                loss=loss, precompute_reference=pre, optimizer_in_backward=in_bw, lora=lora) for pre in precompute]
    if not out:
        raise NoCandidatesError("The pinned settings leave no configuration to try; drop one of the constraints.")
    return out
