"""Resolve a model argument (preset name, local checkpoint folder or config.json) into its config.

``resolve_config`` is what ``train`` and ``estimate`` share: configs are facts, weights are never
needed to estimate. Presets live in ``presets/architectures.yaml``.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from memfit.errors import UserError


@lru_cache(maxsize=1)
def load_presets() -> dict[str, dict[str, Any]]:
    """All architecture presets, keyed by name (lower case)."""
    text = resources.files("memfit.presets").joinpath("architectures.yaml").read_text()
    return {str(k).lower(): v for k, v in yaml.safe_load(text).items()}


def preset_names() -> list[str]:
    return sorted(load_presets())


def is_preset(name: str) -> bool:
    return str(name).lower() in load_presets()


def unknown_model_error(name: str) -> UserError:
    close = difflib.get_close_matches(str(name).lower(), preset_names(), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else " Run `memfit presets` to list them."
    return UserError(f"{name!r} is neither a preset nor a local model folder or config.json.{hint}")


def preset_config(name: str):
    """A transformers ``PretrainedConfig`` built from a preset (no download)."""
    from transformers import AutoConfig

    entry = load_presets()[str(name).lower()]
    cfg = dict(entry["config"])
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def resolve_config(model: str, trust_remote_code: bool = False):
    """Preset name, checkpoint folder or ``config.json`` path -> ``PretrainedConfig`` of a causal LM.

    Raises ``UserError`` (one sentence) for unknown names and configs that are not causal LMs.
    """
    from transformers import AutoConfig

    if is_preset(model):
        config = preset_config(model)
    else:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise UserError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}).") from None
            if "model_type" not in data:
                raise UserError(f"{path} has no model_type, so it is not a transformers model config.")
            data = dict(data)
            config = AutoConfig.for_model(data.pop("model_type"), **data)
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise UserError(f"{path} has no config.json, so it is not a Hugging Face model folder.")
            try:
                config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
            except ValueError as err:
                raise UserError(f"{path} holds a config transformers cannot read: {str(err).splitlines()[0]}") from None
        else:
            raise unknown_model_error(model)
    check_causal_lm(config, model)
    return config


def check_causal_lm(config, name: str) -> None:
    """Raise ``UserError`` unless transformers has a causal-LM class for this config."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(
            f"{name!r} is a {config.model_type!r} model, which transformers cannot build as a causal language model."
        )
