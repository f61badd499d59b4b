"""`python -m server`: help, refusing bad settings early, and exiting when the model cannot load."""

import socket
import subprocess
import sys

import pytest

from server.__main__ import main


def test_an_inconsistent_budget_exits_before_loading(capsys):
    assert main(["--kv-budget", "4", "--sink-tokens", "8"]) == 2
    assert "sink tokens" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--policy", "full", "--recall-budget", "64"], "recall needs an evicting policy"),
    (["--recall-budget", "20"], "must be a multiple of recall_block"),  # blocks of 8
    (["--recall-budget", "64", "--recall-archive", "32"], "must hold at least recall_budget"),
    (["--recall-digest", "median"], "--recall-digest: Input should be 'centre', 'mean' or 'minmax' (got 'median')"),
    (["--device", "tpu"], "--device: Input should be 'auto', 'cpu' or 'cuda' (got 'tpu')"),
    (["--kv-budget", "0"], "--kv-budget: Input should be greater than or equal to 2"),
])
def test_recall_settings_that_cannot_work_exit_before_loading(capsys, args, message):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_server_help():
    r = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--kv-budget" in r.stdout and "H2O_KV_BUDGET" in r.stdout


def test_a_model_that_cannot_load_stops_the_server_with_status_1(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["--port", str(port), "--model", str(tmp_path / "missing.gguf"), "--log-level", "error"]) == 1
