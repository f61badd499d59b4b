"""Recall through the engine: a conversation's windows are chosen exactly as `Generator.generate` chooses
them, on the fast path and the transformers path alike, batched rows recall independently, and a failed
choice fails only its own request."""

import asyncio
import threading
from array import array
from contextlib import asynccontextmanager

import pytest

from h2o_cache import Generator, recall, reread
from server.engine import GenerationFailed
from server.engine.sequence import Sequence
from tests.engine.conftest import ask, collect, greedy

# A probe longer than a prefill chunk (16) is fed in two chunks after the recall; the third turn
# (about 22 tokens) is all probe. No re-reads (`h2o_cache.reread`) but where a test turns them on.
RECALL = dict(recall_budget=16, recall_block=4, recall_probe=24, recall_archive=512, recall_reread=0)
# the look through the windows: the tiny model's attention is too flat for a dense look to find a
# position drawn twice as much as at its first step (`h2o_cache.reread`), so it re-reads nothing
REREAD = {**RECALL, "recall_reread": 12, "recall_reread_look": 4, "recall_reread_dense": 0}
DOCUMENT = " ".join(["a long pasted document about caches and budgets"] * 4)
TURNS = ["tell me everything about caches and budgets", "and more", "ok"]


def recall_engine(make_engine, **config):
    return make_engine(policy="h2o", budget=32, cache=RECALL, **config)


def row_state(cache) -> tuple:
    """What a turn leaves in a 1-row cache: the tokens each head holds, the window's size, the archive
    length, the tokens fed and the pending one, the tokens copied into the window so far."""
    n = cache.lengths[0]
    archive = cache.archives[0]
    return (cache.buffers().origins[:, 0, :, :n].tolist(), cache.recalled[0], len(archive) if archive else 0,
            cache.seen[0], cache.pending[0], cache.recall_count[0])


@asynccontextmanager
async def together(engine):
    """Hold the engine thread while requests are submitted, so that their prefills run in the same passes."""
    gate = threading.Event()
    engine.scheduler.call(gate.wait)
    try:
        yield
    finally:
        gate.set()


async def talk(engine, turns, owner=""):
    """Turn after turn in one session; returns the replies and the session's state after each."""
    replies, states, session_id = [], [], None
    for text in turns:
        reply = await collect(await engine.submit(ask(text, greedy(20), owner=owner, session_id=session_id)))
        session_id = reply.session_id
        session = engine.sessions.get(owner, session_id)
        replies.append(reply)
        states.append((row_state(session.cache), array("i", session.token_ids)))
    return replies, states


