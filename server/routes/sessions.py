"""GET /v1/sessions/{session_id}/cache: what a session's KV cache still holds, for the cache inspector."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request

from server.cache_protocol import SessionCache
from server.engine.types import EngineNotReady
from server.errors import ErrorResponse
from server.routes.auth import api_key_owner

router = APIRouter()


@router.get("/v1/sessions/{session_id}/cache", response_model=SessionCache,
            responses={401: {"model": ErrorResponse, "description": "missing or invalid API key"},
                       404: {"model": ErrorResponse, "description": "no such session for this API key"},
                       503: {"model": ErrorResponse, "description": "the model is still loading"}})
async def session_cache(request: Request, session_id: str,
                        last: int = Query(4096, ge=1, le=65536, description="spell out only the last N tokens"),
                        owner: str = Depends(api_key_owner)) -> SessionCache:
    """Per layer and KV head, the positions of the conversation's tokens the session's cache holds and
    their scores, with the text of the conversation's last `last` tokens. Owned like the session: an
    unknown id and another key's session both answer 404. During a reply the view is live (read between
    two decode steps)."""
    engine = request.app.state.engine
    if engine is None:
        raise EngineNotReady("the model is still loading; retry when /health answers 200")
    return SessionCache.of(await engine.inspect(owner, session_id, last))
