"""The GPU table (``presets/gpus.yaml``): memory, dense half-precision and fp32 peaks, bandwidths.

``gpu_by_name`` reads it, ``detect_gpu`` maps the CUDA device present onto it (by name, then by
memory among the variants of one family), and ``smallest_fitting`` answers "which listed GPU would
this fit on".
"""

# Inside a function: torch (2.6 s to import; python -X importtime, 2026-12-06, this shared 2-core machine): `memfit presets` lists the GPU table without it.
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml

from memfit.errors import UserError
from memfit.units import GB, parse_size

#: The device whose speed ``plan`` reports when only ``--budget`` is given (a common reference in papers).
REFERENCE_GPU = "a100-80gb"
#: A node's inter-node bandwidth per direction, all its network interfaces together, GB/s, when none is given:
#: 400 Gb/s, e.g. AWS p4d (8 x A100, 400 Gb/s EFA per node) or one NDR InfiniBand port per node.
DEFAULT_INTERNODE_GBS = 50.0


@dataclass(frozen=True)
class GPU:
    """One accelerator as the planner sees it (dense datasheet peaks; see gpus.yaml for sources)."""

    name: str
    memory_bytes: int
    half_tflops: float
    """Dense fp16/bf16 tensor-core peak, FP32 accumulate, in TFLOP/s."""
    fp32_tflops: float
    """Plain FP32 peak (TF32 is off by default in PyTorch), in TFLOP/s."""
    bandwidth_gbs: float
    """Device memory bandwidth, GB/s."""
    host_gbs: float = 32.0
    """Host link (PCIe) bandwidth per direction, GB/s: used by offload."""
    link_gbs: float = 32.0
    """GPU-to-GPU bandwidth per direction, GB/s: used by DDP/FSDP collectives."""
    bf16: bool = True
    """Whether bf16 compute is supported (else AMP uses fp16)."""
    internode_gbs: float = DEFAULT_INTERNODE_GBS
    """A node's bandwidth to the other nodes per direction, all its network interfaces together, GB/s: a property
    of the cluster, not of the GPU (``plan --internode-gbs``; ``planning.internode`` uses it)."""
    listed: bool = True
    """False for a detected device missing from the table (speeds then come from the reference GPU)."""

    def flops(self, half: bool) -> float:
        """Peak FLOP/s for half-precision tensor-core matmuls or for plain fp32."""
        return (self.half_tflops if half else self.fp32_tflops) * 1e12

    def bytes_per_s(self, which: str) -> float:
        """Bandwidth in bytes/s of ``device`` memory, the ``host`` link or the GPU-to-GPU ``link``."""
        gbs = {"device": self.bandwidth_gbs, "host": self.host_gbs, "link": self.link_gbs}[which]
        return gbs * GB


@lru_cache(maxsize=1)
def load_gpus() -> dict[str, GPU]:
    """All GPUs of ``presets/gpus.yaml``, keyed by name, in file order."""
    text = resources.files("memfit.presets").joinpath("gpus.yaml").read_text()
    out = {}
    for name, entry in yaml.safe_load(text).items():
        entry = dict(entry)
        memory = parse_size(str(entry.pop("memory")))
        out[str(name).lower()] = GPU(name=str(name).lower(), memory_bytes=memory, **entry)
    return out


def gpu_by_name(name: str) -> GPU:
    """A listed GPU by name (case-insensitive); ``UserError`` naming the nearest ones otherwise."""
    gpus = load_gpus()
    key = str(name).strip().lower()
    if key in gpus:
        return gpus[key]
    close = difflib.get_close_matches(key, list(gpus), n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(close)}?" if close else f" Known: {', '.join(gpus)}."
    raise UserError(f"Unknown GPU {name!r}.{hint}")


def smallest_fitting(peak_bytes: float) -> GPU | None:
    """The listed GPU with the least memory that holds ``peak_bytes`` (ties: bf16-capable, faster, name)."""
    fitting = [g for g in load_gpus().values() if g.memory_bytes >= peak_bytes]
    if not fitting:
        return None
    return min(fitting, key=lambda g: (g.memory_bytes, not g.bf16, -g.half_tflops, g.name))


def _family(name: str) -> str:
    """``rtx-4090`` -> ``rtx 4090``, ``a100-80gb`` -> ``a100``, ``h100-sxm`` -> ``h100``."""
    parts = [p for p in name.split("-") if not re.fullmatch(r"\d+gb|sxm|pcie", p)]
    return " ".join(parts)


def match_device(device_name: str, total_bytes: int) -> GPU:
    """Map a CUDA device name (``NVIDIA GeForce RTX 4090``, ``NVIDIA H100 80GB HBM3``) onto the table.

    Variants of one family (a100-40gb/80gb, v100-16gb/32gb) are told apart by memory, h100-pcie from
    h100-sxm by ``PCIe`` in the name. A device that is not listed keeps its real memory and borrows
    the reference GPU's speeds (``listed=False``), so planning still works and says so.
    """
    norm = re.sub(r"[^a-z0-9]+", " ", device_name.lower())
    gpus = load_gpus()
    found = [g for g in gpus.values() if f" {_family(g.name)} " in f" {norm} "]
    if any(g.name == "h100-pcie" for g in found):
        found = [g for g in found if ("pcie" in norm) == g.name.endswith("pcie")]
    if found:
        best = min(found, key=lambda g: (abs(g.memory_bytes - total_bytes), g.name))
        return GPU(**{**best.__dict__, "memory_bytes": int(total_bytes)})
    ref = gpus[REFERENCE_GPU]
    return GPU(**{**ref.__dict__, "name": device_name, "memory_bytes": int(total_bytes), "listed": False})


def detect_gpu() -> GPU:
    """The CUDA device present (device 0), with its real total memory; ``UserError`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("--gpu auto needs a CUDA device and none is visible; pass --gpu NAME or --budget SIZE.")
    props = torch.cuda.get_device_properties(0)
    return match_device(props.name, props.total_memory)
