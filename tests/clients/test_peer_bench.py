"""The peer benchmark's logic against two fake servers, one slower: rounds, ratios, fresh prompts."""

import re

from clients import peer_bench
from clients.peer_bench import OURS, PEER, long_prompt, measure_round, ratio
from tests.clients.conftest import serve
from tests.clients.fake_server import make_app


def test_ratios_read_better_for_ours_above_one():
    assert ratio("1 streams tok/s", 30.0, 20.0) == 1.5 and ratio("first token s", 0.5, 1.0) == 2.0


def test_every_server_and_round_gets_a_long_prompt_of_its_own():
    prompts = {long_prompt(200, seed) for seed in range(50)}
    assert len(prompts) == 50 and all(len(p.split()) > 200 for p in prompts)


def test_rounds_alternate_and_the_faster_server_wins_every_measure(capsys):
    fast, fast_url = serve(make_app(delay=0.001))
    slow, slow_url = serve(make_app(delay=0.02))
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
