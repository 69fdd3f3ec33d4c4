"""Preference data: ``prompt``/``chosen``/``rejected`` records, encoded as pairs for DPO, ORPO and SimPO.

A record is one of (TRL's dataset formats, https://huggingface.co/docs/trl/dataset_formats):

=========================  ================================================================================
standard, explicit prompt  ``{"prompt": "...", "chosen": "...", "rejected": "..."}``
standard, implicit prompt  ``{"chosen": "...", "rejected": "..."}``: the prompt is their common start
conversational, explicit   ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``
conversational, implicit   ``{"chosen": [messages], "rejected": [messages]}``: the prompt is the turns they
                           share (TRL's ``extract_prompt``), the completions the turns after it
=========================  ================================================================================

Each side is encoded as memfit encodes a prompt/completion record (``memfit.data.dataset.encode_docs``:
``[bos] + prompt + completion + [eos]``, loss on the completion and its eos) or a conversation
(``memfit.data.formats.encode_conversation``: the chat template, loss on the assistant turns of the
completion only). A row is the chosen side in ``input_ids``/``labels`` (so everything that reads a row,
the held-out loss included, sees the chosen answer) and the rejected side in ``rejected_input_ids``/
``rejected_labels``. A side longer than ``--seq-len`` is cut to it (its completion's end is lost, as TRL
cuts); a prompt that leaves no completion token within ``--seq-len`` is refused.
"""

# Inside functions: torch (2.6 s) and memfit.data.dataset (4.8 s: torch and transformers; python -X importtime, 2026-12-06, this shared 2-core machine); reading
# and checking pair files stays torch-free (tests/test_faults_inputs.py).
from __future__ import annotations

from dataclasses import dataclass

from memfit.data import sources as data_sources
from memfit.data.formats import Fields, chat_template_of, encode_conversation, to_messages
from memfit.errors import UserError

REJECTED_KEYS = ("rejected_input_ids", "rejected_labels")


@dataclass(frozen=True)
class Pair:
    """One preference record: a prompt and two completions, as text or as messages."""

    prompt: str | tuple[tuple[str, str], ...]
    chosen: str | tuple[tuple[str, str], ...]
    rejected: str | tuple[tuple[str, str], ...]
    where: str

    @property
    def is_conversation(self) -> bool:
        return not isinstance(self.chosen, str)


def is_pair_record(record) -> bool:
    """Whether a record is a preference record (it has ``chosen`` or ``rejected``)."""
    return isinstance(record, dict) and ("chosen" in record or "rejected" in record)


def _messages(value, where: str, side: str):
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise UserError(f"{where} has a {side} that is neither a string nor a list of messages.")
    if not value:
        return ()
    return to_messages({"messages": value}, "messages", f"{where} ({side})", Fields()) if side != "prompt" else \
        tuple((str(m.get("role")), str(m.get("content"))) for m in value)


def _common_prefix(a: str, b: str) -> str:
    """The longest common start of two texts, ending before a space where it can (TRL's ``extract_prompt``)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[: n - 1] if n and a[n - 1] == " " else a[:n]


def record_to_pair(record, where: str) -> Pair:
    """One record as a ``Pair``, or the one sentence that says what is wrong with it."""
    if not isinstance(record, dict):
        raise UserError(f"{where} is a JSON {type(record).__name__}, not a record with prompt, chosen and rejected.")
    for side in ("chosen", "rejected"):
        if record.get(side) in (None, "", []):
            raise UserError(f"{where} has no {side} answer; a preference record needs prompt, chosen and rejected "
                            f"(its fields are: {', '.join(map(str, record)) or 'none'}).")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if chosen == rejected:
        raise UserError(f"{where} has identical chosen and rejected answers, so it carries no preference.")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            prompt = _common_prefix(chosen, rejected)
            chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
        if not isinstance(prompt, str):
            raise UserError(f"{where} has text answers but a prompt that is not a string.")
        return Pair(prompt, chosen, rejected, where)
    chosen, rejected = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
    if prompt is None:  # the turns both share are the prompt
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif isinstance(prompt, str):
        prompt = (("user", prompt),)
    else:
        prompt = _messages(prompt, where, "prompt")
    if not any(role == "assistant" for role, _ in chosen) or not any(role == "assistant" for role, _ in rejected):
        raise UserError(f"{where} has a chosen or rejected answer with no assistant turn after the prompt.")
    return Pair(prompt, chosen, rejected, where)


def encode_side(pair: Pair, side: str, tokenizer) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of the prompt followed by the ``side`` completion; labels only on the completion."""
    from memfit.data.dataset import Example, encode_docs

    completion = getattr(pair, side)
    if pair.is_conversation:
        return encode_conversation(tokenizer, pair.prompt + completion, train_on_prompt=False,
                                   where=f"{pair.where} ({side})", from_turn=len(pair.prompt))
    ids, labels = encode_docs([Example(prompt=pair.prompt, completion=completion, where=pair.where)], tokenizer)[0]
    return ids, labels


