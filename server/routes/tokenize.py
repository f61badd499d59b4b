"""POST /tokenize and /detokenize, in vLLM's shapes: what the model sees of a prompt or a conversation."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, model_validator

from server.body import Strict
from server.engine.types import EngineNotReady
from server.errors import APIError
from server.protocol import ChatMessage
from server.routes.auth import api_key_owner
from server.tools import Tool, tools_of

router = APIRouter(dependencies=[Depends(api_key_owner)])


class TokenizeRequest(Strict):
    """Either a `prompt` (tokenized as it is) or `messages` (rendered by the chat template first,
    with `tools` described as a chat request would have them)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # the most prompt tokens one request may bring (the model's window with `full`)
    tokens: list[int]


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


def _engine(request: Request):
    engine = request.app.state.engine
    if engine is None:
        raise EngineNotReady("the model is still loading; retry when /health answers 200")
    return engine


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    engine = _engine(request)
    if body.prompt is not None:
        tokens = engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        tokens = engine.tokenize_chat([m.for_engine() for m in body.messages], tools_of(body.tools, None, None),
                                      body.add_generation_prompt)
    return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = _engine(request)
    wrong = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
    if wrong:
        raise APIError(400, f"token id {wrong[0]} is not in the model's vocabulary of {engine.vocab_size}",
                       param="tokens", code="invalid_token_id")
    return DetokenizeResponse(prompt=engine.detokenize(body.tokens))
