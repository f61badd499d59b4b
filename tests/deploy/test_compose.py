"""docker/compose.yaml, checked without a Docker engine: files, settings, profiles and commands."""

from pathlib import Path

import pytest

from clients.mtbench_demo import parse_args as demo_args
from tests.deploy.compose import COMPOSE_DIR, load_compose, server_env_names

COMPOSE = load_compose()
SERVICES = COMPOSE["services"]
BUILT = {name: s for name, s in SERVICES.items() if "build" in s}
SERVERS = {name: s for name, s in BUILT.items() if "command" not in s}  # the image's CMD: python -m server


def profile_of(service: dict) -> set[str]:
    return set(service.get("profiles", []))


def test_default_server_needs_no_profile():
    assert not profile_of(SERVICES["server"]) and SERVICES["server"]["ports"] == ["8000:8000"]
    assert set(SERVERS) == {"server", "server-gpu", "replica"} and {"demo", "router"} <= set(SERVICES)


@pytest.mark.parametrize("name", sorted(BUILT))
def test_build_context_and_dockerfile_exist(name):
    build = BUILT[name]["build"]
    context = (COMPOSE_DIR / build["context"]).resolve()
    assert context.is_dir() and (context / build.get("dockerfile", "Dockerfile")).is_file()
    assert set(build.get("args", {})) <= {"BASE_IMAGE"}, "the Dockerfile declares only ARG BASE_IMAGE"


def test_bind_mounts_exist():
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in COMPOSE.get("volumes", {}), f"{name}: named volume {source} is not declared"


def test_environment_names_are_server_settings():
    known = server_env_names()
    for name in SERVERS:
        env = SERVICES[name].get("environment", {})
        assert env, f"{name} sets no server settings"
        unknown = {k for k in env if k.startswith("H2O_")} - known
        assert not unknown, f"{name}: {unknown} are not settings of `python -m server` ({sorted(known)})"


def test_servers_restart_and_healthcheck_on_the_health_endpoint():
    for name in [*SERVERS, "router"]:
        service = SERVICES[name]
        assert service["restart"] == "unless-stopped"
        assert "/health" in " ".join(service["healthcheck"]["test"])
    for name in SERVERS:
        test = SERVICES[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        compile(test[3], "healthcheck", "exec")


def test_servers_keep_their_state_in_a_named_volume_and_docker_stop_outwaits_the_shutdown():
    for name in SERVERS:
        service = SERVICES[name]
        state_dir = service["environment"]["H2O_STATE_DIR"]
        assert f"state:{state_dir}" in service["volumes"] and "state" in COMPOSE["volumes"]
        grace = int(service["stop_grace_period"].removesuffix("s"))
        # in-flight replies get the shutdown timeout, then the snapshots need time of their own
        assert grace >= float(service["environment"]["H2O_SHUTDOWN_TIMEOUT"]) + 20


def test_gpu_profile_reserves_a_gpu():
    gpu = SERVICES["server-gpu"]
    assert profile_of(gpu) == {"gpu"}
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "cuda" in gpu["build"]["args"]["BASE_IMAGE"] and gpu["environment"]["H2O_DEVICE"] == "cuda"
    assert gpu["environment"]["H2O_POLICY"] == SERVICES["server"]["environment"]["H2O_POLICY"]


def test_scale_profile_routes_replicas_by_session():
    replica, router = SERVICES["replica"], SERVICES["router"]
    assert profile_of(replica) == profile_of(router) == {"scale"}
    assert int(replica["deploy"]["replicas"]) > 1
    assert router["depends_on"]["replica"]["condition"] == "service_healthy"
    conf = (COMPOSE_DIR / "nginx.conf").read_text()
    assert "hash $route_key consistent;" in conf and "map $http_x_session_id $route_key" in conf
    assert "server replica:8000;" in conf and "proxy_buffering off;" in conf


def test_demo_command_is_a_valid_mtbench_demo_invocation():
    demo = SERVICES["demo"]
    assert demo["depends_on"]["server"]["condition"] == "service_healthy"
    python, flag, module, *argv = demo["command"]
    assert (python, flag, module) == ("python", "-m", "clients.mtbench_demo")
    args = demo_args(argv)
    assert args.base_url == ["http://server:8000"] and args.history in ("resend", "session")
    assert Path(args.out) == Path("/out") and "demo-out:/out" in demo["volumes"]


def test_every_image_is_built_here_or_pinned():
    """The demo reuses the server image; the router pins its nginx version."""
    for name, service in SERVICES.items():
        image = service["image"]
        assert image.startswith("h2o-chat:") if name in BUILT else ":" in image and not image.endswith(":latest")
