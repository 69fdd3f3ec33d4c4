"""Record formats: text, prompt/completion, and conversations through the tokenizer's chat template.

A record (a JSON object, a row of a CSV/Parquet/Arrow table) is one of:

=====================  ===========================================================================
``messages``           ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``
                       (the OpenAI / Hugging Face chat format; multi-turn; system optional)
``sharegpt``           ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}``
``alpaca``             ``{"instruction": ..., "input": ... (optional), "output": ...}``
``prompt-completion``  ``{"prompt": ..., "completion": ...}``: loss on the completion
``text``               ``{"text": ...}``
=====================  ===========================================================================

The format is detected from each record's keys (the first that matches, in the order above), or
forced with ``--data-format``. ShareGPT and Alpaca become ``messages`` (Alpaca: one user turn,
``instruction`` and ``input`` joined by a blank line, and one assistant turn), so all conversations
take one path: ``encode_conversation``.

**Loss on assistant turns.** The conversation is rendered with the tokenizer's chat template
(``tokenizer.apply_chat_template``, transformers' Jinja renderer, never a hand-written format). The
text of assistant turn ``i`` is found by rendering: ``render(messages[:i], add_generation_prompt=True)``
is the text up to where the assistant starts; ``render(messages[:i+1])`` the text up to where its turn
ends, end-of-turn token and all. Tokenizing the whole rendering with character offsets, a token is a
target iff it starts inside one of those spans. This works with every template that renders a
conversation's prefix as a prefix of the whole (all common ones); one that does not is refused in one
sentence. ``--train-on-prompt`` takes the loss on every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from memfit import textfiles
from memfit.errors import UserError
from memfit.files import user_path

IGNORE_INDEX = -100

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant",
                  "observation": "tool"}

BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The chat template of the built-in byte tokenizer (and so of the ``tiny`` preset): each turn is
``<|role|>\\n`` + content (+ an assistant's tool calls as JSON) + newline, an assistant turn ends with eos
(so generation stops there)."""

TURN_EXTRAS = ("tool_calls", "tool_call_id", "name")
"""The keys of a ``messages`` turn beyond role and content that reach the chat template (OpenAI's and
transformers' tool-use format): an assistant's ``tool_calls`` (its content may then be empty or null), a
``tool`` message's ``tool_call_id`` and ``name``. A turn carrying any is ``(role, content, extras_json)``."""


@dataclass(frozen=True)
class Fields:
    """Column names, when a data set names them differently (``--text-field`` and the like)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"


def detect_format(record: dict, fields: Fields) -> str | None:
    """The format a record's keys say, or None. A key holding null does not count: a table that mixes
    formats (json/parquet) gives every row every column, null where the row has none."""
    record = {k: v for k, v in record.items() if v is not None}
    if fields.messages in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if fields.prompt in record or fields.completion in record:
        return "prompt-completion"
    if fields.text in record:
        return "text"
    return None


def to_messages(record: dict, fmt: str, where: str, fields: Fields) -> tuple[tuple[str, str], ...]:
    """A conversation record as ``((role, content), ...)``, checked (roles known, an assistant turn)."""
    if fmt == "alpaca":
        instruction, extra, output = record.get("instruction"), record.get("input") or "", record.get("output")
        if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str):
            raise UserError(f"{where} needs instruction and output (and an optional input) as strings.")
        user = instruction + ("\n\n" + extra if extra else "")
        turns = [("user", user), ("assistant", output)]
    else:
        key, role_key, text_key = ((fields.messages, "role", "content") if fmt == "messages"
                                   else ("conversations", "from", "value"))
        raw = record.get(key)
        if not isinstance(raw, list) or not raw:
            raise UserError(f"{where} has a {key} field that is not a non-empty list of turns.")
        turns = []
        for n, turn in enumerate(raw, start=1):
            extras = _extras(turn) if fmt == "messages" and isinstance(turn, dict) else {}
            if extras.get("tool_calls") and turn.get(text_key) is None:
                turn = {**turn, text_key: ""}  # OpenAI's format: a reply that only calls tools has null content
            if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
                raise UserError(f"{where} turn {n} is not an object with {role_key} and {text_key} strings.")
            role = turn.get(role_key)
            role = SHAREGPT_ROLES.get(role) if fmt == "sharegpt" else role
            if role not in ROLES:
                known = ", ".join(SHAREGPT_ROLES if fmt == "sharegpt" else ROLES)
                raise UserError(f"{where} turn {n} has the unknown role {turn.get(role_key)!r} (known: {known}).")
            if extras.get("tool_calls") and role != "assistant":
                raise UserError(f"{where} turn {n} is a {role} turn with tool_calls; only an assistant calls tools.")
            turns.append((role, turn[text_key], json.dumps(extras, sort_keys=True)) if extras
                         else (role, turn[text_key]))
    if not any(turn[0] == "assistant" for turn in turns):
        raise UserError(f"{where} has no assistant turn, so it carries no loss.")
    return tuple(turns)


def _extras(turn: dict) -> dict:
    """The ``TURN_EXTRAS`` a turn carries, nulls left out (a table gives every row every column, null where
    the row has none: a plain turn of a data set with tool calls has ``tool_calls: null``)."""
    out = {key: _without_nulls(turn[key]) for key in TURN_EXTRAS if turn.get(key) is not None}
    return {key: value for key, value in out.items() if value not in ({}, [], "")}


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def as_dicts(messages) -> list[dict]:
    """``((role, content[, extras_json]), ...)`` as the chat template takes them: ``[{"role", "content", ...}]``."""
    return [{"role": turn[0], "content": turn[1], **(json.loads(turn[2]) if len(turn) > 2 else {})}
            for turn in messages]


def chat_template_of(tokenizer, template_file: str | None, *, data_has_conversations: bool) -> None:
    """Give ``tokenizer`` the chat template the run uses: ``--chat-template FILE`` if given, else its own.

    Raises:
        UserError: the file cannot be read, or conversations need a template the tokenizer lacks.
    """
    if template_file:
        path = user_path(template_file)
        if not path.is_file():  # a folder, a missing file, a name such as ../../../x: never a template name
            raise UserError(f"Chat template {path} is not a file; pass --chat-template FILE (a Jinja template).")
        tokenizer.chat_template = textfiles.read_text(path, what="Chat template")
    if data_has_conversations and not getattr(tokenizer, "chat_template", None):
        raise UserError("The data holds conversations but the tokenizer has no chat template; pass "
                        "--chat-template FILE (a Jinja template).")


def _render(tokenizer, messages, *, generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(as_dicts(messages), tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as err:  # noqa: BLE001 - jinja raises many types; any of them is the template's fault
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"The chat template fails to render {where}: {first}") from None


def assistant_spans(tokenizer, messages, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (see module docstring)."""
    full = _render(tokenizer, messages, generation_prompt=False, where=where)
    _check_tools_rendered(tokenizer, messages, full, where)
    spans = []
    for i, turn in enumerate(messages):
        if turn[0] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:i], generation_prompt=True, where=where) if i else ""
        end_text = _render(tokenizer, messages[: i + 1], generation_prompt=False, where=where)
        if not full.startswith(end_text) or not end_text.startswith(start_text):
            raise UserError(f"The chat template does not render {where} turn by turn (a prefix of the "
                            "conversation is not a prefix of its rendering); pass --chat-template FILE.")
        spans.append((len(start_text), len(end_text)))
    return full, spans


