"""The data of a run, from ``TrainConfig``: read, chat template, tokenize; shared by ``memfit train``
and ``memfit data preview`` so that the preview shows exactly what training sees."""

from __future__ import annotations

from collections.abc import Sequence

from memfit.config import RunConfig, TrainConfig
from memfit.errors import UserError


def fields_of(config: TrainConfig):
    """``Fields`` from ``--text-field`` and the like, and the names the user typed (checked to exist)."""
    from memfit.data_formats import Fields

    given = {"text": config.text_field, "prompt": config.prompt_field, "completion": config.completion_field,
             "messages": config.messages_field}
    named = tuple(k for k, v in given.items() if v)
    return Fields(**{k: v for k, v in given.items() if v}), named


def load_for_run(config: TrainConfig, run: RunConfig, tokenizer):
    """``(examples, TokenizedData)`` for the run; the tokenizer gets ``--chat-template`` when given.

    Raises:
        UserError: any bad input (see ``memfit.data``, ``memfit.data_formats``, ``memfit.data_sources``),
            or data that leaves no training sequence.
    """
    from memfit import data
    from memfit.data_formats import FORMATS, chat_template_of

    if config.data_format is not None and config.data_format not in FORMATS:
        raise UserError(f"Unknown --data-format {config.data_format!r}; choose one of: {', '.join(FORMATS)}.")
    fields, named = fields_of(config)
    from memfit import data_sources

    if config.data is not None and data_sources.handles(config.data):
        return _load_arrow(config, run, tokenizer, fields, named)
    examples = data.load_examples(config.data, fmt=config.data_format, fields=fields, split=config.split,
                                  data_config=config.data_config, named_fields=named)
    has_chat = any(ex.is_conversation for ex in examples)
    chat_template_of(tokenizer, config.chat_template, data_has_conversations=has_chat)
    tokenized = data.tokenize(examples, tokenizer, seq_len=run.seq_len, packing=run.packing,
                              eval_fraction=config.eval_fraction, seed=config.seed,
                              train_on_prompt=config.train_on_prompt)
    _check_not_empty(tokenized, run)
    return examples, tokenized


def _check_not_empty(tokenized, run: RunConfig) -> None:
    if not len(tokenized.train):
        extra = (f" ({tokenized.dropped_long} conversation(s) longer than --seq-len {run.seq_len} were dropped)"
                 if tokenized.dropped_long else "")
        raise UserError(f"The data yields no training sequence with a target token{extra}.")


class LazyExamples(Sequence):
    """The records of a ``datasets`` source as ``Example`` objects, converted when read."""

    def __init__(self, ds, where: str, fmt, fields) -> None:
        self.ds, self.where, self.fmt, self.fields = ds, where, fmt, fields

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index):
        from memfit.data import record_to_example

        return record_to_example(self.ds[index], f"{self.where} row {index + 1}", self.fmt, self.fields)


def _load_arrow(config: TrainConfig, run: RunConfig, tokenizer, fields, named):
    """A ``datasets`` source tokenized and packed on disk (``memfit.data_arrow``)."""
    from memfit import data_sources
    from memfit.data_arrow import tokenize_dataset
    from memfit.data_formats import chat_template_of

    ds = data_sources.load_dataset(config.data, split=config.split, data_config=config.data_config)
    data_sources.check_columns(ds, config.data, [getattr(fields, name) for name in named])
    if len(ds) == 0:
        raise UserError(f"Data source {config.data} is empty.")
    examples = LazyExamples(ds, config.data, config.data_format, fields)
    chat_template_of(tokenizer, config.chat_template, data_has_conversations=examples[0].is_conversation)
    tokenized = tokenize_dataset(ds, tokenizer, seq_len=run.seq_len, packing=run.packing,
                                 eval_fraction=config.eval_fraction, seed=config.seed, fmt=config.data_format,
                                 fields=fields, train_on_prompt=config.train_on_prompt,
                                 num_proc=config.num_proc, where=config.data)
    _check_not_empty(tokenized, run)
    return examples, tokenized


def data_note(tokenized, run: RunConfig) -> str:
    """One line before training: the packing mode, its padding share, conversations dropped as too long."""
    from memfit.packing import padding_share

    head = tokenized.train[: 4096]  # the first rows tell the share; a corpus on disk is not read whole for it
    share = padding_share(head, run.seq_len, run.micro_batch)
    line = f"packing {run.packing}: {share:.1%} of the token slots of a micro-batch are padding"
    if tokenized.conversations:
        line += f" | {tokenized.conversations:,} conversation(s), loss on assistant turns"
    if tokenized.dropped_long:
        line += (f" | {tokenized.dropped_long:,} conversation(s) longer than --seq-len {run.seq_len} dropped "
                 "(policy: drop; raise --seq-len to keep them)")
    return line


def preview_record(config: TrainConfig, index: int = 0) -> dict:
    """Record ``index`` of ``config.data`` encoded as training encodes it (before packing), with its
    loss mask shown: ``{"where", "format", "tokens", "targets", "input_ids", "labels", "marked"}``."""
    from memfit import data, modelspec
    from memfit.data_formats import chat_template_of, preview

    fields, named = fields_of(config)
    tokenizer = data.load_tokenizer(config.tokenizer, config.model, is_preset=modelspec.is_preset(config.model),
                                    trust_remote_code=config.trust_remote_code)
    examples = data.load_examples(config.data, fmt=config.data_format, fields=fields, split=config.split,
                                  data_config=config.data_config, named_fields=named)
    if not 0 <= index < len(examples):
        raise UserError(f"--index {index} is outside the data's {len(examples):,} records.")
    example = examples[index]
    chat_template_of(tokenizer, config.chat_template, data_has_conversations=example.is_conversation)
    ids, labels, *_ = data._encode_docs([example], tokenizer, config.train_on_prompt)[0]
    fmt = "conversation" if example.is_conversation else ("prompt-completion" if example.is_prompt_completion
                                                           else "text")
    targets = sum(1 for t in labels[1:] if t != data.IGNORE_INDEX)
    return {"where": example.where or f"record {index}", "format": fmt, "tokens": len(ids), "targets": targets,
            "input_ids": ids, "labels": labels, "marked": preview(tokenizer, ids, labels)}
