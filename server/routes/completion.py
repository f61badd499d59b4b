"""Turn an engine `Handle` into an OpenAI chat completion: one JSON body, or a stream of SSE chunks."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.engine.types import Delta, EngineError, Finish, GenerationFailed
from server.errors import APIError, from_engine_error, internal_error
from server.routes.pacing import KEEPALIVE, paced, timed_out
from server.protocol import (
    AssistantMessage, ChatCompletion, ChatCompletionChunk, Choice, ChoiceLogprobs, ChunkChoice, UsageInfo,
)
from server.tools import ToolCallBody, tool_call_deltas

log = logging.getLogger("server")

# Proxies (nginx) must hand each token on at once instead of buffering the stream.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Completion:
    """What every chunk or body of one reply shares: its id, creation time, model and token spelling.

    This is a chat completion; `TextCompletion` (routes/text_completion.py) shapes the same stream
    as a text completion by overriding `opening`, `frames` and `body`.
    """

    prefix = "chatcmpl"

    def __init__(self, model: str, token_text: Callable[[int], str], keepalive: float = 15.0,
                 timeout: float | None = None):
        """keepalive: seconds of a stream's silence before a keep-alive comment; timeout: seconds the
        request may run (None: no limit)."""
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.token_text = token_text
        self.keepalive = keepalive
        self.timeout = timeout
        self._content_frame: tuple[str, str] | None = None

    def content_chunk(self, text: str) -> str:
        """The frame of a plain content delta: the one sent per token, so it is built from a template
        made once per reply (1 us rather than 9 us for a pydantic chunk; the same bytes)."""
        if self._content_frame is None:
            frame = self.chunk([ChunkChoice(delta={"content": _MARK})])
            before, _, after = frame.partition(json.dumps(_MARK, ensure_ascii=False))
            self._content_frame = before, after
        before, after = self._content_frame
        return before + json.dumps(text, ensure_ascii=False) + after

    async def respond(self, handle, request: Request, stream: bool, include_usage: bool,
                      headers: dict[str, str]) -> Response:
        """The HTTP response for a submitted request: an SSE stream, or one JSON body."""
        if stream:
            async def cancel() -> None:  # async: a sync background task would run on a worker thread
                handle.cancel()

            # The background task also cancels a stream the client left before its first chunk was
            # pulled, when the generator never started and so never reaches its own `finally`.
            return StreamingResponse(self.stream(handle, include_usage), media_type="text/event-stream",
                                     headers=headers | STREAM_HEADERS, background=BackgroundTask(cancel))
        try:
            async with asyncio.timeout(self.timeout):
                reply = await self.body(handle, request)
        except EngineError as exc:  # failed midway: the error carries the response's headers too
            error = from_engine_error(exc)
            error.headers = (error.headers or {}) | headers
            raise error from exc
        except TimeoutError as exc:
            handle.cancel()
            error = timed_out(self.timeout)
            error.headers = headers
            raise error from exc
        if reply is None:  # the client is gone; nobody reads this
            return Response(status_code=499, headers=headers)
        return JSONResponse(reply.model_dump(), headers=headers)

    def opening(self) -> str:
        """The stream's first frame, before any token."""
        return self.chunk([ChunkChoice(delta={"role": "assistant", "content": ""})])

    def logprobs(self, delta: Delta) -> ChoiceLogprobs | None:
        return ChoiceLogprobs.of(delta.logprobs, self.token_text) if delta.logprobs else None

    def chunk(self, choices: list[ChunkChoice], usage: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return sse(body.model_dump_json())

    def frames(self, item: Delta | Finish, include_usage: bool) -> str:
        if isinstance(item, Finish):
            calls = "".join(self.chunk([ChunkChoice(delta=delta)]) for delta in tool_call_deltas(item.tool_calls))
            finish = calls + self.chunk([ChunkChoice(delta={}, finish_reason=item.finish_reason)])
            return finish + (self.chunk([], UsageInfo.of(item.usage)) if include_usage else "")
        if item.logprobs:
            return self.chunk([ChunkChoice(delta={"content": item.text}, logprobs=self.logprobs(item))])
        return self.content_chunk(item.text) if item.text else ""

    async def collect(self, handle, request: Request) -> tuple[list[str], list, Finish | None]:
        """The whole reply: its text pieces, logprobs and Finish (None when the client left first:
        the request is then cancelled)."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        text, samples, finish = [], [], None
        try:
            async for item in handle:
                if isinstance(item, Finish):
                    finish = item
                else:
                    text.append(item.text)
                    samples += item.logprobs
        finally:
            watcher.cancel()
        return text, samples, finish

    async def body(self, handle, request: Request) -> ChatCompletion | None:
        """The reply as one body; None when the client left first."""
        text, samples, finish = await self.collect(handle, request)
        if finish is None:
            return None
        logprobs = ChoiceLogprobs.of(samples, self.token_text) if samples else None
        content = "".join(text)
        calls = [ToolCallBody.of(call) for call in finish.tool_calls] or None
        message = AssistantMessage(content=content.strip() or None if calls else content, tool_calls=calls)
        choice = Choice(message=message, logprobs=logprobs, finish_reason=finish.finish_reason)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=UsageInfo.of(finish.usage))

    async def stream(self, handle, include_usage: bool) -> AsyncIterator[str]:
        """SSE frames: role, content deltas, finish, usage (when asked), [DONE].

        Every token is its own frame; the frames of tokens that arrived while the client was still
        being written to go out in one write (`Handle.batches`), so a slow reader costs one pass
        through the ASGI stack per catch-up rather than per token.
        The response is cancelled when the client disconnects (Starlette watches for it), which
        raises CancelledError here; `finally` then frees the request's batch slot.
        """
        try:
            opening = self.opening()
            if opening:
                yield opening
            async for batch in paced(handle.batches(), self.keepalive, self.timeout):
                yield KEEPALIVE if batch is None else "".join(self.frames(item, include_usage) for item in batch)
        except APIError as exc:  # the deadline passed
            yield sse(json.dumps(exc.body()))
        except EngineError as exc:
            if not isinstance(exc, GenerationFailed):
                log.warning("engine error in a stream: %r", exc)
            yield sse(json.dumps(from_engine_error(exc).body()))
        except Exception:
            log.exception("error while streaming %s", self.id)
            yield sse(json.dumps(internal_error().body()))
        finally:
            handle.cancel()
        yield sse("[DONE]")


_MARK = "\ue000content\ue000"  # a private-use string no JSON encoder escapes


def sse(data: str) -> str:
    return f"data: {data}\n\n"


async def _cancel_on_disconnect(request: Request, handle) -> None:
    """Once the body is read, the next ASGI message can only be the client going away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()
