"""The engine end to end on the tiny model: batching, sessions, admission errors."""

import asyncio

import pytest

from server.engine import ChatRequest, PromptTooLong, QueueFull, SessionBusy, SessionNotFound
from tests.engine.conftest import ask, collect, greedy, until
from tests.engine.test_sessions import Clock

PROMPTS = ["hello there", "what is a cache?", "x", "tell me a long story about heavy hitters", "abc abc abc"]


async def test_concurrent_requests_all_complete_with_more_than_fit_in_a_batch(make_engine):
    engine = make_engine(max_batch_size=2)
    handles = [await engine.submit(ask(p, greedy(5 + i))) for i, p in enumerate(PROMPTS)]
    replies = await asyncio.gather(*(collect(h) for h in handles))
    assert [len(r.token_ids) for r in replies] == [5, 6, 7, 8, 9]
    assert all(r.finish.finish_reason == "length" for r in replies)
    assert len({r.session_id for r in replies}) == len(PROMPTS)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.active_sessions) == (0, 0, len(PROMPTS))
    assert stats.requests_by_finish == {"length": len(PROMPTS)} and stats.generated_tokens_total == 35


@pytest.mark.parametrize("policy,budget", [("full", 64), ("h2o", 24)])
async def test_batched_greedy_replies_equal_one_at_a_time(make_engine, policy, budget):
    engine = make_engine(policy=policy, budget=budget)
    requests = [ask(p, greedy(20 - 3 * i)) for i, p in enumerate(PROMPTS)]
    handles = [await engine.submit(r) for r in requests]
    batched = await asyncio.gather(*(collect(h) for h in handles))
    for request, together in zip(requests, batched):
        alone = await collect(await engine.submit(request))
        assert together.token_ids == alone.token_ids and together.text == alone.text


@pytest.mark.parametrize("policy", ["full", "h2o"])  # h2o's budget (256) is never reached here
async def test_resent_history_prefills_only_the_new_turn_and_matches_a_fresh_prefill(make_engine, policy):
    engine = make_engine(policy=policy, budget=256)
    first = await collect(await engine.submit(ask("hello there", greedy(12))))
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.text},
               {"role": "user", "content": "and then?"}]
    continued = await collect(await engine.submit(ChatRequest(history, greedy(12))))
    fresh = await collect(await engine.submit(ChatRequest(history, greedy(12), owner="someone else")))
    assert continued.session_id == first.session_id != fresh.session_id
    assert continued.finish.usage.cached_tokens == first.finish.usage.conversation_tokens > 0
    assert fresh.finish.usage.cached_tokens == 0
    assert continued.finish.usage.prompt_tokens == fresh.finish.usage.prompt_tokens
    assert continued.token_ids == fresh.token_ids


async def test_session_id_continues_with_only_the_new_messages(make_engine):
    engine = make_engine(policy="full")
    first = await collect(await engine.submit(ask("hello there", greedy(10))))
    more = {"role": "user", "content": "and then?"}
    continued = await collect(await engine.submit(ChatRequest([more], greedy(10), session_id=first.session_id)))
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.text}, more]
    fresh = await collect(await engine.submit(ChatRequest(history, greedy(10), owner="someone else")))
    assert continued.session_id == first.session_id
    assert continued.finish.usage.cached_tokens == first.finish.usage.conversation_tokens
    assert continued.token_ids == fresh.token_ids


async def test_eviction_keeps_the_cache_within_budget_across_turns(make_engine):
    engine = make_engine(policy="h2o", budget=24)
    reply = await collect(await engine.submit(ask("a fairly long first message to overflow the budget", greedy(20))))
    usage = reply.finish.usage
    assert usage.kv_resident_tokens <= 24 < usage.conversation_tokens
    more = await collect(await engine.submit(ChatRequest([{"role": "user", "content": "go on"}], greedy(5),
                                                         session_id=reply.session_id)))
    assert more.finish.usage.cached_tokens == usage.conversation_tokens
    assert more.finish.usage.kv_resident_tokens <= 24
    assert engine.stats().resident_kv_tokens == more.finish.usage.kv_resident_tokens


async def test_a_reply_cut_by_a_stop_string_continues_with_a_fresh_prefill(make_engine):
    engine = make_engine(policy="full")
    free = await collect(await engine.submit(ask("hello there", greedy(12))))
    stop = free.text[4:6]
    cut = await collect(await engine.submit(ask("hello there", greedy(12, stop=(stop,)))))
    assert cut.finish.finish_reason == "stop" and cut.text == free.text[:free.text.index(stop)]
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": cut.text},
               {"role": "user", "content": "more"}]
    again = await collect(await engine.submit(ChatRequest(history, greedy(4))))
    assert again.session_id == cut.session_id and again.finish.usage.cached_tokens == 0


