"""Serve the fake server on a free loopback port in a background thread, and run clients as programs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.clients.fake_server import make_app

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(app) -> tuple[uvicorn.Server, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError("fake server did not start")


@pytest.fixture
def fake_server():
    server, url = serve(make_app())
    yield url
    server.should_exit = True


@pytest.fixture
def small_context_server():
    """Refuses a conversation past 60 words, like the `full` policy past the model's window."""
    server, url = serve(make_app(context_limit=60))
    yield url
    server.should_exit = True


@pytest.fixture
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def run_client(module: str, *args: str, stdin: str = "", timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m clients.<module>` as a user would; the output is checked for tracebacks."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", f"clients.{module}", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env, check=False)
