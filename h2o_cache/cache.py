"""`H2OCache`: a batched KV cache with a fixed per-layer, per-KV-head token budget.

Layout, per layer: keys and values [rows, H_kv, capacity, D] and fp32 scores [rows, H_kv, capacity].
Row b holds `lengths[b]` tokens in slots 0..lengths[b]-1, in arrival order; every layer and head of
a row holds the same number of tokens, but each head keeps its own choice of tokens.

One forward pass is bracketed by `begin()` (positions, mask and write slots for the new chunk; the
pass itself is `h2o_cache.forward_pass`) and `end()` (bookkeeping and eviction down to the budget), so
between passes no row exceeds its budget; during a pass a row holds at most budget + chunk tokens.

With position rolling, keys are stored before RoPE and rotated to their slot positions whenever
they are read, so the query of slot n sees its keys at distances 1..n, never more than the budget.

With `recall_budget`, evicted tokens move to the row's `Archive` instead of being dropped, and the
row's first slots are a window onto it (`h2o_cache.recall`). A prefill chunk (a pass that feeds some
row more than one token) first fills each layer and KV head's window with the archived blocks its
own queries point at, layer by layer; with `recall_ahead`, a chunk of a prompt's body
(`begin(ahead=...)`) is instead given, before its pass, what its previous chunk's queries point at,
all layers in one choice. Every pass keeps each fed row's last queries; they choose the window
again, pooled over all layers, at the start of each of the row's first `recall_burst` decode passes
after a prefill and then of every `recall_interval`-th (`choose_due`), before anything of that pass
is fed. The fast step (`StaticDecoder`) does the same, so both paths keep the same tokens, and a
choice that fails fails before its pass: a retry never feeds a token twice.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from h2o_cache import compaction, forward_pass, recall
from h2o_cache.archive import Archive
from h2o_cache.config import CacheConfig
from h2o_cache.decode import CacheBuffers
from h2o_cache.policies import get_policy
from h2o_cache.rope import RopeTable

# `H2OCache.due[row]`: the choice due before the row's next decode pass: INTERVAL, one every
# `recall_interval` after a reply's burst (by the votes of `recall_voters`' layers); BURST, one of a
# reply's first `recall_burst` (every layer votes); FIRST, the reply's first, due since its prompt
# (capped choices, `CacheConfig.recall_choices`, serve these first; one kept waiting chooses by the
# latest queries)
INTERVAL, BURST, FIRST = 1, 2, 3

# `H2OCache.epochs`: a number no other row of any cache has had, given to a row whenever it may start
# to hold another sequence's tokens (added empty, copied in); within one epoch a row's origin names one
# token, so what was computed from its keys (the native step's keys at their ranks) can be kept
_epochs = itertools.count()


@dataclass(frozen=True)
class ModelSpec:
    """What the cache needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype
    rope: RopeTable
    num_heads: int = 0  # query heads (recall keeps a decode step's queries)
    scaling: float = 1.0  # softmax scale of q.k


