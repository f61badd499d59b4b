"""POST /v1/chat/completions: validate, hand the request to the engine, answer plain or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from server.engine.types import ChatRequest, EngineNotReady
from server.errors import ErrorResponse
from server.protocol import ChatCompletion, ChatCompletionRequest
from server.routes.auth import api_key_owner
from server.routes.completion import Completion

router = APIRouter()

SESSION_HEADER = "X-Session-ID"


@router.post("/v1/chat/completions", response_model=ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}}},
                        "4XX": {"model": ErrorResponse, "description": "refused (400 for invalid fields, not 422)"},
                        "5XX": {"model": ErrorResponse, "description": "not ready (503) or failed"}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 owner: str = Depends(api_key_owner)) -> Response:
    """A chat reply. The session id (body `session_id` or the `X-Session-ID` header) continues a
    conversation with only the new messages; every response names its session in `X-Session-ID`."""
    state = request.app.state
    engine = state.engine
    if engine is None:
        raise EngineNotReady("the model is still loading; retry when /health answers 200")
    settings = state.settings
    completion = Completion(state.model_name, lambda token: engine.tokenizer.decode([token]),
                            settings.sse_keepalive, settings.request_timeout)
    tools = body.engine_tools()
    chat = ChatRequest(
        messages=body.engine_messages(),
        params=body.sampling_params(settings.default_max_tokens, settings.max_tokens_limit),
        tools=tools,
        grammar=body.grammar(tools),
        owner=owner,
        session_id=body.session_id or request.headers.get(SESSION_HEADER) or None,
        request_id=completion.id,
    )
    handle = await engine.submit(chat)
    return await completion.respond(handle, request, body.stream, body.include_usage,
                                    {SESSION_HEADER: handle.session_id})
