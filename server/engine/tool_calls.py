"""Tool calls in the model's output: hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The model writes calls as text; `parse` turns a finished reply into its calls, and `Holdback` keeps a
call's text out of the streamed content while it is being written. A reply whose call blocks do not
all parse (broken JSON, an unknown function, a block never closed) is plain text: the client gets
what the model wrote, never an error.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


@dataclass(frozen=True)
class Tools:
    """The functions a request offers and how it lets the model use them.

    functions: OpenAI function definitions ({"name", "description", "parameters", ...}).
    choice: "auto" (the model decides), "none" (it must not call: its output stays text), "required"
        (at least one call), or a function's name (exactly that function).
    parallel: whether a reply may hold several calls.
    """

    functions: list[dict] = field(default_factory=list)
    choice: Literal["auto", "none", "required"] | str = "auto"
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    @property
    def parsed(self) -> bool:
        """Whether the output is read for calls."""
        return bool(self.functions) and self.choice != "none"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def call_text(name: str, arguments: str | dict) -> str:
    """How a call reads in the conversation: the block the model is asked to write, and forced to."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def parse(text: str, tools: Tools) -> list[ToolCall]:
    """The calls of a finished reply; none when it has no block or any block is invalid (then the
    reply is text). The reply's content is what comes before its first block (`content_of`).
    Without `tools.parallel` only the first call is kept."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks or text.count(OPEN) != len(blocks):
        return []
    calls = []
    for block in blocks:
        call = _call(block.group(1), tools.names)
        if call is None:
            return []
        calls.append(call)
    return calls if tools.parallel else calls[:1]


def content_of(text: str, calls: list[ToolCall]) -> str | None:
    """A reply's content as the client sees it: all of it, or when it made calls the text before them."""
    if not calls:
        return text
    return text[:text.find(OPEN)].strip() or None


def _call(body: str, names: list[str]) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    arguments = data.get("arguments", data.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if data.get("name") not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), data["name"], json.dumps(arguments, ensure_ascii=False))


class Holdback:
    """Streams a reply's text up to its first `<tool_call>` and holds the rest until the reply ends,
    when `parse` decides whether it was calls or text. A possible start of the marker at the end of
    what arrived is held until the next piece tells."""

    def __init__(self):
        self.held = ""
        self.holding = False

    def push(self, text: str) -> str:
        if self.holding:
            self.held += text
            return ""
        text = self.held + text
        at = text.find(OPEN)
        if at >= 0:
            self.holding, self.held = True, text[at:]
            return text[:at]
        keep = _partial_marker(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def release(self, calls: list[ToolCall]) -> str:
        """What is still to stream once the reply ended: nothing when it made calls, else the held text."""
        held, self.held = self.held, ""
        return "" if calls else held


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that begins the marker."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
