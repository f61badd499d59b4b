"""/health through start-up (503 while the model loads, then 200), /metrics in Prometheus text format."""

import dataclasses
import re
import threading

import httpx
import pytest

from server import app as app_module
from server.app import create_app
from server.engine.types import StateStats
from server.settings import ServerSettings
from tests.engine.conftest import until
from tests.server.fake_engine import FakeEngine

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]+="[^"]*"(,[a-zA-Z_]+="[^"]*")*\})? (-?[0-9.e+-]+|\+Inf)$')


@pytest.fixture
def slow_load(monkeypatch):
    """build_engine blocks until `release` is set, then returns a fake engine (or raises `error`)."""
    release, built = threading.Event(), []

    def build(settings):
        release.wait(10)
        if hasattr(build, "error"):
            raise build.error
        built.append(FakeEngine())
        return built[-1]

    monkeypatch.setattr(app_module, "build_engine", build)
    return release, built, build


async def test_health_is_503_while_loading_then_200(slow_load):
    release, built, _ = slow_load
    app = create_app(ServerSettings())
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        loading = await client.get("/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "model_not_ready"
        assert "h2o_model_ready 0" in (await client.get("/metrics")).text
        release.set()
        await until(lambda: app.state.engine is not None)
        assert (await client.get("/health")).status_code == 200
    assert not built[0].ready, "shutdown stops the engine the app built"


async def test_a_failed_load_is_reported(slow_load):
    release, _, build = slow_load
    build.error = FileNotFoundError("no such model")
    failures = []
    app = create_app(ServerSettings(), on_load_failure=failures.append)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        release.set()
        await until(lambda: failures)
        r = await client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "failed", "error": "FileNotFoundError: no such model"}


async def test_health_is_503_once_the_engine_stopped(client, engine):
    engine.stop()
    assert (await client.get("/health")).status_code == 503


def parse(text: str) -> dict[str, dict]:
    """name -> {"type", "help", "samples": [(name+labels, value)]}; asserts the exposition format."""
    families: dict[str, dict] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help = line[7:].split(" ", 1)
            families[name] = {"help": help, "samples": []}
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in {"counter", "gauge", "histogram"} and not families[name]["samples"]
            families[name]["type"] = kind
        else:
            match = SAMPLE.match(line)
            assert match, line
            family = next(f for f in families if match.group(1) == f or match.group(1).startswith(f + "_"))
            families[family]["samples"].append((line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])))
    return families


async def test_metrics_in_prometheus_text_format(client):
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    await client.post("/v1/chat/completions", json={"messages": []})
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = parse(r.text)
    samples = {name: value for f in families.values() for name, value in f["samples"]}
    assert samples['h2o_http_requests_total{code="200"}'] == 1 and samples['h2o_http_requests_total{code="400"}'] == 1
    assert samples["h2o_resident_kv_tokens"] == 48 and samples["h2o_resident_kv_bytes"] == 4096
    assert samples["h2o_archived_kv_tokens"] == 160 and samples["h2o_archived_kv_bytes"] == 9000
    assert samples["h2o_archives_dropped_total"] == 1
    assert samples["h2o_recalled_tokens_total"] == 64 and samples["h2o_recall_turns_total"] == 2
    assert families["h2o_archived_kv_bytes"]["type"] == "gauge"
    assert samples["h2o_running_sequences"] == 1 and samples["h2o_waiting_sequences"] == 2
    assert samples["h2o_active_sessions"] == 1 and samples["h2o_cached_tokens_total"] == 3
    assert samples["h2o_prompt_tokens_total"] == 10 and samples["h2o_generated_tokens_total"] == 20
    assert samples['h2o_requests_finished_total{reason="length"}'] == 1
    assert families["h2o_decode_step_seconds"]["type"] == "histogram"
    assert dict(families["h2o_decode_step_seconds"]["samples"]) == {
        'h2o_decode_step_seconds_bucket{le="0.01"}': 2, 'h2o_decode_step_seconds_bucket{le="0.1"}': 4,
        'h2o_decode_step_seconds_bucket{le="+Inf"}': 5, "h2o_decode_step_seconds_sum": 0.25,
        "h2o_decode_step_seconds_count": 5}
    assert all(f["type"] == "counter" for n, f in families.items() if n.endswith("_total"))
    assert samples["h2o_time_to_first_token_seconds_count"] == 3 and samples["h2o_queue_time_seconds_sum"] == 0.5
    for name in ("inter_token_latency", "e2e_request_latency"):
        assert families[f"h2o_{name}_seconds"]["type"] == "histogram"
    assert samples["process_resident_memory_bytes"] > 0 and "process_cpu_seconds_total" in samples


async def test_metrics_report_the_state_dir_when_sessions_persist(client, engine, monkeypatch):
    assert "h2o_state_bytes" not in (await client.get("/metrics")).text  # no state dir: no such families
    state = StateStats(sessions=3, transcript_bytes=1200, snapshot_bytes=50_000_000,
                       restored={"snapshot": 2, "transcript": 1}, snapshots_refused=1)
    with_state = dataclasses.replace(engine.stats(), state=state)
    monkeypatch.setattr(engine, "stats", lambda: with_state)
    families = parse((await client.get("/metrics")).text)
    samples = {name: value for f in families.values() for name, value in f["samples"]}
    assert samples['h2o_sessions_restored_total{source="snapshot"}'] == 2
    assert samples['h2o_sessions_restored_total{source="transcript"}'] == 1
    assert samples["h2o_snapshots_refused_total"] == 1 and samples["h2o_state_sessions"] == 3
    assert samples['h2o_state_bytes{kind="snapshot"}'] == 50_000_000
    assert samples['h2o_state_bytes{kind="transcript"}'] == 1200
    assert families["h2o_sessions_restored_total"]["type"] == "counter"
