"""The data of a run, from ``TrainConfig``: read, chat template, tokenize; shared by ``memfit train``
and ``memfit data preview`` so that the preview shows exactly what training sees.

Imports: ``memfit.data.dataset`` and ``memfit.data.arrow`` are imported where they are used, not here: they import
torch (and ``datasets``), 2.7 s and 3.4 s on this project's machine (``python -X importtime``), which
``memfit estimate`` would pay on every call, as it reaches this module through ``training.derived``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from memfit.data import sources as data_sources
from memfit.data.formats import Fields, chat_template_of, preview
from memfit.data.packing import padding_share
from memfit.data.pairs import Pair, encode_side
from memfit.data.stream import record_at
from memfit.errors import UserError
from memfit.integrations.hub import local_folder
from memfit.settings.config import RunConfig, TrainConfig
from memfit.spec.model import is_preset


def fields_of(config: TrainConfig):
    """``Fields`` from ``--text-field`` and the like, and the names the user typed (checked to exist)."""
    given = {"text": config.reading.text_field, "prompt": config.reading.prompt_field, "completion": config.reading.completion_field,
             "messages": config.reading.messages_field}
    named = tuple(k for k, v in given.items() if v)
    return Fields(**{k: v for k, v in given.items() if v}), named


def run_tokenizer(source, hub_model=None):
    """The tokenizer a run of ``source`` (``memfit.settings.config.ModelSource``) trains with: ``--tokenizer`` when
    given, else the model's own: from ``hub_model``'s snapshot (``training.setup.fetch_hub_model``), a Hub id's
    cached tokenizer files, a folder's, or memfit's byte tokenizer for a preset
    (``memfit.data.dataset.load_tokenizer``)."""
    from memfit.data import dataset as data  # torch: see the module docstring

    folder = str(hub_model.path) if hub_model is not None else local_folder(
        source.model, source.revision, files="tokenizer", trust_remote_code=source.trust_remote_code)
    return data.load_tokenizer(source.tokenizer, folder, is_preset=is_preset(source.model),
                               trust_remote_code=source.trust_remote_code)


def load_for_run(config: TrainConfig, run: RunConfig, tokenizer):
    """``(examples, TokenizedData)`` for the run; the tokenizer gets ``--chat-template`` when given.

    Every source is read through ``datasets`` and tokenized and packed on disk (``memfit.data.sources``,
    ``memfit.data.arrow``): ``examples`` reads its records lazily, ``TokenizedData``'s rows are
    memory-mapped, so a corpus larger than RAM trains.

    Raises:
        UserError: any bad input (see ``memfit.data.dataset``, ``memfit.data.formats``, ``memfit.data.sources``),
            or data that leaves no training sequence.
    """
    from memfit.data.arrow import pack_encoded  # torch: see the module docstring

    examples, encoded = _encode(config, tokenizer)
    tokenized = pack_encoded(encoded, seq_len=run.seq_len, packing=run.packing, eval_fraction=config.eval_fraction,
                             seed=config.seed, truncate=config.truncate)
    _check_not_empty(tokenized, run, config.truncate)
    return examples, tokenized


def record_lengths(config: TrainConfig, tokenizer):
    """The tokenized lengths of the run's training records (held-out ones left out), as an int64 numpy array.

    Read from the ``length`` column of the encoded table (``memfit.data.arrow``, step 1): every record of
    every source, Hub datasets included, is tokenized whole before packing and cached by ``datasets``,
    so ``load_for_run`` then reuses this encoding instead of tokenizing again.
    """
    from memfit.data.dataset import split_indices  # torch: see the module docstring

    _, encoded = _encode(config, tokenizer)
    lengths = encoded.select_columns(["length"]).with_format("arrow")[:].column("length").to_numpy()
    train, _ = split_indices(len(lengths), config.eval_fraction, config.seed)  # tokenize's split
    return lengths[train]


def _encode(config: TrainConfig, tokenizer):
    """``(examples, encoded)``: the records of ``config.data`` and their encoding, one row per document."""
    from memfit.data.arrow import encode_parts  # torch: see the module docstring
    fields, named = fields_of(config)
    parts = data_sources.load_parts(config.data, split=config.reading.split, data_config=config.reading.data_config,
                                    fmt=config.reading.data_format, fields=fields)
    plan = []  # (dataset, where, format, fields) per part
    for part in parts:
        if part.files and part.files[0].suffix.lower() == ".txt":  # one "text" column, whatever the options
            plan.append((part.ds, part.where, "text", Fields()))
            continue
        data_sources.check_columns(part.ds, part.where, [getattr(fields, name) for name in named])
        plan.append((part.ds, part.where, config.reading.data_format, fields))
    examples = LazyExamples(plan)
    chat_template_of(tokenizer, config.reading.chat_template, data_has_conversations=examples.has_conversations())
    try:
        encoded = encode_parts(plan, tokenizer, train_on_prompt=config.reading.train_on_prompt, num_proc=config.reading.num_proc)
    except UserError:
        from memfit.data.dataset import find_bad_input  # torch: see the module docstring

        for part in parts:  # a bad record of a .jsonl file: name its line, as memfit's own reader does
            for file in part.files:
                find_bad_input(file, config.reading.data_format, fields)
        raise
    return examples, encoded


def _check_not_empty(tokenized, run: RunConfig, truncate: bool = False) -> None:
    if not len(tokenized.train):
        how = ("no reply token within their first --seq-len tokens; raise --seq-len" if truncate
               else "raise --seq-len, or add --truncate to keep them cut")
        extra = (f" ({tokenized.dropped_long} conversation(s) longer than --seq-len {run.seq_len} were dropped; "
                 f"{how})" if tokenized.dropped_long else "")
        raise UserError(f"The data yields no training sequence with a target token{extra}.")


class LazyExamples(Sequence):
    """The records of one or more ``datasets`` tables, in order, as ``Example`` objects converted when read
    (a few are: the documents that prompt the samples)."""

    def __init__(self, parts) -> None:
        self.parts = list(parts)  # (dataset, where, format, fields)
        self.starts = [0]
        for ds, *_ in self.parts:
            self.starts.append(self.starts[-1] + len(ds))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index):
        from memfit.data.dataset import record_to_example  # torch: see the module docstring

        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = bisect.bisect_right(self.starts, index) - 1
        ds, where, fmt, fields = self.parts[part]
        row = index - self.starts[part]
        return record_to_example(ds[row], f"{where} row {row + 1}", fmt, fields)

    def has_conversations(self) -> bool:
        """Whether a part's first record is a conversation (a table holds one format, by its columns)."""
        return any(self[start].is_conversation for start in self.starts[:-1] if start < len(self))


