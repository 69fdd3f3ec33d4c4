"""Training data: loading, the built-in byte-level tokenizer, tokenization, packing, label masks.

The pipeline users run is ``memfit.data.prep`` -> ``memfit.data.arrow`` (records encoded here by ``encode_docs``,
the held-out split by document of ``split_indices``, then packing or truncation, with loss masks in ``labels``)
-> ``collate`` (right padding). ``count_target_tokens`` is the normaliser of the training loss (issue 6) and
``unigram_loss`` the baseline to beat.

Label convention (the Hugging Face one): ``labels`` has the same length as ``input_ids``; the
model shifts internally, so ``labels[t]`` is the target of the prediction made at position
``t - 1``. ``-100`` marks a position that carries no loss (prompt tokens, padding).

Size: near 500 lines, because the label convention, the byte tokenizer and the collation that depend on it
are kept in one place.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from memfit import textfiles
from memfit.data.formats import BYTE_CHAT_TEMPLATE, Fields, detect_format, encode_conversation, to_messages
from memfit.errors import UserError
from memfit.files import user_path

IGNORE_INDEX = -100
"""Label value that carries no loss (``torch.nn.CrossEntropyLoss``'s default ``ignore_index``)."""

DATA_SUFFIXES = (".txt", ".jsonl")
"""File types ``load_local_examples`` reads."""

# Files a Hugging Face tokenizer can be loaded from; a folder with none of these has no tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)

# Special tokens of the built-in byte-level tokenizer, in id order; they match the `tiny` preset.
BYTE_SPECIALS = ("<pad>", "<s>", "</s>")
BYTE_TOKENIZER_NAME = "byte"
"""``--tokenizer byte`` selects the built-in byte-level tokenizer for any model."""


# --------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Example:
    """One training record: plain ``text``, a ``prompt`` with its ``completion``, or a conversation.

    With ``prompt``/``completion`` the loss is taken on the completion only; with ``messages``
    (``((role, content), ...)``, rendered by the chat template) on the assistant turns only.
    """

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[tuple[str, ...], ...] | None = None
    """``((role, content), ...)``; a turn with tool calls is ``(role, content, extras_json)`` (``memfit.data.formats``)."""
    where: str = field(default="", compare=False)
    """File and record, for messages about this record."""

    def __post_init__(self) -> None:
        plain = self.text is not None and self.prompt is None and self.completion is None
        paired = self.text is None and self.prompt is not None and self.completion is not None
        chat = self.messages is not None and self.text is None and self.prompt is None and self.completion is None
        if not (plain or paired or chat):
            raise ValueError("an Example holds either text, a prompt and a completion, or messages")
        if chat == (plain or paired):
            raise ValueError("an Example holds either text, a prompt and a completion, or messages")

    @property
    def is_conversation(self) -> bool:
        return self.messages is not None

    @property
    def is_prompt_completion(self) -> bool:
        return self.completion is not None


def default_corpus_path() -> Path:
    """The corpus shipped inside the package (``src/memfit/data/corpus/``), read when ``--data`` is not given."""
    return Path(__file__).resolve().parent / "corpus"


def load_local_examples(path: str | os.PathLike | None, *, fmt: str | None = None, fields=None) -> list[Example]:
    """Read training records from a ``.txt`` file, a ``.jsonl`` file, or a folder of these.

    * ``None``: the corpus shipped in the package (``default_corpus_path()``).
    * ``.txt``: documents are separated by one or more blank lines; each document is stripped of
      surrounding whitespace and keeps its inner line breaks. A file without blank lines is one document.
    * ``.jsonl``: one JSON object per line, ``{"text": ...}`` or ``{"prompt": ..., "completion": ...}``
      (if both kinds of keys are present, prompt/completion wins); blank lines are skipped.
    * A folder: every ``.txt`` and ``.jsonl`` file below it, recursively, sorted by path; other
      files (a README, say) and hidden files or folders are ignored.

    Records may also be conversations (``messages``, ShareGPT, Alpaca; see ``memfit.data.formats``),
    ``.json``/``.csv``/``.parquet``/``.arrow`` files, ``save_to_disk`` folders and Hub ids are read through
    Hugging Face ``datasets`` by ``memfit.data.sources.load_examples``, which calls this for the rest.
    ``fmt`` forces a record format, ``fields`` renames columns.

    Raises:
        UserError: a missing path, an empty file or folder, a malformed JSONL line (file and line
            named), a record with neither text nor prompt/completion, an unsupported file type.
    """
    fields = fields or Fields()
    root = default_corpus_path() if path is None else user_path(path)
    if not root.exists():
        raise UserError(f"Data path {root} does not exist.")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and _is_data_file(p.relative_to(root)))
        if not files:
            raise UserError(f"Data folder {root} holds no .txt or .jsonl files.")
    else:
        files = [root]
    examples: list[Example] = []
    for file in files:
        examples.extend(_load_file(file, fmt, fields))
    return examples


