"""Which archived blocks a layer and KV head's queries would attend to most, as pure tensor functions.

Two stages, as Quest (arXiv 2406.10774) and ArkVale rank pages: each block's digest, a box [lo, hi]
per channel (ArkVale's mean -/+ mean deviation of its keys by default, or Quest's min and max, which
bound q.k for every key of the block: `config.DIGESTS`), scores the block by the box's corner best
aligned with the query, so softmaxing the scores over the blocks gives the attention mass a block
may draw (`bound_mass`); the exact logits of the queries
against the keys of the best candidates then choose among them (`token_mass`), since a block of
large keys pointing every way has a loose bound though none of its keys matches the query. The
exact mass is pooled by original position over every layer and head that chose together
(`position_votes`), as the keys of one token sit in different blocks of different heads: each head
then takes its candidate blocks whose positions drew the most (`pool_by_position`), or, for a choice
pooled over all layers, the tokens of all of its archive whose positions or their neighbours' drew
the most (`span_votes`, `token_votes`), so that a head whose own bound missed the fact still fetches
it, and all of it.

No function here reads a value back to the host or returns a shape that depends on tensor values
(`tests/h2o_cache/test_capture_safety.py` holds them to it), so on a GPU the ranking can run on the
device, inside a captured step, with the digests there; `Archive.select` is the host glue around them.
"""

from __future__ import annotations

import torch


