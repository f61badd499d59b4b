"""Start `python -m server` as a child process on a free loopback port, for benchmarks and tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


class ServerFailed(Exception):
    """The child exited or never became healthy; the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def start_server(args: list[str], log: Path, port: int | None = None, ready_timeout: float = 600.0,
                 module: str = "server") -> tuple[subprocess.Popen, str]:
    """Start `python -m MODULE --host 127.0.0.1 --port PORT *args` (output appended to `log`) and
    wait until /health answers 200; returns the process and its base URL. The caller stops it."""
    port = port or free_port()
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args]
    url = f"http://127.0.0.1:{port}"
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise ServerFailed(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{_tail(log)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServerFailed(f"{url} not healthy after {ready_timeout:.0f} s:\n{_tail(log)}")
            time.sleep(0.5)  # loading the model: polling slowly leaves it the CPU
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def spawned_server(policy: str, args: list[str] = (), log: Path = Path("server.log"), ready_timeout: float = 600.0,
                   state_dir: str = ""):
    """Yield the base URL of a healthy server running `--policy policy *args`; always stop it after.

    state_dir: its --state-dir; none by default, so a benchmark never resumes a conversation that an
    earlier run left on disk."""
    log.write_text("")
    proc, url = start_server(["--policy", policy, "--state-dir", state_dir, *args], log, ready_timeout=ready_timeout)
    try:
        yield url
    finally:
        stop_server(proc)
