"""HTTP bodies of tool calling, as the OpenAI reference shapes them: definitions, `tool_choice`, calls."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from server.body import Strict
from server.engine.tool_calls import ToolCall, Tools
from server.errors import APIError


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # with tool_choice "required" or named, arguments follow the schema anyway

    def for_engine(self) -> dict:
        return self.model_dump(exclude_none=True, exclude={"strict"})


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise PydanticCustomError("json_object", "arguments must be a JSON object, as text")
        return arguments


class ToolCallBody(Strict):
    """A call in an assistant message (sent back by the client) or in a reply."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # a streamed call's position, which the SDK's stream helper leaves on the calls it assembles
    index: int | None = Field(None, exclude=True)

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallBody:
        return cls(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def tools_of(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> Tools | None:
    """The engine's view of a request's tools; 400 naming the field for a choice the tools cannot meet."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise APIError(400, "two tools have the same name", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        choice = choice.function.name
    return Tools([t.function.for_engine() for t in tools], choice or "auto", True if parallel is None else parallel)


def tool_call_deltas(calls: list[ToolCall]) -> list[dict]:
    """A stream's deltas for the calls of a reply: per call its id, type and name, then its arguments."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas
