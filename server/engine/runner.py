"""`ModelRunner`: the engine thread's forward passes, with failures confined to the rows that raise."""

from __future__ import annotations

import torch

from h2o_cache import Generator, H2OCache
from server.engine.sequence import Sequence


class ModelRunner:
    """Feeds prefill chunks and decode steps to the model through a `Generator`.

    Only the engine thread calls it: the model, its caches and `Generator.step` are not thread-safe.
    """

    def __init__(self, generator: Generator, prefill_chunk: int):
        self.generator = generator
        self.prefill_chunk = prefill_chunk

    def prefill(self, seq: Sequence) -> torch.Tensor | None:
        """Feed the next chunk (<= prefill_chunk tokens) of a waiting sequence to its own cache.

        Returns fp32 logits [V] after the prompt's last token once the whole prompt is in, else None.
        """
        chunk = seq.next_chunk(self.prefill_chunk)
        logits = self.generator.step(seq.cache, [chunk])
        seq.prefilled += len(chunk)
        return logits[0] if seq.prefill_done else None

    def decode(self, batch: H2OCache) -> list[torch.Tensor | Exception]:
        """One step feeding every row its pending token. Returns per row fp32 logits [V], or the
        error that row raised.

        A failed batched pass leaves the cache as it was (`H2OCache.abort`); the step is then
        retried one row at a time (the other rows idle) so that only the rows that fail lose their
        request. That costs B passes, but only on the failure path.
        """
        pieces = [list(p) for p in batch.pending]
        try:
            logits = self.generator.step(batch, pieces)
            return list(logits)
        except Exception:
            pass
        results: list[torch.Tensor | Exception] = []
        for row in range(batch.batch_size):
            alone = [piece if i == row else [] for i, piece in enumerate(pieces)]
            try:
                results.append(self.generator.step(batch, alone)[row])
            except Exception as error:
                results.append(error)
        return results
