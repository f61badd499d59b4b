"""API keys: a missing or wrong key is a 401; each key owns its sessions."""

import hashlib

import httpx
import pytest

from server.app import create_app
from server.settings import ServerSettings

URL = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def keyed(engine):
    app = create_app(ServerSettings(api_key=["alpha", "beta"]), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "alpha"},
                                     {"Authorization": "Basic alpha"}, {"Authorization": "Bearer "}])
async def test_missing_or_wrong_key_is_401(keyed, engine, headers):
    for r in [await keyed.post(URL, json=BODY, headers=headers), await keyed.get("/v1/models", headers=headers)]:
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert not engine.requests


async def test_each_key_is_an_opaque_owner_and_owns_its_sessions(keyed, engine):
    r = await keyed.post(URL, json=BODY, headers={"Authorization": "Bearer alpha"})
    assert r.status_code == 200
    assert engine.requests[0].owner == hashlib.sha256(b"alpha").hexdigest()[:32]
    session = {"X-Session-ID": r.headers["x-session-id"]}
    other = await keyed.post(URL, json=BODY, headers={"Authorization": "Bearer beta", **session})
    assert other.status_code == 404
    same = await keyed.post(URL, json=BODY, headers={"Authorization": "Bearer alpha", **session})
    assert same.status_code == 200


async def test_health_and_metrics_need_no_key(keyed):
    assert (await keyed.get("/health")).status_code == 200
    assert (await keyed.get("/metrics")).status_code == 200


async def test_without_keys_there_is_no_owner(client, engine):
    assert (await client.post(URL, json=BODY, headers={"Authorization": "Bearer anything"})).status_code == 200
    assert engine.requests[0].owner == ""
