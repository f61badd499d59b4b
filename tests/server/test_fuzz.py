"""Schema fuzzing of the real app on the real engine (tiny model): no 5xx, one error shape, still serving.

Schemathesis generates requests from the app's own OpenAPI document, valid and invalid alike
(wrong types, missing fields, out-of-range numbers, odd strings). A thousand chat requests run
in about a minute: replies are capped at a few tokens.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

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


SCHEMAS = [{}, {"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "array"}, {"enum": [1, "x"]},
           {"type": "string", "pattern": "[a-z]+"}, {"type": "nope"}, {"anyOf": [{"type": "integer"}, {"$ref": "#/x"}]},
           {"type": "object", "required": ["b"], "additionalProperties": False}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@st.composite
def tool_and_format_bodies(draw):
    """Bodies that reach the new fields' code paths (schemathesis alone rarely builds a valid tool loop)."""
    tools = draw(st.sampled_from([None, [TOOL], [TOOL, {"type": "function", "function": {"name": "g"}}]]))
    messages = [{"role": "user", "content": draw(st.text(max_size=20))}]
    if draw(st.booleans()):
        messages += [{"role": "assistant", "content": draw(st.sampled_from([None, "", "ok"])), "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "c1", "content": draw(st.text(max_size=10))}]
    body = {"messages": messages, "max_tokens": draw(st.integers(1, 8)), "stream": draw(st.booleans())}
    optional = {
        "tools": st.just(tools),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                                        {"type": "function", "function": {"name": "zz"}}]),
        "parallel_tool_calls": st.booleans(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}]
                                           + [{"type": "json_schema", "json_schema": {"name": "s", "schema": s}}
                                              for s in SCHEMAS]),
        "logit_bias": st.dictionaries(st.integers(0, 200).map(str), st.floats(-100, 100), max_size=3),
        "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.01, 10),
        "stop_token_ids": st.lists(st.integers(0, 200), max_size=3), "temperature": st.sampled_from([0, 1]),
    }
    for field, values in optional.items():
        if draw(st.booleans()):
            body[field] = draw(values)
    return body


def test_the_new_fields_never_get_a_5xx(fuzzed_app):
    statuses = {}
    client = TestClient(fuzzed_app, raise_server_exceptions=False)

    @given(body=tool_and_format_bodies())
    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              database=None)
    def fuzz(body):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code < 500, f"{body!r}: {response.text}"
        if response.status_code >= 400:
            assert set(response.json()["error"]) == ERROR_FIELDS and response.json()["error"]["param"]
        elif body["stream"]:
            assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    fuzz()
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 5, statuses
    print(f"new fields fuzz: statuses {statuses}")


async def test_the_server_still_serves_after_the_fuzzing(fuzzed_app):
    transport = httpx.ASGITransport(app=fuzzed_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        stats = fuzzed_app.state.engine.stats()
        assert stats.running == 0 and stats.waiting == 0
