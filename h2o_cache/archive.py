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
bound is computed before RoPE on both sides, i.e. as if the block sat at distance 0.

Recalled blocks leave the archive at once but their storage is reclaimed lazily: they are marked
taken and compacted away when a quarter of the storage is taken, so a turn's recall costs what it
takes, not the archive's size. On a CUDA device the storage is pinned and evicted tokens are copied
asynchronously; reads (`select`, `take`, `state`) wait for the copies first.
"""

from __future__ import annotations

import torch

_FIELDS = ("keys", "values", "scores", "origins")
SPREAD = 8  # neighbours on each side whose votes a position shares


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
        tokens = (blocks[..., None] * size + torch.arange(size)).flatten(-2)
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
            new = self._data["keys"][:, :, start * size:full * size].float()
            new = new.view(*self.shape, full - start, size, self.head_dim)
            self._lo[:, :, start:full] = new.amin(dim=3)
            self._hi[:, :, start:full] = new.amax(dim=3)
            self._digested = full
        return self._lo[:, :, :full], self._hi[:, :, :full]

    @torch.no_grad()
    def select(self, queries: torch.Tensor, scaling: float, blocks: int) -> torch.Tensor:
        """The `blocks` full blocks (of those not taken) each layer and KV head's queries would
        attend to most.

        queries: [L, H_kv, Q, D] before RoPE, the Q = group x chunk queries sharing each KV head
        (any device).
        Each query's upper-bound logits over the blocks are softmaxed, as attention would be, and
        summed over the queries: the attention mass the block may draw, H2O's measure. Heads then
        pool their masses by original position (a head's mass goes to the positions its block
        holds), and each head recalls its blocks whose positions drew the most mass from all heads:
        a head that never attends to a fact still gets it back when the heads that do vote for it.
        Returns [L, H_kv, blocks] int64 storage block indices, ascending.
        """
        lo, hi = self._digests()
        device = queries.device
        lo, hi = lo.to(device), hi.to(device)
        taken = self._taken[:, :, :lo.shape[2]].to(device)
        q = queries.float()
        bound = torch.matmul(q.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(q.clamp(max=0), lo.transpose(-1, -2))
        bound = bound.masked_fill(taken[:, :, None], float("-inf"))
        mass = (bound * scaling).softmax(dim=-1).sum(dim=2).cpu()  # [L, H_kv, blocks]
        # Every head votes for the conversation's positions its blocks hold; a head then recalls the
        # blocks holding the positions all heads voted for most.
        full = mass.shape[-1]
        origins = self._data["origins"][:, :, :full * self.block]
        votes = torch.zeros(int(origins.max()) + 1).index_add_(
            0, origins.flatten(), mass[..., None].expand(-1, -1, -1, self.block).flatten() / self.block)
        # A phrase is relevant as a whole: a position also scores the mean vote of its neighbours.
        nearby = torch.nn.functional.avg_pool1d(votes[None, None], 2 * SPREAD + 1, stride=1, padding=SPREAD)[0, 0]
        score = (votes + nearby)[origins].view(*self.shape, full, self.block).sum(dim=-1)
        score = score.masked_fill(self._taken[:, :, :full], float("-inf"))
        chosen = score.topk(blocks, dim=-1).indices
        return chosen.sort(dim=-1).values

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
        tokens = (chosen[..., None] * self.block + torch.arange(self.block)).flatten(-2)
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
        """The held tokens as host tensors, in storage order (digests are recomputed on load)."""
        self._wait()
        self._compact()
        if not self._data:
            keys = torch.zeros(*self.shape, 0, self.head_dim, dtype=self.dtype)
            return {"keys": keys, "values": keys.clone(), "scores": torch.zeros(*self.shape, 0),
                    "origins": torch.zeros(*self.shape, 0, dtype=torch.int64)}
        return {name: self._data[name][:, :, :self.stored].clone() for name in _FIELDS}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the contents with `state()` of an archive of the same geometry."""
        self.stored = self.taken_blocks = self._capacity = self._digested = 0
        self._data, self._lo, self._hi, self._taken = {}, None, None, None
        self.append(*(state[name] for name in _FIELDS))


def _gather(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer[l, h, index[l, h, j]] over the token axis (dim 2), trailing dims kept."""
    if buffer.dim() == 4:
        index = index[..., None].expand(-1, -1, -1, buffer.shape[-1])
    return buffer.gather(2, index)
