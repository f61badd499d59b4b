"""The official `openai` SDK as the client, against uvicorn on 127.0.0.1."""

import openai
import pytest

from tests.server.conftest import serving

MESSAGES = [{"role": "system", "content": "terse"}, {"role": "user", "content": "red green blue"}]


@pytest.fixture
def sdk(live_url):
    with openai.OpenAI(base_url=f"{live_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_plain_completion(sdk):
    completion = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16)
    assert completion.choices[0].message.content == "red green blue "
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.total_tokens == 7 and completion.usage.prompt_tokens_details.cached_tokens == 1
    assert completion.usage.model_extra == {"kv_resident_tokens": 7, "conversation_tokens": 7, "reread_tokens": 0}


def test_streaming_with_include_usage(sdk):
    chunks = list(sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "red green blue "
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_streaming_without_usage(sdk):
    chunks = list(sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"


def test_session_header_through_the_sdk(sdk):
    raw = sdk.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    session_id = raw.headers["x-session-id"]
    again = sdk.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "more"}], extra_headers={"X-Session-ID": session_id})
    assert again.headers["x-session-id"] == session_id


def test_errors_surface_as_sdk_exceptions(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="m", messages=MESSAGES, n=2)
    assert info.value.param == "n"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="m", messages=MESSAGES, extra_headers={"X-Session-ID": "gone"})


def test_api_key_through_the_sdk(engine):
    from server.app import create_app
    from server.settings import ServerSettings

    with serving(create_app(ServerSettings(api_key=["k1"]), engine)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0) as good:
            assert good.models.list().data[0].id
        with openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0) as bad, \
                pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.code == "invalid_api_key"
