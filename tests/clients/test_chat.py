"""The terminal chat driven through stdin: streaming, /reset, /exit, and errors without tracebacks."""

from tests.clients.conftest import run_client


def test_conversation_reset_and_exit(fake_server):
    r = run_client("chat", "--base-url", fake_server, "--max-tokens", "3",
                   stdin="hello there\nand more\n/reset\nfresh start\n/exit\nnever sent\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant> w0 w1 w2") == 3
    # Session continuity: the second turn's conversation includes the first; /reset starts from zero.
    assert "conversation 5 tokens" in r.stdout and "conversation 10 tokens" in r.stdout
    assert "(new conversation)" in r.stdout and "conversation 5 tokens" in r.stdout.split("(new conversation)")[1]


def test_end_of_input_exits_cleanly(fake_server):
    r = run_client("chat", "--base-url", fake_server, "--max-tokens", "2", stdin="hi\n")
    assert r.returncode == 0 and "assistant> w0 w1" in r.stdout


def test_server_down(dead_url):
    r = run_client("chat", "--base-url", dead_url, stdin="hello\n")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "cannot connect" in r.stderr and "python -m server" in r.stderr


def test_server_error_is_shown_and_chat_goes_on(small_context_server):
    r = run_client("chat", "--base-url", small_context_server, "--max-tokens", "3",
                   stdin="word " * 100 + "\nshort\n")
    assert "error: context_length_exceeded (HTTP 400)" in r.stderr and "Traceback" not in r.stderr
    assert "assistant> w0 w1 w2" in r.stdout and r.returncode == 0  # the last message was answered


def test_error_in_stream_as_last_message_exits_nonzero(fake_server):
    r = run_client("chat", "--base-url", fake_server, stdin="FAIL_MIDSTREAM\n")
    assert r.returncode == 1 and "generation_failed" in r.stderr and "Traceback" not in r.stderr