async def test_another_owner_cannot_use_a_session(make_engine):
    engine = make_engine()
    mine = await collect(await engine.submit(ask("secret", owner="alice")))
    with pytest.raises(SessionNotFound):
        await engine.submit(ask("let me in", owner="mallory", session_id=mine.session_id))
    with pytest.raises(SessionNotFound):
        await engine.submit(ask("let me in", owner="alice", session_id="made-up"))


async def test_a_session_generating_a_reply_is_busy(make_engine):
    engine = make_engine()
    handle = await engine.submit(ask("hello", greedy(2000)))
    with pytest.raises(SessionBusy):
        await engine.submit(ask("again", session_id=handle.session_id))
    handle.cancel()


async def test_queue_full_beyond_max_queue_then_room_again(make_engine):
    engine = make_engine(max_batch_size=1, max_queue=2)
    handles = [await engine.submit(ask(p, greedy(2000))) for p in PROMPTS[:2]]
    with pytest.raises(QueueFull):
        await engine.submit(ask("one too many"))
    for handle in handles:
        handle.cancel()
    await until(lambda: engine.stats().waiting + engine.stats().running == 0)
    reply = await asyncio.wait_for(collect(await engine.submit(ask("now", greedy(3)))), 30)
    assert len(reply.token_ids) == 3


async def test_prompt_too_long(make_engine):
    engine = make_engine(max_prompt_tokens=20)
    with pytest.raises(PromptTooLong):
        await engine.submit(ask("a message that renders to more than twenty tokens"))
    short = await collect(await engine.submit(ask("hi", greedy(3))))
    assert short.finish.usage.prompt_tokens <= 20
    assert engine.stats().active_sessions == 1


async def test_context_window_reserves_room_for_the_reply(make_engine):
    engine = make_engine(policy="full", context_window=40)
    with pytest.raises(PromptTooLong):
        await engine.submit(ask("hi", greedy(40)))
    reply = await collect(await engine.submit(ask("hi", greedy(20))))
    assert reply.finish.usage.conversation_tokens <= 40


async def test_an_expired_session_is_gone_but_its_history_can_be_resent(make_engine):
    clock = Clock()
    engine = make_engine(policy="full", clock=clock, session_ttl=60)
    first = await collect(await engine.submit(ask("hello there", greedy(6))))
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.text},
               {"role": "user", "content": "more"}]
    clock.now = 61
    with pytest.raises(SessionNotFound):
        await engine.submit(ChatRequest(history[2:], greedy(6), session_id=first.session_id))
    resent = await collect(await engine.submit(ChatRequest(history, greedy(6))))
    assert resent.session_id != first.session_id and resent.finish.usage.cached_tokens == 0
    assert engine.stats().active_sessions == 1


async def test_idle_sessions_expire_on_a_timer_without_any_request(make_engine):
    clock = Clock()
    engine = make_engine(policy="full", clock=clock, session_ttl=0.4)  # the timer checks every 0.1 s
    await collect(await engine.submit(ask("hello there", greedy(3))))
    await asyncio.sleep(0.3)
    assert len(engine.sessions) == 1  # the clock has not moved: not expired
    clock.now = 1.0
    await until(lambda: len(engine.sessions) == 0, timeout=5)


async def test_least_recently_used_sessions_go_beyond_max_sessions(make_engine):
    engine = make_engine(max_sessions=2)
    old, kept, new = [await collect(await engine.submit(ask(p, greedy(2)))) for p in PROMPTS[:3]]
    with pytest.raises(SessionNotFound):
        await engine.submit(ask("more", session_id=old.session_id))
    assert (await collect(await engine.submit(ask("more", greedy(2), session_id=kept.session_id)))).session_id == kept.session_id
    assert engine.stats().active_sessions == 2


async def test_a_stop_token_ends_the_reply_without_streaming_it(make_engine):
    engine = make_engine()
    free = await collect(await engine.submit(ask("hello there", greedy(12))))
    stop = free.token_ids[5]
    cut = await collect(await engine.submit(ask("hello there", greedy(12, stop_token_ids=(stop,)))))
    first = free.token_ids.index(stop)
    assert cut.finish.finish_reason == "stop" and cut.token_ids == free.token_ids[:first]
    assert cut.finish.usage.completion_tokens == first + 1


async def test_logprobs_come_with_each_token(make_engine):
    engine = make_engine()
    handle = await engine.submit(ask("hello", greedy(4, logprobs=2)))
    deltas = [item async for item in handle][:-1]
    samples = [s for d in deltas for s in d.logprobs]
    assert [s.token for s in samples] == [t for d in deltas for t in d.token_ids]
    assert all(len(s.top_logprobs) == 2 and s.top_logprobs[0][0] == s.token for s in samples)
