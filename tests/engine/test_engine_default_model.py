"""The engine on the real default model and its ChatML template."""

import asyncio

import pytest

from h2o_cache import CacheConfig, SamplingParams
from server.engine import ChatRequest, Engine, EngineConfig
from tests.engine.conftest import collect

pytestmark = pytest.mark.model

QUESTION = {"role": "user", "content": "Name three colours. Answer in one line."}
FOLLOW_UP = {"role": "user", "content": "Now name one more."}


@pytest.fixture
def engine(default_model):
    model, tokenizer = default_model
    engine = Engine(model, tokenizer, CacheConfig(policy="full", prefill_chunk=64), EngineConfig())
    engine.start()
    yield engine
    engine.stop()


def test_chatml_renders_are_prefix_stable(default_model):
    _, tokenizer = default_model
    first = tokenizer.apply_chat_template([QUESTION], add_generation_prompt=True, tokenize=False)
    reply = "Red, green and blue."
    longer = tokenizer.apply_chat_template(
        [QUESTION, {"role": "assistant", "content": reply}, FOLLOW_UP], add_generation_prompt=True, tokenize=False)
    assert longer.startswith(first + reply + tokenizer.eos_token)


@pytest.mark.parametrize("max_tokens", [24, 5])  # ends at <|im_end|>, or cut by length
async def test_echoed_reply_continues_the_session_and_matches_a_fresh_prefill(engine, max_tokens):
    params = SamplingParams(max_new_tokens=max_tokens)
    first = await collect(await engine.submit(ChatRequest([QUESTION], params)))
    assert first.finish.finish_reason == ("stop" if max_tokens == 24 else "length")
    history = [QUESTION, {"role": "assistant", "content": first.text}, FOLLOW_UP]
    follow = SamplingParams(max_new_tokens=12)
    continued, fresh = await asyncio.gather(
        collect(await engine.submit(ChatRequest(history, follow))),
        collect(await engine.submit(ChatRequest(history, follow, owner="other"))),
    )
    assert continued.session_id == first.session_id
    assert continued.finish.usage.cached_tokens == first.finish.usage.conversation_tokens > 0
    assert fresh.finish.usage.cached_tokens == 0
    assert continued.finish.usage.prompt_tokens == fresh.finish.usage.prompt_tokens
    assert continued.text == fresh.text
