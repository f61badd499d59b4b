"""Incremental detokenization with stop strings, for streaming text out of a generation."""

from __future__ import annotations


class StreamDecoder:
    """Turns tokens into text deltas that never split a UTF-8 character and never show a stop string.

    Text that could be the beginning of a stop string is held back until it is known not to be.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False
        self._prefix = 0
        self._read = 0
        self._held = ""

    def push(self, token: int) -> str:
        """Add a token; return the text it makes safe to emit ('' while held back)."""
        if self.stopped:
            return ""
        self.ids.append(token)
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
