"""Time in a reply's stream: keep-alive comments through a long silence, and the per-request deadline."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

from server.errors import APIError

T = TypeVar("T")

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see the connection is alive


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"the request ran past this server's limit of {seconds:g} s (--request-timeout)",
                    "timeout_error", "request_timeout")


async def paced(source: AsyncIterator[T], keepalive: float, timeout: float | None) -> AsyncIterator[T | None]:
    """The items of `source`, with a None after every `keepalive` seconds without one (a prefill
    that takes long); raises the `timed_out` error once `timeout` seconds have passed since the start.

    Waiting never cancels the pending read, which would end `source` (a Handle cancels its request
    when its iteration is interrupted); the read is cancelled only when this generator ends.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            wait = keepalive if deadline is None else min(keepalive, deadline - loop.time())
            done = (await asyncio.wait({pending}, timeout=wait))[0] if wait > 0 else set()
            if not done:
                if deadline is not None and loop.time() >= deadline:
                    raise timed_out(timeout)
                yield None
                continue
            read, pending = pending, None
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
