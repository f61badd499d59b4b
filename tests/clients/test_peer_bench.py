"""The peer benchmark's logic against two fake servers, one slower: rounds, ratios, fresh prompts."""

import os
import re
import subprocess
import sys
import time

from clients import peer_bench
from clients.peer_bench import OURS, PEER, long_prompt, measure_round, ratio
from tests.clients.conftest import REPO, serve
from tests.clients.fake_server import make_app


def test_ratios_read_better_for_ours_above_one():
    assert ratio("1 streams tok/s", 30.0, 20.0) == 1.5 and ratio("first token s", 0.5, 1.0) == 2.0


def test_every_server_and_round_gets_a_long_prompt_of_its_own():
    prompts = {long_prompt(200, seed) for seed in range(50)}
    assert len(prompts) == 50 and all(len(p.split()) > 200 for p in prompts)


def test_rounds_alternate_and_the_faster_server_wins_every_measure(capsys):
    fast, fast_url = serve(make_app(delay=0.001))
    # The slow one's first token lags by a prefill far above the noise of a fresh connection on a busy
    # machine (~50 ms seen in CI), so the order of the first-token measure cannot flip by chance.
    slow, slow_url = serve(make_app(delay=0.02, prefill=0.3))
    try:
        first = measure_round({OURS: fast_url, PEER: slow_url}, 0, [1, 2], 1, 8, 30)
        assert set(first[OURS]) == {"1 streams tok/s", "2 streams tok/s", "first token s"}
        assert first[OURS]["2 streams tok/s"] > first[PEER]["2 streams tok/s"]
        assert first[OURS]["first token s"] < first[PEER]["first token s"]
        status = peer_bench.main(["--ours-url", fast_url, "--llama-url", slow_url, "--rounds", "2", "--streams", "1", "2",
                                  "--requests", "2", "--max-tokens", "6", "--long-words", "30"])
    finally:
        fast.should_exit = slow.should_exit = True
    out = capsys.readouterr().out
    assert status == 0 and out.count("round ") >= 2
    medians = dict(re.findall(r"^\| (\d streams tok/s|first token s) \| ([\d.]+)x \|", out, re.M))
    assert set(medians) == {"1 streams tok/s", "2 streams tok/s", "first token s"}
    assert all(float(v) > 1 for v in medians.values())


def test_without_llama_server_it_says_how_to_get_one(monkeypatch, capsys):
    monkeypatch.setattr(peer_bench.shutil, "which", lambda name: None)
    assert peer_bench.main([]) == 2
    assert "README" in capsys.readouterr().err


def test_two_threads_beside_other_work_are_warned_of_one_thread_or_a_quiet_machine_not():
    assert "--threads 1" in peer_bench.contention_warning(threads=2, load=1.0, cores=2)
    assert peer_bench.contention_warning(threads=2, load=0.1, cores=2) is None
    assert peer_bench.contention_warning(threads=1, load=1.0, cores=2) is None


def test_every_measure_is_told_on_stderr_as_it_is_taken(capsys):
    server, url = serve(make_app(delay=0.001))
    try:
        measure_round({OURS: url, PEER: url}, 1, [1, 2], 1, 4, 30)
    finally:
        server.should_exit = True
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 6 and all(line.startswith("round 2 ") for line in lines)
    assert lines[0].startswith(f"round 2 {PEER}: 1 streams tok/s ") and lines[-1].startswith(f"round 2 {OURS}: first token s ")


def test_a_round_reaches_a_pipe_when_it_ends_not_when_the_program_does():
    """Piped stdout is block-buffered: without a flush, a run stopped by a time limit shows nothing."""
    server, url = serve(make_app(delay=0.02))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "clients.peer_bench", "--ours-url", url, "--llama-url", url,
                                 "--rounds", "4", "--streams", "1", "--requests", "1", "--max-tokens", "10",
                                 "--long-words", "30"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                cwd=REPO, env=env)
        first = proc.stdout.readline()
        arrived = time.monotonic()
        proc.communicate(timeout=60)
        ended = time.monotonic()
    finally:
        server.should_exit = True
    assert first.startswith("round 1: ") and proc.returncode == 0
    assert ended - arrived > 0.5  # three rounds of >= 4 requests of 10 tokens at 20 ms each were still to run


def test_a_count_below_one_is_refused_at_the_command_line_not_a_crash_after_the_servers_start(capsys):
    for flag in ("--rounds", "--requests", "--streams"):
        try:
            peer_bench.main(["--ours-url", "http://x", "--llama-url", "http://y", flag, "0"])
        except SystemExit as stop:
            assert stop.code == 2
        else:
            raise AssertionError(f"{flag} 0 was taken")
        assert f"{flag} must be at least 1" in capsys.readouterr().err
