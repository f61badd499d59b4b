"""HTTP bodies of /v1/chat/completions, shaped and ordered like the OpenAI API reference."""

from __future__ import annotations

from typing import Annotated, Callable, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from h2o_cache import Sample, SamplingParams
from server.body import Strict
from server.engine.tool_calls import Tools
from server.engine.types import Usage
from server.errors import APIError
from server.response_format import ResponseFormat, grammar_of
from server.sampling_fields import SamplingRequest
from server.tools import Tool, ToolCallBody, ToolChoice, tools_of


def _text_of_parts(content):
    """Content may be an array of text parts; it reaches the model as their text joined by newlines."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise PydanticCustomError("content_part", 'only text parts ({"type": "text", "text": ...}) are supported')
        texts.append(part["text"])
    return "\n".join(texts)


Content = Annotated[str, BeforeValidator(_text_of_parts)]


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls (before content: its check reads them)
    content: Content | None = Field(None, validate_default=True)  # null only beside an assistant's tool_calls
    name: str | None = None  # a participant's name: handed to the chat template, which may show it
    tool_call_id: str | None = Field(None, validate_default=True)  # the call a `tool` message answers

    # What the SDK echoes back of an assistant message it received; null here, so nothing to act on.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[dict] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, calls, info: ValidationInfo):
        if calls is not None and info.data.get("role") != "assistant":
            raise PydanticCustomError("role", "only assistant messages carry tool_calls")
        return calls

    @field_validator("content")
    @classmethod
    def _content_unless_calls(cls, content, info: ValidationInfo):
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError("missing", "content is required (it may be null only beside tool_calls)")
        return content

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, call_id, info: ValidationInfo):
        role = info.data.get("role")
        if (call_id is None) == (role == "tool"):
            raise PydanticCustomError("role", "a tool message, and only a tool message, names its tool_call_id")
        return call_id

    def for_engine(self) -> dict:
        # `developer` is OpenAI's newer name for the system role; chat templates know only `system`.
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingRequest):
    model: str | None = None  # any name is accepted: the server serves one model
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # default: true
    response_format: ResponseFormat | None = None

    # ----- accepted and ignored: none of them changes the reply ---------------------------------------
    safety_identifier: str | None = None  # an end-user id for abuse monitoring (`user`'s newer name)
    metadata: dict[str, str] | None = None  # tags of a stored completion; nothing is stored
    store: bool | None = None  # whether OpenAI keeps the completion for its dashboard
    service_tier: str | None = None  # OpenAI's billing tier
    prompt_cache_key: str | None = None  # a caching hint; sessions find their cache by themselves
    prediction: dict | None = None  # predicted output: a latency hint, the reply is the same without it

    # ----- server extras, not in the OpenAI API -------------------------------------------------------
    session_id: str | None = Field(None, description="continue this session: messages are only the new ones")

    def engine_messages(self) -> list[dict]:
        return [m.for_engine() for m in self.messages]

    def engine_tools(self) -> Tools | None:
        return tools_of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def grammar(self, tools: Tools | None) -> str | None:
        grammar = grammar_of(self.response_format, tools)
        if grammar is not None and self.min_tokens:
            # a grammar ends the reply where its text is whole: holding the end back could force a token
            # the grammar refuses
            raise APIError(400, "min_tokens cannot be combined with a response_format or tools that constrain "
                                "the reply", param="min_tokens", code="invalid_value")
        return grammar

    def sampling_params(self, default_max_tokens: int, max_tokens_limit: int) -> SamplingParams:
        """max_completion_tokens (or the older max_tokens, or the server default, capped by the limit)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return self.params(("max_completion_tokens", "max_tokens"), default_max_tokens, max_tokens_limit,
                           (self.top_logprobs or 0) if self.logprobs else None)


# ----- responses ----------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Server extras: how much of the conversation the session's fixed-budget cache still holds.
    kv_resident_tokens: int
    conversation_tokens: int
    reread_tokens: int = 0  # tokens of the prompt fed again after its question (`h2o_cache.reread`)

    @classmethod
    def of(cls, usage: Usage) -> UsageInfo:
        return cls(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   total_tokens=usage.prompt_tokens + usage.completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
                   kv_resident_tokens=usage.kv_resident_tokens, conversation_tokens=usage.conversation_tokens,
                   reread_tokens=usage.reread_tokens)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]

    @classmethod
    def of(cls, samples: list[Sample], token_text: Callable[[int], str]) -> ChoiceLogprobs:
        def top(token: int, logprob: float) -> TopLogprob:
            text = token_text(token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return cls(content=[
            TokenLogprob(**top(s.token, s.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in s.top_logprobs])
            for s in samples
        ])


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallBody] | None = Field(None, exclude_if=lambda calls: calls is None)


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: UsageInfo


class ChunkChoice(BaseModel):
    index: int = 0
    # {"role": "assistant", "content": ""} first, then {"content": ...} or {"tool_calls": [...]}, then {}
    delta: dict
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageInfo | None = None
