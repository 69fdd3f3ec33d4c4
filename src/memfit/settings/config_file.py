"""``memfit train --config FILE``: a YAML file of settings, read as the flags' words.

YAML 1.1 (PyYAML's) reads ``no``, ``yes``, ``on`` and ``off`` as booleans, so ``mixed_precision: no``
would arrive as ``False`` and be refused as an unknown precision. Here only ``true``/``false`` are
booleans (as in YAML 1.2); ``yes``/``no``/``on``/``off`` stay the words written, which a choice takes as
its own word and a true/false setting reads as true or false (``memfit.settings.validate.boolean``).

The file must be one flat mapping of settings: a nested ``config:`` mapping is refused rather than read
instead of (or beside) the top level, so no key is ever silently ignored.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from memfit import textfiles
from memfit.errors import UserError
from memfit.files import user_path


class SettingsLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose booleans are only ``true``/``false`` (any case), as in YAML 1.2."""


SettingsLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
SettingsLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                     list("tTfF"))


def read_settings(path: str | Path) -> dict[str, Any]:
    """The settings of a ``--config`` YAML file, keys spelled as the flags' words with ``_``.

    Raises:
        UserError: a missing or unreadable file, one that is not UTF-8 (line and byte named), not YAML,
            not a mapping, or that nests its settings under ``config:``.
    """

    file = user_path(path)
    if not file.is_file():
        raise UserError(f"Config file {file} does not exist." if not file.exists() else
                        f"Config file {file} is not a file (a folder, device or pipe); pass a YAML file.")
    text = textfiles.read_text(file, what="Config file")
    try:
        data = yaml.load(text, Loader=SettingsLoader) or {}  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise UserError(f"{file} is not valid YAML ({str(err).splitlines()[0]}).") from None
    except (ValueError, RecursionError) as err:  # an int of 5000 digits, a deeply nested flow
        raise UserError(f"{file} holds a value YAML cannot read ({str(err)[:100]}).") from None
    if not isinstance(data, dict):
        raise UserError(f"{file} must hold a mapping of settings (key: value), not a {type(data).__name__}.")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    if isinstance(data.get("config"), dict):
        raise UserError(f"{file} nests settings under config:; write them at the top level (key: value), as "
                        "memfit plan --output does.")
    return data
