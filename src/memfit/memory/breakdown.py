"""``MemoryBreakdown``: the bytes held at the peak of one training step, by category.

Every memory number memfit reports is one of these, whether it was estimated (``method="analytic"``),
traced on fake tensors (``"exact"``) or measured on a device (``"measured"``), so the three compare
field by field. The categories follow PyTorch's memory tracker (``torch.distributed._tools.mem_tracker``):

- ``weights``: parameters and buffers (frozen, trainable, quantized), as stored.
- ``gradients``: ``.grad`` tensors of trainable parameters.
- ``optimizer``: optimizer state (AdamW's two moments, step counters, 8-bit quantization state).
- ``activations``: tensors saved by autograd for backward (per layer in ``activations_per_layer``).
- ``logits``: the LM head output, its fp32 upcast for the loss, and its gradient.
- ``temporary``: short-lived buffers at the peak (autocast weight copies, optimizer-step temporaries,
  attention workspaces).
- ``other``: CUDA context, cuBLAS workspace and allocator reserve: bytes the GPU holds that no tensor does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

CATEGORIES: tuple[str, ...] = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "logits",
    "temporary",
    "other",
)

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


@dataclass
class MemoryBreakdown:
    """Bytes by category at the step's peak; ``peak_bytes`` is their sum."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    temporary: int = 0
    other: int = 0
    phase: str = "backward"
    """Phase of the step where the peak falls: forward, backward or optimizer."""
    method: str = "analytic"
    """How the numbers were obtained: analytic, exact or measured."""
    params: int = 0
    """Total parameters of the model (all ranks; quantized weights counted as parameters)."""
    trainable_params: int = 0
    activations_per_layer: int = 0
    """Bytes saved for backward by one decoder layer (0 when unknown)."""
    notes: list[str] = field(default_factory=list)
    """One-line explanations shown under the table (why a term is what it is)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Peak bytes of each phase (forward, backward, optimizer), where known."""
    attn_implementation: str = ""
    """The attention implementation the run uses (what transformers runs for the model), where known."""
    experts_implementation: str = ""
    """The experts kernel of a mixture-of-experts model (``memfit.spec.resolved.experts``); empty for a dense one."""
    lora_targets: tuple[str, ...] = ()
    """Last name components of the LoRA-wrapped projections (empty for a full fine-tune)."""
    reserved: int = 0
    """Predicted ``torch.cuda.max_memory_reserved``: the caching allocator's segments at their most (exact
    mode on a CUDA target, from the replay of the step's allocations: ``memory/alloc_stream.py``); 0 when not
    predicted. nvidia-smi shows it plus the CUDA context."""
    reserved_allocated: int = 0
    """Predicted ``torch.cuda.max_memory_allocated`` of the same replay (blocks as handed out: 512-byte rounding,
    whole blocks where the rest is not split, cuBLAS's workspace); 0 when not predicted."""
    allocator_settings: str = ""
    """The caching allocator's settings the replay used (``AllocatorSettings.describe``)."""
    recipe: str = ""
    """Where the activation model came from (analytic only): ``hand-written recipe: llama`` or
    ``derived from traces of 1-2 layer <model_type>`` (``... of 3 layers of lfm2 (2 kinds)`` with several layer
    kinds; ``memory/derive.py``)."""

    @property
    def peak_bytes(self) -> int:
        return int(sum(getattr(self, c) for c in CATEGORIES))

    @property
    def fragmentation_share(self) -> float:
        """Share of the predicted reserved peak that no block handed out covers at the allocated peak
        (``(reserved - reserved_allocated) / reserved``); 0 when not predicted."""
        return (self.reserved - self.reserved_allocated) / self.reserved if self.reserved else 0.0

    @property
    def model_states(self) -> int:
        """Weights + gradients + optimizer state: what ZeRO/FSDP shard."""
        return self.weights + self.gradients + self.optimizer

    def categories(self) -> dict[str, int]:
        return {c: int(getattr(self, c)) for c in CATEGORIES}

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON schema shared by ``estimate --json`` and ``estimate --exact --json``."""
        return {
            "method": self.method,
            "params": int(self.params),
            "trainable_params": int(self.trainable_params),
            "peak_bytes": self.peak_bytes,
            "phase": self.phase,
            "breakdown": self.categories(),
            "activations_per_layer": int(self.activations_per_layer),
            "phase_peaks": {k: int(v) for k, v in self.phase_peaks.items()},
            "attn_implementation": self.attn_implementation,
            "experts_implementation": self.experts_implementation,
            "lora_targets": list(self.lora_targets),
            "recipe": self.recipe,
            "allocator": {"reserved_bytes": int(self.reserved), "allocated_bytes": int(self.reserved_allocated),
                          "fragmentation_share": round(self.fragmentation_share, 4),
                          "settings": self.allocator_settings} if self.reserved else None,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryBreakdown:
        kwargs = dict(data.get("breakdown", {}))
        names = {f.name for f in fields(cls)}
        kwargs.update({k: v for k, v in data.items() if k in names and k != "breakdown"})
        allocator = data.get("allocator") or {}
        kwargs.update(reserved=int(allocator.get("reserved_bytes", 0)),
                      reserved_allocated=int(allocator.get("allocated_bytes", 0)),
                      allocator_settings=str(allocator.get("settings", "")))
        return cls(**kwargs)

    def relative_error(self, truth: MemoryBreakdown) -> dict[str, float]:
        """Signed relative error of each category and the peak against ``truth`` (0 where truth is 0)."""
        out = {}
        for c in (*CATEGORIES, "peak_bytes"):
            mine, ref = getattr(self, c), getattr(truth, c)
            out[c] = (mine - ref) / ref if ref else 0.0
        return out

    def as_plain(self) -> dict[str, Any]:
        return asdict(self)
