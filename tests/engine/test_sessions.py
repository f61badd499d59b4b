import pytest
import torch

from server.engine.conversation import conversation_keys
from server.engine.sessions import SessionStore
from server.engine.types import SessionBusy, SessionNotFound


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def finished_turn(store, owner, messages, reply="ok", session_id=None):
    """Claim, then release with the reply appended, as the engine does after a turn."""
    session, conversation = store.claim(owner, messages, session_id)
    store.release(session, conversation + [assistant(reply)])
    return session


def test_keys_chain_prefixes_and_separate_owners():
    messages = [user("a"), assistant("b"), user("c")]
    keys = conversation_keys("alice", messages)
    assert keys[:2] == conversation_keys("alice", messages[:2])
    assert len(set(keys)) == 3
    assert conversation_keys("bob", messages) != keys
    assert conversation_keys("alice", [user("ab")])[-1] != conversation_keys("alice", [user("a"), user("b")])[-1]


def test_resent_history_finds_the_session_whose_messages_are_a_strict_prefix():
    store = SessionStore(max_sessions=8, ttl=60)
    first = finished_turn(store, "alice", [user("hi")])
    history = [user("hi"), assistant("ok"), user("more")]
    session, conversation = store.claim("alice", history, None)
    assert session is first and session.busy and conversation == history


def test_identical_history_or_other_owner_starts_a_new_session():
    store = SessionStore(max_sessions=8, ttl=60)
    first = finished_turn(store, "alice", [user("hi")])
    same, _ = store.claim("alice", [user("hi"), assistant("ok")], None)  # not a strict prefix
    other, _ = store.claim("bob", [user("hi"), assistant("ok"), user("more")], None)
    assert same is not first and other is not first and same.id != other.id


def test_busy_prefix_match_starts_afresh():
    store = SessionStore(max_sessions=8, ttl=60)
    first = finished_turn(store, "alice", [user("hi")])
    history = [user("hi"), assistant("ok"), user("more")]
    store.claim("alice", history, None)
    second, _ = store.claim("alice", history, None)
    assert second is not first


def test_session_id_appends_new_messages_and_checks_owner_and_busy():
    store = SessionStore(max_sessions=8, ttl=60)
    first = finished_turn(store, "alice", [user("hi")])
    with pytest.raises(SessionNotFound):
        store.claim("bob", [user("x")], first.id)
    with pytest.raises(SessionNotFound):
        store.claim("alice", [user("x")], "no-such-session")
    session, conversation = store.claim("alice", [user("more")], first.id)
    assert session is first and conversation == [user("hi"), assistant("ok"), user("more")]
    with pytest.raises(SessionBusy):
        store.claim("alice", [user("again")], first.id)


def test_idle_sessions_expire_after_ttl_but_busy_ones_stay():
    clock = Clock()
    store = SessionStore(max_sessions=8, ttl=10, clock=clock)
    idle = finished_turn(store, "alice", [user("a")])
    busy, _ = store.claim("alice", [user("b")], None)
    clock.now = 11
    store.expire()
    assert len(store) == 1
    with pytest.raises(SessionNotFound):
        store.claim("alice", [user("x")], idle.id)
    store.release(busy, [user("b"), assistant("ok")])
    store.claim("alice", [user("x")], busy.id)


def test_a_session_released_without_messages_is_dropped():
    store = SessionStore(max_sessions=8, ttl=10)
    refused, _ = store.claim("alice", [user("a")], None)
    store.release(refused)
    assert len(store) == 0


def test_least_recently_used_idle_sessions_go_beyond_max_sessions():
    clock = Clock()
    store = SessionStore(max_sessions=2, ttl=100, clock=clock)
    a = finished_turn(store, "o", [user("a")])
    clock.now = 1
    b = finished_turn(store, "o", [user("b")])
    clock.now = 2
    finished_turn(store, "o", [user("a2")], session_id=a.id)  # a is now the most recently used
    clock.now = 3
    c = finished_turn(store, "o", [user("c")])
    assert len(store) == 2
    with pytest.raises(SessionNotFound):
        store.claim("o", [user("x")], b.id)
    for kept in (a, c):
        session, _ = store.claim("o", [user("x")], kept.id)
        assert session is kept


def test_archives_beyond_the_host_memory_bound_go_least_recently_used_first(tiny_model):
    from h2o_cache import CacheConfig, H2OCache, model_spec

    config = CacheConfig(budget=16, evict_slack=4, recall_budget=8, recall_block=4)
    store = SessionStore(max_sessions=8, ttl=100, max_archive_bytes=0)
    sessions = []
    for name in ("old", "new", "busy"):
        session, _ = store.claim("me", [{"role": "user", "content": name}], None)
        session.cache = H2OCache(model_spec(tiny_model), config, rows=1)
        session.cache.archives[0] = session.cache.new_archive()
        keys = torch.zeros(2, 2, 8, 16)
        session.cache.archives[0].append(keys, keys, None, torch.zeros(2, 2, 8, dtype=torch.int64))
        sessions.append(session)
    one = sessions[0].archived_bytes
    store.max_archive_bytes = one  # room for one archive
    store.release(sessions[0], [{"role": "user", "content": "old"}, {"role": "assistant", "content": "a"}])
    store.release(sessions[1], [{"role": "user", "content": "new"}, {"role": "assistant", "content": "b"}])
    assert sessions[0].cache.archives == [None] and sessions[1].archived_bytes == one
    assert sessions[2].archived_bytes == one  # busy: its request holds it
    assert store.archives_dropped == 1 and store.archived()[1] == 2 * one