def encode_pair(pair: Pair, tokenizer, seq_len: int) -> dict[str, list[int]]:
    """The row of one pair (module docstring), each side cut to ``seq_len``.

    Raises:
        UserError: the prompt leaves no completion token within ``seq_len``.
    """
    row = {}
    for side, (ids_key, labels_key) in (("chosen", ("input_ids", "labels")), ("rejected", REJECTED_KEYS)):
        ids, labels = encode_side(pair, side, tokenizer)
        first = next((i for i, t in enumerate(labels) if t != -100), len(labels))
        if first >= seq_len:
            raise UserError(f"{pair.where} has a prompt of {first} tokens, which leaves its {side} answer no "
                            f"token within --seq-len {seq_len}; raise --seq-len or shorten the prompt.")
        row[ids_key], row[labels_key] = ids[:seq_len], labels[:seq_len]
    return row


def collate_pairs(batch: list[dict], pad_id: int) -> dict:
    """One (2B, T) batch: the B chosen sequences, then the B rejected ones, right-padded to the longest.

    TRL's ``concatenated_inputs``: both sides go through one forward, so the weights are read once.
    A row without a rejected side (the sampler's dummy row, one pad token) is paired with itself and
    carries no target, so it adds no pair (``memfit.builder.preference.pair_mask``).
    """
    import torch

    from memfit.data.dataset import collate

    rejected = [{"input_ids": r.get("rejected_input_ids", r["input_ids"]),
                 "labels": r.get("rejected_labels", r["labels"])} for r in batch]
    chosen = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in batch]
    out = collate(chosen + rejected, pad_id)
    if all("ref_logps" in r for r in batch):  # --precompute-reference: (chosen, rejected) per row
        ref = torch.tensor([r["ref_logps"] for r in batch], dtype=torch.float32)  # (B, 2)
        out["ref_logps"] = torch.cat([ref[:, 0], ref[:, 1]])  # (2B,), the batch's order
    return out


def read_pairs(config) -> list[Pair]:
    """Every record of ``--data`` (any source ``memfit.data.sources.load_parts`` reads) as a ``Pair``.

    Raises:
        UserError: a source with no preference record, or a bad record (file and record named).
    """

    method = str(config.run.method)
    if config.data is None:  # the demo: pairs made from the shipped question/answer records
        from memfit.data.corpus.pairs import QA, demo_pairs

        return [record_to_pair(r, f"{QA} pair {i}") for i, r in enumerate(demo_pairs(config.seed), start=1)]
    pairs = []
    for part in data_sources.load_parts(config.data, split=config.reading.split, data_config=config.reading.data_config):
        first = part.ds[0] if len(part.ds) else None
        if first is not None and not is_pair_record(first):
            fields = ", ".join(map(str, first)) if isinstance(first, dict) else "a text document"
            raise UserError(f"--method {method} trains on preference pairs, but {part.where} row 1 has none "
                            f"(its fields are: {fields}); give records with prompt, chosen and rejected.")
        pairs += [record_to_pair(row, f"{part.where} row {i}") for i, row in enumerate(part.ds, start=1)]
    return pairs


def load_pair_rows(config, run, tokenizer):
    """``(pairs, train rows, held-out rows, held-out pair indices)``: the pairs split as ``memfit.data.dataset``
    splits documents (``split_indices``), each encoded by ``encode_pair``. Held-out rows are the chosen
    side only: the held-out loss is the chosen completion's next-token loss."""
    from memfit.data.dataset import split_indices

    pairs = read_pairs(config)
    chat_template_of(tokenizer, config.reading.chat_template, data_has_conversations=any(p.is_conversation for p in pairs))
    rows = [encode_pair(p, tokenizer, run.seq_len) for p in pairs]
    train, held = split_indices(len(rows), config.eval_fraction, config.seed)
    evals = [{"input_ids": rows[i]["input_ids"], "labels": rows[i]["labels"]} for i in held]
    return pairs, [rows[i] for i in train], evals, held


def prompt_example(pair: Pair):
    """The pair as a ``memfit.data.dataset.Example`` whose prompt starts a sample (the chosen answer as its completion)."""
    from memfit.data.dataset import Example

    if pair.is_conversation:
        return Example(messages=pair.prompt + pair.chosen, where=pair.where)
    return Example(prompt=pair.prompt, completion=pair.chosen, where=pair.where)
