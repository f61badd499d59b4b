"""Incremental detokenization with stop strings, for streaming text out of a generation."""

from __future__ import annotations

import codecs


def byte_table(tokenizer) -> list[bytes] | None:
    """Every token id's bytes, for a byte-level BPE tokenizer (GPT-2's scheme, as SmolLM2 and Llama 3
    use), with special tokens as b"" (they are skipped); None for any other tokenizer.

    With it, `StreamDecoder` appends bytes per token instead of calling `tokenizer.decode` twice
    (3.7 against 10.4 us a token on our CPU, stop-string handling included): that is per-row host
    work in every decode step of a large batch.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or type(backend.decoder).__name__ != "ByteLevel" or backend.normalizer is not None
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    byte_of = {char: byte for byte, char in _byte_chars().items()}
    table = []
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        if token is None or any(c not in byte_of for c in token):
            return None
        table.append(bytes(byte_of[c] for c in token))
    for token_id, added in tokenizer.added_tokens_decoder.items():
        table[token_id] = b"" if added.special else added.content.encode()
    return table


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


class StreamDecoder:
    """Turns tokens into text deltas that never split a UTF-8 character and never show a stop string.

    Text that could be the beginning of a stop string is held back until it is known not to be.
    table: `byte_table(tokenizer)`, computed once per tokenizer; without it each token costs two
    `tokenizer.decode` calls over a short window.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = (), table: list[bytes] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._prefix = 0
        self._read = 0
        self._held = ""

    def push(self, token: int) -> str:
        """Add a token; return the text it makes safe to emit ('' while held back)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        if self._table is not None:
            new = self._utf8.decode(self._table[token])  # holds back an incomplete UTF-8 sequence
            return self._release(self._held + new) if new else ""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        full_text = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete UTF-8 sequence, or nothing printable yet
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(self._held + full_text[len(prefix_text):])

    def flush(self) -> str:
        """Emit what is held back (at the end of generation)."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        self.text += out
        return out

    def _release(self, pending: str) -> str:
        for stop in self.stop:
            at = pending.find(stop)
            if at != -1:
                self.stopped = True
                pending = pending[:at]
                self._held = ""
                self.text += pending
                return pending
        hold = max((self._overlap(pending, stop) for stop in self.stop), default=0)
        out, self._held = pending[:len(pending) - hold], pending[len(pending) - hold:]
        self.text += out
        return out

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of stop."""
        for n in range(min(len(text), len(stop) - 1), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0


def token_texts(tokenizer, table: list[bytes] | None = None) -> list[bytes]:
    """Every token id's text: the byte table (`byte_table`) where given, else each id decoded (special
    tokens: b"")."""
    if table is not None:
        return table
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return [b"" if i in special else tokenizer.decode([i]).encode() for i in range(len(tokenizer))]


def holding(tokenizer, marks: tuple[str, ...], table: list[bytes] | None = None) -> frozenset[int]:
    """The token ids whose text holds any of `marks` (`token_texts`)."""
    wanted = [mark.encode() for mark in marks]
    return frozenset(i for i, t in enumerate(token_texts(tokenizer, table)) if any(w in t for w in wanted))


def line_breaks(tokenizer, table: list[bytes] | None = None) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    """The token ids whose text ends with a newline, starts with one, and holds a blank line ("\n\n"),
    from a byte table (`byte_table`) where given, else by decoding each id (special tokens: none)."""
    texts = token_texts(tokenizer, table)
    return (frozenset(i for i, t in enumerate(texts) if t.endswith(b"\n")),
            frozenset(i for i, t in enumerate(texts) if t.startswith(b"\n")),
            frozenset(i for i, t in enumerate(texts) if b"\n\n" in t))


def probe_start(tokens, probe: int, breaks: tuple[frozenset[int], frozenset[int], frozenset[int]] | None) -> int:
    """Where a turn's probe starts in `tokens` (>= 1 of them): `probe` tokens from the end, or with
    `breaks` (`line_breaks`) right after the last blank line within them (at the token that completes it
    where that token carries text after its newlines), so that a question set apart from the document
    before it probes alone, without the newline's own query. The probe keeps at least one token."""
    n = len(tokens)
    low = max(n - probe, 0)
    if breaks is None:
        return low
    ends, starts, blank = breaks
    for i in range(n - 1, low, -1):  # the blank line that token i completes
        if tokens[i] in blank or (tokens[i] in starts and tokens[i - 1] in ends):
            return i + 1 if tokens[i] in ends and i + 1 < n else i
    return low
