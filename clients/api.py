"""Streaming chat over the server's OpenAI-compatible HTTP API, with per-chunk timing.

Every client goes through `Conversation.ask`, which streams one turn, records when each chunk
arrived and returns a `Turn`; failures are `ApiError` (the server's error object) or
`ServerUnavailable` (nothing answered), so a client can print one clear line instead of a traceback.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ServerUnavailable(Exception):
    """Nothing answered at the base URL, or it stayed unhealthy past the deadline."""


class ApiError(Exception):
    """The server answered with its error object {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, code: str | None = None):
        where = f"HTTP {status}" if status else "in the stream"  # status 0: an error frame after a 200
        super().__init__(f"{code or 'error'} ({where}): {message}")
        self.status, self.message, self.code = status, message, code


@dataclass
class Turn:
    """One streamed reply. Times are time.perf_counter() seconds."""

    text: str
    session_id: str | None
    t_start: float
    t_end: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    usage: dict = field(default_factory=dict)  # the final usage chunk, server extras included
    finish_reason: str | None = None

    @property
    def completion_tokens(self) -> int:
        return self.usage.get("completion_tokens", len(self.chunk_times))

    @property
    def ttft(self) -> float:
        return (self.chunk_times[0] if self.chunk_times else self.t_end) - self.t_start

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first one arrived (the decode rate the user sees)."""
        span = self.chunk_times[-1] - self.chunk_times[0] if self.chunk_times else 0.0
        return (self.completion_tokens - 1) / span if span > 0 else 0.0

    @property
    def seconds_per_token(self) -> float:
        """Whole turn (request sent to last byte) per generated token: prefill included."""
        return (self.t_end - self.t_start) / max(self.completion_tokens, 1)

    @property
    def inter_token_gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def make_client(base_url: str, api_key: str | None = None, timeout: float = 600.0) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Read timeout is long: under load a request may queue behind others before its first token.
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=5.0),
                             limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))


async def wait_ready(client: httpx.AsyncClient, timeout: float = 0.0) -> None:
    """Poll GET /health until 200; timeout 0 checks once (a server that is down fails fast)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = await client.get("/health")
            if r.status_code == 200:
                return
            reason = f"/health answered {r.status_code} (still loading?)"
        except httpx.TransportError as e:
            reason = f"cannot connect ({type(e).__name__})"
        if time.monotonic() >= deadline:
            raise ServerUnavailable(f"server at {client.base_url} is not ready: {reason}")
        await asyncio.sleep(0.5)


async def served_model(client: httpx.AsyncClient) -> str:
    """The first id from GET /v1/models, so clients need no --model for a one-model server."""
    try:
        r = await client.get("/v1/models")
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def _api_error(status: int, body: bytes | str) -> ApiError:
    try:
        err = json.loads(body)["error"]
        return ApiError(status, err.get("message", ""), err.get("code") or err.get("type"))
    except (ValueError, KeyError, TypeError):
        return ApiError(status, (body.decode(errors="replace") if isinstance(body, bytes) else body)[:300])


async def sse_chunks(response: httpx.Response):
    """The JSON objects of an SSE stream, up to `data: [DONE]`; an error frame raises ApiError."""
    async with aclosing(response.aiter_lines()) as lines:  # closed on break or raise, not left to GC
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:  # an error after streaming began arrives as a frame
                raise _api_error(0, data)
            yield chunk


async def stream_chat(client: httpx.AsyncClient, messages: list[dict], *, model: str = "default",
                      max_tokens: int = 256, temperature: float = 0.0, session_id: str | None = None,
                      on_text=None, extra: dict | None = None) -> Turn:
    """POST /v1/chat/completions with stream=true; `on_text(str)` sees each piece as it arrives.

    extra: more body fields, e.g. the server's {"ignore_eos": true} for fixed-length benchmark replies.
    """
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    headers = {"X-Session-ID": session_id} if session_id else {}
    t_start = time.perf_counter()
    turn = Turn("", None, t_start, t_start)
    pieces = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                raise _api_error(r.status_code, await r.aread())
            turn.session_id = r.headers.get("x-session-id")
            async with aclosing(sse_chunks(r)) as chunks:
                async for chunk in chunks:
                    turn.usage = chunk.get("usage") or turn.usage
                    for choice in chunk.get("choices") or []:
                        turn.finish_reason = choice.get("finish_reason") or turn.finish_reason
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            turn.chunk_times.append(time.perf_counter())
                            pieces.append(text)
                            if on_text:
                                on_text(text)
    except httpx.TransportError as e:
        raise ServerUnavailable(f"lost the server at {client.base_url}: {type(e).__name__} {e}") from e
    turn.text, turn.t_end = "".join(pieces), time.perf_counter()
    return turn


@dataclass
class Conversation:
    """A chat kept on the client. resend=True re-sends the whole history every turn (what OpenAI
    clients do; the server recognizes the prefix); resend=False sends only the new message with the
    X-Session-ID the server returned, which is also what pins a conversation to one replica."""

    resend: bool = True
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    session_id: str | None = None

    def __post_init__(self):
        if self.system and not self.messages:
            self.messages.append({"role": "system", "content": self.system})

    async def ask(self, client: httpx.AsyncClient, text: str, **params) -> Turn:
        user = {"role": "user", "content": text}
        continuing = not self.resend and self.session_id is not None
        sent = [user] if continuing else [*self.messages, user]
        try:
            turn = await stream_chat(client, sent, session_id=self.session_id if continuing else None, **params)
        except ApiError as e:
            if not (continuing and e.status == 404):
                raise
            # The server dropped the session (idle timeout or LRU): start it again from the full history.
            turn = await stream_chat(client, [*self.messages, user], **params)
        self.messages += [user, {"role": "assistant", "content": turn.text}]
        self.session_id = turn.session_id or self.session_id
        return turn

    def reset(self) -> None:
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self.session_id = None
