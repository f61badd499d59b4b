"""GET /v1/sessions/{id}/cache on the real engine (tiny model): shape, ownership, origins after eviction."""

import httpx
import pytest

from h2o_cache import CacheConfig
from server.app import create_app
from server.cache_protocol import SessionCache
from server.engine import Engine, EngineConfig
from server.settings import ServerSettings
from tests.engine.conftest import render

BUDGET = 16
URL = "/v1/chat/completions"
ALPHA, BETA = {"Authorization": "Bearer alpha"}, {"Authorization": "Bearer beta"}


def ask(content: str, max_tokens: int = 12) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


@pytest.fixture
def engine(tiny_model, byte_tokenizer):
    engine = Engine(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=BUDGET, prefill_chunk=16),
                    EngineConfig(max_batch_size=2), render=render)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def app(engine):
    return create_app(ServerSettings(api_key=["alpha", "beta"]), engine)


async def two_turns(client) -> tuple[str, dict]:
    first = await client.post(URL, json=ask("a message long enough to evict"), headers=ALPHA)
    session = first.headers["x-session-id"]
    second = await client.post(URL, json=ask("go on"), headers=ALPHA | {"X-Session-ID": session})
    assert second.status_code == 200, second.text
    return session, second.json()["usage"]


async def test_the_cache_of_a_session_after_evictions(client, engine):
    session, usage = await two_turns(client)
    r = await client.get(f"/v1/sessions/{session}/cache", headers=ALPHA)
    assert r.status_code == 200, r.text
    view = SessionCache.model_validate(r.json())
    assert view.session_id == session and view.live is False
    assert view.conversation_tokens == usage["conversation_tokens"] > 3 * BUDGET
    assert view.resident_tokens == usage["kv_resident_tokens"] <= BUDGET
    assert len(view.turns) == 2 and view.turns[-1].conversation_tokens == view.conversation_tokens
    spec = engine.generator.spec
    assert len(view.layers) == spec.num_layers and {len(heads) for heads in view.layers} == {spec.num_kv_heads}
    assert view.first_position == 0 and len(view.tokens) == view.conversation_tokens
    assert view.recalled_tokens == view.archived_tokens == 0  # recall is off
    recent = view.kept_recent
    newest = view.conversation_tokens - 2  # the last token fed; the one after it is pending
    for heads in view.layers:
        for head in heads:
            assert len(head.positions) == len(head.scores) == view.resident_tokens and head.recalled == []
            assert head.positions == sorted(set(head.positions)) and head.positions[0] >= 0
            assert head.positions[-recent:] == list(range(newest - recent + 1, newest + 1))
            assert all(score >= 0 for score in head.scores)
    evicted = set(range(newest + 1)) - set(view.layers[0][0].positions)
    assert len(evicted) == newest + 1 - view.resident_tokens  # most of the conversation is gone

    tail = (await client.get(f"/v1/sessions/{session}/cache?last=7", headers=ALPHA)).json()
    assert tail["first_position"] == view.conversation_tokens - 7 and tail["tokens"] == view.tokens[-7:]


async def test_another_keys_session_is_as_unknown_as_a_missing_one(client):
    session, _ = await two_turns(client)
    theirs = await client.get(f"/v1/sessions/{session}/cache", headers=BETA)
    missing = await client.get("/v1/sessions/no-such-session/cache", headers=BETA)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["code"] == missing.json()["error"]["code"] == "session_not_found"
    assert theirs.json()["error"]["message"].replace(session, "X") == missing.json()["error"]["message"].replace(
        "no-such-session", "X")
    anonymous = await client.get(f"/v1/sessions/{session}/cache")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    bad = await client.get(f"/v1/sessions/{session}/cache?last=0", headers=ALPHA)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "last"


async def test_the_endpoint_is_in_the_openapi_document_with_its_response_model(client):
    spec = (await client.get("/openapi.json")).json()
    operation = spec["paths"]["/v1/sessions/{session_id}/cache"]["get"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionCache")
    assert {"404", "401"} <= set(operation["responses"])
    fields = spec["components"]["schemas"]["SessionCache"]["properties"]
    assert {"live", "layers", "tokens", "kept_sinks", "kept_recent", "turns", "recalled_tokens",
            "archived_tokens"} <= set(fields)
    assert "recalled" in spec["components"]["schemas"]["HeadCache"]["properties"]


async def test_after_a_recall_each_head_names_its_recalled_tokens(tiny_model, byte_tokenizer):
    recall = dict(recall_budget=8, recall_block=4, recall_probe=8)
    engine = Engine(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=BUDGET, prefill_chunk=16, **recall),
                    EngineConfig(max_batch_size=2), render=render)
    engine.start()
    app = create_app(ServerSettings(api_key=["alpha"]), engine)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            session, usage = await two_turns(client)
            r = await client.get(f"/v1/sessions/{session}/cache", headers=ALPHA)
            view = SessionCache.model_validate(r.json())
    finally:
        engine.stop()
    assert view.recalled_tokens == 8 and view.archived_tokens > 0
    assert BUDGET < view.resident_tokens == usage["kv_resident_tokens"] <= BUDGET + 8  # recalled: over the budget
    for heads in view.layers:
        for head in heads:
            assert len(head.recalled) == 8 and set(head.recalled) < set(head.positions)
            assert not set(head.recalled) & set(head.positions[-view.kept_recent:])