@pytest.mark.parametrize("eager", [True, False])
async def test_a_session_recalls_exactly_as_generate_does_and_the_stats_count_it(make_engine, eager):
    engine = recall_engine(make_engine, enforce_eager=eager)
    replies, states = await talk(engine, TURNS)
    assert all(r.finish.usage.cached_tokens for r in replies[1:])  # every later turn continues the cache
    assert any(state[1] for state, _ in states[1:])  # some turn recalled

    stats = engine.stats()
    session = engine.sessions.get("", replies[0].session_id)
    spec = session.cache.spec
    counts = [0] + [state[5] for state, _ in states]
    recalled = [(after - before) // (spec.num_layers * spec.num_kv_heads) for before, after in zip(counts, counts[1:])]
    assert stats.recalled_tokens_total == sum(recalled) > 0 and stats.recall_turns_total == sum(map(bool, recalled))
    assert stats.archived_kv_tokens == states[-1][0][2] > 0
    assert stats.archived_kv_bytes == session.cache.archived_bytes() > 0

    assert_as_generate(engine, replies, states)


async def test_a_long_first_turn_recalls_what_its_own_beginning_evicted(make_engine):
    engine = recall_engine(make_engine)
    replies, states = await talk(engine, [" ".join(["a long first question about caches and budgets"] * 4)])
    assert states[0][0][1] > 0 and engine.stats().recall_turns_total == 1
    assert_as_generate(engine, replies, states)


async def test_a_long_turn_s_archive_makes_room_for_its_prompt_at_once(make_engine, monkeypatch):
    """The runner tells a row's archive what the rest of its prompt may evict (`H2OCache.expect`): a long
    turn's archive is allocated about once, not at every half again it grows, and holds what `generate`'s does."""
    from h2o_cache.archive import Archive

    grown = []
    original = Archive._reallocate
    monkeypatch.setattr(Archive, "_reallocate", lambda self, capacity: grown.append(capacity) or original(self, capacity))
    engine = recall_engine(make_engine)
    replies, states = await talk(engine, [" ".join(["a long first question about caches and budgets"] * 12)])
    archived = states[0][0][2]
    assert archived > 200 and len(grown) <= 2 and grown[-1] >= archived
    assert_as_generate(engine, replies, states)


def assert_as_generate(engine, replies, states) -> None:
    """`Generator.generate`, fed each turn's prompt tokens, gives the same replies and cache states."""
    generator = Generator(engine.generator.model, engine.tokenizer, engine.cache_config)
    cache = generator.new_cache(1)
    consumed = 0
    for reply, (state, token_ids) in zip(replies, states):
        new = list(token_ids[consumed:len(token_ids) - len(reply.token_ids)])  # the turn's prompt tokens
        [completion] = generator.generate([new], greedy(20), cache)
        assert completion.token_ids == reply.token_ids
        assert row_state(cache) == state
        consumed = len(token_ids)


async def test_sessions_prefilled_together_recall_as_they_do_alone(make_engine):
    """Two turns prefilled in the same passes reach their probes at different chunks; each recalls as alone."""
    engine = recall_engine(make_engine)
    owners = ["ann", "bob"]
    firsts = [await collect(await engine.submit(ask(text, greedy(20), owner=owner)))
              for owner, text in zip(owners, ["a long first question about caches and budgets", TURNS[0]])]
    requests = [ask(text, greedy(20), owner=owner, session_id=first.session_id)
                for owner, text, first in zip(owners, ["short", "a longer second question, with more words"], firsts)]
    async with together(engine):
        handles = [await engine.submit(r) for r in requests]
    batched = await asyncio.gather(*(collect(h) for h in handles))
    batched_states = [row_state(engine.sessions.get(o, r.session_id).cache) for o, r in zip(owners, batched)]
    assert any(state[1] for state in batched_states)

    alone = recall_engine(make_engine)
    for owner, text, request, reply, state in zip(owners, ["a long first question about caches and budgets", TURNS[0]],
                                                  requests, batched, batched_states):
        first = await collect(await alone.submit(ask(text, greedy(20), owner=owner)))
        request.session_id = first.session_id
        again = await collect(await alone.submit(request))
        assert again.token_ids == reply.token_ids
        assert row_state(alone.sessions.get(owner, first.session_id).cache) == state


async def test_a_failed_recall_fails_only_its_own_request(make_engine, monkeypatch):
    engine = recall_engine(make_engine)
    good, bad = "a question is fine", "a question to FAIL"  # one length: their probes are due together
    firsts = [await collect(await engine.submit(ask(TURNS[0], greedy(20), owner=o))) for o in ("ann", "bob")]
    bobs = engine.sessions.get("bob", firsts[1].session_id).cache.archives[0]
    assert bobs is not None  # the first turn evicted: the next one chooses windows
    choose_rows = recall.choose_rows  # every choice goes through it, one row or several

    def failing_choose(cache, asked, *args, **kwargs):
        if any(cache.archives[row] is bobs for row, _ in asked):
            raise RuntimeError("injected recall failure")
        return choose_rows(cache, asked, *args, **kwargs)

    expected = recall_engine(make_engine)
    control = await collect(await expected.submit(ask(TURNS[0], greedy(20), owner="ann")))
    control = await collect(await expected.submit(ask(good, greedy(20), owner="ann", session_id=control.session_id)))

    monkeypatch.setattr(recall, "choose_rows", failing_choose)
    async with together(engine):
        handles = [await engine.submit(ask(text, greedy(20), owner=o, session_id=f.session_id))
                   for text, o, f in zip((good, bad), ("ann", "bob"), firsts)]
    fine, failed = await asyncio.gather(*(collect(h) for h in handles), return_exceptions=True)
    assert isinstance(failed, GenerationFailed) and "injected recall failure" in str(failed)
    assert fine.token_ids == control.token_ids
    assert engine.sessions.get("bob", firsts[1].session_id).cache is None  # forgotten: the next turn prefills


async def test_a_question_set_apart_from_its_document_probes_alone_as_generate_does(make_engine):
    """With `recall_probe_break` the engine's probe starts after the turn's last blank line, as the library's."""
    engine = make_engine(policy="h2o", budget=32, cache={**RECALL, "recall_probe_break": True})
    document = " ".join(["a long pasted document about caches and budgets"] * 4)
    replies, states = await talk(engine, [f"{document}\n\nwhy?"])
    assert states[0][0][1] > 0  # the window holds recalled tokens
    tokens = list(states[0][1][:len(states[0][1]) - len(replies[0].token_ids)])
    start = engine.generator.probe_start(tokens, engine.cache_config)
    assert len(tokens) - RECALL["recall_probe"] < start < len(tokens) - 12  # the question and the template alone
    assert bytes(t - 3 for t in tokens[start:]).startswith(b"why?")
    assert_as_generate(engine, replies, states)


@pytest.mark.parametrize("eager", [True, False])
async def test_a_long_turn_is_re_read_as_generate_re_reads_it_and_counted_apart(make_engine, monkeypatch, eager):
    """The re-read passages go into the session's tokens where they were fed, as `Generator.generate` feeds
    them; the prompt's token counts leave them out, the conversation's count holds them."""
    engine = make_engine(policy="h2o", budget=32, cache=REREAD, enforce_eager=eager)
    inserted = []
    insert = Sequence.insert

    def spy(seq, tokens, inside=0):
        inserted.append((len(seq.history) + seq.tail_at + inside, list(tokens)))
        insert(seq, tokens, inside)

    monkeypatch.setattr(Sequence, "insert", spy)
    replies, states = await talk(engine, [f"{DOCUMENT} what is it about?", "and then?"])
    first, second = replies
    [(at, again)] = inserted  # the short second turn is not re-read
    assert first.finish.usage.reread_tokens == len(again) > 0 and second.finish.usage.reread_tokens == 0
    token_ids = states[0][1]
    assert list(token_ids[at:at + len(again)]) == again
    end = engine.generator.turn_end()  # the template's "\n<assistant>": the excerpt follows the question
    assert end and list(token_ids[at + len(again):at + len(again) + len(end)]) == end
    assert bytes(t - 3 for t in token_ids[at - len("what is it about?"):at]) == b"what is it about?"
    prompt = list(token_ids[:at]) + list(token_ids[at + len(again):len(token_ids) - len(first.token_ids)])
    assert first.finish.usage.prompt_tokens == len(prompt)  # what the client sent, not the re-read
    assert second.finish.usage.cached_tokens == len(prompt) + len(first.token_ids)
    assert second.finish.usage.prompt_tokens == len(states[1][1]) - len(again) - len(second.token_ids)
    assert second.finish.usage.conversation_tokens == len(states[1][1])  # every token fed, the re-read too
    generator = Generator(engine.generator.model, engine.tokenizer, engine.cache_config, turn_end=end)
    cache = generator.new_cache(1)
    [completion] = generator.generate([prompt], greedy(20), cache)
    assert completion.token_ids == first.token_ids and row_state(cache) == states[0][0]


@pytest.mark.parametrize("dense", [True, False], ids=["dense look", "windowed look"])
async def test_a_failed_re_read_is_skipped_and_the_turn_goes_on_without_it(make_engine, monkeypatch, dense):
    engine = make_engine(policy="h2o", budget=32, cache={**REREAD, "recall_reread_dense": 8192 if dense else 0})
    plain = make_engine(policy="h2o", budget=32, cache=RECALL)
    expected, _ = await talk(plain, [f"{DOCUMENT} what is it about?"])
    name = "dense_row" if dense else "held_counts"
    original = getattr(reread, name)
    calls = []

    def failing(*args):  # the windowed look's second step fails, its row in the look's decoder
        calls.append(args)
        if len(calls) == (1 if dense else 3):
            raise RuntimeError("injected re-read failure")
        return original(*args)

    monkeypatch.setattr(reread, name, failing)
    replies, states = await talk(engine, [f"{DOCUMENT} what is it about?"])
    assert len(calls) == (1 if dense else 3)
    assert replies[0].finish.usage.reread_tokens == 0 and replies[0].token_ids == expected[0].token_ids
    if not dense:
        assert engine.runner.looker().cache.batch_size == 0
    monkeypatch.setattr(reread, name, original)
    again, _ = await talk(engine, [f"{DOCUMENT} what is it about?"])  # a new session: re-read again
    assert again[0].finish.usage.reread_tokens > 0 or dense  # (a dense look finds nothing here: see REREAD)
