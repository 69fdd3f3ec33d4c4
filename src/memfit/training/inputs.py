"""A run's model and data arguments checked on the file system alone, before torch and transformers load.

``memfit train --data notes.jsnol`` used to say "Data path notes.jsnol does not exist." only after importing
torch, transformers and PEFT (about 9 s on this project's 2-core machine, more on a busy one). These are the
same checks the loaders make (``spec.model.model_kind``, ``data.sources.check_data_path``), run first.
"""

from __future__ import annotations

from memfit.data.sources import check_data_path
from memfit.spec.model import model_kind


def check_inputs(model: str, data: str | None, revision: str | None = None) -> None:
    """Refuse, in one sentence, a ``--model`` that is no preset, config.json, model folder or Hub id, and a
    ``--data`` path that does not exist or is no data file; a Hub id is looked up later, when it is read.

    Raises:
        UserError: the loader's own sentence for the first of these problems.
    """

    model_kind(model, revision)
    check_data_path(data)
