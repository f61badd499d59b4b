"""Sessions that outlive the engine: snapshot restarts continue token for token with no prefill,
crashes resume from the transcript, foreign snapshots are refused, transcripts commit before a
reply is seen to end."""

import sqlite3
import time

import pytest

from server.engine import ChatRequest, Finish, SessionNotFound
from server.engine.persistence import Persistence
from server.engine.conversation import conversation_keys
from server.engine.session import Session
from server.engine.statedb import StateDB
from tests.engine.conftest import ask, collect, greedy
from tests.engine.test_recall import DOCUMENT, RECALL, REREAD

TURNS = ["hello there", "what is a cache?", "tell me about heavy hitters", "and rolling?"]


async def talk(engine, turns, session_id=None):
    """One conversation, turn after turn by session id; returns the session id and every reply."""
    replies = []
    for text in turns:
        reply = await collect(await engine.submit(ask(text, greedy(10), session_id=session_id)))
        session_id = reply.session_id
        replies.append(reply)
    return session_id, replies


def restarted(make_engine, state_dir, **kwargs):
    return make_engine(policy="h2o", budget=24, state_dir=str(state_dir), **kwargs)


async def stopped_before_the_last_turn(make_engine, state_dir, **kwargs):
    """An engine that had all turns but the last and stopped gracefully, the engine started after it
    on the same state dir, and the session's id: (first, second, session_id)."""
    first = restarted(make_engine, state_dir, **kwargs)
    session_id, _ = await talk(first, TURNS[:-1])
    first.stop()
    return first, restarted(make_engine, state_dir, **kwargs), session_id


async def test_a_graceful_restart_resumes_from_the_snapshot_with_the_same_tokens_and_no_prefill(make_engine, tmp_path):
    control = make_engine(policy="h2o", budget=24)
    _, expected = await talk(control, TURNS)

    first, second, session_id = await stopped_before_the_last_turn(make_engine, tmp_path)
    assert first.sessions.idle()[0].cache.lengths[0] < first.sessions.idle()[0].cache.seen[0]  # it evicted
    _, [got] = await talk(second, TURNS[-1:], session_id)

    assert got.token_ids == expected[-1].token_ids and got.session_id == session_id
    assert got.finish.usage == expected[-1].finish.usage  # cached_tokens: the whole history, as never stopped
    state = second.stats().state
    assert state.restored == {"snapshot": 1, "transcript": 0} and state.snapshots_refused == 0


async def test_a_restored_session_shows_the_inspector_the_same_cache_and_tokens(make_engine, tmp_path):
    control = make_engine(policy="h2o", budget=24)
    control_id, _ = await talk(control, TURNS)
    _, second, session_id = await stopped_before_the_last_turn(make_engine, tmp_path)
    await talk(second, TURNS[-1:], session_id)

    got, expected = await second.inspect("", session_id, 10_000), await control.inspect("", control_id, 10_000)
    assert got.tokens == expected.tokens and got.turns == expected.turns
    assert got.kept.heads == expected.kept.heads and got.kept.seen == expected.kept.seen


async def test_a_session_with_an_archive_resumes_from_its_snapshot_and_recalls_as_if_never_stopped(make_engine,
                                                                                                     tmp_path):
    control = make_engine(policy="h2o", budget=24, cache=RECALL)
    control_id, expected = await talk(control, TURNS)

    first, second, session_id = await stopped_before_the_last_turn(make_engine, tmp_path, cache=RECALL)
    archive = first.sessions.idle()[0].cache.archives[0]
    assert len(archive) > 0
    archived = sum(t.numel() * t.element_size() for t in archive.state().values())
    assert second.stats().state.snapshot_bytes > archived  # the archive is in the snapshot, and counted
    _, [got] = await talk(second, TURNS[-1:], session_id)

    assert got.token_ids == expected[-1].token_ids and got.finish.usage == expected[-1].finish.usage
    assert second.stats().state.restored == {"snapshot": 1, "transcript": 0}
    view, control_view = await second.inspect("", session_id, 10), await control.inspect("", control_id, 10)
    assert view.kept == control_view.kept and view.kept.recalled > 0 and view.kept.archived > 0


