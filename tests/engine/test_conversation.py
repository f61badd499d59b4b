"""Conversation identity (what makes a re-sent history the same conversation) and tool rendering."""

import hashlib
import json

from server.engine.conversation import ChatTemplate, assistant_message, continued, conversation_keys, tools_prompt
from server.engine.tool_calls import Tools, call_text, parse
from tests.engine.conftest import render

TOOLS = Tools([{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])
USER = {"role": "user", "content": "weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_plain_message_keys_as_transcripts_saved_before_tool_calls_did():
    digest = hashlib.sha256(b"o")
    digest.update(json.dumps(["user", "hi"]).encode())
    assert conversation_keys("o", [{"role": "user", "content": "hi"}]) == [digest.hexdigest()]


def test_tool_calls_and_tool_results_are_part_of_the_identity_and_raw_text_is_not():
    reply = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    ours = {**reply, "raw": "<tool_call>...", "content": ""}
    echoed = {**reply, "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": '{"city":"Paris"}'}}]}
    key = conversation_keys("o", [USER, reply])
    assert conversation_keys("o", [USER, ours]) == conversation_keys("o", [USER, echoed]) == key
    other = {**reply, "tool_calls": [{**CALL, "id": "call_2"}]}
    assert conversation_keys("o", [USER, other]) != key
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert conversation_keys("o", [USER, reply, result])[-1] != \
        conversation_keys("o", [USER, reply, {**result, "tool_call_id": "call_2"}])[-1]


def test_a_re_sent_history_takes_the_sessions_copies_of_what_they_share():
    ours = [USER, {"role": "assistant", "content": None, "raw": "R", "tool_calls": [CALL]}]
    sent = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert continued(ours, sent) == ours + sent[2:]


def test_without_native_tools_they_are_described_in_the_system_message_and_calls_read_as_blocks():
    template = ChatTemplate(lambda messages, generation, tools: render(messages, generation), native_tools=False)
    conversation = [{"role": "system", "content": "be brief"}, USER,
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = template.render(conversation, TOOLS)
    assert text.startswith("<system>be brief\n\n" + tools_prompt(TOOLS))
    assert f"<assistant>{call_text('get_weather', {'city': 'Paris'})}\n" in text
    assert "<user><tool_response>\nsunny\n</tool_response>\n<assistant>" in text
    assert '"name": "get_weather"' in tools_prompt(TOOLS) and "<tools>" in tools_prompt(TOOLS)


def test_a_reply_the_server_produced_renders_as_the_text_the_model_wrote():
    template = ChatTemplate(lambda messages, generation, tools: render(messages, generation), native_tools=False)
    raw = 'ok <tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    message = assistant_message(raw, "ok", parse(raw, TOOLS))
    prompt = template.render([USER], TOOLS)
    assert template.render([USER, message], TOOLS, add_generation_prompt=False) == prompt + raw + "\n"


def test_a_native_template_gets_the_tools_and_the_calls_with_their_arguments_as_objects():
    seen = {}

    def fn(messages, generation, tools):
        seen.update(messages=messages, tools=tools)
        return "x"

    ChatTemplate(fn, native_tools=True).render([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], TOOLS)
    assert seen["tools"] == [{"type": "function", "function": TOOLS.functions[0]}]
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert seen["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
