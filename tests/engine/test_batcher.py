"""The engine thread's loop: cancellation, failures confined to one request, sleeping when idle."""

import asyncio

import pytest

from server.engine import ChatRequest, EngineNotReady, GenerationFailed
from tests.engine.conftest import ask, collect, greedy, render, until

POISON = "|"  # a prompt holding it fails in prefill, see `fail_prefill_of_poisoned_prompts`


async def first_delta(handle):
    """Wait for the first token. Keep the returned stream: dropping it cancels the request."""
    stream = aiter(handle)
    return stream, await anext(stream)


def assert_consistent(engine, session_id):
    """A kept session's cache consumed exactly the text its messages render to."""
    session = engine.sessions._sessions[session_id]
    *history, reply = session.messages
    assert reply["role"] == "assistant"
    assert session.consumed_text == render(history, True) + reply["content"]
    cache = session.cache
    consumed = len(engine.tokenizer.encode(session.consumed_text))
    assert cache.seen[0] + len(cache.pending[0]) == consumed
    return consumed


async def test_cancel_frees_the_slot_and_keeps_the_session_continuable(make_engine):
    engine = make_engine(max_batch_size=1)
    handle = await engine.submit(ask("never ending", greedy(5000)))
    stream, _ = await first_delta(handle)
    handle.cancel()
    after = await asyncio.wait_for(collect(await engine.submit(ask("next", greedy(4)))), 30)
    assert len(after.token_ids) == 4
    assert engine.stats().requests_by_finish == {"cancelled": 1, "length": 1}
    consumed = assert_consistent(engine, handle.session_id)
    more = ChatRequest([{"role": "user", "content": "go on"}], greedy(3), session_id=handle.session_id)
    continued = await collect(await engine.submit(more))
    assert continued.finish.usage.cached_tokens == consumed > len(engine.tokenizer.encode(render([], True)))


async def test_cancel_while_waiting_gives_the_session_its_cache_back(make_engine):
    engine = make_engine(max_batch_size=1)
    first = await collect(await engine.submit(ask("hello there", greedy(6))))
    blocker = await engine.submit(ask("blocking", greedy(5000)))
    stream, _ = await first_delta(blocker)
    more = [{"role": "user", "content": "go on"}]
    queued = await engine.submit(ChatRequest(more, greedy(3), session_id=first.session_id))
    queued.cancel()
    await until(lambda: engine.stats().waiting == 0)
    assert engine.stats().running == 1  # the blocker kept its row: the queued request never started
    blocker.cancel()
    continued = await collect(await engine.submit(ChatRequest(more, greedy(3), session_id=first.session_id)))
    assert continued.finish.usage.cached_tokens == first.finish.usage.conversation_tokens


def fail_step(monkeypatch, engine, poisoned):
    """Make the model raise on any pass that feeds a row for which poisoned(cache, row, piece) holds."""
    step = engine.generator.step

    def failing_step(cache, pieces, ahead=None):
        if any(piece and poisoned(cache, row, piece) for row, piece in enumerate(pieces)):
            raise RuntimeError("injected failure")
        return step(cache, pieces, ahead)

    monkeypatch.setattr(engine.generator, "step", failing_step)


async def test_a_failed_prefill_fails_only_its_request(make_engine, monkeypatch):
    engine = make_engine()
    healthy = ask("hello there", greedy(12))
    alone = await collect(await engine.submit(healthy))
    poison = engine.tokenizer.encode(POISON)[0]
    fail_step(monkeypatch, engine, lambda cache, row, piece: len(piece) > 1 and poison in piece)
    handles = [await engine.submit(healthy), await engine.submit(ask(f"bad {POISON} prompt"))]
    together, failed = await asyncio.gather(*(collect(h) for h in handles), return_exceptions=True)
    assert isinstance(failed, GenerationFailed)
    assert together.token_ids == alone.token_ids
    assert engine.stats().requests_by_finish == {"length": 2, "error": 1}
    assert len((await collect(await engine.submit(ask("still alive", greedy(3))))).token_ids) == 3


