"""A stand-in for `server.engine.Engine` with the same API: scripted replies, no model, no thread.

It answers each request with the words of its last message, one `Delta` per word (or, when the
request offers tools and its last message starts with "call", a call of the first tool), and records
what it was asked, so HTTP tests neither wait on a model nor depend on the engine's internals.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from h2o_cache import Sample
from server.engine.tool_calls import ToolCall
from server.engine.types import (
    ChatRequest, Delta, EngineError, EngineStats, Finish, GenerationFailed, Histogram, SessionNotFound, Usage,
)


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass
class FakeHandle:
    session_id: str
    prompt_tokens: int
    cached_tokens: int
    items: list[Delta | Finish | Exception]
    hold: asyncio.Event | None = None  # when set: wait for it before every item
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def __aiter__(self):
        return self._stream()

    async def batches(self):
        async for item in self:
            yield [item]

    async def _stream(self):
        for item in self.items:
            if self.hold is not None:
                await self.hold.wait()
            if self.cancelled.is_set():
                return
            if isinstance(item, Exception):
                raise item
            yield item


class FakeEngine:
    """submit_error: raised by the next submit. fail_after: raise GenerationFailed after that many deltas.
    hold: an event every handle waits on before each item (to test disconnects mid-stream)."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.ready = True
        self.requests: list[ChatRequest] = []
        self.handles: list[FakeHandle] = []
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.submit_error: EngineError | None = None
        self.fail_after: int | None = None
        self.hold: asyncio.Event | None = None

    async def submit(self, request: ChatRequest) -> FakeHandle:
        self.requests.append(request)
        if self.submit_error is not None:
            error, self.submit_error = self.submit_error, None
            raise error
        if request.session_id is not None:
            if self.sessions.get(request.session_id) != request.owner:
                raise SessionNotFound(f"session {request.session_id!r} not found")
            session_id = request.session_id
        else:
            session_id = f"s{len(self.sessions)}"
            self.sessions[session_id] = request.owner
        messages = request.messages if request.prompt is None else [{"role": "user", "content": request.prompt}]
        if request.tools is not None and request.tools.parsed and messages[-1]["content"].startswith("call"):
            call = ToolCall(f"call_{len(self.handles)}", request.tools.names[0], '{"a": 1}')
            finish = Finish("tool_calls", Usage(3, 5, 1, 8, 8), tool_calls=[call])
            handle = FakeHandle("s-tools", 3, 1, [Delta("", [1]), finish], self.hold)
            self.handles.append(handle)
            return handle
        words = messages[-1]["content"].split()[: request.params.max_new_tokens]
        items: list = []
        for i, word in enumerate(words):
            logprobs = [Sample(i, -0.5, [(i, -0.5), (99, -1.5)][: request.params.logprobs])] \
                if request.params.logprobs is not None else []
            items.append(Delta(word + " ", [i], logprobs))
        if self.fail_after is not None:
            items = items[: self.fail_after] + [GenerationFailed("the model failed")]
        reason = "length" if len(words) == request.params.max_new_tokens else "stop"
        prompt = sum(len((m["content"] or "").split()) for m in messages)
        items.append(Finish(reason, Usage(prompt, len(words), 1, min(prompt + len(words), 8), prompt + len(words))))
        handle = FakeHandle(session_id, prompt, 1, items, self.hold)
        self.handles.append(handle)
        return handle

    vocab_size = 100
    max_model_len = 2048

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def tokenize_chat(self, messages: list[dict], tools, add_generation_prompt: bool) -> list[int]:
        return self.tokenize(" ".join(m["content"] or "" for m in messages))

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def stats(self) -> EngineStats:
        return EngineStats(
            active_sessions=len(self.sessions), running=1, waiting=2, resident_kv_tokens=48, resident_kv_bytes=4096,
            archived_kv_tokens=160, archived_kv_bytes=9000, archives_dropped_total=1, recalled_tokens_total=64,
            recall_turns_total=2,
            prompt_tokens_total=10, generated_tokens_total=20, cached_tokens_total=3, decode_steps_total=5,
            decode_step_seconds=Histogram((0.01, 0.1), [2, 4], sum=0.25, count=5),
            requests_by_finish={"stop": 2, "length": 1},
            latency={"time_to_first_token": Histogram((0.1, 1.0), [1, 3], sum=1.5, count=3),
                     "inter_token_latency": Histogram((0.01,), [20], sum=0.1, count=20),
                     "e2e_request_latency": Histogram((1.0,), [2], sum=1.0, count=3),
                     "queue_time": Histogram((0.1,), [3], sum=0.5, count=3)},
        )

    def start(self) -> None:
        self.ready = True

    def stop(self) -> None:
        self.ready = False
