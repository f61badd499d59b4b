"""spawned_server with a stand-in `server` package: it waits for /health, and always stops the child."""

import httpx
import pytest

from clients.server_proc import ServerFailed, spawned_server
from tests.clients.conftest import REPO

FAKE_MAIN = """
import argparse, uvicorn
from tests.clients.fake_server import make_app
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--policy")
args, _ = p.parse_known_args()
print("policy", args.policy, flush=True)
uvicorn.run(make_app(), host=args.host, port=args.port, log_level="warning")
"""


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A `server` package in the working directory, found before the real one by `python -m server`."""
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return tmp_path / "server" / "__main__.py"


def test_yields_a_healthy_server_and_stops_it(fake_package, tmp_path):
    fake_package.write_text(FAKE_MAIN)
    with spawned_server("h2o", log=tmp_path / "s.log", ready_timeout=60) as url:
        assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health")
    assert "policy h2o" in (tmp_path / "s.log").read_text()


def test_a_server_that_dies_is_reported_with_its_log(fake_package, tmp_path):
    fake_package.write_text("import sys\nprint('no model here')\nsys.exit(3)\n")
    with pytest.raises(ServerFailed, match="exited with 3(.|\n)*no model here"), \
            spawned_server("h2o", log=tmp_path / "s.log", ready_timeout=60):
        pass
