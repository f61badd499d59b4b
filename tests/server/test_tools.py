"""Tool calling over HTTP: request fields, the reply's `tool_calls`, streamed deltas, refusals (fake engine)."""

import json

import openai
import pytest

from server.engine.tool_calls import Tools
from tests.server.test_errors import error_of

URL = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                                            "strict": True}}
ASK = [{"role": "user", "content": "call the weather tool"}]


async def test_a_call_is_the_replys_tool_calls_with_finish_reason_tool_calls(client, engine):
    r = await client.post(URL, json={"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}]}
    function = {k: v for k, v in WEATHER["function"].items() if k != "strict"}
    assert engine.requests[0].tools == Tools([function], "auto", True)


@pytest.mark.parametrize("choice,parallel,expected", [
    ("none", None, Tools([{"name": "get_weather"}], "none", True)),
    ("required", False, Tools([{"name": "get_weather"}], "required", False)),
    ({"type": "function", "function": {"name": "get_weather"}}, True, Tools([{"name": "get_weather"}], "get_weather")),
])
async def test_tool_choice_and_parallel_calls_reach_the_engine(client, engine, choice, parallel, expected):
    tool = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.post(URL, json={"messages": ASK, "tools": [tool], "tool_choice": choice,
                                     "parallel_tool_calls": parallel})
    assert r.status_code == 200, r.text
    assert engine.requests[0].tools == expected


async def test_the_tool_loop_messages_reach_the_engine_as_sent(client, engine):
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    r = await client.post(URL, json={"messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert engine.requests[0].messages == messages


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.[0].type"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages.[0].tool_calls.[0].function.arguments"),
])
async def test_tool_fields_that_cannot_be_met_are_refused_by_name(client, engine, body, param):
    err = error_of(await client.post(URL, json={"messages": ASK, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert not engine.requests


def test_the_sdk_reads_plain_and_streamed_calls(live_url):
    with openai.OpenAI(base_url=f"{live_url}/v1", api_key="x", max_retries=0) as sdk:
        plain = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
        [call] = plain.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"a": 1}
        with sdk.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER]) as stream:
            final = stream.get_final_completion()
        [streamed] = final.choices[0].message.tool_calls
        assert (streamed.function.name, streamed.function.arguments) == ("get_weather", '{"a": 1}')
        assert final.choices[0].finish_reason == "tool_calls"
        chunks = list(sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True))
        deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert [d[0].index for d in deltas] == [0, 0] and deltas[0][0].id == "call_2"
        assert deltas[0][0].type == "function" and deltas[1][0].function.arguments == '{"a": 1}'
