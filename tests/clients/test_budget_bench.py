"""`clients.budget_bench`: servers side by side on the same long messages, their memory, facts and times."""

import json
import re

import pytest

from clients.budget_bench import gauges, labelled, main, messages, per_conversation, table
from tests.clients.conftest import free_port, serve
from tests.clients.fake_server import make_app

WORDS = [f"w{i}" for i in range(20_000)]


def code_of(content: str) -> list[str]:
    """A fake model that finds the fact: it answers with the message's 6-digit number."""
    return re.findall(r"\b\d{6}\b", content)[:1] or ["none"]


@pytest.fixture
def servers():
    finder, finder_url = serve(make_app(answer=code_of, kv_bytes=3_000_000))
    blind, blind_url = serve(make_app(prefill=0.02))  # no /metrics, and it never finds the code
    yield finder_url, blind_url
    finder.should_exit = blind.should_exit = True


def news(tmp_path):
    """A JSON-lines file of documents (the code form's filler), 3,000 words."""
    path = tmp_path / "news.jsonl"
    path.write_text("".join(json.dumps({"document": " ".join(WORDS[i:i + 500])}) + "\n" for i in range(0, 3000, 500)))
    return path


def test_a_run_sends_every_message_to_every_server_in_rotated_order_and_tells_who_found_the_facts(servers, tmp_path, capsys):
    finder, blind = servers
    rows_path = tmp_path / "rows.json"
    argv = ["--base-url", f"finder={finder}", "--base-url", f"blind={blind}", "--messages", "3", "--words", "300",
            "--max-tokens", "6", "--json", str(rows_path), "--quiet", "--xsum", str(news(tmp_path))]
    assert main(argv) == 0
    rows = json.loads(rows_path.read_text())
    assert [(r["message"], r["server"]) for r in rows] == [(0, "finder"), (0, "blind"), (1, "blind"), (1, "finder"),
                                                         (2, "finder"), (2, "blind")]
    assert all(r["completion_tokens"] == 6 and r["decode_ms"] > 0 for r in rows)
    assert [r["found"] for r in rows if r["server"] == "finder"] == [True] * 3
    assert not any(r["found"] for r in rows if r["server"] == "blind")
    # the finder's metrics: 3 MB a kept session on the device, half that archived; the blind server has none
    assert {r["device_bytes"] for r in rows if r["server"] == "finder"} == {3e6}
    assert all(r["device_bytes"] is None and r["archive_bytes"] is None for r in rows if r["server"] == "blind")
    out = capsys.readouterr().out
    finder_row = next(line for line in out.splitlines() if line.startswith("| finder"))
    blind_row = next(line for line in out.splitlines() if line.startswith("| blind"))
    cells = [c.strip() for c in finder_row.split("|")[1:-1]]
    assert cells[2:5] == ["3.0", "1.5", "3/3"] and cells[6] == "1.00" and cells[8] == "1.00"
    blind_cells = [c.strip() for c in blind_row.split("|")[1:-1]]
    assert blind_cells[2:5] == ["", "", "0/3"]
    assert float(blind_cells[6]) > 1.0  # its 20 ms before the first token, against the finder's none


def test_the_table_pairs_ratios_by_message():
    rows = [{"server": s, "message": m, "prompt_tokens": 100 + m, "ttft_s": t, "decode_ms": d, "found": f,
             "device_bytes": None, "archive_bytes": None}
            for s, m, t, d, f in [("a", 0, 1.0, 10.0, True), ("b", 0, 2.0, 30.0, False),
                                  ("a", 1, 4.0, 20.0, True), ("b", 1, 4.0, 20.0, True)]]
    lines = table(rows, ["a", "b"])
    b = [c.strip() for c in lines[-1].split("|")[1:-1]]
    # ratios 2.0 and 1.0 for the first token (median 1.5), 3.0 and 1.0 for decode (median 2.0): paired, not
    # the ratio of the medians (3.0 / 2.5 and 25 / 15)
    assert b == ["b", "100-101", "", "", "1/2", "3.00", "1.50", "25.00", "2.00"]


def test_metrics_pages_give_a_conversations_share_and_labelled_series_are_not_read_as_gauges():
    page = gauges("# TYPE h2o_active_sessions gauge\nh2o_active_sessions 4.0\nh2o_resident_kv_bytes 8e6\n"
                  'h2o_archived_kv_bytes{kind="x"} 5\nh2o_archived_kv_bytes 2000000.0\nother 1\n')
    assert page == {"h2o_active_sessions": 4.0, "h2o_resident_kv_bytes": 8e6, "h2o_archived_kv_bytes": 2e6}
    assert per_conversation(page) == (2e6, 5e5)
    assert per_conversation({"h2o_active_sessions": 0.0, "h2o_resident_kv_bytes": 1.0}) == (None, None)
    assert per_conversation({"h2o_active_sessions": 2.0, "h2o_resident_kv_bytes": 4.0}) == (2.0, None)


def test_messages_plant_each_key_once_at_the_depths_in_turn_each_in_its_own_passage():
    sent = messages("code", WORDS, 4, 1000, [0.25, 0.75], seed=3)
    assert len({key for _, key in sent}) == 4 and len({content for content, _ in sent}) == 4
    for i, (content, key) in enumerate(sent):
        words = content.split()
        assert content.count(key) == 1 and words.index("Staff") == (250 if i % 2 == 0 else 750)
    assert messages("code", WORDS, 4, 1000, [0.25, 0.75], seed=3) == sent  # the same seed: the same messages


def test_labels_are_required_and_distinct(capsys):
    assert labelled("512=--kv-budget 512", "--spawn") == ("512", "--kv-budget 512")
    assert labelled("defaults=", "--spawn") == ("defaults", "")
    for argv in (["--spawn", "--kv-budget 512"], ["--base-url", "=http://x"], ["--base-url", "a=http://x", "--base-url", "a=http://y"], []):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    assert "LABEL=VALUE" in capsys.readouterr().err


def test_a_server_that_is_not_there_fails_the_run_with_a_message(tmp_path, capsys):
    assert main(["--base-url", f"gone=http://127.0.0.1:{free_port()}", "--messages", "1", "--words", "50", "--quiet",
                 "--xsum", str(news(tmp_path))]) == 1
    assert "error:" in capsys.readouterr().err


def test_a_missing_filler_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--base-url", "a=http://127.0.0.1:1", "--xsum", str(tmp_path / "none.jsonl")])
    assert exited.value.code == 2 and "the filler" in capsys.readouterr().err
