"""`Handle`: a request's output stream, fed from the engine thread into the asyncio loop."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from server.engine.types import Delta, Finish, GenerationFailed

_CLOSED = object()  # ends the iteration after cancel()


class Channel:
    """Per-request output queue: the engine thread puts, the request's coroutine gets.

    `put` never blocks: the engine never waits on a consumer, however slow. It returns False once
    the loop is gone (the server shut down under a request), so the engine can drop the sequence.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Delta | Finish | Exception) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # event loop closed
            return False
        return True


class Handle:
    """Async-iterable of `Delta`s ending with exactly one `Finish`; raises `GenerationFailed`.

    Leaving the iteration early (the client disconnected) cancels the request, like `cancel()`;
    the engine frees its batch slot within one step.
    """

    def __init__(self, session_id: str, prompt_tokens: int, cached_tokens: int, channel: Channel,
                 on_cancel: Callable[[], None]):
        self.session_id = session_id
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self._channel = channel
        self._on_cancel = on_cancel
        self._done = False

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._on_cancel()
            self._channel.queue.put_nowait(_CLOSED)

    def __aiter__(self) -> AsyncIterator[Delta | Finish]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[Delta | Finish]:
        try:
            while True:
                item = await self._channel.queue.get()
                if item is _CLOSED:
                    return
                if isinstance(item, Exception):
                    self._done = True
                    raise item if isinstance(item, GenerationFailed) else GenerationFailed(str(item))
                if isinstance(item, Finish):
                    self._done = True
                    yield item
                    return
                yield item
        finally:
            self.cancel()