def _is_data_file(relative: Path) -> bool:
    # Hidden files and folders (.git, .ipynb_checkpoints) are never training data.
    hidden = any(part.startswith(".") for part in relative.parts)
    return not hidden and relative.suffix.lower() in DATA_SUFFIXES


def _load_file(path: Path, fmt: str | None = None, fields=None) -> list[Example]:
    if path.suffix.lower() not in DATA_SUFFIXES:
        raise UserError(
            f"{path} is a {path.suffix or 'suffix-less'} file; --data takes .txt, .jsonl, .json, .csv, .parquet, .arrow or a folder of them."
        )

    text = textfiles.read_text(path, what="Data file")  # UTF-8 (a byte-order mark tolerated), not binary
    examples = _parse_txt(text) if path.suffix.lower() == ".txt" else _parse_jsonl(text, path, fmt, fields)
    if not examples:
        raise UserError(f"Data file {path} is empty.")
    return examples


def txt_documents(text: str) -> list[str]:
    """The documents of a ``.txt`` text: separated by blank lines (lines holding only whitespace), each
    stripped, empty ones left out. ``datasets``' ``text`` builder (``sample_by="paragraph"``) cuts a file
    at every ``"\\n\\n"``; this cuts each of its paragraphs further, so both readers give the same documents."""
    docs = (doc.strip() for doc in re.split(r"\n[ \t\r\f\v]*\n", text))
    return [doc for doc in docs if doc]


def _parse_txt(text: str) -> list[Example]:
    return [Example(text=doc) for doc in txt_documents(text)]


def _parse_jsonl(text: str, path: Path, fmt: str | None = None, fields=None) -> list[Example]:
    # split("\n"), not splitlines(): a JSON string may hold a raw U+2028, which splitlines() breaks on.
    return list(jsonl_records(text.split("\n"), path, fmt, fields))


