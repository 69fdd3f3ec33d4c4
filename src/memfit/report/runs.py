"""A run in words: its method, precision and settings on one line, and the command that launches it folded
for a terminal. Render only: the planner's messages, the plan table and ``memfit plan``'s output read them.
"""

from __future__ import annotations

import re
import shlex

from memfit.memory.preference_terms import reference_policy
from memfit.settings.config import DType, Offload, Precision, Quantize, RunConfig


def method(run: RunConfig) -> str:
    """``full``, ``LoRA r16``, ``QLoRA 4bit r16``."""
    if run.quantize is not Quantize.NONE:
        return f"QLoRA {run.quantize} r{run.lora.r}"
    return f"LoRA r{run.lora.r}" if run.is_lora() else "full"


def precision(run: RunConfig) -> str:
    """``bf16 AMP / fp32 w`` (autocast compute / stored weights), ``pure bf16``, ``fp32``."""
    if run.mixed_precision is Precision.NO:
        return "fp32" if run.dtype is DType.FP32 else f"pure {run.dtype}"
    stored = {Quantize.Q4: "4bit", Quantize.Q8: "int8"}.get(run.quantize, str(run.dtype))
    return f"{run.mixed_precision} AMP / {stored} w"


def describe(run: RunConfig) -> str:
    """One line: ``QLoRA 4bit r16, bf16 AMP / 4bit w, checkpointing, micro-batch 1 x 16 accumulation, ...``."""
    parts = [method(run), precision(run)]
    if run.grad_checkpointing:
        parts.append("checkpointing")
    parts += [f"micro-batch {run.micro_batch} x {run.grad_accum} accumulation", str(run.optimizer)]
    if run.offload is not Offload.NONE:
        parts.append(f"offload {run.offload}")
    if str(run.loss) != "standard":
        parts.append(f"{run.loss} loss")
    if run.optimizer_in_backward:
        parts.append("optimizer in backward")
    if str(run.method) != "sft":
        policy = reference_policy(run)
        parts.append(f"{run.method}" + (f" (reference: {policy})" if policy else ""))
    if run.num_processes > 1:
        parts.append(f"{run.sharding} over {run.num_processes} processes")
    return ", ".join(parts)


def _quoted(word: str) -> str:
    """``shlex.quote``, except that a word naming a shell variable (a multi-node launch's ``$NODE_RANK``) is
    double-quoted, so that the shell of each node expands it."""
    if "$" in word and re.fullmatch(r"[\w./${}:= -]+", word):
        return f'"{word}"'
    return shlex.quote(word)


def shell_lines(command: str, width: int = 80) -> str:
    """``command`` folded at flag boundaries into shell lines of at most ``width`` columns joined by
    ``\\`` (a flag stays with its value), so it fits the terminal and still pastes as one command."""
    words = shlex.split(command)
    groups: list[str] = []
    for word in words:
        if groups and not word.startswith("-") and groups[-1].startswith("--") and " " not in groups[-1]:
            groups[-1] += " " + _quoted(word)  # a flag's value stays on its line
        else:
            groups.append(_quoted(word))
    lines, line = [], "  "
    for group in groups:
        if line.strip() and len(line) + 1 + len(group) + 2 > width:
            lines.append(line + " \\")
            line = "    " + group
        else:
            line = (line + " " + group) if line.strip() else "  " + group
    lines.append(line)
    return "\n".join(lines)
