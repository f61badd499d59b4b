"""The Dockerfile, checked without a Docker engine: same install steps as the README, safe defaults."""

import json
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def readme_block(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)\n```", text, re.DOTALL)
    assert block, f"README has no {marker} block"
    return block.group(1).strip()


def instructions(name: str) -> list[str]:
    """Arguments of every `name` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def run_steps() -> list[str]:
    return [" ".join(step.split()) for run in instructions("RUN") for step in run.split("&&")]


def test_install_steps_are_the_readme_serve_command():
    steps = [" ".join(s.split()) for s in readme_block("serve-command").split("&&")]
    assert "-m server" in steps[-1], "the serve command should end by starting the server"
    installs = steps[:-1]
    docker = run_steps()
    found = [docker.index(s) if s in docker else -1 for s in installs]
    assert -1 not in found, f"README steps missing from the Dockerfile: {[s for s, i in zip(installs, found) if i < 0]}"
    assert found == sorted(found), "the README's install steps must run in the README's order"


def test_extra_installs_come_from_the_readme_test_command():
    test_steps = readme_block("test-command")
    for step in run_steps():
        if "pip install" in step and step not in readme_block("serve-command"):
            packages = [w for w in shlex.split(step) if not w.startswith("-") and w not in (".venv/bin/pip", "install")]
            for pkg in packages:
                assert pkg.split("[")[0] in test_steps or pkg.startswith(".["), f"{pkg} is installed by neither README command"


def test_cpu_base_by_default_with_a_cuda_build_arg():
    assert "ARG BASE_IMAGE=python:3.11-slim" in DOCKERFILE
    assert instructions("FROM") == ["${BASE_IMAGE}"]


def test_runs_the_server_offline_as_a_non_root_user():
    assert instructions("USER") and instructions("USER")[-1] not in ("root", "0")
    assert instructions("CMD") == ['["python", "-m", "server", "--host", "0.0.0.0"]']
    assert "HF_HUB_OFFLINE=1" in DOCKERFILE


def test_healthcheck_polls_health_with_the_standard_library():
    [check] = instructions("HEALTHCHECK")
    assert "/health" in check and "urllib.request" in check and "curl" not in check
    argv = json.loads(check.split("CMD", 1)[1])
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "healthcheck", "exec")


def test_copied_paths_exist_and_are_not_ignored():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    for copy in instructions("COPY"):
        for src in copy.split()[:-1]:
            assert (REPO / src).exists(), f"COPY {src}: no such path"
            assert src not in ignored, f"COPY {src} is excluded by .dockerignore"