def _check_tools_rendered(tokenizer, messages, full: str, where: str) -> None:
    """Refuse a template that drops a tool call or a tool message: rendered without it, the conversation
    must change (templates that know no tools skip such keys and roles silently, so the data would train
    without them)."""
    for i, turn in enumerate(messages):
        if turn[0] == "tool":
            without, what = messages[:i] + messages[i + 1:], "the tool message"
        elif len(turn) > 2 and "tool_calls" in json.loads(turn[2]):
            extras = {k: v for k, v in json.loads(turn[2]).items() if k != "tool_calls"}
            without = (*messages[:i], (turn[0], turn[1], json.dumps(extras)), *messages[i + 1:])
            what = "the tool_calls"
        else:
            continue
        if _render(tokenizer, without, generation_prompt=False, where=where) == full:
            raise UserError(f"The chat template does not render {what} of {where} turn {i + 1}, so training "
                            "would drop it; pass --chat-template FILE with a template that renders tool use.")


def encode_conversation(tokenizer, messages, *, train_on_prompt: bool, where: str,
                        from_turn: int = 0) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation; labels ``-100`` outside assistant turns.

    The rendering carries its own special tokens (bos, end-of-turn), so it is tokenized without adding any.
    ``from_turn``: only the assistant turns from that message on carry loss (a preference pair's
    completion after its prompt, ``memfit.data.pairs``).
    """
    text, spans = assistant_spans(tokenizer, messages, where)
    spans = spans[sum(role == "assistant" for role, _ in messages[:from_turn]):]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = enc["input_ids"]
    if train_on_prompt:
        return ids, list(ids)
    labels = [tok if any(a <= start < b for a, b in spans) else IGNORE_INDEX
              for tok, (start, _) in zip(ids, enc["offset_mapping"], strict=True)]
    return ids, labels


def preview(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The decoded tokens with every run of no-loss tokens wrapped in ``[[no loss: ...]]``."""
    out, run, masked = [], [], None
    for tok, lab in zip(ids, labels, strict=True):
        is_masked = lab == IGNORE_INDEX
        if masked is not None and is_masked != masked:
            out.append(_chunk(tokenizer, run, masked))
            run = []
        run.append(tok)
        masked = is_masked
    if run:
        out.append(_chunk(tokenizer, run, masked))
    return "".join(out)


def _chunk(tokenizer, ids: list[int], masked: bool) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return f"[[no loss: {text}]]" if masked else text
