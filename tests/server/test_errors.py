"""Every refusal in one shape, `{"error": {message, type, param, code}}`, with the right status."""

import httpx
import pytest

from server.engine.types import EngineNotReady, PromptTooLong, QueueFull, SessionBusy
from server.errors import APIError, from_engine_error

URL = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


async def test_malformed_json(client):
    r = await client.post(URL, content=b'{"messages": [', headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.[0].role"),
    ({"messages": [{"role": "user"}]}, "messages.[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.[0].content"),
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "presence_penalty": -3}, "presence_penalty"),
    ({"messages": USER, "frequency_penalty": 2.1}, "frequency_penalty"),
    ({"messages": USER, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "top_k": -1}, "top_k"),
    ({"messages": USER, "seed": 2**64}, "seed"),
    ({"messages": USER, "stop": [""]}, "stop.[0]"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"messages": USER, "min_p": 1.5}, "min_p"),
    ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids.[0]"),
])
async def test_bad_requests_name_the_field(client, engine, body, param):
    err = error_of(await client.post(URL, json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert not engine.requests


@pytest.mark.parametrize("body,param", [
    ({"messages": USER, "some_future_field": 1}, "some_future_field"),
    ({"messages": USER, "functions": []}, "functions"),
    ({"messages": USER, "stream_options": {"include_usage": True, "chunk_size": 3}}, "stream_options.chunk_size"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "sad"}]}, "messages.[0].mood"),
    ({"messages": [{"role": "assistant", "content": "hi", "refusal": "no"}]}, "messages.[0].refusal"),
])
async def test_unknown_fields_are_refused_by_name(client, engine, body, param):
    err = error_of(await client.post(URL, json=body), 400)
    expected = "unsupported_parameter" if param != "messages.[0].refusal" else None
    assert (err["param"], err["code"], err["type"]) == (param, expected, "invalid_request_error")
    assert not engine.requests


async def test_n_other_than_one_says_so(client):
    assert "only n=1" in error_of(await client.post(URL, json={"messages": USER, "n": 3}), 400)["message"]


async def test_body_that_is_not_an_object(client):
    assert error_of(await client.post(URL, json=[1, 2]), 400)["param"] is None
    form = await client.post(URL, content=b'{"messages": []}', headers={"content-type": "text/plain"})
    assert "Content-Type: application/json" in error_of(form, 400)["message"]


@pytest.mark.parametrize("error,status,code", [
    (PromptTooLong("too long"), 400, "context_length_exceeded"),
    (SessionBusy("busy"), 409, "session_busy"),
    (EngineNotReady("stopped"), 503, "model_not_ready"),
    (QueueFull("full"), 429, "queue_full"),
])
async def test_engine_refusals_map_by_type(client, engine, error, status, code):
    engine.submit_error = error
    r = await client.post(URL, json={"messages": USER})
    assert error_of(r, status)["code"] == code
    if status == 429:
        assert r.headers["retry-after"] == "1"


def test_engine_error_subclasses_map_like_their_parent():
    class Overloaded(QueueFull):
        retry_after = 2.5

    error = from_engine_error(Overloaded("later"))
    assert (error.status, error.headers) == (429, {"Retry-After": "3"})


async def test_failure_midway_names_the_session(client, engine):
    engine.fail_after = 1
    r = await client.post(URL, json={"messages": USER})
    assert error_of(r, 500)["code"] == "generation_failed" and r.headers["x-session-id"] == "s0"


async def test_unknown_session_is_404(client):
    err = error_of(await client.post(URL, json={"messages": USER}, headers={"X-Session-ID": "nope"}), 404)
    assert err["code"] == "session_not_found" and err["param"] == "session_id"


async def test_unknown_route_and_wrong_method(client):
    assert error_of(await client.get("/v1/nothing"), 404)["code"] == "not_found"
    r = await client.get(URL)
    assert error_of(r, 405)["code"] == "method_not_allowed" and "POST" in r.headers["allow"]


async def test_a_bug_is_a_500_without_details_and_the_server_keeps_serving(app, engine):
    engine.submit_error = ZeroDivisionError("secret detail")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        err = error_of(await client.post(URL, json={"messages": USER}), 500)
        assert err["code"] == "internal_error" and "secret" not in err["message"]
        assert (await client.post(URL, json={"messages": USER})).status_code == 200


async def test_api_error_body_is_the_one_shape():
    assert APIError(400, "m", param="p", code="c").body() == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}}


def test_openapi_documents_the_error_shape_not_fastapis_422(app):
    responses = app.openapi()["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in responses and responses["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse")
