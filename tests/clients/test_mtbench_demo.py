"""The MT-Bench demo as a program: CSV and plot for a couple of turns, failures recorded, clear errors."""

import csv

import pytest

from tests.clients.conftest import run_client


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_two_turns_write_csv_and_png(fake_server, tmp_path):
    r = run_client("mtbench_demo", "--base-url", fake_server, "--label", "h2o", "--turns", "2",
                   "--max-tokens", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "assistant: w0 w1 w2 w3" in r.stdout  # the reply streamed to the terminal
    got = rows(tmp_path / "h2o.csv")
    assert [(g["turn"], g["question_id"], g["question_turn"]) for g in got] == [("1", "81", "1"), ("2", "81", "2")]
    assert all(float(g["ttft_s"]) > 0 and g["kv_resident_tokens"] and not g["error"] for g in got)
    assert int(got[1]["conversation_tokens"]) > int(got[0]["conversation_tokens"])
    # the fake server answers every turn alike: the second reply repeats the first, counted
    assert [g["repeats_previous"] for g in got] == ["0", "1"]
    assert "h2o: 2 turns ok" in r.stdout and "1 of 2 replies open as the one before" in r.stdout
    assert (tmp_path / "mtbench.png").read_bytes()[:4] == b"\x89PNG"


def test_failed_turn_is_recorded_plotted_and_reported(fake_server, small_context_server, tmp_path):
    r = run_client("mtbench_demo", "--base-url", fake_server, "--label", "h2o", "--base-url", small_context_server,
                   "--label", "full", "--turns", "6", "--max-tokens", "4", "--quiet", "--history", "session",
                   "--out", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    full = rows(tmp_path / "full.csv")
    assert "context_length_exceeded" in full[-1]["error"] and not any(g["error"] for g in full[:-1])
    assert len(rows(tmp_path / "h2o.csv")) == 6
    assert f"full: {len(full) - 1} turns ok" in r.stdout and "FAILED at turn" in r.stdout
    replot = run_client("mtbench_demo", "--plot", str(tmp_path / "h2o.csv"), str(tmp_path / "full.csv"),
                        "--out", str(tmp_path / "replot"))
    assert replot.returncode == 1 and (tmp_path / "replot" / "mtbench.png").exists()  # the failure still counts


def test_unreachable_server_is_a_clear_error(dead_url, tmp_path):
    r = run_client("mtbench_demo", "--base-url", dead_url, "--turns", "1", "--out", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "not ready: cannot connect" in r.stderr


def test_a_reply_repeats_the_one_before_where_its_opening_is_the_same():
    from clients.mtbench_demo import OPENING, repeats

    assert not repeats(None, "anything")
    assert repeats("The answer is not provided.", " The answer is not provided.\n")
    long = "x" * OPENING
    assert repeats(long + " one ending", long + " another")  # the opening alone is compared
    assert not repeats("The answer is 4.", "The answer is 5.")


def test_penalties_are_sent_only_where_given():
    from clients.mtbench_demo import parse_args, penalties

    assert penalties(parse_args([])) == {}
    args = parse_args(["--repetition-penalty", "1.2", "--frequency-penalty", "0.5"])
    assert penalties(args) == {"repetition_penalty": 1.2, "frequency_penalty": 0.5}


def test_interleaved_servers_play_turn_by_turn_and_the_table_divides_by_the_reference(fake_server, tmp_path):
    from tests.clients.conftest import serve
    from tests.clients.fake_server import make_app

    other, other_url = serve(make_app())
    try:
        r = run_client("mtbench_demo", "--base-url", fake_server, "--label", "a", "--base-url", other_url,
                       "--label", "b", "--turns", "3", "--max-tokens", "40", "--quiet", "--interleave",
                       "--reference", "b", "--block", "2", "--out", str(tmp_path))
    finally:
        other.should_exit = True
    assert r.returncode == 0, r.stderr
    played = [line.split(" · ")[0].lstrip("[") + line.split(" · ")[1] for line in r.stdout.splitlines()
              if line.startswith("[")]
    assert played == ["aturn 1/3", "bturn 1/3", "aturn 2/3", "bturn 2/3", "aturn 3/3", "bturn 3/3"]
    table = r.stdout[r.stdout.index("turns | "):].splitlines()
    assert "a / b (ratio" in table[0] and [line.split(" | ")[0] for line in table[2:4]] == ["1-2", "3-4"]
    assert len(rows(tmp_path / "a.csv")) == len(rows(tmp_path / "b.csv")) == 3


def test_full_replies_send_min_tokens_at_max_tokens_only_where_asked():
    from clients.mtbench_demo import parse_args, request_extras

    with pytest.raises(SystemExit):
        parse_args(["--block", "0"])

    assert request_extras(parse_args([])) == {}
    assert request_extras(parse_args(["--full-replies", "--max-tokens", "48", "--presence-penalty", "0.1"])) == {
        "min_tokens": 48, "ignore_eos": True, "presence_penalty": 0.1}


def test_a_reference_that_names_no_run_is_a_clear_error(tmp_path):
    from clients.plot import write_csv

    write_csv(tmp_path / "h2o.csv", [{"label": "h2o", "turn": 1, "decode_tokens_per_s": 100.0,
                                      "completion_tokens": 64, "error": ""}])
    r = run_client("mtbench_demo", "--plot", str(tmp_path / "h2o.csv"), "--reference", "full", "--out", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--reference 'full' names no run (runs: h2o)" in r.stderr


def test_a_reference_that_names_no_server_fails_before_any_turn(tmp_path):
    # nothing listens on the port: the check must come before the demo reaches for a server
    r = run_client("mtbench_demo", "--base-url", "http://127.0.0.1:9", "--label", "recall", "--reference", "h2o",
                   "--out", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--reference 'h2o' names no run (runs: recall)" in r.stderr
    assert not list(tmp_path.glob("*.csv"))
