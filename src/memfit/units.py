"""Units: bytes, GB versus GiB, dtype sizes, and parsing/formatting of memory sizes.

GPU memory is sold in GiB ("24 GB" cards have 24 GiB = 25.77 GB), while model sizes are usually
quoted in GB (1e9 bytes). memfit parses both spellings exactly and always labels what it prints.
This is the only module that divides by 1e9 or 2**30.
"""

from __future__ import annotations

import math
import re

from memfit.errors import UserError

KB, MB, GB = 10**3, 10**6, 10**9
KiB, MiB, GiB = 2**10, 2**20, 2**30

#: Bytes per element for the dtypes memfit talks about (the names are torch's and memfit's flags').
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "int8": 1,
    "8bit": 1,
    "4bit": 0.5,  # NF4/FP4 payload only; bitsandbytes' absmax/quant-state overhead is added separately
    "bool": 1,
    "int64": 8,
}

#: memfit's weight dtypes (``--dtype``) by torch's names for them (``torch.bfloat16``, a config's ``torch_dtype``).
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype_name(dtype) -> str:
    """torch's name of a memfit weight dtype (``bf16`` -> ``bfloat16``)."""
    return TORCH_DTYPE_NAMES[str(dtype)]


_UNITS = {
    "b": 1,
    "kb": KB,
    "mb": MB,
    "gb": GB,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype given by memfit's or torch's name (``"bf16"``, ``"float32"``)."""
    key = str(name).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise UserError(f"Unknown dtype {name!r}; expected one of fp32, bf16, fp16.")
    return DTYPE_BYTES[key]


MAX_SIZE = 2**60
"""The largest memory size memfit reads (1 EiB): beyond it a figure is a typo, and ``int()`` of ``inf`` fails."""


def parse_size(text: str | int | float) -> int:
    """Parse ``"24GiB"``, ``"24 GB"``, ``"80gib"``, ``"1.5e9"`` or a plain number of bytes into bytes.

    A bare ``"24G"`` is ambiguous; memfit reads it as GiB because that is what GPU makers mean.
    """
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text <= 0 or text > MAX_SIZE:
            raise UserError(f"Memory size must be a positive number of bytes up to 1 EiB, got {text:g}.")
        return int(text)
    raw = str(text)
    match = _SIZE_RE.match(raw)
    if not match:
        try:
            value = float(raw)
        except ValueError:
            raise UserError(f"Cannot read memory size {raw!r}; write it like 24GiB, 24GB or 8000MiB.") from None
        return parse_size(value)
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit in ("g", "gi"):
        unit = "gib"
    elif unit in ("m", "mi"):
        unit = "mib"
    elif unit in ("t", "ti"):
        unit = "tib"
    elif unit == "":
        if 0 < number < MiB:  # "--budget 80": 80 GiB or GB surely meant, not 80 bytes
            raise UserError(f"Memory size {raw.strip()!r} has no unit and would be {raw.strip()} bytes; write it "
                            f"like {raw.strip()}GiB or {raw.strip()}GB.")
        unit = "b"
    if unit not in _UNITS:
        raise UserError(f"Unknown memory unit {match.group(2)!r} in {raw!r}; use GiB, GB, MiB or MB.")
    if number <= 0:
        raise UserError(f"Memory size must be positive, got {raw!r}.")
    return parse_size(number * _UNITS[unit])  # the bound: 1e400GiB is no size either


def to_gib(n_bytes: float) -> float:
    return n_bytes / GiB


def to_gb(n_bytes: float) -> float:
    return n_bytes / GB


def fmt_gib(n_bytes: float, digits: int = 2) -> str:
    """``"24.00 GiB"``: the unit GPU memory is sold in; below 1 GiB it scales down: ``"165.1 MiB"``."""
    if 0 < abs(n_bytes) < GiB:
        return f"{n_bytes / MiB:.1f} MiB"
    return f"{n_bytes / GiB:.{digits}f} GiB"


def fmt_gb(n_bytes: float, digits: int = 2) -> str:
    """``"25.77 GB"`` (decimal, 1e9 bytes); below 1 GB it scales down: ``"173.1 MB"``."""
    if 0 < abs(n_bytes) < GB:
        return f"{n_bytes / MB:.1f} MB"
    return f"{n_bytes / GB:.{digits}f} GB"


def fmt_bytes(n_bytes: float, digits: int | None = None) -> str:
    """Human size with a binary unit chosen to fit: ``"512.0 MiB"``, ``"1.25 GiB"``.

    ``digits`` overrides the default decimals (2 for GiB, 1 below): the progress line uses 0.
    """
    n = float(n_bytes)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            places = digits if digits is not None else (2 if unit == "GiB" else 1)
            return f"{n / size:.{places}f} {unit}"
    return f"{int(n)} B"


def binary_scale(n_bytes: float) -> tuple[str, int]:
    """``("GiB", 2**30)`` for figures of a GiB or more, else ``("MiB", 2**20)``: the unit a column of
    sizes up to ``n_bytes`` is shown in, so small models do not print 0.00 GiB everywhere."""
    return ("GiB", GiB) if abs(n_bytes) >= GiB else ("MiB", MiB)


def decimal_scale(n_bytes: float) -> tuple[str, int]:
    """``("GB", 1e9)`` or ``("MB", 1e6)``: the decimal twin of ``binary_scale``."""
    return ("GB", GB) if abs(n_bytes) >= GB else ("MB", MB)


def fmt_scaled(n_bytes: float, scale: tuple[str, int], digits: int = 2, unit: bool = True) -> str:
    """``n_bytes`` in a unit picked by ``binary_scale``/``decimal_scale``: ``"165.10 MiB"``."""
    name, size = scale
    return f"{n_bytes / size:.{digits}f}" + (f" {name}" if unit else "")


def fmt_count(n: float) -> str:
    """``"6.74 B"``, ``"124.4 M"``: parameter or token counts."""
    n = float(n)
    for suffix, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {suffix}" if suffix == "B" else f"{n / size:.1f} {suffix}"
    return f"{int(n)}"
