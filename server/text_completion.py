"""HTTP bodies of POST /v1/completions (OpenAI's legacy text completions): a raw prompt, no template."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from h2o_cache import SamplingParams
from server.protocol import UsageInfo
from server.sampling_fields import SamplingRequest


class CompletionRequest(SamplingRequest):
    model: str | None = None  # any name is accepted: the server serves one model
    prompt: str = Field(min_length=1)
    echo: bool = False  # the reply's text starts with the prompt
    # not supported: a value other than these is refused by name
    logprobs: None = None
    suffix: None = None
    best_of: Literal[1] | None = None

    def sampling_params(self, default_max_tokens: int, max_tokens_limit: int) -> SamplingParams:
        return self.params(("max_tokens",), default_max_tokens, max_tokens_limit, None)


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class TextCompletion(BaseModel):
    """The body of a reply, and (with `finish_reason` null until the last) of every stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageInfo | None = None
