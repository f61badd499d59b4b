"""Read docker/compose.yaml the way `docker compose` would, for the tests (no Docker engine here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "docker"


def interpolate(value):
    """Replace ${VAR:-default} and ${VAR} by their defaults, as compose does with an empty environment."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_compose() -> dict:
    return interpolate(yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text()))


def server_env_names() -> set[str]:
    """Every environment variable name `python -m server` reads, from its pydantic-settings classes."""
    settings = pytest.importorskip("server.settings", reason="server/settings.py has not landed yet")
    from pydantic_settings import BaseSettings

    names = set()
    for obj in vars(settings).values():
        if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj is not BaseSettings:
            prefix = obj.model_config.get("env_prefix", "")
            for name, field in obj.model_fields.items():
                names.add((prefix + name).upper())
                if isinstance(field.validation_alias, str):
                    names.add(field.validation_alias.upper())
    return names
