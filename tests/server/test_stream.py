"""Streaming over a real uvicorn on loopback: SSE framing, errors inside a stream, disconnects."""

import asyncio
import json

import httpx
import pytest

from server.engine.types import GenerationFailed
from server.protocol import ChunkChoice
from server.routes.completion import Completion
from tests.engine.conftest import until

URL = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "one two three"}], "stream": True}


async def frames(url: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, list[str]]:
    """The `data:` payloads of a stream, in order, and the response."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", URL, json=body, headers=headers) as r:
            lines = [line async for line in r.aiter_lines()]
    assert all(line.startswith("data: ") for line in lines if line), lines
    return r, [line[6:] for line in lines if line]


async def test_stream_is_role_then_content_then_finish_then_done(live_url, engine):
    r, data = await frames(live_url, BODY)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-session-id"] == engine.handles[0].session_id
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "one "}, {"content": "two "}, {"content": "three "}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["stop"]
    assert all(c["usage"] is None for c in chunks)


async def test_usage_chunk_only_with_include_usage(live_url):
    _, data = await frames(live_url, {**BODY, "stream_options": {"include_usage": True}})
    usage_chunk = json.loads(data[-2])
    assert usage_chunk["choices"] == [] and data[-1] == "[DONE]"
    assert usage_chunk["usage"]["completion_tokens"] == 3 and usage_chunk["usage"]["total_tokens"] == 6
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert json.loads(data[-3])["choices"][0]["finish_reason"] == "stop"


async def test_stream_logprobs_ride_on_their_chunks(live_url):
    _, data = await frames(live_url, {**BODY, "logprobs": True, "top_logprobs": 1})
    content_chunks = [json.loads(d) for d in data[1:4]]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in content_chunks] == ["<0>", "<1>", "<2>"]


async def test_failure_midway_is_an_error_frame_then_done(live_url, engine):
    engine.fail_after = 1
    r, data = await frames(live_url, BODY)
    assert r.status_code == 200
    assert json.loads(data[-2]) == {"error": {"message": "the model failed", "type": "server_error", "param": None,
                                              "code": "generation_failed"}}
    assert data[-1] == "[DONE]" and json.loads(data[1])["choices"][0]["delta"] == {"content": "one "}
    engine.fail_after = None
    r, data = await frames(live_url, BODY)  # the server goes on serving
    assert "error" not in data[-2]


async def test_refusal_before_streaming_is_a_plain_http_error(live_url, engine):
    engine.submit_error = GenerationFailed("never started")
    async with httpx.AsyncClient(base_url=live_url) as client:
        r = await client.post(URL, json=BODY)
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_request(live_url, engine, stream):
    engine.hold = asyncio.Event()  # never set: the reply never comes
    async with httpx.AsyncClient(base_url=live_url, timeout=10) as client:
        request = asyncio.create_task(client.post(URL, json={**BODY, "stream": stream}))
        await until(lambda: engine.handles)
        request.cancel()  # httpx closes the connection under a cancelled request
    await until(lambda: engine.handles[0].cancelled.is_set())


async def test_a_stream_left_before_its_first_chunk_is_cancelled(app, engine):
    """The client is gone while the response is still sending its headers: the generator never starts."""
    messages = [{"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            await asyncio.Event().wait()  # a slow socket: only the disconnect's cancellation ends this

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": URL, "raw_path": URL.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("test", 80)}
    await app(scope, receive, send)
    assert engine.handles[0].cancelled.is_set()


@pytest.mark.parametrize("text", ["hello", ' "quoted" \\ back', "é 日本 😀", "".join(map(chr, range(32))) + "\x7f\u2028"])
def test_content_frames_are_the_bytes_pydantic_would_write(text):
    completion = Completion("m", str)
    expected = completion.chunk([ChunkChoice(delta={"content": text})])
    assert completion.content_chunk(text) == expected
    assert json.loads(expected.removeprefix("data: "))["choices"][0]["delta"]["content"] == text
