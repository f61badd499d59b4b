"""Operations: X-Request-Id, CORS, SSE keep-alive comments, the per-request timeout (fake engine)."""

import asyncio
import logging

import httpx
import pytest

from server.app import create_app
from server.settings import ServerSettings
from tests.engine.conftest import until

URL = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "a b c"}]}


def client_for(engine, **settings) -> httpx.AsyncClient:
    app = create_app(ServerSettings(**settings), engine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_a_request_id_is_echoed_or_made_and_logged(client, caplog):
    with caplog.at_level(logging.INFO, logger="server.requests"):
        sent = await client.post(URL, json=BODY, headers={"X-Request-Id": "trace-42"})
        made = await client.get("/v1/models")
        odd = await client.get("/v1/models", headers={"X-Request-Id": "has spaces\tand tabs"})
    assert sent.headers["x-request-id"] == "trace-42"
    assert len(made.headers["x-request-id"]) == 32 and odd.headers["x-request-id"] != "has spaces\tand tabs"
    assert "request trace-42: POST /v1/chat/completions -> 200" in caplog.text
    assert f"request {made.headers['x-request-id']}: GET /v1/models -> 200" in caplog.text


async def test_cors_is_off_by_default_and_allows_the_named_origins(client, engine):
    plain = await client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in plain.headers
    async with client_for(engine, allowed_origins=["https://app.example"]) as cors:
        preflight = await cors.options(URL, headers={"Origin": "https://app.example",
                                                     "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "content-type,authorization"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        r = await cors.post(URL, json=BODY, headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-session-id" in r.headers["access-control-expose-headers"].lower()
        other = await cors.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_allowed_origins_come_comma_separated_from_the_environment(monkeypatch):
    monkeypatch.setenv("H2O_ALLOWED_ORIGINS", "https://a.example, https://b.example")
    assert ServerSettings().allowed_origins == ["https://a.example", "https://b.example"]


async def test_a_silent_stream_gets_keepalive_comments(engine):
    engine.hold = asyncio.Event()
    async with client_for(engine, sse_keepalive=0.05) as client:
        async def release():
            await asyncio.sleep(0.3)
            engine.hold.set()

        releasing = asyncio.create_task(release())
        r = await client.post(URL, json={**BODY, "stream": True})
        await releasing
    assert ": keep-alive" in r.text and r.text.rstrip().endswith("data: [DONE]")
    assert r.text.index(": keep-alive") < r.text.index('"content":"a "')


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_past_its_timeout_is_cancelled_and_told(engine, stream):
    engine.hold = asyncio.Event()  # never set: the reply never comes
    async with client_for(engine, request_timeout=0.2) as client:
        r = await client.post(URL, json={**BODY, "stream": stream})
    if stream:
        assert r.status_code == 200 and '"code": "request_timeout"' in r.text
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert r.json()["error"]["type"] == "timeout_error" and "x-session-id" in r.headers
    await until(lambda: engine.handles[0].cancelled.is_set(), timeout=5)
