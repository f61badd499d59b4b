"""`Archive`: the tokens a cache row evicted, kept in host memory so that a later turn can recall them.

Eviction moves each layer and KV head's losers here instead of dropping them: their keys before
RoPE, values, accumulated scores and original positions (origins). Every eviction removes the same
number of tokens from every layer and head, so all of them hold the same count and the archive is
a few dense tensors [L, H_kv, n, ...] in eviction order.

Consecutive runs of `block` entries form blocks, the unit of recall. Before blocks are formed, the
tokens archived since the last recall are sorted by original position, per head: eviction drops a
phrase's tokens a few at a time, mixed with others, and sorting gathers them back into the same
blocks, so that a block is mostly a contiguous run of the conversation. Each full block has a digest,
the channel-wise min and max of its keys (Quest, arXiv 2406.10774): for a query q,
sum_d max(q_d lo_d, q_d hi_d) bounds q.k from above for every key k of the block, so a block holding
one key the query would attend to strongly scores high even when its other keys are noise. The
bound is computed before RoPE on both sides, i.e. as if the block sat at distance 0. The bound picks
candidate blocks; the exact logits of the query against their keys choose among them (`select`).

Recalled blocks leave the archive at once but their storage is reclaimed lazily: they are marked
taken and compacted away when a quarter of the storage is taken, so a turn's recall costs what it
takes, not the archive's size. On a CUDA device the storage is pinned and evicted tokens are copied
asynchronously; reads (`select`, `take`, `state`) wait for the copies first.
"""

from __future__ import annotations

import torch

from h2o_cache.eviction import take_vectors

_FIELDS = ("keys", "values", "scores", "origins")
SPREAD = 8  # neighbours on each side whose votes a position shares
# Blocks per recalled block that the exact logits rank (second stage of `select`). Measured on ten
# 30-turn chats replayed at the question: 4 kept 40% of the pass key's tokens resident (7/10 answered),
# 8 kept 61% (8/10), 16 kept 99% (10/10), as did the whole archive (10/10, 4x the time).
CANDIDATES = 16