def data_note(tokenized, run: RunConfig, truncate: bool = False) -> str:
    """One line before training: the packing mode, its padding share, conversations too long for
    ``--seq-len`` dropped or (``truncate``) cut."""
    head = tokenized.train[: 4096]  # the first rows tell the share; a corpus on disk is not read whole for it
    share = padding_share(head, run.seq_len, run.micro_batch)
    line = f"packing {run.packing}: {share:.1%} of the token slots of a micro-batch are padding"
    if tokenized.conversations:
        line += f" | {tokenized.conversations:,} conversation(s), loss on assistant turns"
    if tokenized.truncated_long:
        line += (f" | {tokenized.truncated_long:,} conversation(s) longer than --seq-len {run.seq_len} cut to it "
                 "(--truncate)")
    if tokenized.dropped_long:
        line += (f" | {tokenized.dropped_long:,} conversation(s) longer than --seq-len {run.seq_len} dropped "
                 + ("(--truncate: no target token within the cut)" if truncate
                    else "(policy: drop; raise --seq-len, or --truncate to keep them cut)"))
    return line


def preview_record(config: TrainConfig, index: int = 0) -> dict:
    """Record ``index`` of ``config.data`` (read up to that record, not further) encoded as training
    encodes it (before packing), with its loss mask shown: ``{"where", "format", "tokens", "targets",
    "input_ids", "labels", "marked"}``."""
    from memfit.data import dataset as data  # torch: see the module docstring

    fields, named = fields_of(config)
    tokenizer = run_tokenizer(config.source)  # a Hub id: its cached tokenizer
    # read up to record `index` only (memfit.data.stream), not the whole source
    example = record_at(config.data, index, fmt=config.reading.data_format, fields=fields, split=config.reading.split,
                        data_config=config.reading.data_config, named_fields=named)
    chat_template_of(tokenizer, config.reading.chat_template, data_has_conversations=example.is_conversation)

    if isinstance(example, Pair):
        return _preview_pair(example, tokenizer)
    ids, labels, *_ = data.encode_docs([example], tokenizer, config.reading.train_on_prompt)[0]
    fmt = "conversation" if example.is_conversation else ("prompt-completion" if example.is_prompt_completion
                                                           else "text")
    targets = sum(1 for t in labels[1:] if t != data.IGNORE_INDEX)
    return {"where": example.where or f"record {index}", "format": fmt, "tokens": len(ids), "targets": targets,
            "input_ids": ids, "labels": labels, "marked": preview(tokenizer, ids, labels)}


def _preview_pair(pair, tokenizer) -> dict:
    """A preference pair as ``--method dpo|orpo|simpo`` trains on it: each side's tokens, loss on its completion."""
    from memfit.data import dataset as data  # torch: see the module docstring

    sides, marked = {}, []
    for side in ("chosen", "rejected"):
        ids, labels = encode_side(pair, side, tokenizer)
        targets = sum(1 for t in labels[1:] if t != data.IGNORE_INDEX)
        sides[side] = {"tokens": len(ids), "targets": targets, "input_ids": ids, "labels": labels}
        marked.append(f"--- {side} ({len(ids)} tokens, {targets} with loss)\n{preview(tokenizer, ids, labels)}")
    return {"where": pair.where, "format": "preference pair", **sides,
            "tokens": sides["chosen"]["tokens"] + sides["rejected"]["tokens"],
            "targets": sides["chosen"]["targets"] + sides["rejected"]["targets"], "marked": "\n".join(marked)}
