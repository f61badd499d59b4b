"""`Persistence`: sessions that outlive the process, kept in a state directory (`StateDB`).

- Every completed turn's transcript is committed on a writer thread (`save_turn`); the turn's
  `Finish` carries the commit's future and its final frame waits for it (`Handle`), so a reply the
  client saw end is on disk, and neither the event loop nor the engine thread waits for the disk.
- A graceful stop snapshots every idle session's cache (`close`).
- A request naming a session this process does not hold, or re-sending a history, finds it on disk
  (`recall`): from its snapshot when one matches this model and cache config (no prefill), else from
  its transcript alone (the next turn prefills it).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from h2o_cache import H2OCache
from h2o_cache.snapshot import SnapshotMismatch, dump_row, load_row, read_metadata
from server.engine.conversation import conversation_keys
from server.engine.session import Session
from server.engine.statedb import StateDB, Transcript
from server.engine.types import StateStats

log = logging.getLogger(__name__)


class Persistence:
    """identity: `h2o_cache.snapshot.cache_identity` of this engine's caches; a snapshot taken under
    another one is refused. new_cache: an empty 1-row cache to restore a snapshot into.
    ttl, max_sessions, max_bytes: the limits on disk (`StateDB.prune`); clock: Unix seconds."""

    def __init__(self, directory: str, identity: str, new_cache: Callable[[], H2OCache], ttl: float,
                 max_sessions: int, max_bytes: int, clock: Callable[[], float] = time.time):
        self.db = StateDB(directory)
        self.identity = identity
        self.new_cache = new_cache
        self.ttl, self.max_sessions, self.max_bytes = ttl, max_sessions, max_bytes
        self.clock = clock
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="state-writer")
        self._lock = threading.Lock()
        self._restored = {"snapshot": 0, "transcript": 0}
        self._refused = 0
        self._usage = self.db.usage()  # refreshed by `prune`: /metrics never waits for the disk
        self.prune()

    # ----- engine thread ---------------------------------------------------------------------------

    def save_turn(self, session: Session) -> Future:
        """Queue the session's transcript for commit (call right after the turn updated it)."""
        now = self.clock()
        transcript = Transcript(session.id, session.owner, session.key, list(session.messages), now, now)
        done = self._writer.submit(self.db.save, transcript)
        self._writer.submit(self.prune)  # after the commit, outside what the reply waits for
        return done

    # ----- any thread -------------------------------------------------------------------------------

    def prune(self) -> None:
        try:
            self.db.prune(self.clock(), self.ttl, self.max_sessions, self.max_bytes)
            self._usage = self.db.usage()
        except Exception:
            log.exception("could not apply the limits to the state directory")

    def recall(self, owner: str, messages: list[dict], session_id: str | None) -> Session | None:
        """The session a request continues, from disk: by id, or the owner's session whose
        conversation is the longest strict prefix of `messages`. None when there is none (or it
        expired). Blocking: call it off the event loop."""
        started = time.perf_counter()
        if session_id is not None:
            transcript = self.db.get(session_id)
            if transcript is None or transcript.owner != owner:
                return None
        else:
            transcript = self.db.find(owner, conversation_keys(owner, messages)[:-1])
            if transcript is None:
                return None
        if self.clock() - transcript.updated > self.ttl:
            return None
        session = Session(id=transcript.id, owner=owner, messages=transcript.messages)
        how = "snapshot" if self._restore_cache(session, transcript) else "transcript"
        with self._lock:
            self._restored[how] += 1
        log.info("session %s restored from its %s (%d messages) in %.0f ms", session.id, how, len(session.messages),
                 (time.perf_counter() - started) * 1000)
        return session

    def _restore_cache(self, session: Session, transcript: Transcript) -> bool:
        blob = self.db.snapshot(transcript)
        if blob is None:
            return False
        try:
            session.cache = load_row(self.new_cache(), blob, self.identity)
            metadata = read_metadata(blob)
            session.consumed_text = metadata["consumed_text"]
            session.token_ids = array("i", base64.b64decode(metadata["token_ids"]))
            session.turns = [tuple(turn) for turn in json.loads(metadata["turns"])]
            session.reread = int(metadata.get("reread", 0))  # snapshots from before re-reads hold none
        except (SnapshotMismatch, KeyError, ValueError) as exc:
            log.warning("snapshot of session %s refused (%s); resuming from its transcript", session.id, exc)
            session.reset()
            self.db.drop_snapshot(transcript.id)  # it will never fit this server
            self._usage = self.db.usage()
            with self._lock:
                self._refused += 1
            return False
        return True

    def stats(self) -> StateStats:
        usage = self._usage
        with self._lock:
            return StateStats(sessions=usage.sessions, transcript_bytes=usage.transcript_bytes,
                              snapshot_bytes=usage.snapshot_bytes, restored=dict(self._restored),
                              snapshots_refused=self._refused)

    # ----- shutdown --------------------------------------------------------------------------------

    def close(self, sessions: list[Session]) -> None:
        """Finish the queued commits, then snapshot the idle sessions that hold a cache (after the
        engine thread stopped: nothing else touches them)."""
        self._writer.shutdown(wait=True)
        started, written, size = time.perf_counter(), 0, 0
        for session in sessions:
            if session.busy or session.cache is None or not session.consumed_text or session.key is None:
                continue
            try:
                transcript = self.db.get(session.id)
                if transcript is None or transcript.snapshot_key == session.key:
                    continue  # expired on disk, or its snapshot is still current (restored, not used since)
                blob = dump_row(session.cache, 0, self.identity, {
                    "consumed_text": session.consumed_text,
                    "token_ids": base64.b64encode(session.token_ids.tobytes()).decode(),  # what the inspector spells
                    "turns": json.dumps(session.turns),
                    "reread": str(session.reread),
                })
                if self.db.put_snapshot(session.id, session.key, blob):
                    written, size = written + 1, size + len(blob)
            except Exception:
                log.exception("could not snapshot session %s", session.id)
        self.prune()
        self.db.close()
        log.info("snapshotted %d sessions (%.1f MB) in %.2f s", written, size / 2**20, time.perf_counter() - started)
