"""Over real HTTP: a turn's transcript is in the state dir before its final frame (or its plain
response) reaches the client, however slow the disk."""

import json
import sqlite3
import time

import httpx
import pytest

from h2o_cache import CacheConfig
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.engine.statedb import StateDB
from server.settings import ServerSettings
from tests.engine.conftest import render
from tests.server.conftest import serving

BODY = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def slow_disk(monkeypatch):
    save = StateDB.save

    def slow_save(self, transcript):
        time.sleep(0.3)
        save(self, transcript)

    monkeypatch.setattr(StateDB, "save", slow_save)


@pytest.fixture
def live(tiny_model, byte_tokenizer, tmp_path, slow_disk):
    engine = Engine(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=24, prefill_chunk=16),
                    EngineConfig(state_dir=str(tmp_path)), render=render)
    engine.start()
    with serving(create_app(ServerSettings(served_model_name="tiny"), engine)) as url:
        yield url, tmp_path / "state.db"
    engine.stop()


def saved_reply(db_path, session_id: str) -> str | None:
    with sqlite3.connect(db_path) as db:
        row = db.execute("SELECT messages FROM sessions WHERE id = ?", (session_id,)).fetchone()
    return json.loads(row[0])[-1]["content"] if row else None


def test_the_final_sse_frame_comes_after_the_commit(live):
    url, db_path = live
    text, finished = "", False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=BODY | {"stream": True}, timeout=30) as r:
        session_id = r.headers["x-session-id"]
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            [choice] = json.loads(line[6:])["choices"]
            if choice["finish_reason"]:
                assert saved_reply(db_path, session_id) == text  # on disk already, whole
                finished = True
            text += choice["delta"].get("content") or ""
    assert finished and text


def test_a_plain_response_comes_after_the_commit(live):
    url, db_path = live
    r = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=30)
    assert saved_reply(db_path, r.headers["x-session-id"]) == r.json()["choices"][0]["message"]["content"]
