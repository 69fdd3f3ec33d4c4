"""The run's defaults that come from its data and method (``memfit.settings.defaults``), applied as it is built.

``build_session`` calls these in order: ``with_seq_len`` before the run's settings are resolved (the
``--budget`` planner needs the length), ``with_lr`` once the model is resolved (random weights or
pretrained), ``total_steps`` once the data is packed. Each returns the line that names the value and
why (None when nothing was derived); the values land in the ``TrainConfig``/``RunConfig`` the run saves
in its checkpoints, so ``--resume`` continues with them instead of deriving again.
"""

from __future__ import annotations

import dataclasses

from memfit.data.prep import record_lengths, run_tokenizer
from memfit.settings import defaults
from memfit.settings.config import TrainConfig
from memfit.spec.model import is_preset, source_config


def is_demo(model: str, data: str | None) -> bool:
    """``memfit train``'s demo: a preset (random weights) on the corpus shipped with memfit. (Here, not in
    ``memfit.settings.defaults``, which ``config`` reads: that must not import the model spec, a cycle.)"""
    return data is None and is_preset(model)


def _given(config: TrainConfig, name: str) -> bool:
    """Whether the user set ``name``; library callers (``explicit`` None) set everything."""
    return config.explicit is None or name in config.explicit


def with_seq_len(config: TrainConfig, *, resumed: bool, hub_model=None) -> tuple[TrainConfig, str | None]:
    """``config`` with ``--seq-len`` from the data when the user did not give it and this is no demo.

    The lengths are those of the encoded training records (``memfit.data.prep.record_lengths``: every
    record, tokenized once; ``build_data`` reuses that encoding from the ``datasets`` cache). The cap is
    the model's ``max_position_embeddings``. A resumed run keeps its saved length (``resumed``).
    ``hub_model``: the snapshot a Hub ``--model`` was fetched to (``setup.fetch_hub_model``), whose
    tokenizer is the one training uses.
    """
    if resumed or _given(config, "seq_len") or is_demo(config.source.model, config.data):
        return config, None
    if str(config.run.method) != "sft":  # a preference method keeps --seq-len: its pairs are cut to it, never packed
        return config, (f"default seq-len {config.run.seq_len} (each {config.run.method} pair's prompt and answers "
                        "are cut to it, not sized from the data; --seq-len to choose)")

    # the tokenizer and config resolve_model loads next (it checks them against the derived length)
    hf_config = source_config(config.source)
    tokenizer = run_tokenizer(config.source, hub_model)
    choice = defaults.seq_len_from_lengths(record_lengths(config, tokenizer),
                                           getattr(hf_config, "max_position_embeddings", None))
    if choice is None:  # no training record: build_data says so in its own words
        return config, None
    run = config.run.replace(seq_len=choice.seq_len)
    return dataclasses.replace(config, run=run), choice.describe()


def seq_len_as_train(model: str, data: str | None, run, *, context: int | None, tokenizer: str | None = None,
                     revision: str | None = None, trust_remote_code: bool = False):
    """``(run, note)``: ``run`` at the ``--seq-len`` ``memfit train --model MODEL [--data DATA]`` runs when the
    user gives none, for ``estimate`` and ``plan`` (one meaning per default), and the line that says where it
    came from (None for the demo, whose length is the default itself).

    * the demo (a preset, no ``--data``): ``DEMO_SEQ_LEN``, as train;
    * ``--data``: derived from the data exactly as train derives it (``with_seq_len``: the model's tokenizer,
      the 99th percentile of the training records, capped by the model's context);
    * a model of the user's own without ``--data``: train derives the length from the corpus shipped with
      memfit; the command prices ``DEMO_SEQ_LEN`` capped by ``context`` instead (tokenizing a corpus is
      train's work, not a pricing's) and the note says so.
    """
    if is_demo(model, data):
        return run, None
    if data is None:
        seq_len = min(run.seq_len, context) if context else run.seq_len
        return run.replace(seq_len=seq_len), (
            f"seq-len {seq_len} (memfit train --model {model} derives it from its data, the shipped corpus without "
            "--data; --data, or --seq-len, to price that length here)")
    config = TrainConfig.from_flat({"model": model, "data": data, "tokenizer": tokenizer, "revision": revision,
                                    "trust_remote_code": trust_remote_code, **run.to_flat(), "explicit": ()})
    derived, note = with_seq_len(config, resumed=False)
    return derived.run, note


def with_lr(config: TrainConfig, *, random_init: bool, lora: bool) -> tuple[TrainConfig, str | None]:
    """``config`` with the learning rate by method when ``--lr`` was not given (``defaults.default_lr``)."""
    if config.optim.lr is not None:
        return config, None
    lr, why = defaults.default_lr(random_init=random_init, lora=lora)
    note = None if is_demo(config.source.model, config.data) else f"lr {defaults.fmt_lr(lr)} ({why}; --lr to choose)"
    return config.replace(lr=lr), note


def total_steps(config: TrainConfig, steps_per_epoch: int) -> tuple[int, str | None]:
    """Optimizer steps of the run: ``--max-steps`` or ``--epochs`` (whichever ends first when both are
    given), else ``defaults.default_steps``."""
    steps = []
    if config.length.epochs:
        steps.append(config.length.epochs * steps_per_epoch)
    if config.length.max_steps:
        steps.append(config.length.max_steps)
    if steps:
        return min(steps), None
    count, note = defaults.default_steps(demo=is_demo(config.source.model, config.data),
                                         steps_per_epoch=steps_per_epoch)
    return count, note or None
