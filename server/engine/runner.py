"""`ModelRunner`: the engine thread's device work, batched, with failures confined to the rows that raise."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from h2o_cache import Generator, H2OCache, Sample, StaticDecoder, UnsupportedModelError, reread, sample
from server.engine.grammar import constrain
from server.engine.sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    """Prefills chunks of several waiting sequences in one pass and decodes the running batch.

    Both return the sampled tokens of the whole batch (one sampler op, one device-to-host copy).
    The decode step takes the fast path (`StaticDecoder`: a fixed-shape step, CUDA graphs on a GPU,
    one C++ call over the GGUF file's quantized matrices on a CPU)
    unless `enforce_eager` is set or the cache cannot take it (`full` policy, no position rolling,
    a model that is not plain Llama) or building it fails (a CUDA graph that cannot be captured, out
    of memory): then the transformers path runs it. `exact` keeps the CPU step's products on fp32
    activations (no int8 rounding).

    Only the engine thread calls it: the model and its caches are not thread-safe.
    """

    def __init__(self, generator: Generator, max_batch_size: int, enforce_eager: bool = False, exact: bool = False):
        self.generator = generator
        self.decoder: StaticDecoder | None = None
        if not enforce_eager:
            try:
                self.decoder = StaticDecoder(generator.model, generator.config, max_batch_size, exact=exact)
                how = ""
                if self.decoder.native is not None:
                    how = (" with the GGUF file's quantized matrices, one C++ call per step, "
                           f"{self.decoder.native.activations} activations")
                elif self.decoder.quantized_weights is not None:
                    how = " with the GGUF file's quantized matrices"
                log.info("decoding on the fast path%s", how)
            except (ValueError, UnsupportedModelError) as reason:
                log.info("decoding on the transformers path: %s", reason)
            except Exception as error:  # a server that starts slower beats one that does not start
                self.decoder = None
                log.warning("the fast path failed to start (%r); decoding on the transformers path", error,
                            exc_info=True)
        self.batch: H2OCache = self.decoder.cache if self.decoder else generator.new_cache(0)
        self.exact = exact
        self._looker: StaticDecoder | None = None  # a 1-row fast step for re-reads' looks, built on first use

    def looker(self) -> StaticDecoder | None:
        """The 1-row decoder a re-read's look steps on (sharing the batch decoder's packed matrices), or
        None where the batch decodes on the transformers path (the look does too)."""
        if self._looker is None and self.decoder is not None:
            self._looker = reread.looker(self.generator.model, self.generator.config, self.decoder, self.exact)
        return self._looker

    def reread(self, seq: Sequence) -> None:
        """Feed a sequence whose body is in the passages of its turn its reply will answer from again,
        inside its tail after the question (`h2o_cache.reread`, `Generator.reread_at`), where the body
        overflows the budget. A re-read that fails is logged and skipped: the turn goes on without it."""
        seq.reread_checked = True
        body, tail = seq.turn.prefill[:seq.tail_at], seq.turn.prefill[seq.tail_at:]
        try:
            tokens = self.generator.reread(seq.cache, 0, body, len(seq.history), tail, self.looker())
        except Exception:
            log.exception("re-read failed for request %s; the turn goes on without it", seq.request_id)
            return
        if tokens:
            seq.insert(tokens, self.generator.reread_at(tail))

    @property
    def fast(self) -> bool:
        return self.decoder is not None

    def prefill(self, seqs: list[Sequence], chunk: int) -> list[Sample | None | Exception]:
        """Feed the next chunk (<= `chunk` tokens) of each waiting sequence to its own cache, in one pass.

        With recall, every row's chunk first fills the row's recall window with what its own queries
        point at (inside the pass, `h2o_cache.recall`); with `recall_ahead`, a chunk of the prompt's
        body (`Sequence.in_body`) instead with what its previous chunk's queries point at, before it.
        Once a sequence's body is in, its re-read (`reread`) goes first.
        Returns per sequence its first token once its whole prompt is in, None while more remains,
        or the error it raised. The rows share a temporary batch cache for the pass and go back to
        their own caches after it.
        """
        for seq in seqs:
            if seq.reread_due:
                self.reread(seq)
        ahead = [seq.in_body for seq in seqs]
        pieces = [seq.next_chunk(chunk) for seq in seqs]
        if len(seqs) == 1:
            results = self._feed(seqs[0].cache, pieces, ahead)
        else:
            batch = self.generator.new_cache(0)
            for seq in seqs:
                batch.extend(seq.cache, move=True)
            try:
                results = self._feed(batch, pieces, ahead)
            finally:
                for row in reversed(range(len(seqs))):  # from the last: no row moves
                    seqs[row].cache = batch.pop(row)
        for seq, piece, result in zip(seqs, pieces, results):
            if not isinstance(result, Exception):
                seq.prefilled += len(piece)
                seq.cache.expect(0, len(seq.turn.prefill) - seq.prefilled)
        done = [i for i, seq in enumerate(seqs) if not isinstance(results[i], Exception) and seq.prefill_done]
        out: list[Sample | None | Exception] = [r if isinstance(r, Exception) else None for r in results]
        if done:
            for i, drawn in zip(done, self._sample([results[i] for i in done], [seqs[i] for i in done])):
                out[i] = drawn
        return out

    def _feed(self, cache: H2OCache, pieces: list[list[int]], ahead: list[bool]) -> list:
        """Feed every row its piece in one pass (ahead[b]: of its prompt's body); a row that fails fails alone."""
        return self._guarded(lambda some: self.generator.step(cache, some, ahead), pieces)

    def decode(self, running: list[Sequence]) -> list[Sample | Exception]:
        """One step feeding every row of the batch its pending token. Returns per row its next token,
        or the error that row raised.

        On the fast path the rows over the budget are evicted after sampling: the sampled tokens'
        download does not wait for the eviction, which runs while the batcher streams them. A step
        that raises has fed nothing (`StaticDecoder.step`), so the transformers path retries it; an
        eviction that raises fails the rows it was evicting.
        """
        if self.decoder is not None:
            try:
                logits = self.decoder.step(evict=False)
            except Exception:
                log.exception("fast decode step failed; retrying it on the transformers path")
            else:
                drawn: list[Sample | Exception] = list(
                    sample(constrain(logits, [seq.matcher for seq in running]), [seq.sampler for seq in running]))
                try:
                    self.batch.evict_over_budget()
                except Exception as error:
                    log.exception("eviction failed after a fast decode step")
                    for row in self.batch.over_budget():
                        drawn[row] = error
                return drawn
        pieces = [list(p) for p in self.batch.pending]
        return self._sample(self._guarded(lambda some: self.generator.step(self.batch, some), pieces), running)

    def _sample(self, logits: list, seqs: list[Sequence]) -> list[Sample | Exception]:
        """Sample every row whose logits are a tensor; rows that failed keep their error."""
        ok = [i for i, row in enumerate(logits) if not isinstance(row, Exception)]
        out = list(logits)
        if ok:
            rows = torch.stack([logits[i] for i in ok])
            drawn = sample(constrain(rows, [seqs[i].matcher for i in ok]), [seqs[i].sampler for i in ok])
            for i, token in zip(ok, drawn):
                out[i] = token
        return out

    def _guarded(self, run: Callable[[list[list[int]]], torch.Tensor | list[int]], pieces: list[list[int]]) -> list:
        """run(pieces) -> one result per row, for every row at once; when it raises, each row with
        tokens is retried alone (the others given none), so that only the rows that fail lose their
        request. That costs B passes, but only on the failure path. Rows without tokens get None.

        A failed pass leaves the cache as it was (`H2OCache.abort`), but for the recall windows it may
        have filled: those hold archived blocks either way, and the next pass chooses them again.
        """
        if not any(pieces):
            return [None] * len(pieces)
        try:
            return [result if piece else None for result, piece in zip(run(pieces), pieces)]
        except Exception as error:
            if sum(1 for piece in pieces if piece) == 1:
                return [error if piece else None for piece in pieces]
        results = []
        for row, piece in enumerate(pieces):
            if not piece:
                results.append(None)
                continue
            try:
                results.append(run([p if i == row else [] for i, p in enumerate(pieces)])[row])
            except Exception as error:
                results.append(error)
        return results
