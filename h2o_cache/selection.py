"""Which archived blocks a layer and KV head's queries would attend to most, as pure tensor functions.

Two stages, as Quest (arXiv 2406.10774) and ArkVale rank pages: each block's digest (the channel-wise
min and max of its keys) bounds q.k for every key of the block, so softmaxing the bounds over the
blocks gives the attention mass a block may draw (`bound_mass`); the exact logits of the queries
against the keys of the best candidates then choose among them (`exact_mass`), since a block of
large keys pointing every way has a loose bound though none of its keys matches the query.

No function here reads a value back to the host or returns a shape that depends on tensor values
(`tests/h2o_cache/test_capture_safety.py` holds them to it), so on a GPU the ranking can run on the
device, inside a captured step, with the digests there; `Archive.select` is the host glue around them.
"""

from __future__ import annotations

import torch


def bound_mass(queries: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scaling: float) -> torch.Tensor:
    """queries [L, H, Q, D] fp32 before RoPE (the queries that share each KV head); lo, hi [L, H, N, D]
    fp32 digests of N blocks. Returns [L, H, N] fp32: per query the softmax over blocks of the upper
    bound of q.k * scaling (sum_d max(q_d lo_d, q_d hi_d)), summed over the queries."""
    bound = torch.matmul(queries.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(queries.clamp(max=0), lo.transpose(-1, -2))
    return (bound * scaling).softmax(dim=-1).sum(dim=2)


def exact_mass(queries: torch.Tensor, keys: torch.Tensor, scaling: float, block: int) -> torch.Tensor:
    """queries [L, H, Q, D] fp32; keys [L, H, M * block, D] fp32, the keys of M candidate blocks, block
    by block. Returns [L, H, M] fp32: per query the softmax over all candidate keys of q.k * scaling,
    summed over the block's keys and over the queries."""
    probs = (torch.matmul(queries, keys.transpose(-1, -2)) * scaling).softmax(dim=-1).sum(dim=2)
    return probs.view(*probs.shape[:2], -1, block).sum(dim=-1)


def top_blocks(mass: torch.Tensor, k: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """The k blocks of most mass ([L, H, N] -> [L, H, k] int64, by decreasing mass); with `among`
    ([L, H, N] block indices that `mass` scores), their indices in it."""
    best = mass.topk(k, dim=-1).indices
    return best if among is None else among.gather(2, best)
