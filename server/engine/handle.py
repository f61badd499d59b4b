"""`Handle`: a request's output stream, fed from the engine thread into the asyncio loop."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

from server.engine.types import Delta, Finish, GenerationFailed

log = logging.getLogger(__name__)

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


class Outbox:
    """Items for many channels, delivered with one wake-up of their event loop per `flush`.

    The engine thread emits an item per running row per step; one `call_soon_threadsafe` per item
    would wake the loop B times a step. Items keep their order per channel.
    """

    def __init__(self):
        self._items: list[tuple[Channel, Delta | Finish | Exception]] = []

    def put(self, channel: Channel, item: Delta | Finish | Exception) -> None:
        self._items.append((channel, item))

    def flush(self) -> list[Channel]:
        """Deliver everything put so far; returns the channels whose loop is gone (nobody listens)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for channel, item in self._items:
            by_loop.setdefault(channel.loop, []).append((channel, item))
        self._items = []
        gone = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # event loop closed
                gone += [channel for channel, _ in items]
        return gone


async def _committed(finish: Finish) -> None:
    """Wait until the turn's transcript is on disk, so no reply is seen to end before it is saved."""
    if finish.durable is None:
        return
    try:
        await asyncio.wrap_future(finish.durable)
    except Exception:  # the reply stands; only its durability was lost
        log.exception("the transcript of a finished turn could not be saved")


def _deliver(items: list[tuple[Channel, object]]) -> None:
    for channel, item in items:
        channel.queue.put_nowait(item)


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
        batches = self.batches()
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()  # now, not at garbage collection: closing cancels the request

    async def batches(self) -> AsyncIterator[list[Delta | Finish]]:
        """The same items, as lists of everything that has arrived (at least one item each): a
        consumer that fell behind catches up in one go, e.g. one network write for several tokens."""
        queue = self._channel.queue
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for item in items:
                    if item is _CLOSED:
                        break
                    if isinstance(item, Exception):
                        self._done = True
                        if batch:
                            yield batch
                        raise item if isinstance(item, GenerationFailed) else GenerationFailed(str(item))
                    batch.append(item)
                    if isinstance(item, Finish):
                        self._done = True
                        await _committed(item)
                        break
                if batch:
                    yield batch
                if self._done or item is _CLOSED:
                    return
        finally:
            self.cancel()
