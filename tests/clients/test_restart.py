"""The restart fault program on the tiny model, scaled down: a graceful and a SIGKILL restart of a
real server process lose no completed turn, and a snapshot resumes with the same greedy reply."""

import pytest

from clients.restart import main

pytestmark = pytest.mark.slow


def test_conversations_survive_both_kinds_of_restart(tiny_model_dir, tmp_path, capsys):
    status = main(["--model", str(tiny_model_dir), "--kv-budget", "32", "--threads", "1", "--rounds", "1",
                   "--conversations", "2", "--turns", "2", "--noise", "2", "--target-turns", "5",
                   "--state-dir", str(tmp_path / "state"), "--log", str(tmp_path / "server.log")])
    out = capsys.readouterr().out
    assert status == 0, out + (tmp_path / "server.log").read_text()[-3000:]
    assert "conversations missing one after a restart: 0" in out and "same reply" in out
    assert out.rstrip().endswith("ok") and (tmp_path / "state" / "state.db").is_file()
