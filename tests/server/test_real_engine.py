"""The HTTP layer on the real `Engine` with the tiny random Llama: sessions, budgets, streams, cancels."""

import asyncio

import httpx
import openai
import pytest

from h2o_cache import CacheConfig
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.settings import ServerSettings
from tests.engine.conftest import render, until
from tests.server.conftest import serving

BUDGET = 24
URL = "/v1/chat/completions"


def ask(content: str, max_tokens: int = 8, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


@pytest.fixture
def engine(tiny_model, byte_tokenizer):
    engine = Engine(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=BUDGET, prefill_chunk=16),
                    EngineConfig(max_batch_size=2, max_prompt_tokens=200), render=render)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def app(engine):
    return create_app(ServerSettings(served_model_name="tiny"), engine)


async def test_a_session_continues_within_its_budget(client):
    first = await client.post(URL, json=ask("a first message long enough to overflow the budget", 12))
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    assert usage["completion_tokens"] == 12 and first.json()["choices"][0]["finish_reason"] == "length"
    assert usage["kv_resident_tokens"] <= BUDGET < usage["conversation_tokens"]
    session = {"X-Session-ID": first.headers["x-session-id"]}
    second = await client.post(URL, json=ask("go on", 4), headers=session)
    assert second.headers["x-session-id"] == session["X-Session-ID"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["conversation_tokens"]
    assert second.json()["usage"]["kv_resident_tokens"] <= BUDGET


async def test_greedy_is_the_same_plain_and_streamed_and_batched(client, live_url):
    plain = (await client.post(URL, json=ask("hello there", 10))).json()["choices"][0]["message"]["content"]
    with openai.OpenAI(base_url=f"{live_url}/v1", api_key="x", max_retries=0) as sdk:
        chunks = list(sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=10, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].model == "tiny"
    together = await asyncio.gather(*(client.post(URL, json=ask("hello there", 10)) for _ in range(3)))
    assert {r.json()["choices"][0]["message"]["content"] for r in together} == {plain}


async def test_engine_refusals_are_openai_errors(client):
    too_long = await client.post(URL, json=ask("x" * 300))
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    gone = await client.post(URL, json=ask("hi"), headers={"X-Session-ID": "gone"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"


async def test_logit_bias_and_stop_token_ids_steer_the_reply_and_unknown_ids_are_refused(client, byte_tokenizer):
    [x] = byte_tokenizer.encode("x")
    forced = (await client.post(URL, json=ask("hello", 6, logit_bias={str(x): 100}))).json()
    assert forced["choices"][0]["message"]["content"] == "x" * 6
    stopped = (await client.post(URL, json=ask("hello", 6, logit_bias={str(x): 100}, stop_token_ids=[x],
                                               ignore_eos=False))).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    for field, value in [("logit_bias", {"128": 1}), ("stop_token_ids", [999])]:
        r = await client.post(URL, json=ask("hello", 2, **{field: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field


async def test_min_tokens_holds_the_end_of_the_reply_back_until_then(client, byte_tokenizer):
    [x] = byte_tokenizer.encode("x")
    eos = 2  # the tiny model's end token, made the likeliest
    ended = (await client.post(URL, json=ask("hello", 8, logit_bias={str(eos): 100}, ignore_eos=False))).json()
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == 1
    held = (await client.post(URL, json=ask("hello", 8, logit_bias={str(eos): 100}, ignore_eos=False,
                                            min_tokens=3))).json()
    assert held["choices"][0]["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 4  # 3, then the end
    stopped = (await client.post(URL, json=ask("hello", 8, logit_bias={str(x): 100}, stop_token_ids=[x],
                                               ignore_eos=False, min_tokens=2))).json()
    assert stopped["usage"]["completion_tokens"] == 3 and "x" not in stopped["choices"][0]["message"]["content"]
    long = (await client.post(URL, json=ask("hello", 8, logit_bias={str(eos): 100}, ignore_eos=False,
                                            min_tokens=8))).json()
    assert long["choices"][0]["finish_reason"] == "length" and long["usage"]["completion_tokens"] == 8
    r = await client.post(URL, json=ask("hello", 4, min_tokens=5))
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert r.json()["error"]["code"] == "invalid_value" and "(max_tokens)" in r.json()["error"]["message"]


async def test_a_text_completion_continues_the_raw_prompt_and_keeps_no_session(client, engine, byte_tokenizer):
    chat = (await client.post(URL, json=ask("hello there", 6))).json()["choices"][0]["message"]["content"]
    sessions = engine.stats().active_sessions
    prompt = render([{"role": "user", "content": "hello there"}], True)
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == chat  # the chat template by hand: the same greedy reply
    assert r.json()["usage"]["prompt_tokens"] == len(byte_tokenizer.encode(prompt))
    assert engine.stats().active_sessions == sessions and "x-session-id" not in r.headers


async def test_tokenize_gives_what_a_chat_request_prefills_and_detokenize_spells_it(client, byte_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
    assert tokens == byte_tokenizer.encode(render(messages, True))
    assert (await client.post("/detokenize", json={"tokens": tokens})).json()["prompt"] == render(messages, True)
    r = (await client.post("/tokenize", json={"prompt": "abc"})).json()
    assert r == {"count": 3, "max_model_len": 200, "tokens": byte_tokenizer.encode("abc")}


async def test_a_disconnected_stream_frees_its_batch_slot(live_url, engine):
    async with httpx.AsyncClient(base_url=live_url, timeout=30) as client:
        async with client.stream("POST", URL, json=ask("hi", 4096, stream=True)) as r:
            async for line in r.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
    await until(lambda: engine.stats().requests_by_finish.get("cancelled") == 1, timeout=30)
    assert engine.stats().running == 0 and engine.stats().waiting == 0


async def test_metrics_count_the_engine_work(client):
    await client.post(URL, json=ask("hello", 5))
    text = (await client.get("/metrics")).text
    assert "h2o_generated_tokens_total 5.0" in text and "h2o_active_sessions 1.0" in text
    assert "h2o_decode_step_seconds_count" in text
    for name, count in [("time_to_first_token", 1), ("inter_token_latency", 4), ("e2e_request_latency", 1),
                        ("queue_time", 1)]:
        assert f"h2o_{name}_seconds_count {count:.1f}" in text
