"""Which cached tokens survive an eviction: pure tensor functions, testable without a model."""

from __future__ import annotations

import torch


def keep_indices(
    priority: torch.Tensor,
    lengths: torch.Tensor,
    budget: int,
    sinks: int,
    recent: int,
) -> torch.Tensor:
    """Slots to keep per row and head, in arrival order.

    priority: [..., B, H, N] fp32, higher is kept first (N >= max(lengths)); leading dims (layers)
        are independent.
    lengths: [B] int64, valid slots of each row; rows of `lengths <= budget` keep everything.
    Returns [..., B, H, min(budget, N)] int64, sorted ascending: the sinks, the `recent` newest slots
    and the highest-priority others. For a row shorter than the budget, the valid slots come
    first and the rest is padding beyond its length.
    """
    n = priority.shape[-1]
    slots = torch.arange(n, device=priority.device)
    length = lengths[:, None, None]
    valid = slots < length
    protected = (slots < sinks) | (slots >= length - recent) | (length <= budget)
    ranked = priority.masked_fill(protected, float("inf")).masked_fill(~valid, float("-inf"))
    keep = ranked.topk(min(budget, n), dim=-1, sorted=False).indices
    return keep.sort(dim=-1).values


def accumulate_scores(
    probs: torch.Tensor,
    query_valid: torch.Tensor | None,
) -> torch.Tensor:
    """Attention each key received from a chunk of queries, per KV head.

    probs: [B, H_kv, G, C, K] softmax weights of the G query heads sharing each KV head.
    query_valid: [B, C] bool, False for padding queries, or None when all are real.
    Returns [B, H_kv, K] fp32: summed over the group and the real queries, never across rows.
    """
    probs = probs.float()
    if query_valid is not None:
        probs = probs * query_valid[:, None, None, :, None]
    return probs.sum(dim=(2, 3))
