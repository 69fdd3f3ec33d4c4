"""What the writers of another tool's configuration share (``plan --emit``)."""

from __future__ import annotations

from typing import Any

from memfit.interop.common import Reading

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_name(dtype) -> str:
    """torch's name of a memfit weight dtype (``bf16`` -> ``bfloat16``)."""
    return DTYPE_NAMES[str(dtype)]


def merged(source: Reading | None, tool: str, settings: dict[str, Any], drop: tuple[str, ...] = ()) -> dict:
    """The emitted file: the source file's own settings (its data, schedule, logging) with the plan's
    memory settings written over them when the source is a file of the same tool (``drop``: keys the
    plan's settings replace, removed first); else the plan's settings alone."""
    if source is None or source.tool != tool:
        return settings
    out = {k: v for k, v in source.data.items() if k not in drop}
    out.update(settings)
    return out
