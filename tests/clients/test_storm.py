"""The disconnect storm against the real engine (tiny model) over real HTTP: survivors complete,
and nothing is left in flight."""

import pytest

from clients.storm import main, storm
from h2o_cache import CacheConfig
from server.app import create_app
from server.engine import Engine, EngineConfig
from server.settings import ServerSettings
from tests.engine.conftest import render
from tests.server.conftest import serving


@pytest.fixture
def engine(tiny_model, byte_tokenizer):
    engine = Engine(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=24, prefill_chunk=16),
                    EngineConfig(max_batch_size=8, max_queue=64), render=render)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def live_url(engine):
    with serving(create_app(ServerSettings(served_model_name="tiny"), engine)) as url:
        yield url


async def test_a_storm_leaves_survivors_whole_and_nothing_in_flight(live_url, engine):
    rounds = await storm(live_url, rounds=3, streams=32, disconnect=0.25, max_tokens=24, seed=1)
    assert all(not r.wrong for r in rounds), [r.wrong for r in rounds]
    assert all(r.settled_s == r.settled_s for r in rounds)  # not NaN: idle again after every round
    assert rounds[-1].other_mb - rounds[0].other_mb < 100 and rounds[0].rss_mb > rounds[0].kv_mb > 0
    assert sum(r.disconnected for r in rounds) >= 12 and sum(r.completed for r in rounds) >= 60
    stats = engine.stats()
    assert (stats.running, stats.waiting, engine.batcher.resident) == (0, 0, (0, 0))
    assert engine.scheduler.in_flight == 0 and not any(s.busy for s in engine.sessions._sessions.values())
    # A stream that left near its end may have finished first: those count as "length" too.
    assert stats.requests_by_finish["length"] >= sum(r.completed for r in rounds)


def test_the_program_prints_a_table_and_exits_0(live_url, capsys):
    assert main(["--base-url", live_url, "--streams", "8", "--rounds", "1", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "completed" in out and out.rstrip().endswith("ok")
