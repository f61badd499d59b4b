"""The load generator and the project benchmark against fake servers: tables, JSON, bounds, errors."""

import json

from clients.loadbench import percentile
from tests.clients.conftest import run_client


def test_percentile_interpolates():
    assert percentile([3, 1, 2], 50) == 2 and percentile([0, 10], 95) == 9.5 and percentile([4], 95) == 4


def test_table_and_json(fake_server, tmp_path):
    out = tmp_path / "load.json"
    r = run_client("loadbench", "--base-url", fake_server, "--sessions", "4", "--turns", "2", "--max-tokens", "5",
                   "--json", str(out))
    assert r.returncode == 0, r.stderr
    for row in ("TTFT p50 / p95", "inter-token latency p50 / p95", "per-stream decode tok/s", "aggregate generated tok/s"):
        assert row in r.stdout
    data = json.loads(out.read_text())
    assert data["summary"]["turns_ok"] == 8 and data["summary"]["tokens"] == 40 and data["summary"]["errors"] == 0
    assert {(t["session"], t["turn"]) for t in data["turns"]} == {(s, k) for s in range(4) for k in (1, 2)}


def test_duration_bounds_the_run(fake_server):
    r = run_client("loadbench", "--base-url", fake_server, "--sessions", "2", "--turns", "1000", "--duration", "0.5",
                   "--quiet")
    assert r.returncode == 0 and "sessions x turns ok" in r.stdout


def test_errors_are_counted_and_fail_the_run(small_context_server):
    r = run_client("loadbench", "--base-url", small_context_server, "--sessions", "2", "--turns", "5",
                   "--max-tokens", "10", "--history", "resend")
    assert r.returncode == 1 and "context_length_exceeded" in r.stderr and "Traceback" not in r.stderr


def test_unreachable(dead_url):
    r = run_client("loadbench", "--base-url", dead_url)
    assert r.returncode == 1 and "cannot connect" in r.stderr and "Traceback" not in r.stderr


def test_project_bench_prints_one_table_of_ratios(fake_server, small_context_server, tmp_path):
    r = run_client("project_bench", "--base-url", f"h2o={fake_server}", "--base-url", f"full={small_context_server}",
                   "--streams", "1,2,8", "--rounds", "1", "--max-tokens", "4", "--conversation-turns", "30",
                   "--out", str(tmp_path))
    assert "8 streams / 1 stream" in r.stdout and "turn 30 / turn 1" in r.stdout
    # The small-context server stands in for `full` past its window: reported, not a crash.
    assert r.returncode == 1 and "full: turn" in r.stdout and "Traceback" not in r.stderr
    assert set(json.loads((tmp_path / "results.json").read_text())) == {"h2o", "full"}


def test_fixed_length_replies_hold_the_end_back_rather_than_run_past_it():
    from clients.loadbench import fixed_length

    assert fixed_length(48) == {"ignore_eos": True, "min_tokens": 48}
