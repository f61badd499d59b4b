"""The server's own endpoints: /health for orchestrators, /metrics for Prometheus, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from server import metrics
from server.errors import APIError
from server.routes.auth import api_key_owner

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded and the engine runs; 503 while loading, or if loading failed."""
    state = request.app.state
    engine = state.engine
    if state.load_error is not None:
        return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
    if engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    if not engine.ready:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.model_name})


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(metrics.render(request.app.state.metrics), media_type=metrics.CONTENT_TYPE)


def model_card(state) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "h2o-chat"}


@router.get("/v1/models", dependencies=[Depends(api_key_owner)])
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(request.app.state)]}


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(api_key_owner)])
async def retrieve_model(model_id: str, request: Request) -> dict:
    """The served model. With --served-model-name, another name is a 404, as OpenAI answers for a
    model that does not exist; without it, any name is the one model (as chat requests treat it)."""
    state = request.app.state
    if state.settings.served_model_name and model_id != state.model_name:
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    return model_card(state)
