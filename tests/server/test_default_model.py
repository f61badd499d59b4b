"""The server on the real default model (SmolLM2-135M-Instruct, its own chat template), via the openai SDK."""

import json

import openai
import pytest
from pydantic import BaseModel, Field

from h2o_cache import CacheConfig
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.settings import ServerSettings
from tests.server.conftest import serving

pytestmark = pytest.mark.model
BUDGET = 24


@pytest.fixture(scope="module")
def sdk(default_model):
    model, tokenizer = default_model
    engine = Engine(model, tokenizer, CacheConfig(policy="h2o", budget=BUDGET),
                    EngineConfig(context_window=model.config.max_position_embeddings))
    engine.start()
    try:
        with serving(create_app(ServerSettings(), engine)) as url, \
                openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            yield client
    finally:
        engine.stop()


def test_resent_history_is_served_from_the_session_cache(sdk):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    first = sdk.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    reply = first.choices[0].message.content
    assert reply.strip() and first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one."}]
    second = sdk.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.model_extra["conversation_tokens"] - 1
    assert second.usage.model_extra["kv_resident_tokens"] <= BUDGET < second.usage.model_extra["conversation_tokens"]


def test_streamed_turns_continue_by_session_header(sdk):
    raw = sdk.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True})
    session_id = raw.headers["x-session-id"]
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    first_usage = chunks[-1].usage
    more = list(sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Again."}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-ID": session_id}))
    assert more[-1].usage.prompt_tokens_details.cached_tokens == first_usage.model_extra["conversation_tokens"]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_parse_fills_a_pydantic_model(sdk):
    completion = sdk.beta.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Name the capital of France and its country."}],
        response_format=City, max_tokens=40, temperature=0)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_a_tool_loop_on_the_real_template_continues_its_session(sdk):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # one call: with parallel calls allowed, this small model writes the same call again and again
    first = sdk.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=48, temperature=0)
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = sdk.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=16, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.model_extra["conversation_tokens"] > 0
