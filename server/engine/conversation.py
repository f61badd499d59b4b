"""What makes two requests the same conversation, and how a conversation reaches the chat template.

A conversation is a list of engine messages (plain dicts): `{"role", "content"}`, plus `name`,
`tool_calls` ([{"id", "type", "function": {"name", "arguments"}}], on assistant messages, content
then possibly None), `tool_call_id` (on `tool` messages), and `raw` on the replies this server
produced: the text the model wrote, which is what the session's cache holds.

Identity (`conversation_keys`) covers what the client sends back: role, content, name, tool calls and
tool call ids, never `raw`. Rendering (`ChatTemplate`) uses a reply's `raw` text when it has one, so
a reply that made tool calls renders as exactly the tokens the model produced and the next turn of
an agent loop continues the session's cache instead of prefilling again.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

from server.engine.tool_calls import CLOSE, OPEN, Tools, ToolCall, call_text

TemplateFn = Callable[[list[dict], bool, "list[dict] | None"], str]  # (messages, generation prompt, tools) -> text


def identity(message: dict) -> list:
    """The part of a message that decides whether two conversations are the same. A plain message is
    [role, content], as transcripts saved before tool calls existed were indexed."""
    calls = [[c.get("id"), c["function"]["name"], _canonical(c["function"]["arguments"])]
             for c in message.get("tool_calls") or ()]
    extras = [message.get("name"), calls, message.get("tool_call_id")]
    plain = [message.get("role"), message.get("content")]
    return plain if extras == [None, [], None] else [*plain[:1], plain[1] or None, *extras]


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def conversation_keys(owner: str, messages: list[dict]) -> list[str]:
    """Chained hashes of every prefix: keys[k] identifies (owner, messages[:k + 1]).

    Extra fields a client echoes with a reply do not count, and `plan_turn` checks the rendered text
    before any cache is reused.
    """
    digest = hashlib.sha256(owner.encode())
    keys = []
    for message in messages:
        digest.update(json.dumps(identity(message), ensure_ascii=False).encode())
        keys.append(digest.copy().hexdigest())
    return keys


def continued(known: list[dict], messages: list[dict]) -> list[dict]:
    """A re-sent history that extends `known` (a session's messages, the same by identity), with the
    session's own copies for the part they share: those carry the replies' `raw` text."""
    return known + messages[len(known):]


def assistant_message(text: str, content: str | None, calls: list[ToolCall]) -> dict:
    """The session's copy of a reply: as the client will send it back, plus the text the model wrote."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": content, "raw": text,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


def tools_prompt(tools: Tools) -> str:
    """The tools' description for a template that has no place for them (hermes-style, as Qwen's and
    NousResearch's templates write it). It depends on the functions alone, not on `tool_choice` or
    `parallel_tool_calls`, so that an agent changing those keeps its session's cache."""
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in tools.functions)
    return (f"You may call one or more functions to help with the user's request. The functions are listed "
            f"inside <tools></tools>:\n<tools>\n{listing}\n</tools>\nTo call a function, reply with its name and "
            f"arguments as a JSON object inside {OPEN}{CLOSE} tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{CLOSE}')


class ChatTemplate:
    """Renders a conversation as the model's prompt text.

    native_tools: whether the template renders `tools`, assistant `tool_calls` and `tool` messages
    itself. When it does not (SmolLM2's does not), the tools are described in the system message
    (`tools_prompt`), calls are written as `<tool_call>` blocks and tool results as user messages
    in `<tool_response>` tags, all in plain messages every template renders.
    """

    def __init__(self, fn: TemplateFn, native_tools: bool):
        self.fn = fn
        self.native_tools = native_tools

    @classmethod
    def of(cls, tokenizer) -> ChatTemplate:
        def fn(messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
            extra = {"tools": tools} if tools else {}
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **extra)

        return cls(fn, native_tools="tools" in (getattr(tokenizer, "chat_template", None) or ""))

    def render(self, messages: list[dict], tools: Tools | None = None, add_generation_prompt: bool = True) -> str:
        shown = [self._message(m) for m in messages]
        if tools is not None and tools.functions:
            if self.native_tools:
                return self.fn(shown, add_generation_prompt,
                               [{"type": "function", "function": f} for f in tools.functions])
            shown = _with_system(shown, tools_prompt(tools))
        return self.fn(shown, add_generation_prompt, None)

    def _message(self, message: dict) -> dict:
        role = message["role"]
        if role == "assistant" and "raw" in message:
            return {"role": "assistant", "content": message["raw"]}
        if role == "assistant" and message.get("tool_calls"):
            if self.native_tools:
                calls = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in message["tool_calls"]]
                return {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls}
            texts = [message.get("content") or ""] + [call_text(c["function"]["name"], c["function"]["arguments"])
                                                      for c in message["tool_calls"]]
            return {"role": "assistant", "content": "\n".join(t for t in texts if t)}
        if role == "tool" and not self.native_tools:
            return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        return {k: v for k, v in message.items() if k in ("role", "content", "name", "tool_call_id")}


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
