"""POST /v1/completions: a raw prompt, the OpenAI text completion shape, plain and streamed (fake engine)."""

import json

import openai
import pytest

from tests.server.test_errors import error_of

URL = "/v1/completions"


async def test_a_prompt_is_continued_without_template_or_session(client, engine):
    r = await client.post(URL, json={"model": "m", "prompt": "once upon a time", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "once upon a ", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["completion_tokens"] == 3 and "x-session-id" not in r.headers
    [request] = engine.requests
    assert request.prompt == "once upon a time" and request.messages == [] and request.session_id is None
    assert request.params.max_new_tokens == 3 and request.params.temperature == 0


async def test_echo_puts_the_prompt_first(client):
    r = await client.post(URL, json={"prompt": "red green", "echo": True})
    assert r.json()["choices"][0]["text"] == "red greenred green "


async def test_a_stream_is_text_chunks_then_the_finish_then_usage(client):
    r = await client.post(URL, json={"prompt": "red green blue", "stream": True,
                                     "stream_options": {"include_usage": True}})
    frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "red green blue "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "messages": []}, "messages"),
])
async def test_what_is_not_supported_is_refused_by_name(client, engine, body, param):
    assert error_of(await client.post(URL, json=body), 400)["param"] == param
    assert not engine.requests


def test_the_sdk_reads_plain_and_streamed_completions(live_url):
    with openai.OpenAI(base_url=f"{live_url}/v1", api_key="x", max_retries=0) as sdk:
        plain = sdk.completions.create(model="m", prompt="one two three", max_tokens=2)
        assert plain.choices[0].text == "one two " and plain.choices[0].finish_reason == "length"
        streamed = list(sdk.completions.create(model="m", prompt="one two three", stream=True))
        assert "".join(c.choices[0].text for c in streamed) == "one two three "
