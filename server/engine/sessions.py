"""`SessionStore`: the live sessions, found by id or by a prefix of a re-sent history."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Callable

from server.engine.conversation import continued, conversation_keys
from server.engine.session import Session
from server.engine.types import SessionBusy, SessionNotFound


class SessionStore:
    """Sessions by id (least recently used first) plus an index of (owner, messages) hashes.

    `claim` marks a session busy for one request and `release` hands it back; busy sessions are
    never dropped. Idle ones go after `ttl` seconds or, beyond `max_sessions`, least recently used
    first. Beyond `max_archive_bytes` of archived (evicted, recallable) KV in host memory, idle
    sessions lose their archives, least recently used first: they go on, without recall of what
    was evicted before; expiry is checked whenever a request arrives or ends, when stats are read, and by the
    engine thread's timer (`expire_if_due`, every `expiry_interval` s). Called from the asyncio
    thread (claim, expire) and the engine thread (release, expire_if_due), hence the lock.
    """

    def __init__(self, max_sessions: int, ttl: float, clock: Callable[[], float] = time.monotonic,
                 max_archive_bytes: int | None = None):
        self.max_sessions = max_sessions
        self.ttl = ttl
        self.max_archive_bytes = max_archive_bytes
        self.archives_dropped = 0
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_key: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._expired_at = clock()

    def __len__(self) -> int:
        return len(self._sessions)

    def claim(self, owner: str, messages: list[dict], session_id: str | None) -> tuple[Session, list[dict]]:
        """Find or create the session a request continues; mark it busy.

        Returns the session and the whole conversation: the session's messages plus the new ones
        when `session_id` is given, else `messages` (a re-sent history). A re-sent history continues
        the idle session of the same owner whose messages are its longest strict prefix; a busy
        match is skipped (the request starts afresh) rather than refused, because the client did
        not ask for that session. A matched session's own copies of the messages they share stand in
        for the re-sent ones (`conversation.continued`).
        """
        with self._lock:
            self._expire()
            if session_id is not None:
                session = self._sessions.get(session_id)
                if session is None or session.owner != owner:
                    raise SessionNotFound(f"session {session_id!r} not found")
                if session.busy:
                    raise SessionBusy(f"session {session_id!r} is generating a reply")
                conversation = session.messages + messages
            else:
                session = self._find_prefix(owner, messages) or self._create(owner)
                conversation = continued(session.messages, messages)
            session.busy = True
            self._touch(session)
            self._expire()  # a new session may push the count over max_sessions
            return session, conversation

    def get(self, owner: str, session_id: str) -> Session:
        """The owner's session; SessionNotFound for an unknown id and for another owner's alike."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.owner != owner:
                raise SessionNotFound(f"session {session_id!r} not found")
            return session

    def knows(self, owner: str, messages: list[dict], session_id: str | None) -> bool:
        """Whether `claim` would find the session here (busy or not), rather than create one."""
        with self._lock:
            if session_id is not None:
                session = self._sessions.get(session_id)
                return session is not None and session.owner == owner
            keys = conversation_keys(owner, messages)[:-1]
            return any(self._by_key.get(key) for key in keys)

    def adopt(self, session: Session) -> None:
        """Keep a session restored from elsewhere (the state directory); one already here wins."""
        with self._lock:
            if session.id in self._sessions:
                return
            self._sessions[session.id] = session
            self._index(session)
            self._touch(session)
            self._expire()

    def idle(self) -> list[Session]:
        """The sessions no request holds, for a snapshot once the engine stopped."""
        with self._lock:
            return [s for s in self._sessions.values() if not s.busy]

    def release(self, session: Session, messages: list[dict] | None = None) -> None:
        """Hand a session back after a turn; `messages` replaces its conversation when given.

        A session that still has no messages (its first request was refused or cancelled before
        a reply) holds nothing to continue and is dropped. An ephemeral session was never stored.
        """
        if session.ephemeral:
            return
        with self._lock:
            if messages is not None:
                self._unindex(session)
                session.messages = messages
                self._index(session)
            session.busy = False
            if not session.messages:
                self._drop(session)
                return
            self._touch(session)
            self._expire()

    def resident(self) -> tuple[int, int]:
        """(tokens, bytes) held by the caches sessions keep (not those a request in flight took)."""
        with self._lock:
            sessions = list(self._sessions.values())
            return sum(s.resident_tokens for s in sessions), sum(s.resident_bytes for s in sessions)

    def archived(self) -> tuple[int, int]:
        """(tokens, host bytes) in the archives of evicted tokens of the caches sessions keep."""
        with self._lock:
            sessions = list(self._sessions.values())
            return sum(s.archived_tokens for s in sessions), sum(s.archived_bytes for s in sessions)

    def expire(self) -> None:
        with self._lock:
            self._expire()

    @property
    def expiry_interval(self) -> float:
        """Seconds between timer checks: a session outlives its TTL by at most a quarter of it (or 30 s)."""
        return min(self.ttl / 4, 30.0)

    def expire_if_due(self) -> None:
        with self._lock:
            if self.clock() - self._expired_at >= self.expiry_interval:
                self._expire()


    def _find_prefix(self, owner: str, messages: list[dict]) -> Session | None:
        keys = conversation_keys(owner, messages)[:-1]
        for key in reversed(keys):
            for session_id in self._by_key.get(key, ()):
                session = self._sessions[session_id]
                if not session.busy:
                    return session
        return None

    def _create(self, owner: str) -> Session:
        session = Session(id=secrets.token_urlsafe(24), owner=owner, last_used=self.clock())
        self._sessions[session.id] = session
        self._index(session)
        return session

    def _touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self._sessions.move_to_end(session.id)

    def _expire(self) -> None:
        now = self._expired_at = self.clock()
        excess = len(self._sessions) - self.max_sessions
        for session in list(self._sessions.values()):  # least recently used first
            if session.busy:
                continue
            if excess > 0 or now - session.last_used > self.ttl:
                self._drop(session)
                excess -= 1
        if self.max_archive_bytes is not None:
            self._bound_archives()

    def _bound_archives(self) -> None:
        idle = [s for s in self._sessions.values() if not s.busy]  # a busy one's cache is in use
        excess = sum(s.archived_bytes for s in idle) - self.max_archive_bytes
        for session in idle:  # least recently used first
            if excess <= 0:
                return
            cache = session.cache
            if cache is None or cache.archives[0] is None:
                continue
            excess -= cache.archived_bytes(0)
            cache.archives[0] = None
            self.archives_dropped += 1

    def _drop(self, session: Session) -> None:
        self._unindex(session)
        del self._sessions[session.id]

    def _index(self, session: Session) -> None:
        if session.messages:
            session.key = conversation_keys(session.owner, session.messages)[-1]
            self._by_key.setdefault(session.key, set()).add(session.id)

    def _unindex(self, session: Session) -> None:
        if session.key is not None:
            ids = self._by_key.get(session.key, set())
            ids.discard(session.id)
            if not ids:
                self._by_key.pop(session.key, None)
            session.key = None
