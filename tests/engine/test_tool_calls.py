"""Reading tool calls out of a reply: what parses, what stays text, and what a stream shows meanwhile."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.engine.tool_calls import Holdback, Tools, call_text, content_of, parse

TOOLS = Tools([{"name": "get_weather", "parameters": {"type": "object"}}, {"name": "add"}])


def test_a_block_becomes_a_call_with_its_arguments_as_json_text():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    [call] = parse(text, TOOLS)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and len(call.id) > 20
    assert content_of(text, [call]) == "Let me check."


def test_several_blocks_are_parallel_calls_unless_parallel_calls_are_off():
    text = call_text("add", {"a": 1}) + "\n" + call_text("get_weather", '{"city": "Oslo"}')
    assert [c.name for c in parse(text, TOOLS)] == ["add", "get_weather"]
    assert [c.name for c in parse(text, Tools(TOOLS.functions, parallel=False))] == ["add"]
    assert content_of(text, parse(text, TOOLS)) is None


@pytest.mark.parametrize("text", [
    "no call at all",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}',  # never closed
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>',  # not among the tools
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "add", "arguments": {}}</tool_call> <tool_call>{"name": "add"</tool_call>',
])
def test_anything_but_valid_blocks_is_text(text):
    assert parse(text, TOOLS) == [] and content_of(text, []) == text


def test_arguments_written_as_a_json_string_or_as_parameters_are_read():
    [a] = parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', TOOLS)
    [b] = parse('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>', TOOLS)
    assert json.loads(a.arguments) == json.loads(b.arguments) == {"a": 1}


@given(st.lists(st.sampled_from(["a", "<", "<tool", "_call>", "<tool_call>", "x}", " "]), max_size=12))
def test_holdback_streams_everything_before_the_marker_and_releases_text_that_made_no_call(pieces):
    hold = Holdback()
    streamed = "".join(hold.push(p) for p in pieces)
    text = "".join(pieces)
    if "<tool_call>" in text:
        assert streamed == text.split("<tool_call>")[0]
    else:  # at most the start of a marker is still held
        assert text.startswith(streamed) and len(text) - len(streamed) < len("<tool_call>")
    assert streamed + hold.release([]) == text


def test_holdback_keeps_the_calls_text_out_of_the_stream():
    hold = Holdback()
    text = "Sure. " + call_text("add", {"a": 1})
    streamed = "".join(hold.push(text[i:i + 3]) for i in range(0, len(text), 3))
    calls = parse(text, TOOLS)
    assert streamed == "Sure. " and hold.release(calls) == ""
