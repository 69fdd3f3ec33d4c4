"""The data of a run, from ``TrainConfig``: read, chat template, tokenize; shared by ``memfit train``
and ``memfit data preview`` so that the preview shows exactly what training sees."""

from __future__ import annotations

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
    examples = data.load_examples(config.data, fmt=config.data_format, fields=fields, split=config.split,
                                  data_config=config.data_config, named_fields=named)
    has_chat = any(ex.is_conversation for ex in examples)
    chat_template_of(tokenizer, config.chat_template, data_has_conversations=has_chat)
    tokenized = data.tokenize(examples, tokenizer, seq_len=run.seq_len, packing=run.packing,
                              eval_fraction=config.eval_fraction, seed=config.seed,
                              train_on_prompt=config.train_on_prompt)
    if not tokenized.train:
        extra = (f" ({tokenized.dropped_long} conversation(s) longer than --seq-len {run.seq_len} were dropped)"
                 if tokenized.dropped_long else "")
        raise UserError(f"The data yields no training sequence with a target token{extra}.")
    return examples, tokenized


def data_note(tokenized, run: RunConfig) -> str:
    """One line before training: the packing mode, its padding share, conversations dropped as too long."""
    from memfit.packing import padding_share

    share = padding_share(tokenized.train, run.seq_len, run.micro_batch)
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
