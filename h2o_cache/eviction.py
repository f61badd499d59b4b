"""Which cached tokens survive an eviction: pure tensor functions, testable without a model."""

from __future__ import annotations

import torch


def keep_indices(
    priority: torch.Tensor,
    lengths: torch.Tensor,
    keep: torch.Tensor,
    sinks: int,
    recent: int,
    width: int | None = None,
    pinned: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slots to keep per row and head, in arrival order.

    priority: [..., B, H, N] fp32, higher is kept first (N >= max(lengths)); leading dims (layers)
        are independent.
    lengths: [B] int64, valid slots of each row.
    keep: [B] int64, slots each row keeps (<= lengths; == lengths keeps the row as it is).
    width: max(keep) when the caller knows it, which spares a device-to-host read.
    pinned: [..., B, H, N] bool, slots kept whatever their priority (recalled tokens), or None.
    first: [B] int64, the slot of each row's first own token (after a recall window), or None (0):
        the sinks are the `sinks` slots from there.
    Returns [..., B, H, max(keep)] int64: per row and head, its sinks, its `recent` newest slots, its
    pinned slots and its highest-priority other slots, ascending; a row keeping fewer than max(keep)
    is padded with slots beyond what it keeps.
    """
    n = priority.shape[-1]
    slots = torch.arange(n, device=priority.device)
    length = lengths[:, None, None]
    valid = slots < length
    start = 0 if first is None else first[:, None, None]
    protected = ((slots >= start) & (slots < start + sinks)) | (slots >= length - recent) | (keep == lengths)[:, None, None]
    if pinned is not None:
        protected = protected | pinned
    ranked = priority.masked_fill(protected, float("inf")).masked_fill(~valid, float("-inf"))
    width = int(keep.max()) if width is None else width
    best = ranked.topk(width, dim=-1).indices  # by priority, best first
    chosen = torch.arange(width, device=priority.device) < keep[:, None, None]
    return best.masked_fill(~chosen, n).sort(dim=-1).values.clamp_(max=n - 1)


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


def take_vectors(buffer: torch.Tensor, starts: torch.Tensor, index: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Vectors starts + index of a contiguous buffer [..., D] seen as [N, D], shaped [*index.shape, D].

    starts: the vector offset of each of index's rows, broadcastable to index; out: flat storage of at
    least index.numel() * D elements to write into, or None for a new tensor. One index_select of
    whole D-vectors: a gather along the token axis would read an index as large as what it returns.
    """
    dim = buffer.shape[-1]
    flat = (index + starts).flatten()
    vectors = buffer.view(-1, dim)
    if out is None:
        return vectors.index_select(0, flat).view(*index.shape, dim)
    out = out[:flat.numel() * dim].view(-1, dim)
    torch.index_select(vectors, 0, flat, out=out)
    return out.view(*index.shape, dim)
