"""POST /v1/chat/completions: validate, hand the request to the engine, answer plain or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from server.engine.types import ChatRequest, EngineError, EngineNotReady
from server.errors import ErrorResponse, from_engine_error
from server.protocol import ChatCompletion, ChatCompletionRequest
from server.routes.auth import api_key_owner
from server.routes.completion import Completion

router = APIRouter()

SESSION_HEADER = "X-Session-ID"
# Proxies (nginx) must hand each token on at once instead of buffering the stream.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    completion = Completion(state.model_name, lambda token: engine.tokenizer.decode([token]))
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
    headers = {SESSION_HEADER: handle.session_id}
    if body.stream:
        async def cancel() -> None:  # async: a sync background task would run on a worker thread
            handle.cancel()

        # The background task also cancels a stream the client left before its first chunk was pulled,
        # when the generator never started and so never reaches its own `finally`.
        return StreamingResponse(completion.stream(handle, body.include_usage), media_type="text/event-stream",
                                 headers=headers | STREAM_HEADERS, background=BackgroundTask(cancel))
    try:
        reply = await completion.body(handle, request)
    except EngineError as exc:  # failed midway: the session exists, so the error names it too
        error = from_engine_error(exc)
        error.headers = (error.headers or {}) | headers
        raise error from exc
    if reply is None:  # the client is gone; nobody reads this
        return Response(status_code=499, headers=headers)
    return JSONResponse(reply.model_dump(), headers=headers)