class Archive:
    """Evicted tokens of one cache row, per layer and KV head, at most `limit` per head.

    Storage: keys, values [L, H_kv, n, D] in the cache's dtype; scores [L, H_kv, n] fp32; origins
    [L, H_kv, n] int64; per block: digests lo, hi [L, H_kv, blocks, D] fp32 (computed when first
    needed) and a taken flag [L, H_kv, blocks] (every head has taken the same number of blocks).
    When an append would pass `limit`, taken blocks are reclaimed, then the oldest blocks dropped (an
    eighth of the limit at a time, so that the shift is paid rarely).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block: int, limit: int, pin: bool = False):
        if block < 1 or limit < block:
            raise ValueError(f"archive block ({block}) must be >= 1 and <= its limit ({limit})")
        self.shape = (num_layers, num_kv_heads)
        self.head_dim = head_dim
        self.dtype = dtype
        self.block = block
        self.limit = limit - limit % block
        self.pin = pin
        self.stored = 0  # tokens per head in storage, taken blocks included
        self.taken_blocks = 0  # per head
        self.dropped = 0  # tokens per head dropped at the limit, oldest first
        self._capacity = 0
        self._data: dict[str, torch.Tensor] = {}
        self._lo = self._hi = self._taken = None
        self._digested = 0  # blocks whose digests are computed
        self._copies: list[torch.cuda.Event] = []

    def __len__(self) -> int:
        """Tokens per layer/head held (not taken)."""
        return self.stored - self.taken_blocks * self.block

    @property
    def full_blocks(self) -> int:
        """Full blocks per layer/head that can be recalled."""
        return self.stored // self.block - self.taken_blocks

    @property
    def nbytes(self) -> int:
        """Host bytes of the held tokens (keys, values, scores, origins and digests)."""
        per_token = 2 * self.head_dim * self.dtype.itemsize + 4 + 8 + 2 * self.head_dim * 4 / self.block
        return int(len(self) * self.shape[0] * self.shape[1] * per_token)

    # ----- writing ---------------------------------------------------------------------------

    @torch.no_grad()
    def append(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, origins: torch.Tensor) -> None:
        """Add m evicted tokens per head: keys, values [L, H_kv, m, D] (any device), scores and
        origins [L, H_kv, m] (scores None for policies that do not score: stored as 0)."""
        m = keys.shape[2]
        if m == 0:
            return
        if self.stored + m > self.limit:
            self._compact()
        if self.stored + m > self.limit:
            self._drop_oldest(self.stored + m - self.limit)
        self._grow(self.stored + m)
        end = self.stored + m
        non_blocking = self.pin and keys.is_cuda
        for name, source in zip(_FIELDS, (keys, values, scores, origins)):
            if source is None:
                self._data[name][:, :, self.stored:end] = 0
            else:
                self._data[name][:, :, self.stored:end].copy_(source, non_blocking=non_blocking)
        if non_blocking:
            event = torch.cuda.Event()
            event.record()
            self._copies.append(event)
        self.stored = end

    def _grow(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        capacity = min(self.limit, max(needed, self._capacity + self._capacity // 2, 4 * self.block))
        capacity = -(-capacity // self.block) * self.block
        self._wait()
        head, d, blocks = self.shape, self.head_dim, capacity // self.block
        new = {"keys": torch.empty(*head, capacity, d, dtype=self.dtype, pin_memory=self.pin),
               "values": torch.empty(*head, capacity, d, dtype=self.dtype, pin_memory=self.pin),
               "scores": torch.empty(*head, capacity, dtype=torch.float32, pin_memory=self.pin),
               "origins": torch.empty(*head, capacity, dtype=torch.int64, pin_memory=self.pin)}
        lo, hi = torch.empty(*head, blocks, d), torch.empty(*head, blocks, d)
        taken = torch.zeros(*head, blocks, dtype=torch.bool)
        if self._data:
            for name, buffer in new.items():
                buffer[:, :, :self.stored] = self._data[name][:, :, :self.stored]
            n = self._taken.shape[2]
            lo[:, :, :n], hi[:, :, :n], taken[:, :, :n] = self._lo, self._hi, self._taken
        self._data, self._lo, self._hi, self._taken = new, lo, hi, taken
        self._capacity = capacity

    def _keep_blocks(self, blocks: torch.Tensor | None, start: int) -> None:
        """Rewrite storage as the full blocks `blocks` ([L, H_kv, b] block indices per head, in order;
        None: blocks `start`.. of every head) followed by the partial tail block."""
        self._digests()  # waits for pending copies; every full block has its digest to move
        size, full = self.block, self.stored // self.block
        tail = self.stored - full * size
        if blocks is None:
            blocks = torch.arange(start, full).expand(*self.shape, full - start)
        b = blocks.shape[-1]
        tokens = _block_tokens(blocks, size)
        for buffer in self._data.values():
            rest = buffer[:, :, full * size:self.stored].clone()
            buffer[:, :, :b * size] = _gather(buffer, tokens)
            buffer[:, :, b * size:b * size + tail] = rest
        for digest in (self._lo, self._hi, self._taken):
            digest[:, :, :b] = _gather(digest[:, :, :full], blocks)
        self._taken[:, :, b:] = False
        self._digested = b
        self.stored = b * size + tail

    def _compact(self) -> None:
        """Reclaim the storage of taken blocks."""
        if not self.taken_blocks:
            return
        full = self.stored // self.block
        kept = self._taken[:, :, :full].to(torch.int8).argsort(dim=-1, stable=True)[..., :full - self.taken_blocks]
        self._keep_blocks(kept.sort(dim=-1).values, 0)
        self.taken_blocks = 0

    def _drop_oldest(self, at_least: int) -> None:
        drop = min(self.stored // self.block, -(-max(at_least, self.limit // 8) // self.block))  # whole blocks
        self._keep_blocks(None, drop)
        self.dropped += drop * self.block

    def _wait(self) -> None:
        for event in self._copies:
            event.synchronize()
        self._copies.clear()

    # ----- recall ----------------------------------------------------------------------------

    def _digests(self) -> tuple[torch.Tensor, torch.Tensor]:
        """lo, hi: [L, H_kv, stored full blocks, D] fp32, computed for the blocks completed since last
        time, once the tokens not yet in a digested block are sorted by origin."""
        self._wait()
        full = self.stored // self.block
        if self._digested < full:
            start, size = self._digested, self.block
            fresh = slice(start * size, self.stored)
            order = self._data["origins"][:, :, fresh].argsort(dim=-1)
            for buffer in self._data.values():
                buffer[:, :, fresh] = _gather(buffer[:, :, fresh], order)
            self._digest(start, full)
        return self._lo[:, :, :full], self._hi[:, :, :full]

    def _digest(self, start: int, end: int) -> None:
        """Compute the digests of storage blocks start..end (their tokens are in their final order)."""
        size = self.block
        keys = self._data["keys"][:, :, start * size:end * size].float().view(*self.shape, end - start, size, self.head_dim)
        self._lo[:, :, start:end] = keys.amin(dim=3)
        self._hi[:, :, start:end] = keys.amax(dim=3)
        self._digested = end

    @torch.no_grad()
    def select(self, queries: torch.Tensor, scaling: float, blocks: int) -> torch.Tensor:
        """The `blocks` full blocks (of those not taken) each layer and KV head's queries would
        attend to most.

        queries: [L, H_kv, Q, D] before RoPE, the Q = group x chunk queries sharing each KV head
        (any device).
        Two stages, each a vote of all heads over the conversation's positions (`_choose`):
        1. each query's upper-bound logits over the blocks (the digests) are softmaxed, as attention
           would be, and summed over the queries: the attention mass a block may draw, H2O's
           measure; each head keeps the CANDIDATES x `blocks` blocks holding the best-voted positions;
        2. the exact logits of the queries against the candidates' keys, softmaxed over them, give
           every candidate token its attention mass, and each head recalls its `blocks` candidates
           holding the best-voted positions.
        The bound alone ranks the blocks poorly (in a 30-turn chat it left a pass key out of the
        candidates of most heads, where the exact logits put it first); the exact logits of the
        whole archive cost seconds on a CPU.
        Returns [L, H_kv, blocks] int64 storage block indices, ascending.
        """
        lo, hi = self._digests()
        full = lo.shape[2]
        device = queries.device
        q = queries.float()
        lo, hi = lo.to(device), hi.to(device)
        taken = self._taken[:, :, :full]
        bound = torch.matmul(q.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(q.clamp(max=0), lo.transpose(-1, -2))
        bound = bound.masked_fill(taken.to(device)[:, :, None], float("-inf"))
        mass = (bound * scaling).softmax(dim=-1).sum(dim=2).cpu()  # [L, H_kv, blocks]
        rarity = self._rarity()
        free = torch.arange(full).expand(*self.shape, full)[~taken].view(*self.shape, -1)
        mass = mass.gather(2, free)[..., None].expand(-1, -1, -1, self.block) / self.block
        origins = _gather(self._data["origins"], _block_tokens(free, self.block)).view_as(mass)
        candidates = free.gather(2, _choose(mass, origins, rarity, min(CANDIDATES * blocks, free.shape[-1])))
        tokens = _block_tokens(candidates, self.block)
        keys = _gather(self._data["keys"], tokens).to(device).float()
        exact = (torch.matmul(q, keys.transpose(-1, -2)) * scaling).softmax(dim=-1).sum(dim=2).cpu()
        exact = exact.view(*self.shape, -1, self.block)
        chosen = _choose(exact, _gather(self._data["origins"], tokens).view_as(exact), rarity, blocks)
        return candidates.gather(2, chosen).sort(dim=-1).values

    def _rarity(self) -> torch.Tensor:
        """[positions] 1 / sqrt(copies): how many archived positions hold the same token, by position.

        A chat template and a repeated instruction come back at every turn, and a probe attends to
        all their copies; summed, the copies outvote a fact stated once (measured: a pass key lost
        after 30 turns to 30 copies of "Here is a passage:"). The layer-0 keys before RoPE are a
        function of the token alone in a Llama-family model, so equal layer-0 keys are copies of one
        token; a position counts the copies in the layer-0 head's archive that holds most of them
        (taken blocks excluded: they are in the cache).
        """
        n, full = self.stored, self.stored // self.block
        held = torch.ones(n, dtype=torch.bool)  # tokens not taken (taken ones are back in the cache)
        copies = torch.ones(int(self._data["origins"][:, :, :n].max()) + 1)
        mix = torch.randint(1, 2**62, (self.head_dim,), generator=torch.Generator().manual_seed(0))
        for head in range(self.shape[1]):
            held[:full * self.block] = ~self._taken[0, head, :full].repeat_interleave(self.block)
            keys = self._data["keys"][0, head, :n][held].float()
            fingerprint = (torch.round(keys * 64).long() * mix).sum(-1)
            _, inverse, counts = torch.unique(fingerprint, return_inverse=True, return_counts=True)
            at = self._data["origins"][0, head, :n][held]
            copies[at] = torch.maximum(copies[at], counts[inverse].float())
        return copies.rsqrt()

    @torch.no_grad()
    def take(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the chosen full blocks ([L, H_kv, b] storage block indices from `select`, not taken
        before) and return their tokens: keys, values [L, H_kv, b * block, D], scores, origins
        [L, H_kv, b * block], on the host, in block order."""
        self._wait()
        chosen = chosen.cpu()
        b = chosen.shape[-1]
        if bool(self._taken.gather(2, chosen).any()):
            raise ValueError("a block is taken twice")
        tokens = _block_tokens(chosen, self.block)
        out = tuple(_gather(self._data[name], tokens) for name in _FIELDS)
        self._taken.scatter_(2, chosen, True)
        self.taken_blocks += b
        if 4 * self.taken_blocks * self.block > self.stored:
            self._compact()
        return out

    # ----- copies and snapshots -------------------------------------------------------------

    def copy(self) -> Archive:
        twin = Archive(*self.shape, self.head_dim, self.dtype, self.block, self.limit, self.pin)
        twin.load_state(self.state())
        twin.dropped = self.dropped
        return twin

    def state(self) -> dict[str, torch.Tensor]:
        """The held tokens as host tensors, in storage order, and `blocked`: how many blocks of them are
        formed (their tokens sorted; the rest are sorted when the next block completes). Digests are
        recomputed on load."""
        self._wait()
        self._compact()
        if not self._data:
            keys = torch.zeros(*self.shape, 0, self.head_dim, dtype=self.dtype)
            return {"keys": keys, "values": keys.clone(), "scores": torch.zeros(*self.shape, 0),
                    "origins": torch.zeros(*self.shape, 0, dtype=torch.int64), "blocked": torch.tensor([0])}
        self._digests()
        state = {name: self._data[name][:, :, :self.stored].clone() for name in _FIELDS}
        return state | {"blocked": torch.tensor([self._digested])}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the contents with `state()` of an archive of the same geometry; its blocks stay as
        they were formed (a state without `blocked` has its tokens re-blocked in origin order)."""
        self.stored = self.taken_blocks = self._capacity = self._digested = 0
        self._data, self._lo, self._hi, self._taken = {}, None, None, None
        n = state["keys"].shape[2]
        self._grow(min(self.limit, n + n // 2))  # room to go on: the next eviction does not copy it all
        self.append(*(state[name] for name in _FIELDS))
        if "blocked" in state and self.stored:
            self._digest(0, int(state["blocked"][0]))


def _choose(mass: torch.Tensor, origins: torch.Tensor, rarity: torch.Tensor, blocks: int) -> torch.Tensor:
    """Indices [L, H_kv, blocks] into dim 2 of mass, origins [L, H_kv, n, block] (the attention mass
    of each token of n blocks per head, and its original position): every head's mass goes to the
    positions its tokens hold, weighted by their rarity; a position also scores the mean vote of
    its SPREAD neighbours on each side (a phrase is relevant as a whole); each head takes its
    blocks whose positions drew the most. A head that never attends to a fact still gets it back
    when the heads that do vote for it."""
    votes = torch.zeros(len(rarity)).index_add_(0, origins.flatten(), mass.flatten()) * rarity
    nearby = torch.nn.functional.avg_pool1d(votes[None, None], 2 * SPREAD + 1, stride=1, padding=SPREAD)[0, 0]
    return (votes + nearby)[origins].sum(dim=-1).topk(blocks, dim=-1).indices


def _block_tokens(blocks: torch.Tensor, size: int) -> torch.Tensor:
    """[L, H_kv, b] storage block indices -> [L, H_kv, b * size] indices of their tokens, in block order."""
    return (blocks[..., None] * size + torch.arange(size)).flatten(-2)


def _gather(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer[l, h, index[l, h, j]] over the token axis (dim 2), trailing dims kept; the archive's own
    [L, H, n, D] storage by whole vectors (`take_vectors`)."""
    if buffer.dim() == 4:
        if not buffer.is_contiguous():
            return buffer.gather(2, index[..., None].expand(-1, -1, -1, buffer.shape[-1]))
        layers, heads, n, _ = buffer.shape
        return take_vectors(buffer, torch.arange(layers * heads, device=index.device).view(layers, heads, 1) * n, index)
    return buffer.gather(2, index)