def json_lines(lines, path):
    """``(record, "<path> line N")`` for each non-blank line of a JSONL file, in order; a bad line is a
    ``UserError`` naming the file and the line. ``lines`` may be an open file (bounded memory)."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {lineno} is not valid JSON ({err.msg}).") from None
        yield record, f"{path} line {lineno}"


def jsonl_records(lines, path, fmt: str | None = None, fields=None):
    """The ``Example`` of each non-blank line of a JSONL file, in order (``json_lines``)."""
    for record, where in json_lines(lines, path):
        yield record_to_example(record, where, fmt, fields)


def find_bad_input(path: Path, fmt: str | None = None, fields=None) -> None:
    """Raise the ``UserError`` naming the first bad line (``.jsonl``) or byte (``.txt``) of ``path``, if any.

    Training reads ``.txt``/``.jsonl`` through ``datasets`` (``memfit.data.sources``), whose errors name
    neither; on an error, this streams the file once (a line, or 1 MiB of text, at a time) to say where."""
    try:
        textfiles.refuse_binary(path)
        textfiles.check_utf8_stream(path)  # the line and byte offset of a byte that is not UTF-8
        if path.suffix.lower() == ".jsonl":
            with path.open(encoding="utf-8-sig", newline="\n") as f:  # newline: lines end at "\n" only
                for _ in jsonl_records(f, path, fmt, fields):
                    pass
    except OSError as err:
        raise UserError(f"{path} cannot be read ({err.strerror or err}).") from None


def record_to_example(record: object, where: str, fmt: str | None = None, fields=None) -> Example:
    """One record (a JSON object or a table row) as an ``Example``, in its detected or forced format."""
    fields = fields or Fields()
    if not isinstance(record, dict):
        raise UserError(
            f"{where} is a JSON {type(record).__name__}, not an object with text or prompt/completion."
        )
    fmt = fmt or detect_format(record, fields)
    if fmt in ("messages", "sharegpt", "alpaca"):
        return Example(messages=to_messages(record, fmt, where, fields), where=where)
    if fmt == "prompt-completion":
        prompt, completion = record.get(fields.prompt), record.get(fields.completion)
        if not isinstance(prompt, str) or not isinstance(completion, str):
            if "chosen" in record and "rejected" in record:  # a preference pair read as SFT: say what it is
                raise UserError(f"{where} is a preference pair (chosen and rejected): train it with --method "
                                "dpo, orpo or simpo.")
            raise UserError(f"{where} needs both {fields.prompt} and {fields.completion} as strings.")
        if not completion:
            raise UserError(f"{where} has an empty completion, so it carries no loss.")
        return Example(prompt=prompt, completion=completion, where=where)
    if fmt == "text":
        text = record.get(fields.text)
        if not isinstance(text, str) or not text:
            raise UserError(f"{where} has a {fields.text} that is not a non-empty string.")
        return Example(text=text, where=where)
    if fmt is not None and fmt not in ("text", "prompt-completion"):
        raise UserError(f"Unknown --data-format {fmt!r}; choose one of: messages, sharegpt, alpaca, "
                        "prompt-completion, text.")
    raise UserError(f"{where} has neither a text field nor prompt and completion fields (nor messages, "
                    f"conversations, or instruction/output); its fields are: {', '.join(map(str, record)) or 'none'}.")


# ------------------------------------------------------------------------------------------ tokenizers


def byte_tokenizer():
    """memfit's byte-level tokenizer, built in memory with ``tokenizers`` (no download).

    Ids: ``<pad>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2 (the ids of the ``tiny`` preset), then
    byte ``b`` = ``3 + b``: 259 tokens, within ``tiny``'s vocab of 384. The GPT-2 byte-to-unicode
    map (ByteLevel pre-tokenizer and decoder, no merges) makes ``decode(encode(s)) == s`` for any
    UTF-8 string: every byte is one token, nothing is normalised, no prefix space is added.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` that ``save_pretrained`` can write.
    """
    # transformers: ~7.7 s to import on this machine (python -X importtime), paid only by who builds a tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    for byte, char in sorted(bytes_to_unicode().items()):
        vocab[char] = len(BYTE_SPECIALS) + byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    pad, bos, eos = BYTE_SPECIALS

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        model_max_length=1 << 30,  # no length limit of its own; the model's positions are checked elsewhere
        clean_up_tokenization_spaces=False,  # keep " ," and " ." exactly as written
    )
    fast.chat_template = BYTE_CHAT_TEMPLATE  # conversations train with no download
    return fast


def load_tokenizer(tokenizer: str | None, model: str, *, is_preset: bool, trust_remote_code: bool = False):
    """The tokenizer for a run: ``tokenizer`` if given, else the model folder's, else (presets) ``byte_tokenizer()``.

    ``tokenizer`` may be a folder or ``"byte"`` (the built-in byte-level tokenizer). A tokenizer without
    a pad token gets its eos token as pad (padding positions are masked out of the loss anyway).

    Raises:
        UserError: the folder has no tokenizer files, or transformers cannot load them.
    """
    if tokenizer == BYTE_TOKENIZER_NAME or (tokenizer is None and is_preset):
        return byte_tokenizer()
    source = user_path(tokenizer if tokenizer is not None else model)
    if source.is_file():  # a config.json: its tokenizer sits next to it
        source = source.parent
    if not source.is_dir():
        raise UserError(f"Tokenizer folder {source} does not exist." if not source.exists() else
                        f"Tokenizer folder {source} is not a folder; pass --tokenizer DIR (or --tokenizer byte).")
    if not any((source / name).is_file() for name in _TOKENIZER_FILES):
        raise UserError(f"{source} holds no tokenizer files; pass --tokenizer DIR (or --tokenizer byte).")
    from transformers import AutoTokenizer  # ~7.7 s to import: only when a tokenizer is loaded

    try:
        tok = AutoTokenizer.from_pretrained(
            source, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"The tokenizer in {source} cannot be loaded: {first}") from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UserError(f"The tokenizer in {source} has neither a pad nor an eos token to pad with.")
        tok.pad_token = tok.eos_token
    return tok


# ---------------------------------------------------------------------------------------- tokenizing


@dataclass
class TokenizedData:
    """Tokenized train and held-out sequences, each ``{"input_ids": [...], "labels": [...]}``.

    ``labels`` equals ``input_ids`` except ``-100`` where no loss is taken (prompt tokens).
    """

    train: list[dict[str, list[int]]] = field(default_factory=list)
    eval: list[dict[str, list[int]]] = field(default_factory=list)
    conversations: int = 0
    """Conversations among the documents."""
    dropped_long: int = 0
    """Conversations longer than ``seq_len``, dropped (policy: drop; a cut conversation would train on a
    reply whose question is gone, or lose the reply's end-of-turn). With ``truncate``, only those whose
    first ``seq_len`` tokens hold no target (the reply begins after the cut)."""
    truncated_long: int = 0
    """Conversations longer than ``seq_len`` kept cut to their first ``seq_len`` tokens (``truncate``)."""


def split_documents(n_docs: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the train and held-out documents, each list in corpus order.

    The held-out set is ``round(eval_fraction * n_docs)`` documents drawn with ``random.Random(seed)``,
    at least 1 when ``eval_fraction > 0`` and there are 2 or more documents, and never all of them.
    """
    train, held = split_indices(n_docs, eval_fraction, seed)
    return train.tolist(), held.tolist()


def split_indices(n_docs: int, eval_fraction: float, seed: int):
    """``split_documents`` as two int64 numpy arrays (8 bytes a document, not a Python int each: a corpus
    of millions of documents is split without a list of millions of objects)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise UserError(f"The eval fraction must be in [0, 1); got {eval_fraction}.")
    n_eval = 0
    if eval_fraction > 0 and n_docs >= 2:
        n_eval = min(max(1, round(eval_fraction * n_docs)), n_docs - 1)
    held = np.array(sorted(random.Random(seed).sample(range(n_docs), n_eval)), dtype=np.int64)
    keep = np.ones(n_docs, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep).astype(np.int64), held


def encode_docs(examples: Sequence[Example], tokenizer, train_on_prompt: bool = False) -> list[tuple]:
    """Each example as ``(input_ids, labels)`` with bos/eos framing and the prompt masked; a conversation
    as ``(input_ids, labels, True)``, framed by its chat template (``memfit.data.formats``)."""
    if not examples:
        return []
    if any(ex.is_conversation for ex in examples):
        plain = iter(encode_docs([ex for ex in examples if not ex.is_conversation], tokenizer, train_on_prompt))
        return [(*encode_conversation(tokenizer, ex.messages, train_on_prompt=train_on_prompt,
                                      where=ex.where or "a conversation"), True)
                if ex.is_conversation else next(plain) for ex in examples]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if eos is None:
        raise UserError("The tokenizer has no eos token to separate documents with.")
    head = [bos] if bos is not None and bos != eos else []
    texts = [ex.text if ex.text is not None else ex.completion for ex in examples]
    bodies = _encode_texts(tokenizer, texts)
    prompts = _encode_texts(tokenizer, [ex.prompt or "" for ex in examples])
    docs = []
    for ex, body, prompt in zip(examples, bodies, prompts, strict=True):
        masked = head + (prompt if ex.is_prompt_completion and not train_on_prompt else [])
        body = (prompt + body) if ex.is_prompt_completion and train_on_prompt else body  # bos: never a target
        ids = masked + body + [eos]
        docs.append((ids, [IGNORE_INDEX] * len(masked) + ids[len(masked) :]))
    return docs


def _encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    # One batched call (fast tokenizers run it in Rust); verbose=False silences the
    # "longer than model_max_length" warning: we cut to seq_len ourselves.
    if not any(texts):
        return [[] for _ in texts]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


# ------------------------------------------------------------------------------------ batches, counts


def collate(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of sequences to the longest one.

    Returns ``input_ids`` (padded with ``pad_id``), ``attention_mask`` (1 = real token) and
    ``labels`` (``-100`` on padding), each of shape (B, T) and dtype int64. When the rows carry
    ``position_ids`` (``--packing documents``), ``position_ids`` too, where the padding of a row is
    one more "document" with positions 0, 1, ... of its own: it attends only to itself and no real
    token attends to it, so the model needs no ``attention_mask`` (see ``model_inputs``).
    """
    longest = max(len(seq["input_ids"]) for seq in batch)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)  # (B, T)
    packed = any("position_ids" in seq for seq in batch)
    positions = torch.zeros((len(batch), longest), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(batch):
        n = len(seq["input_ids"])
        input_ids[row, :n] = torch.as_tensor(seq["input_ids"], dtype=torch.long)
        labels[row, :n] = torch.as_tensor(seq["labels"], dtype=torch.long)
        attention_mask[row, :n] = 1
        if packed:
            own = seq.get("position_ids") or range(n)
            positions[row, :n] = torch.as_tensor(list(own), dtype=torch.long)
            positions[row, n:] = torch.arange(longest - n)  # padding: a segment of its own
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if packed:
        out["position_ids"] = positions
    return out


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss: ``(labels[..., 1:] != -100).sum()``.

    This is the normaliser of the loss (issue 6): the optimizer-step loss is the sum of per-token
    losses divided by the target tokens of all micro-batches and ranks of the step. The shift
    matters because a causal LM predicts ``labels[t]`` from positions ``< t``: ``labels[..., 0]`` is
    never a target (transformers' ``ForCausalLMLoss`` drops it), so counting it would over-count by
    one per sequence whose first label is not ``-100`` and the "mean" would be off by that much.
    """
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def unigram_loss(data: TokenizedData) -> float:
    """Cross-entropy (nats/token) of the held-out targets under the train targets' unigram distribution.

    Targets are the labels after the causal shift that are not ``-100`` (as in ``count_target_tokens``).
    With ``c(t)`` the count of token ``t`` among the ``N`` train targets and ``V`` the number of distinct
    train targets, add-one smoothing over the seen vocabulary plus one bucket for unseen tokens gives
    ``p(t) = (c(t) + 1) / (N + V + 1)`` for a seen token and ``1 / (N + V + 1)`` for any unseen one
    (the probabilities sum to 1). The loss is ``-mean(log p(target))`` over the held-out targets: the
    loss of a model that ignores context, which a trained model must beat. The single unseen bucket
    is slightly optimistic (it does not split that mass among unseen tokens); with thousands of
    targets it moves the figure by well under 0.01 nats.

    Returns:
        The loss in nats per token, or ``nan`` when there are no held-out or no train targets.
    """
    train_counts, eval_counts = target_counts(data.train), target_counts(data.eval)
    n_train, n_eval = int(train_counts.sum()), int(eval_counts.sum())
    if n_train == 0 or n_eval == 0:
        return math.nan
    log_total = math.log(n_train + int(np.count_nonzero(train_counts)) + 1)
    seen = np.zeros(max(len(train_counts), len(eval_counts)), dtype=np.int64)
    seen[: len(train_counts)] = train_counts
    held = np.flatnonzero(eval_counts)
    nll = float(np.sum(eval_counts[held] * (log_total - np.log(seen[held] + 1.0))))
    return nll / n_eval


def target_counts(rows) -> np.ndarray:
    """How often each token id is a target (a label after the causal shift that is not ``-100``), as an
    int64 array indexed by token id. Rows are read a batch at a time (rows on disk, ``memfit.data.arrow.ArrowRows``,
    count themselves and keep the counts next to their table), so memory stays bounded by the vocabulary,
    not the corpus."""
    if hasattr(rows, "target_counts"):
        return rows.target_counts()
    return count_targets(_target_batches(rows))


def count_targets(batches) -> np.ndarray:
    """Sum of ``np.bincount`` over batches of target ids (flat int64 arrays)."""
    counts = np.zeros(0, dtype=np.int64)
    for targets in batches:
        if targets.size:
            batch = np.bincount(targets)
            if len(batch) > len(counts):
                counts = np.concatenate([counts, np.zeros(len(batch) - len(counts), dtype=np.int64)])
            counts[: len(batch)] += batch
    return counts


def _target_batches(rows, batch_rows: int = 1024):
    for start in range(0, len(rows), batch_rows):
        labels = [t for seq in rows[start : start + batch_rows] for t in seq["labels"][1:]]
        flat = np.asarray(labels, dtype=np.int64)
        yield flat[flat != IGNORE_INDEX]
