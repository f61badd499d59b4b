"""API keys: each accepted key names an opaque owner, so a session is only reachable with its key."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from server.errors import APIError


def key_owners(api_keys: list[str]) -> dict[str, str]:
    """key -> owner id. A digest, so the engine (and its logs) never hold a key itself."""
    return {key: hashlib.sha256(key.encode()).hexdigest()[:32] for key in api_keys}


def api_key_owner(request: Request) -> str:
    """FastAPI dependency: the owner of the request's bearer key; "" when the server has no keys."""
    owners: dict[str, str] = request.app.state.key_owners
    if not owners:
        return ""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() == "bearer" and key:
        for known, owner in owners.items():
            if hmac.compare_digest(known.encode(), key.encode()):  # constant time: no key guessing by timing
                return owner
    raise APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
