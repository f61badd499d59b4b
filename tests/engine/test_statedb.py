"""The state directory's limits on disk (TTL, LRU, bytes) and its snapshot bookkeeping."""

from server.engine.statedb import StateDB, Transcript


def put(db: StateDB, sid: str, updated: float, content: str = "hello", snapshot: bytes = b"") -> Transcript:
    transcript = Transcript(sid, "owner", f"{sid}:{content}", [{"role": "user", "content": content}], updated, updated)
    db.save(transcript)
    if snapshot:
        assert db.put_snapshot(sid, transcript.key, snapshot)
    return transcript


def ids(db: StateDB) -> set[str]:
    return {sid for sid in "abcdef" if db.get(sid) is not None}


def test_ttl_then_least_recently_used_beyond_max_sessions(tmp_path):
    db = StateDB(tmp_path)
    for i, sid in enumerate("abcde"):
        put(db, sid, updated=100.0 + i)
    assert db.prune(now=160.5, ttl=60, max_sessions=10, max_bytes=1 << 20) == 1  # a: 60.5 s idle
    assert ids(db) == set("bcde")
    assert db.prune(now=160.5, ttl=60, max_sessions=2, max_bytes=1 << 20) == 2
    assert ids(db) == set("de")


def test_bytes_over_the_bound_drop_the_oldest_snapshots_then_the_oldest_sessions(tmp_path):
    db = StateDB(tmp_path)
    for i, sid in enumerate("abc"):
        put(db, sid, updated=100.0 + i, snapshot=bytes(1000))
    transcript = db.usage().transcript_bytes // 3
    assert db.usage().total == 3 * (transcript + 1000)

    db.prune(now=103, ttl=60, max_sessions=10, max_bytes=3 * transcript + 1500)  # two snapshots must go
    assert ids(db) == set("abc") and db.usage().snapshot_bytes == 1000
    assert db.snapshot(db.get("c")) == bytes(1000) and db.snapshot(db.get("a")) is None
    assert sorted(p.name for p in db.snapshots.iterdir()) == ["c.st"]

    db.prune(now=103, ttl=60, max_sessions=10, max_bytes=transcript)
    assert ids(db) == {"c"} and db.usage().total == transcript and not any(db.snapshots.iterdir())


def test_a_snapshot_is_valid_only_for_the_transcript_it_was_taken_with(tmp_path):
    db = StateDB(tmp_path)
    first = put(db, "a", updated=100.0, snapshot=b"state")
    assert db.snapshot(db.get("a")) == b"state"
    put(db, "a", updated=101.0, content="a newer turn")  # the next turn makes the snapshot stale
    assert db.snapshot(db.get("a")) is None and db.usage().snapshot_bytes == 0
    assert not db.put_snapshot("a", first.key, b"stale")  # taken before that turn: refused
    assert not db.put_snapshot("z", "z:hello", b"orphan")  # no such session
    assert not any(db.snapshots.iterdir())


def test_reopening_removes_files_no_row_names_and_keeps_the_rest(tmp_path):
    db = StateDB(tmp_path)
    put(db, "a", updated=100.0, snapshot=b"state")
    db.close()
    (tmp_path / "snapshots" / "x.st").write_bytes(b"left by a crash")
    (tmp_path / "snapshots" / "a.tmp").write_bytes(b"torn")
    db = StateDB(tmp_path)
    assert sorted(p.name for p in db.snapshots.iterdir()) == ["a.st"]
    assert db.get("a").messages == [{"role": "user", "content": "hello"}]
    assert db.find("owner", ["nothing", "a:hello"]).id == "a" and db.find("other", ["a:hello"]) is None
