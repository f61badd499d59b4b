"""Graceful shutdown of `python -m server`: SIGTERM lets the replies in flight finish, then exits."""

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from clients.server_proc import free_port


def start(model_dir, *flags):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model", str(model_dir), "--port", str(port),
                             "--threads", "1", "--log-level", "warning", "--state-dir", "", *flags])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


def stream_after_sigterm(proc, url, max_tokens):
    """Start a stream, SIGTERM the server once tokens flow, read the rest; (tokens, usage, done)."""
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens, usage, done, errors = 0, None, False, []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"]["message"])
                    continue
                tokens += sum(1 for c in chunk.get("choices", []) if c["delta"].get("content"))
                usage = chunk.get("usage") or usage
                if tokens == 5:
                    proc.send_signal(signal.SIGTERM)
    except httpx.RemoteProtocolError:  # the server closed the stream at its shutdown timeout
        pass
    return tokens, usage, done, errors


@pytest.mark.slow
def test_sigterm_lets_a_reply_in_flight_finish_and_refuses_new_connections(tiny_model_dir):
    proc, url = start(tiny_model_dir, "--shutdown-timeout", "60")
    try:
        tokens, usage, done, errors = stream_after_sigterm(proc, url, 400)
        assert done and not errors and usage["completion_tokens"] == 400  # the whole reply, after the SIGTERM
        assert proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises the signal once drained
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        proc.kill()


@pytest.mark.slow
def test_a_reply_longer_than_the_shutdown_timeout_ends_with_an_error_frame(tiny_model_dir):
    proc, url = start(tiny_model_dir, "--shutdown-timeout", "2")
    try:
        started = time.monotonic()
        tokens, usage, done, errors = stream_after_sigterm(proc, url, 4000)
        assert done and errors == ["the server is shutting down"]  # then `data: [DONE]`, not a cut
        assert tokens < 4000 and time.monotonic() - started < 30
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
