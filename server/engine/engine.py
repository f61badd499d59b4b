"""`Engine`: the facade the HTTP layer calls: submit a chat request, stream its reply, read stats."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from h2o_cache import CacheConfig, Generator
from h2o_cache.generation import common_end
from h2o_cache.snapshot import cache_identity, model_fingerprint
from server.engine.batcher import Batcher
from server.engine.conversation import ChatTemplate
from server.engine.grammar import GrammarError, Grammars
from server.engine.handle import Channel, Handle
from server.engine.inspection import CacheView, on_engine_thread, snapshot, spell
from server.engine.metrics import EngineMetrics
from server.engine.persistence import Persistence
from server.engine.runner import ModelRunner
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.engine.session import Session
from server.engine.tool_calls import Tools
from server.engine.sessions import SessionStore
from server.engine.turn import Render, check_length, plan_turn
from server.engine.types import ChatRequest, EngineConfig, EngineNotReady, EngineStats, InvalidGrammar, InvalidTokenId


class Engine:
    """Chat generation with continuous batching and per-conversation budgeted KV caches.

    render: (messages, add_generation_prompt) -> prompt text, a template without tool support (tools are
        then described in the system message); the tokenizer's chat template by default.
    clock: monotonic seconds, for session expiry (injectable in tests).
    With `config.state_dir`, sessions persist there (`persistence.Persistence`).
    """

    def __init__(self, model, tokenizer, cache_config: CacheConfig, config: EngineConfig = EngineConfig(),
                 render: Render | None = None, clock: Callable[[], float] = time.monotonic):
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        self.config = config
        self.template = ChatTemplate.of(tokenizer) if render is None else \
            ChatTemplate(lambda messages, add_generation_prompt, tools: render(messages, add_generation_prompt), False)
        # the end of a user's turn in this template: a re-read goes before it, after the question
        ends = [tokenizer.encode(self.template.render([{"role": "user", "content": text}], None, True),
                                 add_special_tokens=False) for text in ("a", "b")]
        self.generator = Generator(model, tokenizer, cache_config, turn_end=common_end(*ends))
        self.generator.stream_decoder()  # builds the byte table now, not in the first request's time to first token
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.grammars = Grammars(tokenizer, self.vocab_size)
        self.sessions = SessionStore(config.max_sessions, config.session_ttl, clock, config.max_archive_bytes)
        self.runner = ModelRunner(self.generator, config.max_batch_size, config.enforce_eager, config.exact)
        self.scheduler = Scheduler(self.runner.batch, config.max_batch_size, config.max_queue)
        self.metrics = EngineMetrics()
        self.persistence = None
        if config.state_dir:
            identity = cache_identity(self.generator.new_cache(1), model_fingerprint(model))
            self.persistence = Persistence(config.state_dir, identity, lambda: self.generator.new_cache(1),
                                           config.session_ttl, config.max_sessions, config.max_state_bytes)
        self.batcher = Batcher(self.scheduler, self.runner, self.sessions, self.metrics, config.prefill_tokens,
                               self.persistence)

    def start(self) -> None:
        """Start the background thread that owns the model."""
        self.batcher.start()

    def stop(self) -> None:
        """Stop the thread and wait for it; requests still in flight fail with GenerationFailed.
        With a state dir, the idle sessions' caches are then snapshotted there."""
        self.batcher.stop()
        if self.persistence is not None:
            persistence, self.persistence = self.persistence, None
            persistence.close(self.sessions.idle())

    def abort(self, reason: str) -> None:
        """Fail every request in flight with GenerationFailed(reason) within one step (any thread)."""
        self.scheduler.abort(reason)

    @property
    def ready(self) -> bool:
        return self.batcher.alive

    async def submit(self, request: ChatRequest) -> Handle:
        """Queue a request; returns its stream.

        Raises before anything streams: EngineNotReady, QueueFull, SessionNotFound (also for another
        owner's session), SessionBusy (a reply for that session is still being generated),
        PromptTooLong, InvalidTokenId or InvalidGrammar. A raw `prompt` gets a session of its own
        that nothing keeps.
        """
        if not self.ready:
            raise EngineNotReady("the engine is not running")
        self._check_token_ids(request)
        if request.prompt is None and self.persistence is not None and \
                not self.sessions.knows(request.owner, request.messages, request.session_id):
            await self._recall(request)
        self.scheduler.reserve()
        try:
            if request.prompt is not None:
                session, conversation = Session(id="", owner=request.owner, ephemeral=True), []
            else:
                session, conversation = self.sessions.claim(request.owner, request.messages, request.session_id)
        except BaseException:
            self.scheduler.unreserve()
            raise
        try:
            # Rendering and tokenizing a long history takes a while; keep it off the event loop.
            def render(messages: list[dict], add_generation_prompt: bool) -> str:
                if request.prompt is not None:
                    return request.prompt
                return self.template.render(messages, request.tools, add_generation_prompt)

            turn = await asyncio.to_thread(plan_turn, session, conversation, render, self.tokenizer)
            check_length(turn, request.params, self.cache_config, self.config)
            matcher = await asyncio.to_thread(self._matcher, request.grammar) if request.grammar else None
            seq = Sequence(session, turn, request.params, Channel(asyncio.get_running_loop()), request.request_id,
                           tools=request.tools, matcher=matcher)
            self.scheduler.add(seq)  # EngineNotReady if the engine stopped meanwhile
        except BaseException:
            self.sessions.release(session)
            self.scheduler.unreserve()
            raise
        return Handle(session.id, turn.prompt_tokens, turn.cached_tokens, seq.channel,
                      on_cancel=lambda: self._cancel(seq))

    @property
    def max_model_len(self) -> int:
        """The most prompt tokens one request may bring: the model's window for a policy that never
        evicts, else the prefill limit (an evicting conversation goes on beyond the window)."""
        if not self.cache_config.evicts and self.config.context_window is not None:
            return min(self.config.context_window, self.config.max_prompt_tokens)
        return self.config.max_prompt_tokens

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tokenize_chat(self, messages: list[dict], tools: Tools | None, add_generation_prompt: bool) -> list[int]:
        """The tokens a chat request with these messages and tools would prefill on a fresh session."""
        return self.tokenize(self.template.render(messages, tools, add_generation_prompt), add_special_tokens=False)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _check_token_ids(self, request: ChatRequest) -> None:
        params = request.params
        for param, ids in [("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)]:
            wrong = [t for t in ids if not 0 <= t < self.vocab_size]
            if wrong:
                raise InvalidTokenId(f"token id {wrong[0]} is not in the model's vocabulary of {self.vocab_size}",
                                     param)

    def _matcher(self, grammar: str):
        try:
            return self.grammars.matcher(grammar)
        except GrammarError as error:
            raise InvalidGrammar(f"the output grammar does not build for this model: {error}") from error

    async def inspect(self, owner: str, session_id: str, last: int) -> CacheView:
        """What the session's cache holds now, with the text of the conversation's last `last` tokens.

        Raises SessionNotFound for an unknown id and for another owner's alike, EngineNotReady.
        """
        if not self.ready:
            raise EngineNotReady("the engine is not running")
        session = self.sessions.get(owner, session_id)
        kept, ids, live = await on_engine_thread(self.scheduler, lambda: snapshot(self.scheduler, session))
        first = max(len(ids) - last, 0)
        tokens = await asyncio.to_thread(spell, self.tokenizer, ids[first:])
        return CacheView(session.id, live, len(ids), kept, first, tokens, list(session.turns))

    async def _recall(self, request: ChatRequest) -> None:
        """Bring the session a request continues back from the state dir, if it is there."""
        persistence = self.persistence
        session = await asyncio.to_thread(persistence.recall, request.owner, request.messages, request.session_id)
        if session is not None:
            self.sessions.adopt(session)

    def _cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self.scheduler.wake()

    def stats(self) -> EngineStats:
        self.sessions.expire()
        idle_tokens, idle_bytes = self.sessions.resident()
        busy_tokens, busy_bytes = self.batcher.resident
        idle_archived, idle_archived_bytes = self.sessions.archived()
        busy_archived, busy_archived_bytes = self.batcher.archived
        totals, step_seconds = self.metrics.snapshot()  # totals hold the request latency histograms too
        running = len(self.scheduler.running)
        return EngineStats(
            active_sessions=len(self.sessions),
            running=running,
            waiting=max(self.scheduler.in_flight - running, 0),
            resident_kv_tokens=idle_tokens + busy_tokens,
            resident_kv_bytes=idle_bytes + busy_bytes,
            archived_kv_tokens=idle_archived + busy_archived,
            archived_kv_bytes=idle_archived_bytes + busy_archived_bytes,
            archives_dropped_total=self.sessions.archives_dropped,
            decode_step_seconds=step_seconds,
            state=self.persistence.stats() if self.persistence is not None else None,
            **totals,
        )