def bound_mass(queries: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scaling: float,
               scanned: torch.Tensor | None = None) -> torch.Tensor:
    """queries [L, H, Q, D] fp32 before RoPE (the queries that share each KV head); lo, hi [L, H, N, D]
    digests of N blocks (an archive's are fp16, widened exactly). Returns [L, H, N] fp32: per query the
    softmax over blocks of the box's best corner, sum_d max(q_d lo_d, q_d hi_d) * scaling (for min and
    max digests, the upper bound of q.k * scaling up to their rounding), summed over the queries.
    Digests of no width (lo and hi one storage, "centre") score q . centre, one product.
    scanned: [L, H, N] bool, the blocks each head ranks (`archive.Sweep`): the softmax runs over those
    alone, and the others score -1, below any of them."""
    if lo.data_ptr() == hi.data_ptr() and lo.shape == hi.shape and lo.stride() == hi.stride():
        logits = torch.matmul(queries, lo.float().transpose(-1, -2)) * scaling
    else:
        lo, hi = lo.float(), hi.float()
        bound = torch.matmul(queries.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(queries.clamp(max=0), lo.transpose(-1, -2))
        logits = bound * scaling
    if scanned is None:
        return logits.softmax(dim=-1).sum(dim=2)
    mass = logits.masked_fill(~scanned[:, :, None], float("-inf")).softmax(dim=-1).sum(dim=2)
    return mass.masked_fill(~scanned, -1.0)


def token_mass(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """queries [L, H, Q, D] fp32; keys [L, H, K, D] fp32, the keys of the candidate blocks. Returns
    [L, H, K] fp32: per query the softmax over the candidate keys of q.k * scaling, summed over the
    queries (the attention mass each key would draw)."""
    return (torch.matmul(queries, keys.transpose(-1, -2)) * scaling).softmax(dim=-1).sum(dim=2)


def position_votes(mass: torch.Tensor, origins: torch.Tensor, positions: int) -> torch.Tensor:
    """mass [L, H, K] fp32 per candidate key; origins [L, H, K] int64, the keys' original positions.
    Returns [positions] fp32: per original position (modulo `positions`), the mass every layer and
    head gave to it, summed."""
    return _tally(mass, _slots(origins, positions), positions)


def pool_by_position(mass: torch.Tensor, origins: torch.Tensor, positions: int, per_layer: bool = False) -> torch.Tensor:
    """mass [L, H, K] fp32 per candidate key; origins [L, H, K] int64, the keys' original positions.
    Returns [L, H, K]: per key, the mass that every layer and head gave to its position, summed
    (per_layer: that the heads of its own layer gave, as when each layer chooses alone).

    Heads choose alone poorly: in a 30-turn chat each head's own ranking put the pass key in its
    top 16 blocks in 64% of the heads, and the key was found 0 times in 10; pooled, the heads that
    point at the fact bring it to the rest. Origins are taken modulo `positions`, a fixed size so
    that the shape never depends on the conversation's length (positions `positions` apart share a
    vote)."""
    slots = _slots(origins, positions)
    if per_layer:  # each layer votes in a table of its own
        slots = slots + torch.arange(mass.shape[0], device=mass.device)[:, None, None] * positions
        positions *= mass.shape[0]
    return _tally(mass, slots, positions)[slots]


def _tally(mass: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    """[size]: the mass of every key summed into its slot (mass, slots of the same shape)."""
    return torch.zeros(size, dtype=mass.dtype, device=mass.device).index_add_(0, slots.flatten(), mass.flatten())


def span_votes(votes: torch.Tensor, radius: int) -> torch.Tensor:
    """votes [positions] (`position_votes`) -> [positions]: per position, its own votes plus those of
    every position within `radius` of it (its own included), so that a phrase's words share the votes
    its attended words drew, and an attended word still ranks above the neighbours that share them."""
    # differences of a running sum (fp64, so that a window of zeros sums to exactly 0): a tenth of a
    # pooling's time over the 64k positions
    summed = votes.double().cumsum(0)  # summed[i]: the votes of positions 0..i
    running = torch.cat([summed.new_zeros(radius + 1), summed, summed[-1:].expand(radius)])
    return votes + (running[2 * radius + 1:] - running[:votes.shape[0]]).to(votes.dtype)


def token_votes(votes: torch.Tensor, origins: torch.Tensor) -> torch.Tensor:
    """votes [positions]; origins [L, H, n] int64, the original positions of a head's archived tokens.
    Returns [L, H, n] fp32: per token, the votes of its position.

    At 8k tokens a head's bound put the pass key among its 64 candidates of ~960 blocks in only 38%
    of the heads; pooled over its candidates alone, the rest could not fetch it, and the key came
    back 2 times in 5. Scored by every head's votes over all of its blocks, 98-100% of the heads
    held the key's tokens, and the key's digits after the first came back 5 in 5. Tokens, not the
    blocks they were archived in: eviction scatters a phrase over many blocks, each mixed with other
    tokens; at 2k tokens, depth 15%, whole blocks left each needle token out of 0-90% of the heads
    and the first digit came back 4 times in 10 (p 0.09-0.30 where missed), with every archived
    token of the needle in every head's window 6 in 6 (p 0.92-0.96; the full cache: 0.80-0.93)."""
    slots = _slots(origins, votes.shape[0])
    return votes.index_select(0, slots.flatten()).view(slots.shape)


def _slots(origins: torch.Tensor, positions: int) -> torch.Tensor:
    """origins modulo `positions`: a mask where it is a power of two (origins are >= 0), which is a
    tenth of an int64 division's time over an 8k archive's 700k origins."""
    if positions & (positions - 1) == 0:
        return origins & (positions - 1)
    return origins.remainder(positions)


def block_tokens(blocks: torch.Tensor, size: int) -> torch.Tensor:
    """[..., b] block indices -> [..., b * size] indices of their tokens, in block order."""
    return (blocks[..., None] * size + torch.arange(size, device=blocks.device)).flatten(-2)


def block_mass(mass: torch.Tensor, block: int) -> torch.Tensor:
    """[L, H, M * block] per key, block by block -> [L, H, M] per block (summed)."""
    return mass.view(*mass.shape[:2], -1, block).sum(dim=-1)


def top_blocks(mass: torch.Tensor, k: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """The k blocks (or tokens) of most mass ([L, H, N] -> [L, H, k] int64, by decreasing mass, ties
    by increasing index: windows of positions that drew no votes tie, and `native_recall` breaks
    ties the same way); with `among` ([L, H, N] indices that `mass` scores), their indices in it."""
    best = mass.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return best if among is None else among.gather(2, best)