async def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(make_engine, monkeypatch):
    engine = make_engine()  # prefill_chunk 16
    runner, events = engine.batcher.runner, []
    prefill, decode = runner.prefill, runner.decode

    def record_prefill(seqs, chunk):
        events.extend(("prefill", seq.request_id, len(seq.next_chunk(chunk))) for seq in seqs)
        return prefill(seqs, chunk)

    monkeypatch.setattr(runner, "prefill", record_prefill)
    monkeypatch.setattr(runner, "decode", lambda running: events.append(("decode", len(running))) or decode(running))
    running = await engine.submit(ask("never ending", greedy(5000)))
    stream, _ = await first_delta(running)
    long = await collect(await engine.submit(ask("a prompt of about a hundred tokens " * 3, greedy(4), request_id="long")))
    assert len(long.token_ids) == 4  # joined and finished while the first request kept running
    running.cancel()
    chunks = [i for i, event in enumerate(events) if event[:2] == ("prefill", "long")]
    assert len(chunks) == -(-long.finish.usage.prompt_tokens // 16) > 1
    assert all(events[i][2] <= 16 for i in chunks)
    assert all(events[i + 1] == ("decode", 1) for i in chunks[:-1])  # the batch advanced meanwhile
    assert ("decode", 2) in events[chunks[-1]:]  # then both decoded together


async def test_a_burst_of_requests_is_prefilled_together_within_the_token_budget(make_engine, monkeypatch):
    engine = make_engine(policy="h2o", budget=32, prefill_tokens=40)
    runner, passes = engine.batcher.runner, []
    prefill = runner.prefill

    def record_prefill(seqs, chunk):
        passes.append((len(seqs), sum(len(seq.next_chunk(chunk)) for seq in seqs)))
        return prefill(seqs, chunk)

    monkeypatch.setattr(runner, "prefill", record_prefill)
    requests = [ask(f"question {i}: " + "words " * 4, greedy(6)) for i in range(6)]
    together = await asyncio.gather(*[collect(await engine.submit(r)) for r in requests])
    alone = [await collect(await engine.submit(ask(r.messages[0]["content"], greedy(6)))) for r in requests]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(tokens <= 40 for _, tokens in passes)
    assert max(n for n, _ in passes) >= 2  # several prompts shared a pass
    prompt_tokens = sum(r.finish.usage.prompt_tokens for r in together)
    assert sum(tokens for _, tokens in passes[:len(passes) // 2]) >= prompt_tokens  # the burst went first


async def test_a_failed_decode_step_fails_only_the_row_that_raises(make_engine, monkeypatch):
    engine = make_engine()
    healthy = ask("hello there", greedy(20))
    alone = await collect(await engine.submit(healthy))
    long_prompt = ask("a long prompt whose row fails once it decodes", greedy(20))
    threshold = len(engine.tokenizer.encode(render(long_prompt.messages, True)))
    fail_step(monkeypatch, engine, lambda cache, row, piece: len(piece) == 1 and cache.seen[row] >= threshold)
    handles = [await engine.submit(healthy), await engine.submit(long_prompt)]
    together, failed = await asyncio.gather(*(collect(h) for h in handles), return_exceptions=True)
    assert isinstance(failed, GenerationFailed)
    assert together.token_ids == alone.token_ids
    assert engine.stats().running == 0


async def test_a_sequence_that_cannot_join_the_batch_fails_alone(make_engine, monkeypatch):
    engine = make_engine()
    healthy = ask("hello there", greedy(20))
    alone = await collect(await engine.submit(healthy))
    batch = engine.scheduler.batch
    extend = batch.extend
    joins = []

    def extend_failing_the_second(other, **kwargs):
        joins.append(1)
        if len(joins) == 2:
            raise RuntimeError("injected out of memory")
        extend(other, **kwargs)

    monkeypatch.setattr(batch, "extend", extend_failing_the_second)
    handles = [await engine.submit(healthy), await engine.submit(ask("another"))]
    together, failed = await asyncio.gather(*(collect(h) for h in handles), return_exceptions=True)
    assert isinstance(failed, GenerationFailed) and together.token_ids == alone.token_ids
    assert engine.stats().waiting == 0


async def test_the_loop_sleeps_when_idle(make_engine, monkeypatch):
    engine = make_engine()
    wakeups = []
    wait = engine.scheduler.wait_for_work
    monkeypatch.setattr(engine.scheduler, "wait_for_work", lambda **kw: wakeups.append(1) or wait(**kw))
    await collect(await engine.submit(ask("hi", greedy(3))))
    await asyncio.sleep(0.05)  # let the thread finish its last iteration and block
    before = len(wakeups)
    await asyncio.sleep(0.2)
    assert len(wakeups) == before


async def test_stop_fails_requests_in_flight_and_refuses_new_ones(make_engine):
    engine = make_engine()
    handle = await engine.submit(ask("never ending", greedy(5000)))
    stream, _ = await first_delta(handle)
    await asyncio.to_thread(engine.stop)
    with pytest.raises(GenerationFailed):
        async for _ in stream:
            pass
    with pytest.raises(EngineNotReady):
        await engine.submit(ask("hello"))


async def test_abort_fails_everything_in_flight_and_the_engine_keeps_serving(make_engine):
    engine = make_engine(max_batch_size=1)
    running = await engine.submit(ask("never ending", greedy(5000)))
    stream, _ = await first_delta(running)
    waiting = await engine.submit(ask("queued", greedy(5)))
    engine.abort("the server is shutting down")
    for handle in (stream, waiting):
        with pytest.raises(GenerationFailed, match="shutting down"):
            async for _ in handle:
                pass
    assert len((await collect(await engine.submit(ask("after", greedy(3))))).token_ids) == 3
