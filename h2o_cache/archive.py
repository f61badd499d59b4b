"""`Archive`: the tokens a cache row evicted, kept in host memory so that later queries can recall them.

Eviction moves each layer and KV head's losers here instead of dropping them: their keys before
RoPE, values, accumulated scores and original positions (origins). Every eviction removes the same
number of tokens from every layer and head, so all of them hold the same count and the archive is
a few dense tensors [L, H_kv, n, ...] in eviction order.

Consecutive runs of `block` entries form blocks, the unit of recall. Before blocks are formed, the
tokens archived since the last block was formed are sorted by original position, per head:
eviction drops a phrase's tokens a few at a time, mixed with others, and sorting gathers them back
into the same blocks, so that a block is mostly a contiguous run of the conversation. Each full
block has a digest, a box [lo, hi] per channel, and a query q scores the block by the box's corner
best aligned with it, sum_d max(q_d lo_d, q_d hi_d), before RoPE on both sides (as if the block sat
at distance 0). By default the box has no width: lo = hi = the keys' mean ("centre"), so q . mean
scores the block, an estimate of the logit its typical key draws, and lo and hi are one buffer, so a
choice reads 2 x head_dim bytes a block. With `digest="mean"` the box is that mean -/+ the keys'
mean absolute deviation (ArkVale's "cuboid-mean"), and with `digest="minmax"` the channel-wise min
and max (Quest, arXiv 2406.10774), a bound on q.k for every key of the block, which a few large keys
pointing every way loosen. Measured on decode queries of the novel (RESULTS.md, "A digest of no
width"): the 256 blocks of a 16k-token archive that the centres rank first hold 0.266 of a voting
head's attention over the archive, the mean -/+ deviation's 0.237 (the best 256 blocks: 0.292); the
width a box adds ranks blocks of spread-out keys up, not the blocks attention goes to. The score picks candidate
blocks; the logits of the queries against their keys choose among them (`select`), in 16 bits: a
16-bit archive's own keys, or the fp16 copies an fp32 archive keeps of its full blocks' keys.
Ranking reads every candidate's keys (all of a 2k history's, ~21 MB in 16 bits per decode choice of a
row of the default model), and half the bytes of fp32 took a row's choice from 3.9 to 2.5 ms (the
C++ kernel, 2 threads, batch 8 at 2k tokens), for logits rounded to fp16 keys (a relative ~5e-4 per
key). `H2OCache` archives in 16 bits (an fp32 cache's in fp16), with fp16 block digests: 26 KB of
host memory per archived token of the default model instead of 63 KB for fp32 with fp16 copies and
fp32 digests.

The archive is never emptied by a recall: the cache's recall window (`h2o_cache.recall`) holds
copies of the blocks its queries chose, so a block that falls out of the chosen set is still here,
and a block is in the window at most once. The storage is ordinary host memory. On a CUDA device an
eviction downloads what it drops in one asynchronous copy into pinned memory (`compaction.archive`)
and appends views of it with the copy's event; they are written into the storage when the archive is
next read or written (`land`), by which time the copy has long finished.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

from h2o_cache.config import DIGESTS, CacheConfig
from h2o_cache.eviction import take_vectors
from h2o_cache.quantized import kernel
from h2o_cache.selection import (block_mass, block_tokens, bound_mass, pool_by_position, position_votes, span_votes, token_mass,
                                 token_votes, top_blocks)

_FIELDS = ("keys", "values", "scores", "origins")
# Candidate blocks per chosen block that the exact logits rank (second stage of `select`): the bound
# alone lets blocks of large, noisy keys crowd out the one a query attends to. Measured on a fact said
# once in a 2k-token prompt (a 6-digit code in news articles, 24 codes): 4 found 10, 8 found 17, 16
# (every block of a 2k history: the bound only narrows longer ones) 21, the full cache 24.
CANDIDATES = 16
# The block digests are stored in fp16, clamped to its finite range (a key channel past it, in an fp32
# or bf16 archive, would make a bound inf and a query's zero channel times it a NaN).
FP16_MAX = 65504.0
# Size of the position table the heads pool their votes in (`pool_by_position`): fixed, so that the
# ranking's shapes never depend on the conversation's length.
POSITIONS = 1 << 16


class Archive:
    """Evicted tokens of one cache row, per layer and KV head, at most `limit` per head.

    Storage: keys, values [L, H_kv, n, D] in the cache's dtype; scores [L, H_kv, n] fp32; origins
    [L, H_kv, n] int64; per block: digests lo, hi [L, H_kv, blocks, D] fp16 (computed in fp32 and
    rounded to nearest: half the bytes a choice reads over a long archive) and, for an fp32
    archive, its keys in fp16 for ranking [L, H_kv, block, D] (computed when first needed). When an
    append would pass `limit`, the oldest blocks are dropped (an eighth of the limit at a time, so
    that the shift is paid rarely); `epoch` counts such renumberings of blocks.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block: int, limit: int, digest: str = CacheConfig.recall_digest):
        if block < 1 or limit < block:
            raise ValueError(f"archive block ({block}) must be >= 1 and <= its limit ({limit})")
        if digest not in DIGESTS:
            raise ValueError(f"archive digest must be one of {DIGESTS}, not {digest!r}")
        self.digest = digest
        self.shape = (num_layers, num_kv_heads)
        self.head_dim = head_dim
        self.dtype = dtype
        self.block = block
        self.limit = limit - limit % block
        self.stored = 0  # tokens per head
        self.dropped = 0  # tokens per head dropped at the limit, oldest first
        self.epoch = 0  # bumped whenever block indices change meaning
        self._capacity = 0
        self._data: dict[str, torch.Tensor] = {}
        self._lo = self._hi = self._half = None
        self._digested = 0  # blocks whose digests are computed
        self._incoming: list[tuple[int, tuple[torch.Tensor | None, ...], torch.cuda.Event | None]] = []
        self._sweep: Sweep | None = None
        self._lent: tuple[Archive, int, dict[str, torch.Tensor]] | None = None  # `lend`: whose storage, what to restore

    def _ranks_copies(self) -> bool:
        """Whether full blocks keep fp16 copies of their keys for ranking (an fp32 archive), rather
        than being ranked by their own 16-bit keys."""
        return self.dtype.itemsize > 2

    def __len__(self) -> int:
        """Tokens per layer/head held."""
        return self.stored

    @property
    def full_blocks(self) -> int:
        """Full blocks per layer/head that can be recalled."""
        return self.stored // self.block

    @property
    def version(self) -> tuple[int, int, int]:
        """Changes whenever what `storage` returns may have: tokens held (an append, which may form
        blocks), capacity (the storage reallocated) or epoch (blocks dropped, a state loaded)."""
        return self.stored, self._capacity, self.epoch

    @property
    def nbytes(self) -> int:
        """Host bytes of the held tokens (keys, values, scores, origins and digests)."""
        digests = 1 if self.digest == "centre" else 2  # a centre's lo and hi are one tensor
        per_token = (2 * self.head_dim * self.dtype.itemsize + 4 + 8 + digests * self.head_dim * 2 / self.block
                     + (2 * self.head_dim if self._ranks_copies() else 0))
        return int(len(self) * self.shape[0] * self.shape[1] * per_token)

    # ----- writing ---------------------------------------------------------------------------

    @torch.no_grad()
    def append(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, origins: torch.Tensor,
               copied: torch.cuda.Event | None = None) -> None:
        """Add m evicted tokens per head: keys, values [L, H_kv, m, D] on the host, scores and origins
        [L, H_kv, m] (scores None for policies that do not score: stored as 0).

        copied: the event of an asynchronous copy still filling the sources; they are kept as they
        are and written into the storage when the archive is next read or written.
        """
        m = keys.shape[2]
        if m == 0:
            return
        self._incoming.append((self.reserve(m), (keys, values, scores, origins), copied))
        if copied is None:
            self.land()

    def reserve(self, m: int) -> int:
        """Make room for m more tokens per head (the oldest blocks dropped at the limit) and count them
        held; returns where they start. `append` queues its sources there; `compaction.archive`'s
        kernel writes keys, values, scores and origins of [start, start + m) in place before anything
        else reads the archive."""
        self.land()
        if self.stored + m > self.limit:
            self._drop_oldest(self.stored + m - self.limit)
        self._grow(self.stored + m)
        start = self.stored
        self.stored += m
        return start

    def native(self) -> bool:
        """Whether the storage is formed into blocks in C++ (`kernels/compaction.cpp`): fp32 or fp16,
        head_dim a multiple of 8, the kernel built (the same results as the torch ops)."""
        return self.dtype in (torch.float32, torch.float16) and self.head_dim % 8 == 0 and kernel() is not None

    def land(self) -> None:
        """Write appended tokens whose copy was pending into the storage (waiting for the copy only
        if it has not finished)."""
        for start, sources, copied in self._incoming:
            if copied is not None and not copied.query():
                copied.synchronize()
            end = start + sources[0].shape[2]
            for name, source in zip(_FIELDS, sources):
                self._data[name][:, :, start:end] = 0 if source is None else source
        self._incoming.clear()

    def expect(self, more: int) -> None:
        """Make room now for `more` tokens per head beyond those held, and an eighth more (what a turn
        feeds after its body: the re-read excerpt, the question), up to the limit, in one allocation: a
        long prompt's archive is otherwise reallocated and copied each time it outgrows its storage by
        half (9 times for a 4k prompt, ~0.16 s of its prefill on the default model). A lent twin keeps
        its lender's storage."""
        needed = min(self.limit, self.stored + more + more // 8)
        if needed > self._capacity and self._lent is None:
            self._reallocate(-(-needed // self.block) * self.block)

    def _grow(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        capacity = min(self.limit, max(needed, self._capacity + self._capacity // 2, 4 * self.block))
        self._reallocate(-(-capacity // self.block) * self.block)

    def _reallocate(self, capacity: int) -> None:
        """New storage of `capacity` tokens per head, holding what the old one held (a lent twin's own
        from then on)."""
        self.land()
        head, d, blocks = self.shape, self.head_dim, capacity // self.block
        new = {"keys": _storage(*head, capacity, d, dtype=self.dtype),
               "values": _storage(*head, capacity, d, dtype=self.dtype),
               "scores": _storage(*head, capacity, dtype=torch.float32),
               "origins": _storage(*head, capacity, dtype=torch.int64)}
        lo = _storage(*head, blocks, d, dtype=torch.float16)
        hi = lo if self.digest == "centre" else _storage(*head, blocks, d, dtype=torch.float16)  # a box of no width
        half = _storage(*head, capacity if self._ranks_copies() else 0, d, dtype=torch.float16)
        if self._data:
            for name, buffer in new.items():
                buffer[:, :, :self.stored] = self._data[name][:, :, :self.stored]
            n = self._lo.shape[2]
            lo[:, :, :n], hi[:, :, :n] = self._lo, self._hi
            half[:, :, :self._digested * self.block] = self._half[:, :, :self._digested * self.block]
        self._data, self._lo, self._hi, self._half = new, lo, hi, half
        self._capacity = capacity

    def _drop_oldest(self, at_least: int) -> None:
        """Drop the oldest whole blocks (at least `at_least` tokens, an eighth of the limit or more)."""
        self._digests()  # lands pending copies; every full block has its digest to move
        if self._lent is not None and self._data is self._lent[0]._data:  # shifting the lender's would lose its tokens
            self._reallocate(self._capacity)
        size, full = self.block, self.stored // self.block
        drop = min(full, -(-max(at_least, self.limit // 8) // size))
        for buffer in self._data.values():
            buffer[:, :, :self.stored - drop * size] = buffer[:, :, drop * size:self.stored].clone()
        for digest in (self._lo,) if self._hi is self._lo else (self._lo, self._hi):
            digest[:, :, :full - drop] = digest[:, :, drop:full].clone()
        if self._ranks_copies():
            self._half[:, :, :(full - drop) * size] = self._half[:, :, drop * size:full * size].clone()
        self._digested = full - drop
        self.stored -= drop * size
        self.dropped += drop * size
        self.epoch += 1

    # ----- recall ----------------------------------------------------------------------------

    def sweep(self, window: int) -> Sweep:
        """The running candidates of this archive's decode choices for a window of `window` tokens
        (CANDIDATES blocks per block it takes, per head): the same object while that count stays (the
        kernel's kept `Choice`s point into it), emptied where the blocks were renumbered since (`epoch`)."""
        candidates = CANDIDATES * (window // self.block)
        state = self._sweep
        if state is None or state.candidates.shape[-1] != candidates:
            state = self._sweep = Sweep(*self.shape, candidates)
        elif state.epoch != self.epoch:
            state.reset()
        state.epoch = self.epoch
        return state

    def forget_sweep(self) -> None:
        """Empty the running candidates: the next decode choice ranks every block (a new prompt's)."""
        if self._sweep is not None:
            self._sweep.reset()

    def _digests(self) -> tuple[torch.Tensor, torch.Tensor]:
        """lo, hi: [L, H_kv, full blocks, D] fp16, computed for the blocks completed since last
        time (and their keys in fp16), once the tokens not yet in a digested block are sorted by origin."""
        full = self._form()
        return self._lo[:, :, :full], self._hi[:, :, :full]

    def _form(self) -> int:
        """`_digests` without the views (a decode choice asks at every step, where two slices of cold
        tensors cost more than the check); returns the full blocks."""
        if self._incoming:
            self.land()
        full = self.stored // self.block
        if self._digested < full and self.native():  # the storage is host memory
            self._form_natively(full)
        elif self._digested < full:
            start, size = self._digested, self.block
            fresh = slice(start * size, self.stored)
            order = self._data["origins"][:, :, fresh].argsort(dim=-1)
            for buffer in self._data.values():
                buffer[:, :, fresh] = _gather(buffer[:, :, fresh], order)
            self._digest(start, full)
        return full

    def _form_natively(self, full: int) -> None:
        """`_digests`' sort and digests in one C++ call."""
        data = self._data
        job = _Forming(heads=self.shape[0] * self.shape[1], capacity=self._capacity, digest_capacity=self._lo.shape[2],
                       dim=self.head_dim, block=self.block, start=self._digested, stored=self.stored,
                       threads=torch.get_num_threads(), keys=data["keys"].data_ptr(), values=data["values"].data_ptr(),
                       scores=data["scores"].data_ptr(), origins=data["origins"].data_ptr(),
                       lo=self._lo.data_ptr(), hi=self._hi.data_ptr(),
                       half=self._half.data_ptr() if self._ranks_copies() else None,
                       fp16=int(self.dtype == torch.float16), mean=_DIGEST_CODES[self.digest])
        if kernel().h2o_form_blocks(ctypes.byref(job)):
            raise ValueError("the native block forming refused the archive's storage")
        self._digested = full

    def _digest(self, start: int, end: int) -> None:
        """Compute the digests of storage blocks start..end (their tokens are in their final order), and
        their keys in fp16."""
        size = self.block
        keys = self._data["keys"][:, :, start * size:end * size].float()
        if self._ranks_copies():
            self._half[:, :, start * size:end * size] = keys.half()
        lo, hi = block_digests(keys.view(*self.shape, end - start, size, self.head_dim), self.digest)
        # stored in fp16 within its finite range, as `kernels/compaction.cpp` stores them
        self._lo[:, :, start:end], self._hi[:, :, start:end] = lo.clamp(-FP16_MAX, FP16_MAX), hi.clamp(-FP16_MAX, FP16_MAX)
        self._digested = end

    @torch.no_grad()
    def select(self, queries: torch.Tensor, scaling: float, tokens: int, layers: slice = slice(None),
               everywhere: bool = False, per_layer: bool = False,
               span: int = CacheConfig.recall_span, voters: list[int] | None = None,
               held: torch.Tensor | None = None, margin: float = 0.0, sweep: int = 0) -> torch.Tensor:
        """The `tokens` archived tokens (whole blocks but with `everywhere`) each KV head of `layers`
        would attend to most, for `queries`.

        queries: [L', H_kv, Q, D] before RoPE (L' = the layers of `layers`), the Q queries that share
        each KV head (its query group times the tokens of a chunk), any device.
        Per layer and head (`h2o_cache.selection`): the CANDIDATES x `tokens` / block blocks whose
        digests' bound draws the most attention mass are candidates (every block, in order, where there
        are no more: the bound is then not computed, as the kernels skip it); the logits of the queries against
        the candidates' keys (in 16 bits: an fp32 archive's fp16 copies; fp32 arithmetic) give each
        key its attention mass, pooled by original position over all the layers and heads of
        `layers`, and each head takes the candidate blocks whose
        tokens' positions drew the most; `everywhere`: the `tokens` tokens of all its full blocks
        whose positions, with their neighbours' within `span`, drew the most (`token_votes`), for a choice
        that pools many heads (a decode step's, over all layers), where one head's bound missing a
        fact must not keep it from the head, nor whole blocks keep out the fact's other words;
        `per_layer` (not with `everywhere`): the votes pool over each layer's own heads only, as if
        each layer chose alone.
        `voters` (with `everywhere`, layers all): only the heads of these layers vote.
        `held` (with `everywhere`): [L', H_kv, r] the tokens each head's window holds (-1: unknown),
        ranked with their votes times 1 + `margin` (`CacheConfig.recall_margin`).
        `sweep` (with `everywhere`, layers all; `CacheConfig.recall_sweep`): a voting head that kept
        its candidates from the last such choice (`Sweep`) ranks by the bound only those, the ones its
        last choice of every block took (its reply's question's) and the `sweep` blocks from the
        sweep's cursor on, not every block; the candidates are kept, the cursor moves on.
        Returns [L', H_kv, tokens] int64 token indices (of the storage, within full blocks),
        ascending; tokens <= full_blocks * block, a multiple of block.
        """
        lo, hi = self._digests()
        blocks = tokens // self.block
        # on the host, where the archive is: a cache on a GPU sends its few queries down once rather
        # than the digests and the candidates' keys up at every choice
        q = queries.float().cpu()
        full_blocks = lo.shape[2]
        state = self.sweep(tokens) if sweep and everywhere and layers == slice(None) else None
        voting = slice(None) if voters is None else voters
        wanted = CANDIDATES * blocks
        if wanted >= full_blocks:  # every block a candidate, in order: the bound could only rank them
            candidates = torch.arange(full_blocks).expand(*q.shape[:2], full_blocks)
            if state is not None:
                state.counts[voting] = 0
        else:
            scanned = None
            if state is not None and wanted + sweep < full_blocks:
                scanned = state.scanned(sweep, full_blocks)
            mass = bound_mass(q, lo[layers], hi[layers], scaling, scanned)  # [L', H_kv, full blocks]
            candidates = top_blocks(mass, wanted)
            if state is not None:
                state.keep(candidates, voting, sweep, full_blocks, scanned is None)
        if candidates.shape[-1] > blocks:
            origins, = self.gather(candidates, layers, ("origins",))  # [L', H_kv, wanted * block]
            ranked = self._half if self._ranks_copies() else self._data["keys"]  # 16-bit keys
            keys = _gather(ranked[layers], block_tokens(candidates, self.block))  # [..., D]
            mass = token_mass(q, keys.float(), scaling)
            if everywhere:
                votes = span_votes(position_votes(_voting(mass, voters), origins, POSITIONS), span)
                full = lo.shape[2] * self.block
                scores = token_votes(votes, self._data["origins"][layers, :, :full])
                if margin and held is not None:
                    scores = _favour_held(scores, held, margin)
                return top_blocks(scores, tokens).sort(dim=-1).values
            mass = pool_by_position(mass, origins, POSITIONS, per_layer)
            candidates = top_blocks(block_mass(mass, self.block), blocks, candidates)
        return block_tokens(candidates.sort(dim=-1).values, self.block)

    def storage(self) -> dict[str, torch.Tensor]:
        """The storage itself, for a kernel that reads it in place (`native_recall`): keys, values
        [L, H_kv, capacity, D], origins [L, H_kv, capacity] (tokens [0, stored) held, the full blocks'
        formed), the digests lo, hi [L, H_kv, block capacity, D] fp16 and the keys in fp16 for ranking
        (half, as keys; of the full blocks), all contiguous. Valid until the next append."""
        self._form()
        return {"keys": self._data["keys"], "values": self._data["values"], "origins": self._data["origins"],
                "lo": self._lo, "hi": self._hi, "half": self._half}

    @torch.no_grad()
    def gather(self, blocks: torch.Tensor, layers: slice = slice(None),
               fields: tuple[str, ...] = _FIELDS) -> tuple[torch.Tensor, ...]:
        """The tokens of `blocks` ([L', H_kv, b] block indices per head of `layers`), block by block:
        per field of `fields`, [L', H_kv, b * block, D] (keys, values) or [L', H_kv, b * block]
        (scores, origins), on the host. The archive keeps them."""
        self._digests()  # blocks are read as formed: a tail not yet sorted into blocks is sorted first
        tokens = block_tokens(blocks.cpu(), self.block)
        return tuple(_gather(self._data[name][layers], tokens) for name in fields)

    @torch.no_grad()
    def gather_heads(self, layer_ids: torch.Tensor, head_ids: torch.Tensor, tokens: torch.Tensor,
                     fields: tuple[str, ...] = _FIELDS) -> tuple[torch.Tensor, ...]:
        """The tokens tokens[i] ([m, t] storage indices within full blocks, `select`'s) of layer
        layer_ids[i], head head_ids[i]: per field, [m, t, D] or [m, t], on the host."""
        self._digests()
        tokens = tokens.cpu()
        rows = (layer_ids.cpu() * self.shape[1] + head_ids.cpu())[:, None] * self._capacity
        out = []
        for name in fields:
            buffer = self._data[name]
            if buffer.dim() == 4:
                out.append(take_vectors(buffer, rows, tokens))
            else:
                out.append(buffer.view(-1)[rows + tokens])
        return tuple(out)

    # ----- copies and snapshots -------------------------------------------------------------

    def copy(self) -> Archive:
        twin = Archive(*self.shape, self.head_dim, self.dtype, self.block, self.limit, self.digest)
        twin.load_state(self.state())
        twin.dropped = self.dropped
        twin.epoch = self.epoch  # the same blocks under the same numbers: windows onto them stay valid
        return twin

    def lend(self) -> Archive:
        """A twin that works on this archive's storage instead of a copy of it, for a look ahead that is
        dropped before this archive is used again (`H2OCache.copy(lend=True)`, `h2o_cache.reread`):
        copying a long archive's storage and forming its blocks again cost ~0.15 s of a 4k prompt's
        re-read. The twin appends past this archive's tokens and writes digests past its formed
        blocks, which this archive overwrites as it goes on; the one region both hold, the tokens not yet
        formed into blocks (which the twin's forming sorts among its own), is restored by the twin's
        `give_back`. A twin that drops blocks at the limit first takes storage of its own, as one that
        grows does."""
        self.land()
        twin = Archive(*self.shape, self.head_dim, self.dtype, self.block, self.limit, self.digest)
        twin._data, twin._lo, twin._hi, twin._half = self._data, self._lo, self._hi, self._half
        twin.stored, twin.dropped, twin.epoch = self.stored, self.dropped, self.epoch
        twin._capacity, twin._digested = self._capacity, self._digested
        start = self._digested * self.block
        twin._lent = (self, start, {name: buffer[:, :, start:self.stored].clone() for name, buffer in self._data.items()})
        return twin

    def give_back(self) -> None:
        """A lent twin (`lend`) is done: its lender's tokens not yet formed are as they were when lent.
        Nothing for an archive that was not lent; the twin is not to be used after."""
        if self._lent is None:
            return
        lender, start, saved = self._lent
        for name, tokens in saved.items():
            lender._data[name][:, :, start:start + tokens.shape[2]] = tokens
        self._lent = None

    def state(self) -> dict[str, torch.Tensor]:
        """The held tokens as host tensors, in storage order, and `blocked`: how many blocks of them are
        formed (their tokens sorted; the rest are sorted when the next block completes). Digests are
        recomputed on load."""
        self.land()
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
        self.stored = self._capacity = self._digested = 0
        self._data, self._lo, self._hi, self._half = {}, None, None, None
        self.epoch += 1
        n = state["keys"].shape[2]
        self._grow(min(self.limit, n + n // 2))  # room to go on: the next eviction does not copy it all
        self.append(*(state[name] for name in _FIELDS))
        if "blocked" in state and self.stored:
            self._digest(0, int(state["blocked"][0]))


class Sweep:
    """A row's decode choices' running candidates (`CacheConfig.recall_sweep`), which the kernel
    (`Choice.kept`) and `Archive.select` read and write alike: per layer and KV head the candidate
    blocks of its last choice and of its last choice that ranked every block (a reply's first, by its
    question), ascending, their count (`candidates` where a head kept them, else 0: its next choice
    ranks every block), and the cursor of the stripe of blocks the next choice ranks beside them. A
    choice over a 16k-token archive then ranks at most 512 + `sweep` blocks by their digests, not 2,048
    (~256 + `sweep`: the two sets are mostly the same), and the whole archive is ranked every
    2,048 / `sweep` choices: a decode choice's cost stops growing with the archive. A new prompt
    empties it (`Archive.forget_sweep`): the first choice of a reply ranks every block by the
    question's queries, and the blocks it takes stay candidates for the whole reply."""

    __slots__ = ("candidates", "question", "counts", "cursor", "epoch")

    def __init__(self, layers: int, heads: int, candidates: int):
        self.candidates = torch.zeros(layers, heads, candidates, dtype=torch.int64)
        self.question = torch.zeros(layers, heads, candidates, dtype=torch.int64)
        self.counts = torch.zeros(layers, heads, dtype=torch.int64)
        self.cursor = torch.zeros(1, dtype=torch.int64)
        self.epoch = 0

    def reset(self) -> None:
        self.counts.zero_()
        self.cursor.zero_()

    def scanned(self, sweep: int, blocks: int) -> torch.Tensor:
        """[L, H, blocks] bool: the blocks each head ranks, its kept candidates, its question's and the
        stripe of `sweep` blocks from the cursor on (every block for a head that kept none)."""
        mask = torch.zeros(*self.counts.shape, blocks, dtype=torch.bool)
        stripe = (int(self.cursor[0]) % blocks + torch.arange(sweep)) % blocks
        mask[..., stripe] = True
        mask.scatter_(2, self.candidates, True)
        mask.scatter_(2, self.question, True)
        return mask | (self.counts != self.candidates.shape[-1])[..., None]

    def keep(self, candidates: torch.Tensor, voting: slice | list[int], sweep: int, blocks: int,
             all_ranked: bool) -> None:
        """Keep the voting heads' `candidates` ([L, H, C]), as their question's too where they ranked
        every block (every head where `all_ranked`, else those that kept none), and move the cursor on
        by `sweep`."""
        ranked = candidates.sort(dim=-1).values
        every = self.counts != candidates.shape[-1]
        if all_ranked:
            every = torch.ones_like(every)
        self.question[voting] = torch.where(every[..., None], ranked, self.question)[voting]
        self.candidates[voting] = ranked[voting]
        self.counts[voting] = candidates.shape[-1]
        self.cursor[0] = (int(self.cursor[0]) % blocks + sweep) % blocks


# `Forming.mean` of each digest (`kernels/compaction.cpp`)
_DIGEST_CODES = {"minmax": 0, "mean": 1, "centre": 2}

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _storage(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.empty` for the archive's storage, asking Linux to back it with 2 MB pages
    (MADV_HUGEPAGE; without effect where transparent huge pages are off). Each eviction writes a few
    tokens per head into parts of the storage never touched before, one page fault per 4 KB page of
    every head's run: on a 2-core VM these faults took 1.05 ms of a row's 1.1 ms archiving per eviction
    (0.10 ms with the pages already touched; 2k history, batch 8)."""
    tensor = torch.empty(*shape, dtype=dtype)
    libc = _libc()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if libc is not None and last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE)  # advice: failure is harmless
    return tensor


class _Forming(ctypes.Structure):
    """The kernel's `Forming` (`kernels/compaction.cpp`)."""

    _fields_ = ([(name, ctypes.c_int64) for name in ("heads", "capacity", "digest_capacity", "dim", "block",
                                                     "start", "stored", "threads")]
                + [(name, ctypes.c_void_p) for name in ("keys", "values", "scores", "origins", "lo", "hi", "half")]
                + [("fp16", ctypes.c_int64), ("mean", ctypes.c_int64)])


def block_digests(keys: torch.Tensor, digest: str = CacheConfig.recall_digest) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., blocks, block, D] fp32. Returns the blocks' digests lo, hi [..., blocks, D] (`DIGESTS`):
    "centre", per channel the keys' mean, as both lo and hi; "mean", that mean -/+ the keys' mean
    absolute deviation; each sum taken in token order (as `kernels/compaction.cpp` sums them, so both
    give the same bits); "minmax", their min and max."""
    if digest == "minmax":
        return keys.amin(dim=-2), keys.amax(dim=-2)
    size = keys.shape[-2]
    centre = functools.reduce(torch.add, keys.unbind(dim=-2)) / size
    if digest == "centre":
        return centre, centre
    spread = functools.reduce(torch.add, (keys - centre.unsqueeze(-2)).abs().unbind(dim=-2)) / size
    return centre - spread, centre + spread


def _voting(mass: torch.Tensor, voters: list[int] | None) -> torch.Tensor:
    """mass [L, H, K] with the layers not among `voters` zeroed (None: every layer votes)."""
    if voters is None:
        return mass
    keep = torch.zeros(mass.shape[0], 1, 1, dtype=mass.dtype, device=mass.device)
    keep[voters] = 1
    return mass * keep


def _gather(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer[l, h, index[l, h, j]] over the token axis (dim 2), trailing dims kept; whole vectors of
    contiguous [L, H, n, D] storage (`take_vectors`)."""
    if buffer.dim() == 4:
        if not buffer.is_contiguous():
            return buffer.gather(2, index[..., None].expand(-1, -1, -1, buffer.shape[-1]))
        layers, heads, n, _ = buffer.shape
        return take_vectors(buffer, torch.arange(layers * heads, device=index.device).view(layers, heads, 1) * n, index)
    return buffer.gather(2, index)


def _favour_held(scores: torch.Tensor, held: torch.Tensor, margin: float) -> torch.Tensor:
    """scores [..., n] fp32 with the tokens of `held` ([..., r], -1 or beyond n: none) times 1 + margin
    (rounded to fp32 first, as the kernel's), no data-dependent shape."""
    n = scores.shape[-1]
    known = ((held >= 0) & (held < n)).to(scores.dtype)
    flags = torch.zeros_like(scores).scatter_reduce_(-1, held.clamp(0, n - 1), known, reduce="amax")
    bonus = torch.tensor(1.0 + margin, dtype=torch.float64).to(scores.dtype)
    return torch.where(flags > 0, scores * bonus, scores)
