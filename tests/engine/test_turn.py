from types import SimpleNamespace

import pytest

from h2o_cache import CacheConfig, SamplingParams
from server.engine.session import Session
from server.engine.turn import check_length, plan_turn
from server.engine.types import EngineConfig, PromptTooLong
from tests.engine.conftest import render

USER = {"role": "user", "content": "hi"}


def session_after_reply(tokenizer, reply: str) -> Session:
    """A session whose cache consumed the first turn and the reply, the reply's last token pending."""
    prompt = render([USER], True)
    ids = tokenizer.encode(prompt + reply)
    cache = SimpleNamespace(seen=[len(ids) - 1], pending=[[ids[-1]]])
    return Session("s", "", [USER, {"role": "assistant", "content": reply}], cache, prompt + reply)


def test_continuation_prefills_only_the_text_after_what_the_cache_consumed(byte_tokenizer):
    session = session_after_reply(byte_tokenizer, "hello")
    conversation = session.messages + [{"role": "user", "content": "more"}]
    turn = plan_turn(session, conversation, render, byte_tokenizer)
    full = byte_tokenizer.encode(render(conversation, True))
    consumed = len(byte_tokenizer.encode(session.consumed_text))
    assert turn.continues and turn.cached_tokens == consumed
    assert turn.prefill == full[consumed - 1:]  # the pending token, then the new text
    assert turn.prompt_tokens == len(full)


def test_history_that_diverges_from_the_cache_is_prefilled_afresh(byte_tokenizer):
    session = session_after_reply(byte_tokenizer, "hello STOP and more")
    trimmed = [USER, {"role": "assistant", "content": "hello "}, {"role": "user", "content": "more"}]
    turn = plan_turn(session, trimmed, render, byte_tokenizer)
    assert not turn.continues and turn.cached_tokens == 0
    assert turn.prefill == byte_tokenizer.encode(render(trimmed, True)) and turn.prompt_tokens == len(turn.prefill)


def test_a_session_without_cache_is_prefilled_afresh(byte_tokenizer):
    turn = plan_turn(Session("s", ""), [USER], render, byte_tokenizer)
    assert not turn.continues and turn.prefill == byte_tokenizer.encode(render([USER], True))


def test_prompt_too_long_counts_tokens_to_prefill(byte_tokenizer):
    session = session_after_reply(byte_tokenizer, "hello")
    turn = plan_turn(session, session.messages + [USER], render, byte_tokenizer)
    config = EngineConfig(max_prompt_tokens=len(turn.prefill))
    check_length(turn, SamplingParams(), CacheConfig(), config)
    with pytest.raises(PromptTooLong):
        check_length(turn, SamplingParams(), CacheConfig(), EngineConfig(max_prompt_tokens=len(turn.prefill) - 1))


def test_context_window_reserves_room_for_the_reply_only_without_eviction(byte_tokenizer):
    turn = plan_turn(Session("s", ""), [USER], render, byte_tokenizer)
    config = EngineConfig(context_window=turn.prompt_tokens + 10)
    check_length(turn, SamplingParams(max_new_tokens=10), CacheConfig(policy="full"), config)
    check_length(turn, SamplingParams(max_new_tokens=11), CacheConfig(policy="h2o"), config)
    with pytest.raises(PromptTooLong):
        check_length(turn, SamplingParams(max_new_tokens=11), CacheConfig(policy="full"), config)
