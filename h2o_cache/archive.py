"""`Archive`: the tokens a cache row evicted, kept in host memory so that a later turn can recall them.

Eviction moves each layer and KV head's losers here instead of dropping them: their keys before
RoPE, values, accumulated scores and original positions (origins). Every eviction removes the same
number of tokens from every layer and head, so all of them hold the same count and the archive is
a few dense tensors [L, H_kv, n, ...] in eviction order.

Consecutive runs of `block` entries form blocks, the unit of recall. Each full block has a digest,
the channel-wise min and max of its keys (Quest, arXiv 2406.10774): for a query q,
sum_d max(q_d lo_d, q_d hi_d) bounds q.k from above for every key k of the block, so a block holding
one key the query would attend to strongly scores high even when its other keys are noise. The
bound is computed before RoPE on both sides, i.e. as if the block sat at distance 0.

On a CUDA device the storage is pinned and evicted tokens are copied asynchronously; reads
(`select`, `take`, `state`) wait for the copies first.
"""

from __future__ import annotations

import torch


class Archive:
    """Evicted tokens of one cache row, per layer and KV head, at most `limit` per head.

    keys, values: [L, H_kv, n, D] in the cache's dtype; scores: [L, H_kv, n] fp32; origins:
    [L, H_kv, n] int64. When an append would pass `limit`, the oldest blocks are dropped first (an
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
        self.length = 0
        self.dropped = 0  # tokens per head dropped at the limit, oldest first
        self._capacity = 0
        self._keys = self._values = self._scores = self._origins = None
        self._lo = self._hi = None  # [L, H_kv, blocks, D] digests of the full blocks
        self._copies: list[torch.cuda.Event] = []

    def __len__(self) -> int:
        return self.length

    @property
    def full_blocks(self) -> int:
        return self.length // self.block

    @property
    def nbytes(self) -> int:
        """Host bytes the archived tokens take (keys, values, scores, origins and digests)."""
        per_token = 2 * self.head_dim * self.dtype.itemsize + 4 + 8 + 2 * self.head_dim * 4 / self.block
        return int(self.length * self.shape[0] * self.shape[1] * per_token)

    # ----- writing ---------------------------------------------------------------------------

    @torch.no_grad()
    def append(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, origins: torch.Tensor) -> None:
        """Add m evicted tokens per head: keys, values [L, H_kv, m, D] (any device), scores and
        origins [L, H_kv, m] (scores None for policies that do not score: stored as 0)."""
        m = keys.shape[2]
        if m == 0:
            return
        if self.length + m > self.limit:
            self._drop_oldest(self.length + m - self.limit)
        self._grow(self.length + m)
        end = self.length + m
        blocking = not (self.pin and keys.is_cuda)
        self._keys[:, :, self.length:end].copy_(keys, non_blocking=not blocking)
        self._values[:, :, self.length:end].copy_(values, non_blocking=not blocking)
        if scores is None:
            self._scores[:, :, self.length:end] = 0
        else:
            self._scores[:, :, self.length:end].copy_(scores, non_blocking=not blocking)
        self._origins[:, :, self.length:end].copy_(origins, non_blocking=not blocking)
        if not blocking:
            event = torch.cuda.Event()
            event.record()
            self._copies.append(event)
        self.length = end

    def _grow(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        capacity = min(self.limit, max(needed, self._capacity + self._capacity // 2, 4 * self.block))
        self._wait()
        old = (self._keys, self._values, self._scores, self._origins)
        head = (*self.shape, capacity)
        self._keys = torch.empty(*head, self.head_dim, dtype=self.dtype, pin_memory=self.pin)
        self._values = torch.empty(*head, self.head_dim, dtype=self.dtype, pin_memory=self.pin)
        self._scores = torch.empty(*head, dtype=torch.float32, pin_memory=self.pin)
        self._origins = torch.empty(*head, dtype=torch.int64, pin_memory=self.pin)
        if old[0] is not None:
            for new, previous in zip((self._keys, self._values, self._scores, self._origins), old):
                new[:, :, :self.length] = previous[:, :, :self.length]
        self._capacity = capacity

    def _drop_oldest(self, at_least: int) -> None:
        self._wait()
        drop = max(at_least, self.limit // 8)
        drop = min(self.length, -(-drop // self.block) * self.block)  # whole blocks
        rest = self.length - drop
        for buffer in (self._keys, self._values, self._scores, self._origins):
            buffer[:, :, :rest] = buffer[:, :, drop:self.length].clone()
        if self._lo is not None:  # digests of the blocks that stay; any not computed yet follow later
            gone = drop // self.block
            self._lo, self._hi = self._lo[:, :, gone:].contiguous(), self._hi[:, :, gone:].contiguous()
        self.length = rest
        self.dropped += drop

    def _wait(self) -> None:
        for event in self._copies:
            event.synchronize()
        self._copies.clear()

    # ----- recall ----------------------------------------------------------------------------

    def _digests(self) -> tuple[torch.Tensor, torch.Tensor]:
        """lo, hi: [L, H_kv, full_blocks, D] fp32, computed for the blocks completed since last time."""
        self._wait()
        done = 0 if self._lo is None else self._lo.shape[2]
        blocks = self.full_blocks
        if done < blocks:
            new = self._keys[:, :, done * self.block:blocks * self.block].float()
            new = new.view(*self.shape, blocks - done, self.block, self.head_dim)
            lo, hi = new.amin(dim=3), new.amax(dim=3)
            self._lo = lo if self._lo is None else torch.cat((self._lo, lo), dim=2)
            self._hi = hi if self._hi is None else torch.cat((self._hi, hi), dim=2)
        return self._lo, self._hi

    @torch.no_grad()
    def select(self, queries: torch.Tensor, scaling: float, blocks: int) -> torch.Tensor:
        """The `blocks` full blocks each layer and KV head's queries would attend to most.

        queries: [L, H_kv, Q, D] before RoPE, the Q = group x chunk queries sharing each KV head
        (any device).
        Each query's upper-bound logits over the blocks are softmaxed, as attention would be, and
        summed over the queries: the attention mass the block may draw, H2O's measure.
        Returns [L, H_kv, blocks] int64 block indices, ascending.
        """
        lo, hi = self._digests()
        device = queries.device
        lo, hi = lo.to(device), hi.to(device)
        q = queries.float()
        bound = torch.matmul(q.clamp(min=0), hi.transpose(-1, -2)) + torch.matmul(q.clamp(max=0), lo.transpose(-1, -2))
        mass = (bound * scaling).softmax(dim=-1)  # [L, H_kv, Q, blocks]
        chosen = mass.sum(dim=2).topk(blocks, dim=-1).indices
        return chosen.sort(dim=-1).values

    @torch.no_grad()
    def take(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the chosen full blocks ([L, H_kv, b], ascending per head) and return their tokens:
        keys, values [L, H_kv, b * block, D], scores, origins [L, H_kv, b * block], on the host."""
        self._digests()  # up to date, so that those of the remaining blocks can be kept
        chosen = chosen.cpu()
        b, size = chosen.shape[-1], self.block
        blocks = self.full_blocks
        within = torch.arange(size)
        taken = (chosen[..., None] * size + within).flatten(-2)  # [L, H, b * block]
        out = [_gather(buffer, taken) for buffer in (self._keys, self._values, self._scores, self._origins)]

        picked = torch.zeros(*self.shape, blocks, dtype=torch.bool).scatter_(2, chosen, True)
        rest = (picked.to(torch.int8).argsort(dim=-1, stable=True))[..., :blocks - b]  # blocks kept, in order
        kept = (rest[..., None] * size + within).flatten(-2)
        tail = self.length - blocks * size
        new_full = (blocks - b) * size
        for buffer in (self._keys, self._values, self._scores, self._origins):
            tail_part = buffer[:, :, blocks * size:self.length].clone()
            buffer[:, :, :new_full] = _gather(buffer, kept)
            buffer[:, :, new_full:new_full + tail] = tail_part
        self._lo, self._hi = _gather(self._lo, rest), _gather(self._hi, rest)
        self.length = new_full + tail
        return tuple(out)

    # ----- copies and snapshots -------------------------------------------------------------

    def copy(self) -> Archive:
        twin = Archive(*self.shape, self.head_dim, self.dtype, self.block, self.limit, self.pin)
        twin.load_state(self.state())
        twin.dropped = self.dropped
        return twin

    def state(self) -> dict[str, torch.Tensor]:
        """The archived tokens as host tensors (digests are recomputed on load)."""
        self._wait()
        n = self.length
        if self._keys is None:
            empty = torch.zeros(*self.shape, 0, self.head_dim, dtype=self.dtype)
            return {"keys": empty, "values": empty.clone(), "scores": torch.zeros(*self.shape, 0),
                    "origins": torch.zeros(*self.shape, 0, dtype=torch.int64)}
        return {"keys": self._keys[:, :, :n].clone(), "values": self._values[:, :, :n].clone(),
                "scores": self._scores[:, :, :n].clone(), "origins": self._origins[:, :, :n].clone()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the contents with `state()` of an archive of the same geometry."""
        self.length, self._capacity = 0, 0
        self._keys = self._values = self._scores = self._origins = self._lo = self._hi = None
        self.append(state["keys"], state["values"], state["scores"], state["origins"])


def _gather(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer[l, h, index[l, h, j]] over the token axis (dim 2), trailing dims kept."""
    if buffer.dim() == 4:
        index = index[..., None].expand(-1, -1, -1, buffer.shape[-1])
    return buffer.gather(2, index)