async def test_a_session_with_a_re_read_resumes_from_its_snapshot_counting_its_prompt_as_never_stopped(make_engine,
                                                                                                        tmp_path):
    turns = [f"{DOCUMENT} what is it about?", "and rolling?"]
    control = make_engine(policy="h2o", budget=24, cache=REREAD)
    _, expected = await talk(control, turns)
    assert expected[0].finish.usage.reread_tokens > 0

    first = restarted(make_engine, tmp_path, cache=REREAD)
    session_id, _ = await talk(first, turns[:1])
    first.stop()
    second = restarted(make_engine, tmp_path, cache=REREAD)
    _, [got] = await talk(second, turns[1:], session_id)
    assert got.token_ids == expected[1].token_ids
    assert got.finish.usage == expected[1].finish.usage  # cached_tokens leave the re-read out after a restart too
    assert second.stats().state.restored == {"snapshot": 1, "transcript": 0}


async def test_after_a_crash_a_session_resumes_from_its_transcript(make_engine, tmp_path):
    first = restarted(make_engine, tmp_path)
    session_id, replies = await talk(first, TURNS[:2])
    first.batcher.stop()  # no graceful stop: no snapshot
    second = restarted(make_engine, tmp_path)

    _, [by_id] = await talk(second, TURNS[2:3], session_id)
    assert by_id.session_id == session_id and by_id.finish.usage.cached_tokens == 0  # prefilled again
    session = second.sessions._sessions[session_id]
    assert [m["content"] for m in session.messages[:4]] == [TURNS[0], replies[0].text, TURNS[1], replies[1].text]
    assert second.stats().state.restored == {"snapshot": 0, "transcript": 1}

    third = restarted(make_engine, tmp_path)  # a re-sent history finds it too
    history = [{"role": m["role"], "content": m["content"]} for m in session.messages]
    resent = await collect(await third.submit(ChatRequest(history + [{"role": "user", "content": "more"}], greedy(4))))
    assert resent.session_id == session_id


async def test_a_snapshot_for_another_cache_config_is_refused_and_the_transcript_serves(make_engine, tmp_path):
    first = restarted(make_engine, tmp_path)
    session_id, _ = await talk(first, TURNS[:2])
    first.stop()
    other = make_engine(policy="h2o", budget=32, state_dir=str(tmp_path))
    _, [reply] = await talk(other, TURNS[2:3], session_id)
    assert reply.finish.usage.cached_tokens == 0
    state = other.stats().state
    assert state.snapshots_refused == 1 and state.restored == {"snapshot": 0, "transcript": 1}
    assert state.snapshot_bytes == 0  # the refused snapshot is gone: it never fits this server


async def test_the_transcript_is_committed_before_the_reply_is_seen_to_end(make_engine, tmp_path, monkeypatch):
    save = StateDB.save

    def slow_save(self, transcript):
        time.sleep(0.3)  # a slow disk: the finish must still wait for the commit
        save(self, transcript)

    monkeypatch.setattr(StateDB, "save", slow_save)
    engine = restarted(make_engine, tmp_path)
    handle = await engine.submit(ask("hello there", greedy(6)))
    text = ""
    async for item in handle:
        if isinstance(item, Finish):
            with sqlite3.connect(tmp_path / "state.db") as db:
                row = db.execute("SELECT messages FROM sessions WHERE id = ?", (handle.session_id,)).fetchone()
            assert row is not None and text and text in row[0]
        else:
            text += item.text


async def test_an_unknown_or_foreign_session_id_is_still_not_found(make_engine, tmp_path):
    first = restarted(make_engine, tmp_path)
    session_id, _ = await talk(first, TURNS[:1])
    second = restarted(make_engine, tmp_path)
    with pytest.raises(SessionNotFound):
        await second.submit(ask("hi", session_id="no-such-session"))
    with pytest.raises(SessionNotFound):
        await second.submit(ask("hi", session_id=session_id, owner="someone else"))


def test_a_session_past_its_ttl_on_disk_is_not_recalled(tmp_path):
    now = [1000.0]
    persistence = Persistence(str(tmp_path), "id", lambda: None, ttl=60, max_sessions=10, max_bytes=1 << 20,
                              clock=lambda: now[0])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    session = Session(id="s1", owner="o", messages=messages, key=conversation_keys("o", messages)[-1])
    persistence.save_turn(session).result()
    assert persistence.recall("o", [], "s1").messages == messages
    assert persistence.recall("o", messages + [{"role": "user", "content": "and?"}], None).id == "s1"
    now[0] += 61
    assert persistence.recall("o", [], "s1") is None
    persistence.close([])
