"""POST /v1/completions: a raw prompt continued, plain or streamed; it keeps no session."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from starlette.requests import Request as StarletteRequest

from server.engine.types import ChatRequest, Delta, EngineNotReady, Finish
from server.errors import ErrorResponse
from server.protocol import UsageInfo
from server.routes.auth import api_key_owner
from server.routes.completion import Completion, sse
from server.text_completion import CompletionRequest, TextChoice, TextCompletion

router = APIRouter()


class TextReply(Completion):
    """A text completion: `choices[0].text` rather than a message; `echo` puts the prompt first."""

    prefix = "cmpl"

    def __init__(self, model: str, token_text, keepalive: float, timeout: float | None, echo: str = ""):
        super().__init__(model, token_text, keepalive, timeout)
        self.echo = echo

    def text_chunk(self, text: str, finish_reason: str | None = None, usage: UsageInfo | None = None) -> str:
        choices = [TextChoice(text=text, finish_reason=finish_reason)] if usage is None else []
        body = TextCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return sse(body.model_dump_json())

    def opening(self) -> str:
        return self.text_chunk(self.echo) if self.echo else ""

    def frames(self, item: Delta | Finish, include_usage: bool) -> str:
        if isinstance(item, Finish):
            usage = self.text_chunk("", usage=UsageInfo.of(item.usage)) if include_usage else ""
            return self.text_chunk("", item.finish_reason) + usage
        return self.text_chunk(item.text) if item.text else ""

    async def body(self, handle, request: StarletteRequest) -> TextCompletion | None:
        text, _, finish = await self.collect(handle, request)
        if finish is None:
            return None
        choice = TextChoice(text=self.echo + "".join(text), finish_reason=finish.finish_reason)
        return TextCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=UsageInfo.of(finish.usage))


@router.post("/v1/completions", response_model=TextCompletion,
             responses={200: {"content": {"text/event-stream": {}}},
                        "4XX": {"model": ErrorResponse, "description": "refused (400 for invalid fields, not 422)"},
                        "5XX": {"model": ErrorResponse, "description": "not ready (503) or failed"}})
async def create_completion(body: CompletionRequest, request: Request, owner: str = Depends(api_key_owner)) -> Response:
    """The prompt as the model sees it, continued: no chat template, and no session kept."""
    state = request.app.state
    engine = state.engine
    if engine is None:
        raise EngineNotReady("the model is still loading; retry when /health answers 200")
    settings = state.settings
    reply = TextReply(state.model_name, lambda token: engine.tokenizer.decode([token]), settings.sse_keepalive,
                      settings.request_timeout, body.prompt if body.echo else "")
    handle = await engine.submit(ChatRequest(
        messages=[], prompt=body.prompt, owner=owner, request_id=reply.id,
        params=body.sampling_params(settings.default_max_tokens, settings.max_tokens_limit)))
    return await reply.respond(handle, request, body.stream, body.include_usage, {})
