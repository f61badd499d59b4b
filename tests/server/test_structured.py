"""Structured outputs and tool calls through the `openai` SDK, on the real engine with the tiny byte model."""

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from h2o_cache import CacheConfig
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.settings import ServerSettings
from tests.engine.conftest import render
from tests.server.conftest import serving
from tests.server.test_errors import error_of

PAINT = {"type": "function", "function": {
    "name": "paint", "description": "paint the wall",
    "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
                   "additionalProperties": False}}}


class Verdict(BaseModel):
    ok: bool
    color: Literal["red", "green"]


@pytest.fixture(scope="module")
def app(exact_model, exact_tokenizer):
    engine = Engine(exact_model, exact_tokenizer, CacheConfig(policy="h2o", budget=512, prefill_chunk=64),
                    EngineConfig(max_batch_size=4, max_prompt_tokens=4000), render=render)
    engine.start()
    yield create_app(ServerSettings(served_model_name="tiny"), engine)
    engine.stop()


@pytest.fixture(scope="module")
def sdk(app):
    with serving(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def test_parse_returns_the_pydantic_object(sdk):
    completion = sdk.beta.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "judge"}],
                                                 response_format=Verdict, max_tokens=60, seed=1)
    assert isinstance(completion.choices[0].message.parsed, Verdict)
    assert completion.choices[0].finish_reason == "stop"


def test_json_object_is_an_object(sdk):
    completion = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "any"}],
                                             response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    if completion.choices[0].finish_reason == "stop":  # a random model may write a long string
        assert isinstance(json.loads(completion.choices[0].message.content), dict)
    else:
        assert completion.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_continues_its_session(sdk, stream):
    messages = [{"role": "user", "content": f"paint it ({stream})"}]
    # one call: a random model allowed parallel calls may write them until max_tokens cuts one
    forced = {"tools": [PAINT], "tool_choice": {"type": "function", "function": {"name": "paint"}},
              "parallel_tool_calls": False, "max_tokens": 100, "seed": 2}
    if stream:
        with sdk.chat.completions.stream(model="tiny", messages=messages, stream_options={"include_usage": True},
                                         **forced) as events:
            first = events.get_final_completion()
    else:
        first = sdk.chat.completions.create(model="tiny", messages=messages, **forced)
    message = first.choices[0].message
    [call] = message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "paint"
    assert json.loads(call.function.arguments)["color"] in ("red", "blue")
    messages += [message.model_dump(exclude_none=True) if stream else message,
                 {"role": "tool", "tool_call_id": call.id, "content": "painted"}]
    second = sdk.chat.completions.create(model="tiny", messages=messages, tools=[PAINT], max_tokens=4,
                                         extra_body={"ignore_eos": True})
    conversation = first.usage.model_extra["conversation_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens == conversation > 0


async def test_a_schema_that_does_not_compile_is_refused_by_name(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integerx"}}}
    err = error_of(await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "response_format": bad}), 400)
    assert (err["param"], err["code"]) == ("response_format", "invalid_schema")
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    err = error_of(await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "tools": [bad_tool], "tool_choice": "required"}), 400)
    assert err["param"] == "tools"
    err = error_of(await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}), 400)
    assert err["param"] == "response_format.json_schema"


async def test_min_tokens_with_a_constrained_reply_is_refused_by_name(client):
    err = error_of(await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
        "min_tokens": 4, "max_tokens": 8}), 400)
    assert (err["param"], err["code"]) == ("min_tokens", "invalid_value")
    plain = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}, "min_tokens": 4,
        "max_tokens": 4, "temperature": 0})
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4


def test_langchain_bind_tools_drives_a_call_and_the_tool_result_continues_the_session(app):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    with serving(app) as url:
        llm = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="x", model="tiny", max_retries=0,
                                          max_tokens=100, temperature=1.0, seed=5)
        forced = llm.bind_tools([PAINT], tool_choice="paint", parallel_tool_calls=False)
        messages = [HumanMessage("paint the wall (langchain)")]
        reply = forced.invoke(messages)
        [call] = reply.tool_calls
        assert call["name"] == "paint" and call["args"]["color"] in ("red", "blue")
        messages += [reply, ToolMessage("painted", tool_call_id=call["id"])]
        after = llm.bind_tools([PAINT]).invoke(messages, max_tokens=4, extra_body={"ignore_eos": True})
        cached = after.response_metadata["token_usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == reply.response_metadata["token_usage"]["conversation_tokens"] > 0
