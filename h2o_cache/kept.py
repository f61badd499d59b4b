"""What one row of an `H2OCache` still holds, as plain lists: which tokens each layer and KV head kept.

Reading it costs one device-to-host copy of the row's origins and scores, paid only when asked;
the decode step itself only writes each new token's origin (one small int write per token).
"""

from __future__ import annotations

from dataclasses import dataclass

from h2o_cache.cache import H2OCache


@dataclass
class HeadKept:
    """One layer and KV head of a row.

    positions: ascending indices, in the row's sequence, of the tokens the head holds (slot order).
    scores: their accumulated attention (fp32 sums over queries and the head's query group); None
        for policies that do not score.
    """

    positions: list[int]
    scores: list[float] | None


@dataclass
class KeptTokens:
    """A row's cache: every head holds `length` of the `seen` tokens fed to it.

    Of each head's positions, the first `sinks` are attention sinks and the last `recent` the recent
    window, both always kept; the rest were kept for their priority (heavy hitters under `h2o`).
    """

    seen: int
    length: int
    sinks: int
    recent: int
    heads: list[list[HeadKept]]  # [layer][kv_head]


def kept_tokens(cache: H2OCache, row: int) -> KeptTokens:
    """Snapshot row `row` of `cache` (between passes, on the thread that runs the model)."""
    n = cache.lengths[row]
    buffers = cache.buffers()
    origins = buffers.origins[:, row, :, :n].tolist()  # [L, H_kv, n]
    scores = buffers.scores[:, row, :, :n].tolist() if buffers.scores is not None else None
    config = cache.config
    sinks = min(config.sinks, n) if config.evicts else 0
    recent = min(config.recent, n - sinks) if config.evicts else n
    heads = [[HeadKept(positions, None if scores is None else scores[layer][head])
              for head, positions in enumerate(by_head)] for layer, by_head in enumerate(origins)]
    return KeptTokens(cache.seen[row], n, sinks, recent, heads)