class H2OCache:
    """Budgeted KV cache for a batch of independent sequences (rows).

    Rows are added with `add_rows`/`extend` and removed with `pop`, so a continuous batcher can move
    sequences in and out between steps. Use it through `h2o_cache.Generator`, or `hf.forward` for one
    pass: `positions = cache.begin(n_new)`, the model's forward with those positions (the model
    reaches `update` and `attend` through the adapter in `hf.py`), then `cache.end()`. The fast
    path (`StaticDecoder`) writes the same buffers and calls `advance` instead.

    Buffers hold all layers at once, so eviction and re-rotation run as a few batched ops per step
    instead of a few per layer:
        _keys, _values: [L, rows, H_kv, capacity, D]  (_keys before RoPE when rolling)
        _rotated:       [L, rows, H_kv, capacity, D]  keys rotated to their slot positions (rolling)
        _scores:        [L, rows, H_kv, capacity] fp32 accumulated attention (scoring policies)
        _origins:       [L, rows, H_kv, capacity] int64 each slot's token index in its row's sequence
                        (0 for the row's first token ever fed); moves with the slot on eviction
        _pinned:        [L, rows, H_kv, capacity] bool, the recall window's slots, never evicted
                        (with recall only; always False at slots >= the row's length)
        _queries:       [L, rows, H_q, D] the queries of the row's last fed token before RoPE (with recall only)
    Per row, with recall: `archives[b]`, the row's evicted tokens (None until its first eviction);
    `recalled[b]`, the size of its window (slots 0..recalled[b]-1 per layer/head), held on top of the
    budget; `windows[b]`, which archived tokens the window holds (None: unknown); `recall_count[b]`,
    tokens (summed over layers and heads) copied into the window so far; `decoded[b]`, its decode
    passes since its last prefill chunk; `due[b]`, whether its
    window is to be chosen by `_queries` before its next decode pass; `ahead[b]` (with `recall_ahead`),
    [L, H_q, q, D] fp32, the choosing queries (`recall_queries` of them) of its last prefill chunk,
    None after a decode pass.
    """

    def __init__(self, spec: ModelSpec, config: CacheConfig, rows: int = 0):
        self.spec = spec
        self.config = config
        self.policy = get_policy(config.policy)
        self._keys = self._values = self._rotated = self._scores = self._origins = self._pinned = None
        self._queries: torch.Tensor | None = None
        self._keeps_scratch = False  # see `reserve`
        self._scratch: torch.Tensor | None = None  # what an eviction keeps, on its way back (`compaction.kept_vectors`)
        self._window_copy: recall.WindowCopy | None = None  # see `keep_window_copy`
        # bumped whenever the buffers or the window's copy are replaced, or the copy starts or stops being
        # read: what a kernel keeps pointers into (`native_recall.choose_again`) is then built again
        self.layout = 0
        self.archives: list[Archive | None] = []
        self.recalled: list[int] = []
        self.windows: list[tuple[int, torch.Tensor] | None] = []  # (archive epoch, [L, H_kv, blocks])
        self.recall_count: list[int] = []
        self.due: list[int] = []  # 0, or the choice due: INTERVAL, BURST, FIRST (the reply's first)
        self._choice_turn = 0  # with recall_choices: the row the next capped choice starts from
        self.decoded: list[int] = []  # decode passes since the row's last prefill chunk (with recall)
        self.ahead: list[torch.Tensor | None] = []  # the queries of the row's last prefill chunk (with recall)
        self.lengths: list[int] = []  # tokens resident per row (the same in every layer and head)
        self.seen: list[int] = []  # tokens ever fed per row
        self.epochs: list[int] = []  # see `_epochs`
        self.pending: list[list[int]] = []  # tokens a row has sampled but not fed yet (see Generator)
        self._rows_capacity = 0
        self._capacity = 0
        self._step: forward_pass.Step | None = None
        self.add_rows(rows)

    # ----- rows -----------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def add_rows(self, n: int) -> None:
        """Append n empty sequences."""
        self._reserve(self.batch_size + n, self._capacity)
        self.lengths += [0] * n
        self.seen += [0] * n
        self.epochs += [next(_epochs) for _ in range(n)]
        self.pending += [[] for _ in range(n)]
        self.archives += [None] * n
        self.recalled += [0] * n
        self.windows += [None] * n
        self.recall_count += [0] * n
        self.due += [0] * n
        self.decoded += [0] * n
        self.ahead += [None] * n

    def extend(self, other: H2OCache, move: bool = False) -> None:
        """Append the rows of `other` (same model and config) after this cache's rows.

        move: `other` is dropped after this, so its archives (host memory, possibly large) are
        taken rather than copied; `other` keeps none.
        """
        start = self.batch_size
        self._reserve(start + other.batch_size, max([self._capacity, *other.lengths]))
        for i, length in enumerate(other.lengths):
            self._copy_row(start + i, other, i, length)
        self.lengths += other.lengths
        self.seen += other.seen
        self.epochs += [next(_epochs) for _ in other.lengths]
        self.pending += [list(p) for p in other.pending]
        if move:
            self.archives += other.archives
            other.archives = [None] * other.batch_size
        else:
            self.archives += [a.copy() if a is not None else None for a in other.archives]
        self.recalled += other.recalled
        self.windows += [None if w is None else (w[0], w[1].clone()) for w in other.windows]
        self.recall_count += other.recall_count
        self.due += other.due
        self.decoded += other.decoded
        self.ahead += other.ahead  # never written in place: a pass gives its rows new tensors

    def pop(self, row: int) -> H2OCache:
        """Remove one row and return it as a cache of its own; the last row takes its place."""
        single = self._single(row, copy=False)
        last = self.batch_size - 1
        per_row = (self.lengths, self.seen, self.pending, self.archives, self.recalled, self.windows,
                   self.recall_count, self.due, self.decoded, self.ahead)
        if row != last:
            self._copy_row(row, self, last, self.lengths[last])
            for rows in per_row:
                rows[row] = rows[last]
            self.epochs[row] = next(_epochs)
        for rows in per_row:
            rows.pop()
        self.epochs.pop()
        return single

    def copy(self, row: int, lend: bool = False) -> H2OCache:
        """Row `row` as a cache of its own, copied, archive and window included: passes fed to the copy
        leave this cache as it is (`h2o_cache.reread` looks ahead on one). lend: the copy's archive works
        on the row's archive's storage (`Archive.lend`) until its `give_back`, after which only this
        cache is used again."""
        return self._single(row, copy=True, lend=lend)

    def _single(self, row: int, copy: bool, lend: bool = False) -> H2OCache:
        """A 1-row cache holding row `row`'s state (`pop`, `copy`): its buffers copied; its archive, window
        and pending tokens taken as they are, or with `copy` copied too."""
        single = H2OCache(self.spec, self.config)
        length = self.lengths[row]
        single._reserve(1, length)
        single._copy_row(0, self, row, length)
        archive, window, pending = self.archives[row], self.windows[row], self.pending[row]
        if copy:
            archive = None if archive is None else archive.lend() if lend else archive.copy()
            window = None if window is None else (window[0], window[1].clone())
            pending = list(pending)
        single.lengths, single.seen, single.pending = [length], [self.seen[row]], [pending]
        single.epochs = [next(_epochs)]
        single.archives, single.recalled = [archive], [self.recalled[row]]
        single.windows, single.recall_count = [window], [self.recall_count[row]]
        single.due, single.decoded, single.ahead = [self.due[row]], [self.decoded[row]], [self.ahead[row]]
        return single

    def _buffers(self) -> list[torch.Tensor]:
        buffers = (self._keys, self._values, self._rotated, self._scores, self._origins, self._pinned)
        return [t for t in buffers if t is not None]

    @torch.no_grad()
    def _copy_row(self, dst: int, src: H2OCache, src_row: int, length: int) -> None:
        for mine, theirs in zip(self._buffers(), src._buffers()):
            mine[:, dst, :, :length] = theirs[:, src_row, :, :length]
        if self._queries is not None:
            self._queries[:, dst] = src._queries[:, src_row]
        if self._pinned is not None:
            self._pinned[:, dst, :, length:] = False
        self.window_changed(dst)

    def reserve(self, rows: int, capacity: int, scratch: bool = False) -> None:
        """Allocate room for `rows` rows of `capacity` tokens now, so no later pass reallocates.

        scratch: also keep an eviction's working storage between evictions (at most one buffer's
        keys), for a batch cache that evicts every few steps: on the CPU a fresh tensor of that size
        costs its page faults at every eviction. Other caches allocate it per eviction.
        """
        self._reserve(rows, capacity)
        self._keeps_scratch = self._keeps_scratch or scratch

    def buffers(self) -> CacheBuffers:
        """The storage, for the fast path; reallocated only when a pass needs more rows or tokens."""
        return CacheBuffers(self._keys, self._values, self._rotated, self._scores, self._origins, self._pinned)

    @torch.no_grad()
    def _reserve(self, rows: int, capacity: int) -> None:
        if rows <= self._rows_capacity and capacity <= self._capacity:
            return
        if self._capacity and capacity > self._capacity:
            capacity = max(capacity, self._capacity + self._capacity // 2)  # amortized growth (full policy)
        rows = max(rows, self._rows_capacity)
        capacity = max(capacity, self._capacity)
        spec = self.spec
        shape = (spec.num_layers, rows, spec.num_kv_heads, capacity, spec.head_dim)
        old = self._buffers()
        self.layout += 1
        self._keys = torch.zeros(shape, device=spec.device, dtype=spec.dtype)
        self._values = torch.zeros(shape, device=spec.device, dtype=spec.dtype)
        if self.config.rolling:
            self._rotated = torch.zeros(shape, device=spec.device, dtype=spec.dtype)
        if self.policy.needs_scores:
            self._scores = torch.zeros(shape[:4], device=spec.device, dtype=torch.float32)
        self._origins = torch.zeros(shape[:4], device=spec.device, dtype=torch.int64)
        if self.config.recalls:
            self._pinned = torch.zeros(shape[:4], device=spec.device, dtype=torch.bool)
            queries = torch.zeros(spec.num_layers, rows, spec.num_heads, spec.head_dim, device=spec.device, dtype=spec.dtype)
            if self._queries is not None:
                queries[:, :self.batch_size] = self._queries[:, :self.batch_size]
            self._queries = queries
        keep_rows, keep_len = self.batch_size, max(self.lengths, default=0)
        if old and keep_rows and keep_len:
            for new, previous in zip(self._buffers(), old):
                new[:, :keep_rows, :, :keep_len] = previous[:, :keep_rows, :, :keep_len]
        self._rows_capacity, self._capacity = rows, capacity
        if self._window_copy is not None and self._window_copy.data.shape[2] < rows:
            self._window_copy = recall.WindowCopy(self, rows)

    def keep_window_copy(self) -> None:
        """Keep an fp16 copy of every row's recall window (`recall.WindowCopy`) for a step that reads
        the window from it (the CPU's native step); with recall in an fp32 cache only."""
        if self.config.recalls and self.spec.dtype == torch.float32 and self._window_copy is None:
            self._window_copy = recall.WindowCopy(self, self._rows_capacity)
            self.layout += 1

    def ranked(self, row: int, n_new: int = 1) -> bool:
        """Whether a pass feeding row `row` n_new tokens reads its held keys at their ranks in the order
        of the text (`recall_positions` "rank"): a row with a window, in every prefill pass (n_new > 1)
        and in its reply's first `recall_rank_steps` decode passes (None: all of them)."""
        if not self.config.ranks or not self.recalled[row]:
            return False
        steps = self.config.recall_rank_steps
        return n_new > 1 or steps is None or self.decoded[row] < steps

    def window_changed(self, row: int) -> None:
        """Row `row`'s window was written: its copy (where one is kept) is copied again before it is read."""
        if self._window_copy is not None:
            self._window_copy.stale.add(row)

    def window_copy(self, current: bool = True) -> torch.Tensor | None:
        """[2, L, rows, H_kv, recall_budget, D] fp16, every row's window (rotated keys, values) as it is
        now (current False: as it is, for a writer that keeps it equal to the window where it was; None
        while no step reads it, `read_window_copy`: the writer marks the rows it writes instead), or
        None where no copy is kept."""
        if self._window_copy is None:
            return None
        if not current:
            return self._window_copy.data if self._window_copy.read else None
        return self._window_copy.current(self)

    def read_window_copy(self, read: bool) -> None:
        """Whether the next steps read the window's copy (where one is kept): while not, the kernel's
        choices and placements do not write it and mark the rows they write (`window_changed`)."""
        if self._window_copy is not None and self._window_copy.read != read:
            self._window_copy.read = read
            self.layout += 1

    # ----- one forward pass (`h2o_cache.forward_pass`) ---------------------------------------------

    def begin(self, n_new: list[int], ahead: list[bool] | None = None) -> torch.Tensor:
        """Prepare a pass that feeds n_new[b] tokens to row b (right-padded to max(n_new)); with recall,
        rows of a prefill chunk widen their windows and decoding rows make their due choices first
        (`forward_pass.begin`; ahead[b]: row b's chunk is of a prompt's body, for `recall_ahead`).
        Returns position_ids [B, C] for the model: slot positions with rolling, else absolute ones."""
        self._step = forward_pass.begin(self, n_new, ahead)
        return self._step.positions

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Store the chunk's keys/values ([B, H_kv, C, D], keys rotated to the pass's positions); return
        every visible key (rotated) and value, [B, H_kv, kv_len, D] each (`forward_pass.store`)."""
        if self._step is None:
            raise RuntimeError("H2OCache.update outside begin()/end(); use h2o_cache.Generator")
        return forward_pass.store(self, self._step, key_states, value_states, layer_idx)

    def attend(self, layer_idx: int, query, keys, values, scaling: float) -> torch.Tensor:
        """Attention of the chunk's queries [B, H_q, C, D] over `update`'s keys and values, scores
        accumulated (`forward_pass.attend`). Returns [B, C, H_q, D]."""
        return forward_pass.attend(self, self._step, layer_idx, query, keys, values, scaling)

    @torch.no_grad()
    def end(self) -> None:
        """Commit the pass: count the new tokens; rows over the budget are evicted down to the target."""
        step, self._step = self._step, None
        self.advance(step.n_new)

    @torch.no_grad()
    def advance(self, n_new: list[int], evict: bool = True) -> None:
        """Count n_new[b] tokens just written into row b, then evict the rows now over the budget.

        Only those rows are touched, each exactly when it crosses the budget, so a row evolves the
        same whatever its batch. `end` calls this; the fast path (`StaticDecoder`) calls it directly.
        With recall, the rows fed are due to choose their windows by their last queries (`_queries`)
        after a prefill chunk (more than one token), after each of the first `recall_burst` - 1
        single tokens that follow it, and after every `recall_interval`-th.
        evict: False leaves the rows over the budget to `evict_over_budget` (the fast path evicts
        after sampling, so that the sampled tokens do not wait for the eviction).
        """
        self.lengths = [n + m for n, m in zip(self.lengths, n_new)]
        self.seen = [n + m for n, m in zip(self.seen, n_new)]
        if evict:
            self.evict_over_budget()
        if self.config.recalls:
            # A prefill chunk chose layer by layer, each layer's heads pooling alone: the row's next
            # decode pass chooses again by the last token's queries, pooled over all layers. A reply's
            # first `recall_burst` passes all choose (the answer to a question about the prompt starts
            # there), then every `recall_interval`-th, times the rows decoding (`choice_interval`).
            burst = self.config.recall_burst
            interval = self.config.choice_interval(sum(n == 1 for n in n_new))  # grows with the rows decoding
            for row, n in enumerate(n_new):
                if n == 1:
                    self.ahead[row] = None
                if n > 1 and self.archives[row] is not None:  # a new prompt: its reply's first choice ranks all
                    self.archives[row].forget_sweep()
                if n:
                    self.decoded[row] = self.decoded[row] + 1 if n == 1 else 0
                    k = self.decoded[row]
                    due = FIRST if k == 0 else BURST if k < burst else INTERVAL if k % interval == 0 else 0
                    self.due[row] = max(self.due[row], due)

    def over_budget(self) -> list[int]:
        """Rows holding more than their budget (plus their recall window)."""
        if not self.policy.evicts:
            return []
        budget = self.config.budget
        return [row for row, n in enumerate(self.lengths) if n > budget + self.recalled[row]]

    def evict_over_budget(self) -> None:
        """Evict the rows over their budget down to the target."""
        over = self.over_budget()
        if over:
            compaction.evict(self, over)

    def choosing(self, rows: list[int] | None = None) -> list[int]:
        """The rows of `rows` (default all) that make their due choice before the next decode pass: every
        due row, or with `recall_choices` C at most C of them, those whose due choice is their reply's
        first (`FIRST`) first, then the others in turn from where the last capped pass stopped (the rest
        stay due for the next pass, and choose by the queries of the step before it)."""
        due = [row for row in (range(self.batch_size) if rows is None else rows) if self.due[row]]
        cap = self.config.recall_choices
        if cap is not None and len(due) > cap:
            start = self._choice_turn % self.batch_size
            due.sort(key=lambda row: (-self.due[row], (row - start) % self.batch_size))
            due = due[:cap]
            self._choice_turn = due[-1] + 1
        return due

    def choose_due(self, rows: list[int] | None = None, queries: torch.Tensor | None = None) -> None:
        """Before a decode pass: every row of `rows` (default all) whose choice is due (`choosing`, which
        caps them) widens its window if it can and fills it with what its last decode queries point at
        (`recall.refresh`; queries: [L, B, H_q, D] to choose by instead of `_queries`, as a host copy of
        them that the fast step took on a GPU). A row whose choice raises stays due; the rows before it
        have chosen."""
        due = self.choosing(rows)
        chose: list[int] = []
        try:
            few = {row for row in due if self.due[row] == INTERVAL}  # by the votes of `recall_voters`' layers
            recall.refresh(self, self._queries if queries is None else queries, self.spec.scaling, due, done=chose,
                           few=few)
        finally:
            for row in chose:
                self.due[row] = 0

    def expect(self, row: int, more: int) -> None:
        """Row `row` will be fed `more` tokens more (the rest of a prompt): its archive, once it has one,
        makes room for what they may evict, at most they and the row's own tokens resident now
        (`Archive.expect`)."""
        archive = self.archives[row]
        if more > 0 and archive is not None:
            archive.expect(more + self.lengths[row] - self.recalled[row])

    def new_archive(self) -> Archive:
        """An empty archive for a row: in 16 bits (an fp32 cache's in fp16), so that an archived token
        takes ~26 KB of host memory on the default model rather than ~63 KB in fp32 with the fp16
        copies of its keys that the choice ranks by; the choice ranks the same fp16 keys either way,
        and a recalled token comes back rounded to fp16."""
        spec, config = self.spec, self.config
        dtype = torch.float16 if spec.dtype == torch.float32 else spec.dtype
        return Archive(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype,
                       config.recall_block, config.recall_archive, config.recall_digest)

    def abort(self) -> None:
        """Forget a pass that failed midway; rows keep the tokens they had before it."""
        if self._step is not None and self.config.recall_ahead:
            for row, n in enumerate(self._step.n_new):
                if n > 1:
                    self.ahead[row] = None  # partly written: the next chunk chooses with its own queries
        self._step = None

    # ----- accounting -----------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def resident_bytes(self, row: int | None = None) -> int:
        """Bytes held by the tokens of one row (or all rows): keys, values, rotated keys, scores, origins
        (and pinned flags with recall). Archived tokens are host memory: see `archived_bytes`."""
        tokens = sum(self.lengths) if row is None else self.lengths[row]
        copies = 3 if self.config.rolling else 2
        per_token = copies * self.spec.num_kv_heads * self.spec.head_dim * self.spec.dtype.itemsize
        if self.policy.needs_scores:
            per_token += self.spec.num_kv_heads * 4
        per_token += self.spec.num_kv_heads * torch.int64.itemsize  # origins
        if self._pinned is not None:
            per_token += self.spec.num_kv_heads
        return tokens * per_token * self.spec.num_layers

    def archived_tokens(self, row: int | None = None) -> int:
        """Archived (evicted, recallable) tokens per layer/head of one row, or summed over all rows."""
        archives = self.archives if row is None else [self.archives[row]]
        return sum(len(a) for a in archives if a is not None)

    def archived_bytes(self, row: int | None = None) -> int:
        """Host bytes of the archived tokens of one row or of all rows."""
        archives = self.archives if row is None else [self.archives[row]]
        return sum(a.nbytes for a in archives if a is not None)

    def allocated_bytes(self) -> int:
        """Bytes of the buffers, of the eviction's scratch when the cache keeps one (`reserve`) and of
        the window's fp16 copy when it keeps one (`keep_window_copy`)."""
        extra = [t for t in (self._scratch, self._window_copy and self._window_copy.data) if t is not None]
        return sum(t.numel() * t.element_size() for t in self._buffers() + extra)
