"""One error shape everywhere, `{"error": {"message", "type", "param", "code"}}`, chosen by exception type."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from server.engine.types import (
    EngineError, EngineNotReady, GenerationFailed, InvalidGrammar, InvalidTokenId, PromptTooLong, QueueFull,
    SessionBusy, SessionNotFound,
)

log = logging.getLogger("server")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response, and of the error frame of a stream."""

    error: ErrorInfo


class APIError(Exception):
    """An error the client sees: an HTTP status and the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# status, type, code, param
ENGINE_ERRORS: dict[type[EngineError], tuple[int, str, str, str | None]] = {
    PromptTooLong: (400, "invalid_request_error", "context_length_exceeded", "messages"),
    InvalidGrammar: (400, "invalid_request_error", "invalid_grammar", "response_format"),
    InvalidTokenId: (400, "invalid_request_error", "invalid_token_id", None),
    SessionNotFound: (404, "invalid_request_error", "session_not_found", "session_id"),
    SessionBusy: (409, "invalid_request_error", "session_busy", "session_id"),
    QueueFull: (429, "rate_limit_error", "queue_full", None),
    GenerationFailed: (500, "server_error", "generation_failed", None),
    EngineNotReady: (503, "server_error", "model_not_ready", None),
}


def from_engine_error(exc: EngineError) -> APIError:
    """Look the type up along its MRO, so an engine subclass of a known error maps like its parent."""
    for cls in type(exc).__mro__:
        if cls in ENGINE_ERRORS:
            status, type_, code, param = ENGINE_ERRORS[cls]
            break
    else:
        status, type_, code, param = 500, "server_error", "engine_error", None
    headers = {"Retry-After": str(math.ceil(exc.retry_after))} if isinstance(exc, QueueFull) else None
    param = getattr(exc, "param", None) or param  # an error that knows which field it is about says so
    return APIError(status, str(exc) or type(exc).__name__, type_, code, param, headers)


def internal_error() -> APIError:
    """What a client sees of a bug: no traceback, no exception text."""
    return APIError(500, "internal server error", "server_error", "internal_error")


def param_name(loc: tuple) -> str | None:
    """OpenAI's spelling of a field path: ("body", "messages", 0, "role") -> "messages.[0].role"."""
    parts = [f"[{p}]" if isinstance(p, int) else str(p) for p in loc[1:] if p != ""]
    return ".".join(parts) or None


def from_validation_error(exc: RequestValidationError) -> APIError:
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return APIError(400, f"malformed JSON in the request body: {error.get('ctx', {}).get('error', '')}".strip())
    param = param_name(tuple(error["loc"]))
    if error["type"] == "extra_forbidden":
        return APIError(400, f"unsupported parameter: {param} is not a field this server accepts", param=param,
                        code="unsupported_parameter")
    if param is None:
        return APIError(400, "the request body must be a JSON object, sent with Content-Type: application/json")
    return APIError(400, f"{param}: {error['msg']}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return from_engine_error(exc).response()

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return internal_error().response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(EngineError, engine_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
