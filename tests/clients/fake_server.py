"""A tiny stand-in for `python -m server`: the same HTTP contract, words as tokens, no model.

It lets the client tests run in a second without loading a model. The contract it follows:
SSE chunks (one JSON body without `"stream": true`), a final usage chunk with the server extras, an X-Session-ID header on every response,
session continuation by header, and the one error shape (context_length_exceeded past `context_limit`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def error(status: int, message: str, code: str, type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}}, status)


def make_app(context_limit: int = 10_000, budget: int = 64, delay: float = 0.001, replica: str = "",
             prefill: float = 0.0, answer: Callable[[str], list[str]] | None = None, kv_bytes: int = 0) -> FastAPI:
    """delay: seconds per token; prefill: seconds before the first one, as a prompt's forward pass takes.
    replica: a name sent back in X-Replica, so routing tests can tell the servers apart. answer: the
    reply's words for the last message's content (default w0 w1 ...), repeated to the reply's length.
    kv_bytes: serve /metrics, each kept session holding this many bytes on the device and half as many
    archived."""
    app = FastAPI()
    sessions: dict[str, int] = {}  # session id -> conversation length in tokens (words)

    if kv_bytes:
        @app.get("/metrics")
        async def metrics():
            n = len(sessions)
            text = (f"# HELP h2o_active_sessions conversations kept\n# TYPE h2o_active_sessions gauge\n"
                    f"h2o_active_sessions {n}.0\nh2o_resident_kv_bytes {n * kv_bytes}.0\n"
                    f"h2o_archived_kv_bytes {n * kv_bytes // 2}.0\n"
                    f'h2o_requests_finished_total{{reason="stop"}} {n}.0\n')
            return PlainTextResponse(text)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/v1/sessions/{sid}/cache")
    async def cache(sid: str):
        if sid not in sessions:
            return error(404, f"session {sid} not found", "session_not_found")
        return JSONResponse({"session_id": sid, "conversation_tokens": sessions[sid]},
                            headers={"X-Replica": replica} if replica else None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        sid = request.headers.get("x-session-id")
        if sid and sid not in sessions:
            return error(404, f"session {sid} not found", "session_not_found")
        new_tokens = sum(len(m["content"].split()) for m in body["messages"])
        prompt = sessions.get(sid, 0) + new_tokens
        n = body.get("max_tokens") or 16
        if prompt + n > context_limit:
            return error(400, f"conversation of {prompt} tokens exceeds {context_limit}", "context_length_exceeded")
        sid = sid or uuid.uuid4().hex
        sessions[sid] = prompt + n
        fail = "FAIL_MIDSTREAM" in body["messages"][-1]["content"]
        words = answer(body["messages"][-1]["content"]) if answer else None

        def word(i: int) -> str:
            return words[i % len(words)] if words else f"w{i}"

        if not body.get("stream"):  # one JSON body, as OpenAI's default
            content = " ".join(word(i) for i in range(n))
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
            return JSONResponse({"id": "chatcmpl-fake", "object": "chat.completion", "model": "fake-model",
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                              "finish_reason": "length"}], "usage": usage},
                                headers={"X-Session-ID": sid, "X-Replica": replica})

        async def frames():
            await asyncio.sleep(prefill)
            base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake-model"}
            for i in range(n):
                if fail and i == 2:
                    err = {"error": {"message": "engine failed", "type": "server_error", "param": None,
                                     "code": "generation_failed"}}
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n"
                    return
                await asyncio.sleep(delay)
                delta = {"index": 0, "delta": {"content": f"{word(i)} "}, "finish_reason": None}
                yield f"data: {json.dumps({**base, 'choices': [delta]})}\n\n"
            done = {"index": 0, "delta": {}, "finish_reason": "length"}
            yield f"data: {json.dumps({**base, 'choices': [done]})}\n\n"
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                     "prompt_tokens_details": {"cached_tokens": prompt - new_tokens},
                     "kv_resident_tokens": min(prompt + n, budget), "conversation_tokens": prompt + n}
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        headers = {"X-Session-ID": sid, "X-Replica": replica}
        return StreamingResponse(frames(), media_type="text/event-stream", headers=headers)

    return app
