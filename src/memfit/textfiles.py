"""User text files (data, ``--config`` YAML, chat templates) decoded and checked before anything uses them.

Every text file memfit reads from the user is UTF-8 (a byte-order mark tolerated). A byte that is not
UTF-8 is one sentence naming the file, the line and the byte offset, so the user can open the file at
that place; a file that is binary data (over 10 % NULs or other control characters in its first 64 KiB)
is refused before a tokenizer would turn its bytes into training tokens.
"""

from __future__ import annotations

from pathlib import Path

from memfit.errors import UserError

SNIFF_BYTES = 1 << 16
"""Bytes read from the start of a file to tell text from binary data (git and grep look at the first 8000)."""

_TEXT_CONTROLS = frozenset(b"\t\n\r\f\v\x1b")


def looks_binary(sample: bytes) -> bool:
    """Whether ``sample`` (the start of a file) is binary data: over 10 % of its bytes are NULs or other
    control characters (text has tabs and newlines, not bytes 0x00-0x1f at every turn; UTF-16 text is
    half NULs, images and archives are full of them). A stray NUL in a text is still text."""
    controls = sum(1 for b in sample if b < 0x20 and b not in _TEXT_CONTROLS)
    return bool(sample) and controls > 0.1 * len(sample)


def refuse_binary(path: Path) -> None:
    """Refuse a file passed as text (``.txt``/``.jsonl``/``.yaml``/a template) whose start is binary data."""
    try:
        with open(path, "rb") as fh:
            sample = fh.read(SNIFF_BYTES)
    except OSError as err:
        raise UserError(f"{path} cannot be read ({err.strerror or err}).") from None
    if looks_binary(sample):
        nul = sample.find(b"\0")
        line = sample[:nul].count(b"\n") + 1
        where = f" (its first NUL byte at line {line}, byte offset {nul})" if nul >= 0 else ""
        raise UserError(f"{path} is binary data, not UTF-8 text{where}; give a text file.")


def not_utf8(path, raw: bytes, err: UnicodeDecodeError, base: int = 0, line: int = 1) -> UserError:
    """The sentence for a byte of ``raw`` (which starts at byte ``base`` of ``path``, on line ``line``) that is
    not UTF-8: the file, its line, and the byte's offset from the start of the file."""
    lineno = line + raw[: err.start].count(b"\n")
    return UserError(f"{path} is not UTF-8 text: line {lineno}, byte offset {base + err.start} holds "
                     f"0x{raw[err.start]:02x} ({err.reason}); save the file as UTF-8.")


def decode(path, raw: bytes) -> str:
    """``raw`` (the whole of ``path``) as text: UTF-8, a leading byte-order mark dropped."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise not_utf8(path, raw, err) from None


def read_text(path, *, what: str) -> str:
    """The text of the user's file ``path`` (``what`` names it in the sentence: "Config file", "Chat template"),
    refused in one sentence when it is missing, unreadable, binary, or not UTF-8."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"{what} {path} cannot be read ({err.strerror or err}).") from None
    if looks_binary(raw[:SNIFF_BYTES]):
        refuse_binary(path)
    return decode(path, raw)


def check_utf8_stream(path, chunk: int = 1 << 20) -> None:
    """Read ``path`` once, ``chunk`` bytes at a time, and raise ``not_utf8`` at its first byte that is not UTF-8
    (bounded memory for a corpus of any size). A character cut by a chunk's end is carried into the next."""
    carry, base, line = b"", 0, 1  # base, line: where ``carry`` starts in the file
    with open(path, "rb") as fh:
        while True:
            raw = fh.read(chunk)
            buffer = carry + raw
            try:
                buffer.decode("utf-8")
                carry = b""
            except UnicodeDecodeError as err:
                if raw and err.reason == "unexpected end of data" and err.end == len(buffer):
                    carry = buffer[err.start:]  # a character the next chunk completes
                    buffer = buffer[: err.start]
                else:
                    raise not_utf8(path, buffer, err, base, line) from None
            if not raw:
                return
            base, line = base + len(buffer), line + buffer.count(b"\n")
