"""`Scheduler`: the waiting queue, the running batch and the batch cache whose rows they occupy."""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from h2o_cache import H2OCache
from server.engine.sequence import Sequence, Status
from server.engine.types import EngineNotReady, QueueFull


class Scheduler:
    """Admission and the mapping between running sequences and rows of the batch cache.

    `running[i]` is row i of `batch`. `H2OCache.pop` moves the last row into the freed one, and
    `leave` mirrors that move, so the two never disagree.

    `reserve`/`add`/`wake`/`call` are called from the asyncio thread; everything else from the engine thread.
    """

    def __init__(self, batch: H2OCache, max_batch_size: int, max_queue: int):
        self.batch = batch
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._inbox: deque[Sequence] = deque()
        self._in_flight = 0  # reserved, waiting or running: what max_queue bounds
        self._stopping = False
        self._abort: str | None = None  # set by `abort`: fail everything in flight with this message
        self._calls: deque[Callable[[], None]] = deque()  # to run on the engine thread between steps
        self._cond = threading.Condition()

    # ----- asyncio thread -----------------------------------------------------------------------

    def reserve(self) -> None:
        """Hold a place for a request about to be submitted, or raise QueueFull."""
        with self._cond:
            if self._in_flight >= self.max_queue:
                raise QueueFull(f"{self._in_flight} requests are waiting or running (max_queue={self.max_queue})")
            self._in_flight += 1

    def unreserve(self) -> None:
        with self._cond:
            self._in_flight -= 1

    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose place was reserved; wakes the engine thread."""
        with self._cond:
            if self._stopping:  # the engine thread would never see it
                raise EngineNotReady("the engine is stopping")
            self._inbox.append(seq)
            self._cond.notify()

    def call(self, fn: Callable[[], None]) -> None:
        """Have the engine thread run `fn` before its next step, when no batch tensor is being written."""
        with self._cond:
            if self._stopping:
                raise EngineNotReady("the engine is stopping")
            self._calls.append(fn)
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def abort(self, reason: str) -> None:
        """Have the engine thread fail every request in flight at its next iteration (any thread)."""
        with self._cond:
            self._abort = reason
            self._cond.notify()

    # ----- engine thread ------------------------------------------------------------------------

    def take_calls(self) -> list[Callable[[], None]]:
        with self._cond:
            calls = list(self._calls)
            self._calls.clear()
            return calls

    def take_abort(self) -> str | None:
        with self._cond:
            reason, self._abort = self._abort, None
            return reason

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until there is something to do, or `timeout` seconds pass; False once stopping.
        Moves newcomers to `waiting`."""
        with self._cond:
            while not (self._stopping or self._inbox or self.waiting or self.running or self._calls):
                if not self._cond.wait(timeout):
                    break
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            return not self._stopping

    def next_prefills(self, tokens: int, chunk: int) -> list[Sequence]:
        """The oldest waiting sequences to prefill together: each takes its next chunk (<= `chunk`
        tokens) while their total stays within `tokens` (the oldest always goes), and only as many
        as the batch has rows free for once they are prefilled."""
        chosen: list[Sequence] = []
        free = self.max_batch_size - len(self.running)
        for seq in self.waiting:
            if len(chosen) == free:
                break
            size = len(seq.next_chunk(chunk))
            if chosen and size > tokens:
                break
            chosen.append(seq)
            tokens -= size
        return chosen

    def join(self, seq: Sequence) -> None:
        """Move a prefilled sequence's 1-row cache into the batch as its last row."""
        self.batch.extend(seq.cache, move=True)  # first: if the copy fails, the sequence is still waiting
        self.waiting.remove(seq)
        seq.cache = None
        seq.status = Status.RUNNING
        self.running.append(seq)

    def leave(self, seq: Sequence) -> H2OCache | None:
        """Take a sequence out of the queue or the batch; returns its 1-row cache."""
        if seq.status is Status.RUNNING:
            row = self.running.index(seq)
            seq.cache = self.batch.pop(row)
            self.running[row] = self.running[-1]
            self.running.pop()
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        with self._cond:
            self._in_flight -= 1
        cache, seq.cache = seq.cache, None
        return cache

    def drain(self) -> list[Sequence]:
        """Every sequence not finished, for shutdown."""
        with self._cond:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        return [*self.waiting, *self.running]

    @property
    def in_flight(self) -> int:
        return self._in_flight
