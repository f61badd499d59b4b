"""The clients against the real `python -m server` on the default model, on a loopback port."""

import csv
import importlib.util
import json

import pytest

from clients.server_proc import spawned_server
from server.settings import DEFAULT_RECALL
from tests.clients.conftest import run_client

pytestmark = [
    pytest.mark.model,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("server.__main__") is None, reason="`python -m server` has not landed"),
]
BUDGET = 64


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with spawned_server("h2o", ["--kv-budget", str(BUDGET), "--threads", "2"], log=log, ready_timeout=300) as url:
        yield url


def test_demo_two_turns_recognizes_the_resent_history(server_url, tmp_path):
    r = run_client("mtbench_demo", "--base-url", server_url, "--label", "h2o", "--turns", "2", "--max-tokens", "24",
                   "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    with open(tmp_path / "h2o.csv", newline="") as f:
        first, second = csv.DictReader(f)
    assert int(second["cached_tokens"]) >= int(first["conversation_tokens"]) - 1  # the re-sent turn is not prefilled
    # resident: at most the budget plus the recall window (on by default), whose copies are of evicted tokens
    resident, conversation = int(second["kv_resident_tokens"]), int(second["conversation_tokens"])
    assert resident <= BUDGET + DEFAULT_RECALL and resident <= conversation and BUDGET < conversation
    assert (tmp_path / "mtbench.png").exists()


def test_chat_continues_the_session_and_resets(server_url):
    r = run_client("chat", "--base-url", server_url, "--max-tokens", "8", "--temperature", "0",
                   stdin="Hi!\nWhat did I just say?\n/reset\nHello\n/exit\n", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant> ") == 3 and "(new conversation)" in r.stdout


def test_context_length_exceeded_is_a_clear_error(server_url):
    r = run_client("chat", "--base-url", server_url, stdin="hello " * 40000 + "\n", timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "HTTP 400" in r.stderr or "HTTP 413" in r.stderr


def test_loadbench_runs_concurrent_sessions(server_url, tmp_path):
    out = tmp_path / "load.json"
    r = run_client("loadbench", "--base-url", server_url, "--sessions", "3", "--turns", "2", "--max-tokens", "8",
                   "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["turns_ok"] == 6 and summary["errors"] == 0 and summary["aggregate_tps"] > 0


def test_project_bench_table_on_the_real_server(server_url, tmp_path):
    """Spawning and stopping is tested with a stand-in server (test_server_proc.py); this is the measuring."""
    r = run_client("project_bench", "--base-url", f"h2o={server_url}", "--streams", "1,2", "--rounds", "1",
                   "--max-tokens", "4", "--conversation-turns", "2", "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert "2 streams / 1 stream" in r.stdout and "turn 2 / turn 1" in r.stdout
    results = json.loads((tmp_path / "results.json").read_text())["h2o"]
    turns = results["conversation"]["turns"]
    assert [t["completion_tokens"] for t in turns] == [4, 4]  # every reply max_tokens long
    assert turns[1]["cached_tokens"] > 0  # and still text the conversation continues from
