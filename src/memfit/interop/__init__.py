"""Other tools' training configurations as memfit runs: read (``estimate --from``, ``plan --from``), written
(``plan --emit``), and a callback for transformers' Trainer (``memfit.interop.callback``).

One module per tool, each with ``NAME``, ``DEEPSPEED`` (the shardings it runs through DeepSpeed), ``detect(data)``, ``read(path, data) -> Reading``,
``emit(model, run, source) -> dict``, ``launch(run)`` (the launch command that states the process count, the
recipe or the trainer, written as a comment) and ``realize(run)`` (a planner candidate as that tool would run it,
or None where it cannot). The tools themselves are never imported: their files are read from their
documented schemas.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from memfit.errors import UserError
from memfit.files import write_text_atomic
from memfit.interop import axolotl, llamafactory, torchtune, trl
from memfit.interop.common import Reading, check_model, load_file
from memfit.settings.stack import Stack

#: In the order formats are detected: the most specific markers first (LLaMA-Factory files also hold Trainer
#: keys; TRL's are the plainest).
TOOLS = {m.NAME: m for m in (torchtune, axolotl, llamafactory, trl)}
FORMATS = tuple(TOOLS)

__all__ = ["FORMATS", "TOOLS", "Reading", "check_model", "detect", "emit", "engine_of", "read", "realize", "stack_of"]


def detect(path: str | Path, data: dict) -> str:
    """The tool whose configuration ``data`` is, or one sentence naming the file."""
    for name, module in TOOLS.items():
        if module.detect(data):
            return name
    raise UserError(f"{path} is none of the configurations memfit reads ({', '.join(FORMATS)}): it has none of "
                    "their keys (base_model, model._component_, finetuning_type, per_device_train_batch_size, ...).")


def read(path: str | Path, fmt: str | None = None) -> Reading:
    """Read ``path`` as ``fmt``'s configuration (detected from its keys when None)."""
    data = load_file(path)
    if fmt is not None and fmt not in TOOLS:
        raise UserError(f"--from-format {fmt!r} is not one of {', '.join(FORMATS)}.")
    return TOOLS[fmt or detect(path, data)].read(str(path), data)


def realize(tool: str):
    """The tool's ``realize``: a planner candidate as it runs it; ``--sharding hybrid`` (FSDP2's HSDP across nodes)
    is no candidate of a tool's config, which none of the writers here can express."""
    tool_realize = TOOLS[tool].realize
    return lambda run: None if str(run.sharding) == "hybrid" else tool_realize(run)


def stack_of(tool: str, reading: Reading | None = None) -> Stack:
    """The stack that runs ``tool``'s candidates (``memfit.settings.stack``): the file's where it is that tool's
    (its FSDP version), else the tool itself on the installed versions; so that a plan priced for a tool reads
    back from the file it writes to the same number."""
    return reading.stack if reading is not None and reading.tool == tool else Stack(trainer=tool)


def engine_of(tool: str):
    """The engine ``tool`` runs a candidate's sharding on (``memory.deepspeed_layout.ENGINES``): DeepSpeed for the
    shardings its ``emit`` writes as a DeepSpeed config, else FSDP2; for the planner, so that a plan written as
    that tool's config reads back to the same prediction."""
    deepspeed = TOOLS[tool].DEEPSPEED
    return lambda run: "deepspeed" if str(run.sharding) in deepspeed else "fsdp2"


def emit(tool: str, path: str | Path, model: str, run, source: Reading | None = None, header: str = "") -> None:
    """Write ``run`` as ``tool``'s configuration to ``path`` (YAML; JSON for a .json path), atomically; a YAML file
    starts with the launch command (``launch``: process count, recipe, trainer), which ``read`` reads back. JSON
    holds no comments: its process count is given to ``estimate`` with ``--num-processes``."""



    data = TOOLS[tool].emit(model, run, source)
    path = Path(path)
    if path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        command = TOOLS[tool].launch(run)
        launch = f"# launch: {command.replace('THIS_FILE', path.name)}\n" if command else ""
        text = header + launch + yaml.safe_dump(data, sort_keys=False)
    write_text_atomic(path, text, what="--emit")
