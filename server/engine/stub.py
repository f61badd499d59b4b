"""`StubEngine`: the engine's HTTP contract with no model, to measure what the HTTP side sustains.

Every step it emits one token to each running request through the real engine-to-loop path
(`Outbox` -> `Channel` -> `Handle`), so what a benchmark measures with it is the event loop, the
ASGI stack, SSE framing and socket writes, as they would be behind a step that costs `step_seconds`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from dataclasses import dataclass

from server.engine.handle import Channel, Handle, Outbox
from server.engine.types import ChatRequest, Delta, EngineNotReady, Finish, QueueFull, Usage


class _Spelling:
    """The tokenizer's one method the HTTP layer calls (for logprobs)."""

    def decode(self, ids: list[int], **_) -> str:
        return "".join(f" t{i}" for i in ids)


@dataclass
class _Reply:
    channel: Channel
    max_tokens: int
    prompt_tokens: int
    sent: int = 0
    cancelled: bool = False


class StubEngine:
    """Answers every chat request with `max_tokens` tokens (" t0", " t1", ...), one per step.

    step_seconds: the time one step takes (sleeping, the GIL released, as on a GPU); each step
        emits a token to every running request (at most `max_batch_size`; the rest wait).
    """

    def __init__(self, step_seconds: float = 0.005, max_batch_size: int = 256):
        self.step_seconds = step_seconds
        self.max_batch_size = max_batch_size
        self.tokenizer = _Spelling()
        self.steps = 0
        self._replies: list[_Reply] = []
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="stub-engine", daemon=True)

    @property
    def ready(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._work:
            self._stopping = True
            self._work.notify()
        self._thread.join()

    async def submit(self, request: ChatRequest) -> Handle:
        if not self.ready:
            raise EngineNotReady("the stub engine is not running")
        prompt = sum(len(m["content"]) for m in request.messages)
        reply = _Reply(Channel(asyncio.get_running_loop()), request.params.max_new_tokens, prompt)
        with self._work:
            if len(self._replies) >= 4 * self.max_batch_size:
                raise QueueFull("the stub engine's queue is full")
            self._replies.append(reply)
            self._work.notify()

        def cancel() -> None:
            reply.cancelled = True

        return Handle(request.session_id or uuid.uuid4().hex, prompt, 0, reply.channel, on_cancel=cancel)

    def _run(self) -> None:
        outbox = Outbox()
        next_step = time.perf_counter()
        while True:
            with self._work:
                while not self._replies and not self._stopping:
                    self._work.wait()
                    next_step = time.perf_counter()
                if self._stopping:
                    return
                self._replies = [r for r in self._replies if not r.cancelled and r.sent < r.max_tokens]
                running = list(itertools.islice(self._replies, self.max_batch_size))
            next_step = max(next_step + self.step_seconds, time.perf_counter())  # late: no catching up
            time.sleep(max(next_step - time.perf_counter(), 0.0))
            for reply in running:
                outbox.put(reply.channel, Delta(f" t{reply.sent}", [reply.sent]))
                reply.sent += 1
                if reply.sent == reply.max_tokens:
                    usage = Usage(reply.prompt_tokens, reply.sent, 0, reply.prompt_tokens + reply.sent,
                                  reply.prompt_tokens + reply.sent)
                    outbox.put(reply.channel, Finish("length", usage))
            for channel in outbox.flush():  # the loop is gone
                for reply in running:
                    if reply.channel is channel:
                        reply.cancelled = True
            self.steps += 1
