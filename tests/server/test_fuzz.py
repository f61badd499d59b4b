"""Schema fuzzing of the real app on the real engine (tiny model): no 5xx, one error shape, still serving.

Schemathesis generates requests from the app's own OpenAPI document, valid and invalid alike
(wrong types, missing fields, out-of-range numbers, odd strings). A thousand chat requests run
in about a minute: replies are capped at a few tokens.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from h2o_cache import CacheConfig
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.settings import ServerSettings
from tests.engine.conftest import render

ERROR_FIELDS = {"message", "type", "param", "code"}
CHAT_CASES = 1000


@pytest.fixture(scope="module")
def fuzzed_app(tiny_model, byte_tokenizer):
    engine = Engine(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=32, prefill_chunk=16),
                    EngineConfig(max_batch_size=4, max_queue=64, max_prompt_tokens=2000), render=render)
    engine.start()
    yield create_app(ServerSettings(served_model_name="tiny", max_tokens_limit=8, default_max_tokens=4), engine)
    engine.stop()


@pytest.fixture(scope="module")
def fuzzed_schema(fuzzed_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)


def check(case, response) -> None:
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_FIELDS and isinstance(error["message"], str) and error["message"]
    elif "text/event-stream" in response.headers.get("content-type", ""):
        assert response.text.rstrip().endswith("data: [DONE]")


def test_no_request_gets_a_5xx_and_every_error_has_the_one_shape(fuzzed_schema):
    calls, statuses = {}, set()
    for result in fuzzed_schema.get_all_operations():
        operation = result.ok()
        chat = operation.path == "/v1/chat/completions"

        @given(case=operation.as_strategy())
        @settings(max_examples=CHAT_CASES if chat else 50, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            response = case.call()
            check(case, response)
            calls[operation.path] = calls.get(operation.path, 0) + 1
            statuses.add(response.status_code)

        fuzz()
    assert calls["/v1/chat/completions"] >= CHAT_CASES and "/v1/models" in calls
    assert {200, 400} <= statuses  # valid and invalid requests were both generated
    print(f"fuzz: {calls}, statuses {sorted(statuses)}")


async def test_the_server_still_serves_after_the_fuzzing(fuzzed_app):
    transport = httpx.ASGITransport(app=fuzzed_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        stats = fuzzed_app.state.engine.stats()
        assert stats.running == 0 and stats.waiting == 0
