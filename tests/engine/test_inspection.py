"""`Engine.inspect`: a session's cache, read on the engine thread between turns and mid-reply."""

import asyncio

import pytest

from server.engine import EngineNotReady, SessionNotFound
from tests.engine.conftest import ask, collect, greedy, until


def held(view) -> list[list[list[int]]]:
    return [[head.positions for head in heads] for heads in view.kept.heads]


async def test_a_view_names_the_conversation_tokens_each_head_holds_after_evictions(make_engine):
    engine = make_engine(policy="h2o", budget=16)
    first = await collect(await engine.submit(ask("tell me about caches", greedy(12), owner="ann")))
    second = await collect(await engine.submit(ask("and more", greedy(10), owner="ann", session_id=first.session_id)))
    view = await engine.inspect("ann", first.session_id, last=10_000)
    assert not view.live and view.session_id == first.session_id
    assert view.conversation_tokens == second.finish.usage.conversation_tokens > 3 * 16
    assert view.kept.length == second.finish.usage.kv_resident_tokens <= 16
    usages = [first.finish.usage, second.finish.usage]
    assert view.turns == [(u.conversation_tokens, u.kv_resident_tokens) for u in usages]
    # The byte tokenizer spells one character per token: the tokens are the text the cache consumed.
    session = engine.sessions.get("ann", first.session_id)
    assert view.first_position == 0 and "".join(view.tokens) == session.consumed_text
    seen = view.kept.seen
    assert seen == view.conversation_tokens - 1  # the last sampled token is pending
    for heads in held(view):
        for positions in heads:
            assert positions == sorted(set(positions)) and 0 <= positions[0] and positions[-1] == seen - 1
            assert positions[-view.kept.recent:] == list(range(seen - view.kept.recent, seen))

    tail = await engine.inspect("ann", first.session_id, last=5)
    assert tail.first_position == view.conversation_tokens - 5 and tail.tokens == view.tokens[-5:]


async def test_another_owners_session_and_an_unknown_one_are_both_not_found(make_engine):
    engine = make_engine(policy="h2o", budget=16)
    reply = await collect(await engine.submit(ask("hi", owner="ann")))
    for owner, session_id in [("bob", reply.session_id), ("ann", "no-such-session")]:
        with pytest.raises(SessionNotFound) as raised:
            await engine.inspect(owner, session_id, last=100)
        assert str(raised.value) == f"session {session_id!r} not found"


async def test_during_a_reply_the_view_is_live_and_grows(make_engine):
    engine = make_engine(policy="h2o", budget=16)
    handle = await engine.submit(ask("count", greedy(4000), owner="ann"))
    stream = handle.__aiter__()
    await stream.__anext__()
    first = await engine.inspect("ann", handle.session_id, last=100)
    later = first
    while later.conversation_tokens < first.conversation_tokens + 40:  # past a few evictions
        later = await engine.inspect("ann", handle.session_id, last=100)
        assert later.live
    assert first.live and first.kept.seen + 1 == first.conversation_tokens
    assert later.kept.length <= 16 and max(later.kept.heads[0][0].positions) == later.kept.seen - 1
    handle.cancel()
    await until(lambda: engine.stats().running == 0)
    after = await engine.inspect("ann", handle.session_id, last=100)
    assert not after.live and after.conversation_tokens >= later.conversation_tokens
    assert after.turns[-1] == (after.conversation_tokens, after.kept.length)


async def test_a_session_whose_request_has_not_started_shows_its_last_turn(make_engine):
    engine = make_engine(policy="h2o", budget=16, max_batch_size=1)
    mine = await collect(await engine.submit(ask("hello", greedy(6), owner="ann")))
    blocker = await engine.submit(ask("long", greedy(4000), owner="bob"))  # holds the only batch row
    waiting = await engine.submit(ask("more", greedy(4), owner="ann", session_id=mine.session_id))
    await asyncio.sleep(0.05)
    view = await engine.inspect("ann", mine.session_id, last=100)
    assert not view.live and view.conversation_tokens == mine.finish.usage.conversation_tokens
    blocker.cancel()
    await collect(waiting)


async def test_a_stopped_engine_is_not_ready_to_inspect(make_engine):
    engine = make_engine(policy="h2o", budget=16)
    reply = await collect(await engine.submit(ask("hi", owner="ann")))
    engine.stop()
    with pytest.raises(EngineNotReady):
        await engine.inspect("ann", reply.session_id, last=10)
