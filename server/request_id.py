"""`X-Request-Id`: every response carries one (the client's own when it sent a sane one), and the
server logs each request under it, so a client's report can be found in the log."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_SANE = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")  # what may be echoed into a header and a log line

log = logging.getLogger("server.requests")


class RequestIds:
    """ASGI middleware: reads or makes the request id, keeps it in `scope["state"]["request_id"]`,
    adds it to the response and logs the request's method, path, status and duration once it ends.
    Plain ASGI rather than BaseHTTPMiddleware, which would buffer and detach streaming responses."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(HEADER.encode(), b"").decode("latin-1")
        request_id = sent if _SANE.match(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        started = time.perf_counter()

        async def with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, with_id)
        finally:
            log.info("request %s: %s %s -> %d in %.0f ms", request_id, scope["method"], scope["path"], status,
                     (time.perf_counter() - started) * 1000)
