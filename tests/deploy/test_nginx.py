"""docker/nginx.conf for real: `nginx -t`, then session affinity through it over three fake replicas.

Docker's DNS name `replica` only exists inside compose, so the test swaps it for loopback replicas.
CI installs nginx from Debian (.ci/run); elsewhere the test skips when nginx is missing.
"""

import re
import shutil
import subprocess
import time
from collections import Counter

import httpx
import pytest

from clients.api import make_client, stream_chat
from tests.clients.conftest import free_port, serve
from tests.clients.fake_server import make_app
from tests.deploy.compose import COMPOSE_DIR

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (apt-get install nginx-light)")


@pytest.fixture
def router(tmp_path):
    """(router URL, replica names): nginx on a loopback port in front of three fake servers."""
    replicas = {name: serve(make_app(replica=name)) for name in ("r0", "r1", "r2")}
    conf = (COMPOSE_DIR / "nginx.conf").read_text()
    assert conf.count("server replica:8000;") == 1 and conf.count("listen 80;") == 1
    port = free_port()
    conf = (conf.replace("server replica:8000;", " ".join(f"server {url[7:]};" for _, url in replicas.values()))
            .replace("listen 80;", f"listen 127.0.0.1:{port};")
            .replace("/dev/stdout", str(tmp_path / "access.log")))
    (tmp_path / "nginx.conf").write_text(conf)
    base = ["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", str(tmp_path / "error.log")]
    check = subprocess.run([*base, "-t", "-g", f"pid {tmp_path}/nginx.pid;"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen([*base, "-g", f"daemon off; pid {tmp_path}/nginx.pid;"])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield url, set(replicas)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for server, _ in replicas.values():
            server.should_exit = True


async def test_each_session_stays_on_one_replica_and_new_ones_spread(router):
    url, names = router
    landed = Counter()
    async with make_client(url) as client:
        for _ in range(12):
            first = await stream_chat(client, [{"role": "user", "content": "hello"}], max_tokens=3)
            sid = first.session_id
            assert re.fullmatch(r"[0-9a-f]{32}\.[0-9a-f]{32}", sid)  # "<router key>.<replica's id>"
            for _ in range(3):
                # A fake replica answers 404 for a session it does not hold: a 200 proves affinity.
                nxt = await stream_chat(client, [{"role": "user", "content": "more"}], session_id=sid, max_tokens=3)
                assert nxt.session_id == sid and len(nxt.chunk_times) == 3  # streamed through, same id
            async with client.stream("POST", "/v1/chat/completions", headers={"X-Session-ID": sid},
                                     json={"messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
                landed[r.headers["x-replica"]] += 1
        assert (await client.get("/health")).status_code == 200
    assert len(landed) >= 2 and set(landed) <= names  # new conversations spread over the replicas


async def test_a_replica_session_id_reached_directly_passes_through(router):
    """An id with no router key (the client first talked to a replica directly) is hashed as is."""
    url, _ = router
    async with make_client(url) as client:
        r = await client.post("/v1/chat/completions", headers={"X-Session-ID": "plain-id"},
                              json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status_code == 404 and "plain-id" in r.json()["error"]["message"]


async def test_the_cache_inspector_reaches_the_replica_holding_the_session(router):
    """GET /v1/sessions/<key>.<id>/cache is routed by the key in its path and the replica sees <id>."""
    url, _ = router
    async with make_client(url) as client:
        for _ in range(6):  # several conversations, so some land on other replicas than hash(path) would
            first = await stream_chat(client, [{"role": "user", "content": "hello"}], max_tokens=3)
            key, replica_id = first.session_id.split(".")
            r = await client.get(f"/v1/sessions/{first.session_id}/cache", params={"last": 5})
            assert r.status_code == 200, r.text
            assert r.json()["session_id"] == replica_id
            gone = await client.get(f"/v1/sessions/{key}.unknown/cache")
            assert gone.status_code == 404
