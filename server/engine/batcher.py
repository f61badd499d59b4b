"""`Batcher`: the engine thread. Each iteration: drop cancelled, prefill a few chunks, decode one step."""

from __future__ import annotations

import logging
import threading
import time

from h2o_cache import Sample
from server.engine.handle import Outbox
from server.engine.metrics import EngineMetrics
from server.engine.persistence import Persistence
from server.engine.runner import ModelRunner
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, Status
from server.engine.sessions import SessionStore
from server.engine.types import Delta, Finish, GenerationFailed, Usage

log = logging.getLogger(__name__)


class Batcher:
    """Continuous batching on one thread, the only one that runs the model.

    Each iteration, the oldest waiting sequences are prefilled one chunk each, together in one pass,
    up to `prefill_tokens` prompt tokens, each on its own 1-row cache: a long prompt delays the
    running batch by one pass per step rather than stalling it, and a burst of new conversations
    starts in a few iterations rather than one per request. Once prefilled, a sequence samples its
    first token and joins the batch cache. Every running row then advances one token per step.
    The thread sleeps on the scheduler's condition whenever nothing is queued or running.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sessions: SessionStore, metrics: EngineMetrics,
                 prefill_tokens: int, persistence: Persistence | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.sessions = sessions
        self.metrics = metrics
        self.prefill_tokens = prefill_tokens
        self.persistence = persistence
        self.generator = runner.generator
        self.resident = (0, 0)  # (tokens, bytes) in the caches of sequences in flight
        self.archived = (0, 0)  # (tokens, host bytes) in their archives of evicted tokens
        self._outbox = Outbox()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.scheduler.stop()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while self.scheduler.wait_for_work(timeout=self.sessions.expiry_interval):
            self.sessions.expire_if_due()  # idle sessions go on time, not only when a request comes
            self._run_calls()
            try:
                self.step()
            except Exception:  # a bug outside any one sequence: fail them all, keep serving
                log.exception("engine step failed")
                self._fail_all([*self.scheduler.waiting, *self.scheduler.running], "internal error in the engine")
            finally:
                self._flush()
        self._fail_all(self.scheduler.drain(), "the engine stopped")
        self._flush()
        self._run_calls()  # those queued before `stop`: each answers its caller

    def _run_calls(self) -> None:
        for fn in self.scheduler.take_calls():
            try:
                fn()
            except Exception:  # a call answers its own caller; a bug in one must not stop the engine
                log.exception("engine call failed")

    def _fail_all(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            try:
                self._fail(seq, GenerationFailed(message))
            except Exception:
                log.exception("could not fail request %s cleanly", seq.request_id)

    def step(self) -> None:
        reason = self.scheduler.take_abort()
        if reason:
            self._fail_all([*self.scheduler.waiting, *self.scheduler.running], reason)
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.cancelled:
                self._cancel(seq)
        seqs = self.scheduler.next_prefills(self.prefill_tokens, self.generator.config.prefill_chunk)
        if seqs:
            self._prefill(seqs)
        if self.scheduler.running:
            self._decode()
        self._count_resident()

    def _count_resident(self) -> None:
        caches = [self.scheduler.batch] + [s.cache for s in self.scheduler.waiting if s.cache is not None]
        self.resident = (sum(sum(c.lengths) for c in caches), sum(c.resident_bytes() for c in caches))
        self.archived = (sum(c.archived_tokens() for c in caches), sum(c.archived_bytes() for c in caches))

    # ----- model work -------------------------------------------------------------------------

    def _prefill(self, seqs: list[Sequence]) -> None:
        started = []
        now = time.perf_counter()
        self.metrics.observe("queue_time", [now - seq.arrived for seq in seqs if not seq.started])
        for seq in seqs:
            try:
                if not seq.started:
                    seq.start(lambda: self.generator.new_cache(1), self.generator.stream_decoder,
                              self.generator.probe_start, self.generator.eos_token_ids)
                started.append(seq)
            except Exception as error:
                log.exception("prefill failed for request %s", seq.request_id)
                self._fail(seq, error)
        if not started:
            return
        try:
            results = self.runner.prefill(started, self.generator.config.prefill_chunk)
        except Exception as error:  # outside the pass (moving rows): every sequence in it fails
            results = [error] * len(started)
        for seq, result in zip(started, results):
            if result is not None:
                self._take(seq, result)

    def _decode(self) -> None:
        running = list(self.scheduler.running)
        start = time.perf_counter()
        results = self.runner.decode(running)
        now = time.perf_counter()
        self.metrics.observe_step(now - start)
        self.metrics.observe("inter_token_latency", [now - seq.last_token_at for seq in running])
        done: list[tuple[Sequence, str | Exception]] = []
        for row, (seq, result) in enumerate(zip(running, results)):
            reason = self._advance(seq, result, self.scheduler.batch, row)
            if reason:
                done.append((seq, reason))
        for seq, reason in done:  # after the loop: leaving moves rows
            self._end(seq, reason)

    def _take(self, seq: Sequence, result: Sample | Exception) -> None:
        """A prefilled sequence's first token: it joins the batch unless it is already done."""
        reason = self._advance(seq, result, seq.cache, 0)
        if not reason:
            try:
                self.scheduler.join(seq)
            except Exception as error:
                log.exception("request %s could not join the batch", seq.request_id)
                reason = error
        if reason:
            self._end(seq, reason)

    def _advance(self, seq: Sequence, result: Sample | Exception, cache, row: int) -> str | Exception | None:
        """Record a sampled token (it becomes the row's pending token) and stream it. Returns the
        finish reason, the error the row raised, or None while the sequence goes on."""
        if isinstance(result, Exception):
            log.error("generation failed for request %s: %r", seq.request_id, result)
            return result
        now = time.perf_counter()
        if seq.last_token_at is None:
            self.metrics.observe("time_to_first_token", [now - seq.arrived])
        seq.last_token_at = now
        try:
            cache.pending[row] = [result.token]
            delta, reason = seq.append(result, self.generator.eos_token_ids)
        except Exception as error:
            log.exception("decode failed for request %s", seq.request_id)
            return error
        if delta is not None:
            self._emit(seq, delta)
        return reason

    def _end(self, seq: Sequence, reason: str | Exception) -> None:
        if isinstance(reason, Exception):
            self._fail(seq, reason)
        else:
            self._finish(seq, reason)

    def _emit(self, seq: Sequence, item) -> None:
        self._outbox.put(seq.channel, item)

    def _flush(self) -> None:
        """Hand this iteration's output to the event loop (one wake-up); after `step` and on failures."""
        gone = {id(channel) for channel in self._outbox.flush()}
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if id(seq.channel) in gone:
                seq.cancelled = True  # nobody is listening any more

    # ----- endings ----------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence that produced tokens ("stop", "length", or "cancelled" midway).

        Its session keeps everything: the cache with the reply in it, the reply as the assistant's
        message, and `consumed_text` to match, so the next turn continues from here. With a state
        dir, the transcript is queued for commit and the `Finish` waits for it (see `Handle`).
        """
        cache = self.scheduler.leave(seq)
        self._count_resident()  # before the session counts it, so stats never count it twice
        tail, calls, message = seq.conclude()
        if calls and reason != "cancelled":
            reason = "tool_calls"
        session = seq.session
        session.cache = cache
        session.consumed_text = seq.turn.prompt_text + self.generator.tokenizer.decode(
            seq.output_ids, skip_special_tokens=False)
        session.token_ids = seq.token_ids
        session.reread = (session.reread if seq.turn.continues else 0) + seq.reread
        session.turns.append((cache.seen[0] + len(cache.pending[0]), cache.lengths[0]))
        spec = cache.spec
        seq.recalled = (cache.recall_count[0] - seq.recall_base) // (spec.num_layers * spec.num_kv_heads)
        self.sessions.release(session, seq.turn.conversation + [message])
        durable = self.persistence.save_turn(session) if self.persistence is not None and not session.ephemeral \
            else None
        self.metrics.record_request(reason, seq.turn.prompt_tokens, seq.turn.cached_tokens, len(seq.output_ids),
                                    seq.recalled)
        if reason == "cancelled":
            return
        self.metrics.observe("e2e_request_latency", [time.perf_counter() - seq.arrived])
        if tail:
            self._emit(seq, Delta(tail))
        usage = Usage(
            prompt_tokens=seq.turn.prompt_tokens,
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.turn.cached_tokens,
            kv_resident_tokens=cache.lengths[0],
            conversation_tokens=cache.seen[0] + len(cache.pending[0]),
            reread_tokens=seq.reread,
        )
        self._emit(seq, Finish(reason, usage, durable, calls))

    def _cancel(self, seq: Sequence) -> None:
        if seq.output_ids:
            self._finish(seq, "cancelled")
            return
        # Cancelled before its first token: a partly prefilled cache matches no text, so the session
        # forgets it; its messages stay as before the request. Not started: nothing changed.
        self.scheduler.leave(seq)
        if seq.started:
            seq.session.reset()
        self.sessions.release(seq.session)
        self.metrics.record_request("cancelled", seq.turn.prompt_tokens, seq.turn.cached_tokens, 0, seq.recalled)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End a sequence with GenerationFailed; its session keeps its messages but not its cache."""
        if seq.status is Status.FINISHED:
            return
        try:
            self.scheduler.leave(seq)
        finally:  # whatever state the batch is in, the request and its session are answered
            seq.session.reset()
            self.sessions.release(seq.session)
            self.metrics.record_request("error", seq.turn.prompt_tokens, seq.turn.cached_tokens, len(seq.output_ids),
                                        seq.recalled)
            failure = error if isinstance(error, GenerationFailed) else GenerationFailed(f"generation failed: {error}")
            self._emit(seq, failure)
