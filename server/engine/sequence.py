"""`Sequence`: one request in flight, from the waiting queue through prefill and decode to its finish."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Callable, Iterable

from llguidance import LLMatcher

from h2o_cache import CacheConfig, H2OCache, Sample, Sampler, SamplingParams, StreamDecoder, consume
from server.engine.conversation import assistant_message
from server.engine.handle import Channel
from server.engine.session import Session
from server.engine.tool_calls import Holdback, ToolCall, Tools, content_of, parse
from server.engine.turn import Turn
from server.engine.types import Delta


class Status(Enum):
    WAITING = auto()  # queued or prefilling on its own 1-row cache
    RUNNING = auto()  # a row of the decode batch
    FINISHED = auto()


@dataclass(eq=False)  # identity: queues find a sequence by `is`, not by comparing fields
class Sequence:
    """A request's generation state, owned by the engine thread once submitted.

    While WAITING, `cache` is the 1-row cache being prefilled (None until `start`) and `prefilled`
    counts the tokens of `turn.prefill` fed so far. `history` holds the tokens its cache was fed
    before this turn (see `token_ids`). While RUNNING, its row of the batch cache holds
    the state and `cache` is None; the row's pending token is the last one sampled.

    When the cache recalls, the turn's last `recall_probe` tokens (where the question usually is; with
    `recall_probe_break`, those after the last blank line among them) are fed as chunks of their own, so
    that their queries alone choose the recall window the reply starts with, as
    `Generator.prefill(recall=True)` does: `tail_at` is where they start in `turn.prefill`. Once the body
    is in, a turn whose body overflows the budget has the passages its reply will answer from fed again
    inside the tail, after the question (`h2o_cache.reread`, `insert`): they are then part of
    `turn.prefill`, and `reread` counts them. `recalled` counts the tokens per layer/KV head copied into
    the window during the turn (set when it finishes).

    When the request offers tools, the reply streams up to its first `<tool_call>` and the rest is
    held (`holdback`) until `conclude` tells calls from text.
    """

    session: Session
    turn: Turn
    params: SamplingParams
    channel: Channel
    request_id: str = ""
    tools: Tools | None = None
    matcher: LLMatcher | None = None  # the output grammar's state, advanced with every sampled token
    status: Status = Status.WAITING
    cache: H2OCache | None = None
    prefilled: int = 0
    history: array = field(default_factory=lambda: array("i"))
    sampler: Sampler | None = None
    decoder: StreamDecoder | None = None
    holdback: Holdback | None = None
    output_ids: list[int] = field(default_factory=list)
    tail_at: int | None = None  # None: the cache does not recall
    reread_checked: bool = False  # whether the turn's re-read (`h2o_cache.reread`) was considered
    reread: int = 0  # tokens of the turn's text fed again before its tail (in `turn.prefill`)
    recalled: int = 0
    recall_base: int = 0  # the cache's recall_count when the turn started
    cancelled: bool = False  # set from the asyncio thread; read by the engine thread between steps
    arrived: float = field(default_factory=time.perf_counter)  # for the latency metrics
    last_token_at: float | None = None

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.turn.prefill)

    @property
    def in_body(self) -> bool:
        """Whether the next chunk is of the prompt's body, before the tail fed on its own."""
        return self.tail_at is not None and self.prefilled < self.tail_at

    @property
    def reread_due(self) -> bool:
        """Whether the turn's body is in and its re-read not yet considered."""
        return self.tail_at is not None and not self.reread_checked and self.prefilled == self.tail_at

    def insert(self, tokens: list[int], inside: int = 0) -> None:
        """Feed `tokens` (a re-read) as part of the turn: `inside` tokens into its tail
        (`Generator.reread_at`: after the question), or with 0 next, as part of the body, before the tail."""
        at = self.tail_at + inside
        self.turn.prefill = [*self.turn.prefill[:at], *tokens, *self.turn.prefill[at:]]
        if not inside:
            self.tail_at = at + len(tokens)
        self.reread += len(tokens)

    def next_chunk(self, size: int) -> list[int]:
        """The next <= `size` tokens to feed; a chunk ends where the tail starts, so it is fed on its own."""
        end = self.prefilled + size
        if self.tail_at is not None and self.prefilled < self.tail_at:
            end = min(end, self.tail_at)
        return self.turn.prefill[self.prefilled:end]

    @property
    def started(self) -> bool:
        return self.sampler is not None

    def start(self, new_cache: Callable[[], H2OCache], new_decoder: Callable[[tuple[str, ...]], StreamDecoder],
              probe: Callable[[list[int], CacheConfig], int], ends: Iterable[int] = ()) -> None:
        """Take the session's cache when the turn continues it, else a new one, to prefill.

        The session's pending token now leads `turn.prefill`. Until this, a cancelled request
        leaves its session untouched. ends: the model's end tokens, held back until the reply's
        `min_new_tokens` (`Sampler`). probe: where the turn's probe starts (`Generator.probe_start`).
        """
        cache = self.session.cache if self.turn.continues else None
        self.session.cache = None
        self.history = self.session.token_ids[:cache.seen[0]] if cache is not None else array("i")
        self.cache = cache or new_cache()
        self.cache.pending[0] = []
        if self.cache.config.recalls:  # the tail is fed on its own, as `Generator.prefill` does
            self.tail_at = probe(self.turn.prefill, self.cache.config)
        self.recall_base = self.cache.recall_count[0]
        # the repetition penalty counts every token the conversation holds as seen
        prompt = [*self.history, *self.turn.prefill] if self.params.repetition_penalty != 1 else ()
        self.sampler = Sampler(self.params, prompt, ends)
        self.decoder = new_decoder(self.params.stop)
        self.holdback = Holdback() if self.tools is not None and self.tools.parsed else None

    def append(self, sample: Sample, eos_token_ids: set[int]) -> tuple[Delta | None, str | None]:
        """Record a sampled token. Returns the delta to stream (None for an end token) and the
        finish reason once the sequence is done, by the one stop rule (`h2o_cache.consume`)."""
        self.output_ids.append(sample.token)
        text, reason = consume(sample.token, self.params, self.decoder, len(self.output_ids), eos_token_ids)
        if self.matcher is not None and text is not None:
            # a matcher that can take nothing more (or refuses the token) ends the reply
            if not self.matcher.consume_token(sample.token) or self.matcher.is_stopped():
                reason = reason or "stop"
        if text is None:
            return None, reason
        if self.holdback is not None:
            text = self.holdback.push(text)
        return Delta(text, [sample.token], [sample] if self.params.logprobs is not None else []), reason

    @property
    def token_ids(self) -> array:
        """Every token its cache has consumed, the pending one included: position p is token_ids[p]."""
        return self.history + array("i", self.turn.prefill[:self.prefilled]) + array("i", self.output_ids)

    def conclude(self) -> tuple[str, list[ToolCall], dict]:
        """At the finish: the text still to stream, the reply's tool calls, and the reply's message
        for the session."""
        tail = self.decoder.flush()
        text = self.reply
        if self.holdback is None:
            return tail, [], assistant_message(text, text, [])
        calls = parse(text, self.tools)
        tail = self.holdback.push(tail) + self.holdback.release(calls)
        return tail, calls, assistant_message(text, content_of(text, calls), calls)

    @property
    def reply(self) -> str:
        """The reply's text as streamed: what the decoder emitted, held-back text included at finish."""
        return self.decoder.text if self.decoder is not None else ""
