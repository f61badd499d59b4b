"""What one row of an `H2OCache` still holds, as plain lists: which tokens each layer and KV head kept.

Reading it costs one device-to-host copy of the row's origins and scores, paid only when asked;
the decode step itself only writes each new token's origin (one small int write per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h2o_cache.cache import H2OCache


@dataclass
class HeadKept:
    """One layer and KV head of a row.

    positions: ascending indices, in the row's sequence, of the tokens the head holds.
    scores: their accumulated attention (fp32 sums over queries and the head's query group); None
        for policies that do not score.
    recalled: those of `positions` the last recall brought back from the archive (pinned until
        the next recall), ascending.
    """

    positions: list[int]
    scores: list[float] | None
    recalled: list[int] = field(default_factory=list)


@dataclass
class KeptTokens:
    """A row's cache: every head holds `length` of the `seen` tokens fed to it.

    Of each head's positions, the first `sinks` are attention sinks and the last `recent` the recent
    window, both always kept; the rest were kept for their priority (heavy hitters under `h2o`) or
    recalled. `recalled` of the `length` tokens are recalled ones, held on top of the budget;
    `archived` tokens per head wait in the row's archive (both 0 without recall).
    """

    seen: int
    length: int
    sinks: int
    recent: int
    heads: list[list[HeadKept]]  # [layer][kv_head]
    recalled: int = 0
    archived: int = 0


def kept_tokens(cache: H2OCache, row: int) -> KeptTokens:
    """Snapshot row `row` of `cache` (between passes, on the thread that runs the model)."""
    n = cache.lengths[row]
    buffers = cache.buffers()
    # slot order is the text's order for a row's own tokens, but a recall window comes first, in any
    # order: each head's tokens are listed by position, their scores and pins with them
    origins, order = buffers.origins[:, row, :, :n].sort(dim=-1)  # [L, H_kv, n]
    scores = buffers.scores[:, row, :, :n].gather(-1, order).tolist() if buffers.scores is not None else None
    origins = origins.tolist()
    config = cache.config
    sinks = min(config.sinks, n) if config.evicts else 0
    recent = min(config.recent, n - sinks) if config.evicts else n
    # [L, H_kv, n] bool, copied only when the row holds recalled tokens.
    pinned = buffers.pinned[:, row, :, :n].gather(-1, order).tolist() if cache.recalled[row] else None
    heads = [[HeadKept(positions, None if scores is None else scores[layer][head],
                       [] if pinned is None else [p for p, pin in zip(positions, pinned[layer][head]) if pin])
              for head, positions in enumerate(by_head)] for layer, by_head in enumerate(origins)]
    return KeptTokens(cache.seen[row], n, sinks, recent, heads, cache.recalled[row], cache.archived_tokens(row))
