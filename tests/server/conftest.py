"""HTTP-layer fixtures: the app on a fake engine, an in-process client, and a real uvicorn on loopback."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from server.app import create_app
from server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine


@pytest.fixture(autouse=True)
def no_server_environment(monkeypatch):
    """Settings come from the test and the defaults, whatever H2O_* the shell exports."""
    for name in [n for n in os.environ if n.startswith("H2O_")]:
        monkeypatch.delenv(name)


@contextmanager
def serving(app):
    """Run `app` under uvicorn on a free 127.0.0.1 port in a thread; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def settings() -> ServerSettings:
    return ServerSettings()


@pytest.fixture
def app(settings, engine):
    return create_app(settings, engine)


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


@pytest.fixture
def live_url(app):
    with serving(app) as url:
        yield url
