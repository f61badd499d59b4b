"""`StateDB`: the state directory: session transcripts in SQLite (WAL) and cache snapshots as files.

    state.db                      sessions(id, owner, key, messages, created, updated, sizes, snapshot_key)
    snapshots/<session id>.st     one safetensors file per snapshotted session

A transcript row is committed with `synchronous=FULL`, so a completed turn survives a crash of the
process or the machine. A snapshot is only valid for the transcript it was taken with
(`snapshot_key` = the conversation key then); saving a transcript drops the session's snapshot in
the same transaction. Files are written to a temporary name and renamed, so a crash never leaves a
torn snapshot under a session's name; files no row names are removed when the database opens.

Plain storage: one connection behind a lock, no thread of its own (`Persistence` owns the writer).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,            -- the API key's digest (server.routes.auth), never the key
    key TEXT NOT NULL,              -- conversation_keys(owner, messages)[-1]: finds a re-sent history
    messages TEXT NOT NULL,         -- JSON list of {"role", "content"}
    created REAL NOT NULL,          -- Unix seconds
    updated REAL NOT NULL,          -- Unix seconds of the last completed turn (TTL and LRU order)
    transcript_bytes INTEGER NOT NULL,
    snapshot_bytes INTEGER NOT NULL DEFAULT 0,
    snapshot_key TEXT               -- the conversation key the snapshot file was taken at; NULL: none
);
CREATE INDEX IF NOT EXISTS sessions_by_key ON sessions(owner, key);
CREATE INDEX IF NOT EXISTS sessions_by_age ON sessions(updated);
"""


@dataclass
class Transcript:
    id: str
    owner: str
    key: str
    messages: list[dict]
    created: float
    updated: float
    snapshot_key: str | None = None


@dataclass
class Usage:
    sessions: int
    transcript_bytes: int
    snapshot_bytes: int

    @property
    def total(self) -> int:
        return self.transcript_bytes + self.snapshot_bytes


class StateDB:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.snapshots = self.directory / "snapshots"
        self.snapshots.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.directory / "state.db", check_same_thread=False)
        # auto_vacuum before the first table: deleted rows give their pages back to the file system.
        self._db.execute("PRAGMA auto_vacuum=FULL")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._remove_orphans()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ----- transcripts ----------------------------------------------------------------------------

    def save(self, t: Transcript) -> None:
        """Insert or replace a session's transcript; its snapshot, now stale, goes."""
        messages = json.dumps(t.messages, ensure_ascii=False)
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO sessions (id, owner, key, messages, created, updated, transcript_bytes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET key=excluded.key, "
                "messages=excluded.messages, updated=excluded.updated, transcript_bytes=excluded.transcript_bytes, "
                "snapshot_bytes=0, snapshot_key=NULL",
                (t.id, t.owner, t.key, messages, t.created, t.updated, len(messages.encode())))
        self._snapshot_path(t.id).unlink(missing_ok=True)

    def get(self, session_id: str) -> Transcript | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return _transcript(row) if row else None

    def find(self, owner: str, keys: list[str]) -> Transcript | None:
        """The owner's session whose conversation key is the latest of `keys` (a history's prefixes)."""
        if not keys:
            return None
        marks = ",".join("?" * len(keys))
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM sessions WHERE owner = ? AND key IN ({marks})",
                                    (owner, *keys)).fetchall()
        order = {key: i for i, key in enumerate(keys)}
        return _transcript(max(rows, key=lambda row: (order[row[2]], row[5]))) if rows else None

    def delete(self, session_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        self._snapshot_path(session_id).unlink(missing_ok=True)

    # ----- snapshots ------------------------------------------------------------------------------

    def put_snapshot(self, session_id: str, key: str, blob: bytes) -> bool:
        """Store a snapshot taken at conversation `key`; False (nothing stored) when the session's
        transcript is gone or has moved on since."""
        path = self._snapshot_path(session_id)
        temporary = path.with_suffix(".tmp")
        with open(temporary, "wb") as out:
            out.write(blob)
            out.flush()
            os.fsync(out.fileno())
        with self._lock, self._db:
            updated = self._db.execute(
                "UPDATE sessions SET snapshot_bytes = ?, snapshot_key = ? WHERE id = ? AND key = ?",
                (len(blob), key, session_id, key)).rowcount
            if updated:
                os.replace(temporary, path)  # inside the transaction: a row never names a missing file
        if not updated:
            temporary.unlink(missing_ok=True)
        return bool(updated)

    def snapshot(self, t: Transcript) -> bytes | None:
        """The session's snapshot, if it has one taken at its current transcript."""
        if t.snapshot_key != t.key:
            return None
        try:
            return self._snapshot_path(t.id).read_bytes()
        except FileNotFoundError:
            return None

    def drop_snapshot(self, session_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("UPDATE sessions SET snapshot_bytes = 0, snapshot_key = NULL WHERE id = ?", (session_id,))
        self._snapshot_path(session_id).unlink(missing_ok=True)

    # ----- limits ---------------------------------------------------------------------------------

    def usage(self) -> Usage:
        with self._lock:
            n, transcripts, snapshots = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(transcript_bytes), 0), COALESCE(SUM(snapshot_bytes), 0) "
                "FROM sessions").fetchone()
        return Usage(n, transcripts, snapshots)

    def prune(self, now: float, ttl: float, max_sessions: int, max_bytes: int) -> int:
        """Apply the limits on disk: sessions idle past `ttl` go, then beyond `max_sessions` the
        least recently used; then, oldest first, snapshots and if need be whole sessions until the
        bytes fit `max_bytes`. Returns the number of sessions removed."""
        with self._lock:
            rows = self._db.execute("SELECT id, updated, transcript_bytes, snapshot_bytes FROM sessions "
                                    "ORDER BY updated DESC").fetchall()
        doomed = [sid for i, (sid, updated, _, _) in enumerate(rows) if now - updated > ttl or i >= max_sessions]
        kept = [row for row in rows if row[0] not in set(doomed)]
        total = sum(t + s for _, _, t, s in kept)
        for sid, _, _, snapshot_bytes in reversed(kept):  # oldest first
            if total <= max_bytes:
                break
            if snapshot_bytes:
                self.drop_snapshot(sid)
                total -= snapshot_bytes
        for sid, _, transcript_bytes, _ in reversed(kept):
            if total <= max_bytes:
                break
            doomed.append(sid)
            total -= transcript_bytes
        for sid in doomed:
            self.delete(sid)
        return len(doomed)

    def _snapshot_path(self, session_id: str) -> Path:
        if not session_id or not all(c.isalnum() or c in "-_" for c in session_id):
            raise ValueError(f"not a session id: {session_id!r}")
        return self.snapshots / f"{session_id}.st"

    def _remove_orphans(self) -> None:
        with self._lock:
            named = {row[0] for row in self._db.execute("SELECT id FROM sessions WHERE snapshot_key IS NOT NULL")}
        for path in self.snapshots.iterdir():
            if path.suffix == ".tmp" or path.stem not in named:
                path.unlink(missing_ok=True)


_COLUMNS = "id, owner, key, messages, created, updated, snapshot_key"


def _transcript(row) -> Transcript:
    sid, owner, key, messages, created, updated, snapshot_key = row
    return Transcript(sid, owner, key, json.loads(messages), created, updated, snapshot_key)
