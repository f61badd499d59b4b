"""POST /v1/chat/completions without streaming: the body OpenAI clients expect, sessions, what reaches the engine."""

import pytest

from h2o_cache import SamplingParams

HELLO = {"model": "any", "messages": [{"role": "user", "content": "hello brave new world"}]}


async def test_reply_has_the_openai_shape_and_names_its_session(client, engine):
    r = await client.post("/v1/chat/completions", json=HELLO)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and body["model"] == "SmolLM2-135M-Instruct"
    [choice] = body["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "hello brave new world "},
                      "logprobs": None, "finish_reason": "stop"}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 1},
                             "kv_resident_tokens": 8, "conversation_tokens": 8,
                             "reread_tokens": 0}
    assert r.headers["x-session-id"] == engine.handles[0].session_id


async def test_request_becomes_sampling_params_and_engine_messages(client, engine, app):
    body = {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7, "max_tokens": 3, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x",
            "presence_penalty": 1, "frequency_penalty": -1, "top_k": 5, "ignore_eos": True}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    [request] = engine.requests
    assert request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert request.params == SamplingParams(max_new_tokens=7, temperature=0.0, top_p=0.5, top_k=5, seed=3,
                                            stop=("x",), ignore_eos=True, presence_penalty=1.0,
                                            frequency_penalty=-1.0)
    assert request.owner == "" and request.session_id is None and request.request_id == r.json()["id"]


async def test_sampling_extras_reach_the_sampler_per_request(client, engine):
    body = {**HELLO, "logit_bias": {"7": -100, "12": 5.5}, "min_p": 0.1, "repetition_penalty": 1.2,
            "stop_token_ids": [2, 9]}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    params = engine.requests[0].params
    assert (params.logit_bias, params.min_p, params.repetition_penalty, params.stop_token_ids) == \
        (((7, -100.0), (12, 5.5)), 0.1, 1.2, (2, 9))


async def test_harmless_openai_fields_are_accepted_and_change_nothing(client, engine):
    harmless = {"user": "u1", "safety_identifier": "s", "metadata": {"k": "v"}, "store": False,
                "service_tier": "auto", "prompt_cache_key": "c", "prediction": {"type": "content", "content": "x"},
                "stream_options": {"include_usage": False, "include_obfuscation": True}}
    plain = await client.post("/v1/chat/completions", json=HELLO)
    extra = await client.post("/v1/chat/completions", json={**HELLO, **harmless})
    assert extra.status_code == 200, extra.text
    assert extra.json()["choices"] == plain.json()["choices"]
    assert engine.requests[0].params == engine.requests[1].params


async def test_an_echoed_assistant_message_with_null_extras_is_accepted(client, engine):
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "audio": None, "function_call": None,
              "annotations": [], "name": "bot"}
    r = await client.post("/v1/chat/completions", json={"messages": [*HELLO["messages"], echoed,
                                                                      {"role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text
    assert engine.requests[0].messages[1] == {"role": "assistant", "content": "hi", "name": "bot"}


async def test_defaults_follow_openai_and_the_default_is_capped_by_the_limit(client, engine, app):
    app.state.settings = app.state.settings.model_copy(update={"default_max_tokens": 9, "max_tokens_limit": 20})
    await client.post("/v1/chat/completions", json=HELLO)
    await client.post("/v1/chat/completions", json={**HELLO, "max_tokens": 20})
    app.state.settings = app.state.settings.model_copy(update={"default_max_tokens": 50})
    await client.post("/v1/chat/completions", json=HELLO)
    assert engine.requests[0].params == SamplingParams(max_new_tokens=9, temperature=1.0)
    assert [r.params.max_new_tokens for r in engine.requests[1:]] == [20, 20]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_above_the_limit_is_refused_before_any_work(client, engine, app, field, stream):
    app.state.settings = app.state.settings.model_copy(update={"max_tokens_limit": 20})
    r = await client.post("/v1/chat/completions", json={**HELLO, field: 10**12, "stream": stream})
    assert r.status_code == 400 and not engine.requests
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (field, "max_tokens_exceeded", "invalid_request_error")
    assert "20" in error["message"]


async def test_length_finish_when_max_tokens_runs_out(client):
    r = await client.post("/v1/chat/completions", json={**HELLO, "max_tokens": 2})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"] == "hello brave "


@pytest.mark.parametrize("where", ["header", "body"])
async def test_session_id_round_trips(client, engine, where):
    first = await client.post("/v1/chat/completions", json=HELLO)
    session_id = first.headers["x-session-id"]
    more = {"messages": [{"role": "user", "content": "and then"}]}
    if where == "header":
        r = await client.post("/v1/chat/completions", json=more, headers={"X-Session-ID": session_id})
    else:
        r = await client.post("/v1/chat/completions", json={**more, "session_id": session_id})
    assert r.status_code == 200 and r.headers["x-session-id"] == session_id
    assert engine.requests[1].session_id == session_id


async def test_logprobs_in_openai_shape(client):
    r = await client.post("/v1/chat/completions", json={**HELLO, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    assert content[1] == {"token": "<1>", "logprob": -0.5, "bytes": list(b"<1>"),
                          "top_logprobs": [{"token": "<1>", "logprob": -0.5, "bytes": list(b"<1>")},
                                           {"token": "<99>", "logprob": -1.5, "bytes": list(b"<99>")}]}


async def test_models_lists_the_served_model(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["SmolLM2-135M-Instruct"] and r.json()["object"] == "list"
