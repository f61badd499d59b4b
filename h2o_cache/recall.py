"""The recall window: the archived tokens the latest queries point at, held in front of a cache row.

With `recall_budget` R, each row of an `H2OCache` keeps its first `recalled[row]` slots (up to R per
layer and KV head, a multiple of the block) as a window onto its `Archive` of evicted tokens. The
window holds *copies* of the archived tokens that the queries of the latest pass chose, per layer and
KV head (whole blocks for a prefill chunk, tokens for a decode step's choice over all layers)
(Quest, arXiv 2406.10774; ArkVale; InfLLM): every prefill chunk of a turn's question chooses with its
own queries, layer by layer before each layer's attention (InfLLM), and so does a chunk of a prompt's
body unless `recall_ahead` gives it what its previous chunk's queries choose, all layers in one
choice, before its pass; a decode step attends with the window the previous step's queries chose,
and its own queries, pooled over all layers, choose the next one (each of a reply's first
`recall_burst` steps, then every `recall_interval`-th by the votes of `recall_voters`' layers alone,
every layer taking its tokens by them), on the transformers path as on the fast step
(`StaticDecoder`), whose fixed shapes leave no room for a choice inside the step. The
archive keeps every token, so a token that falls out of the chosen set is not lost, and a token is in
the window at most once; the window never competes for the budget (its slots are pinned). The
choice runs on the host, where the archive is: in one C++ call per row (`native_recall`), which on
the CPU in fp32 also writes the window, and elsewhere (a GPU, a 16-bit cache) names the slots whose
token changes, which `write_rows` then copies, for all the rows that chose together.

Layout of a row with a window of r slots:
    [0, r)        the window: recalled keys, their values and origins; each key rotated to where its
                  token stood in the text among the row's own tokens (`place`, `text_positions`: a
                  fractional position between the slots of the two own tokens around its origin)
    [r, length)   the row's own tokens, evicted by the policy down to its budget as without recall,
                  each rotated to its slot (position rolling)
So RoPE never sees a position past the row's length, and the model reads the held tokens in the order
of the text: rotated to the window's slots 0..r-1, before every own token, a listing of three facts
of a 2k prompt came back 3/10, placed 9/10 (the full cache 10/10). An eviction moves the own tokens,
so it places the window again.
With `recall_positions` "rank" the buffers keep this layout, and every pass of a row with a window
reads its held keys rotated from the keys as fed to their ranks in the order of the text instead
(`held_ranks`: the transformers path's copy `rank_rotated`, `decode.ranked_keys`, the native step's
own rotation), so a phrase recalled whole keeps one position a word.
The window grows (up to R) as the archive gains blocks; growing shifts the row's tokens right and
re-rotates them, which happens only during the first evictions of a row (R / evict_slack of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from h2o_cache import native_recall
from h2o_cache.rope import rotate, rotate_into
from h2o_cache.transfer import as_slice, upload

if TYPE_CHECKING:
    from h2o_cache.cache import H2OCache


def window_size(cache: H2OCache, row: int) -> int:
    """Slots the row's window should have: R, or what the archive's full blocks fill."""
    archive = cache.archives[row]
    if archive is None:
        return 0
    return min(cache.config.recall_budget, archive.full_blocks * cache.config.recall_block)


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A window key (rotated) or value as a window holds it: in an fp32 cache rounded to fp16 first,
    as the fp16 archive gives its values back, so that the fast step's fp16 copy of the window
    (`WindowCopy`) holds the very same values and every path attends to the same keys."""
    return (x.to(torch.float16) if dtype == torch.float32 else x).to(dtype)


class WindowCopy:
    """An fp16 copy of every row's recall window ([2, L, rows, H_kv, R, D]: rotated keys as the text
    layout places them, values), for
    the CPU's native decode step, which reads it instead of the fp32 window slots: the window's 128
    slots are a third of what a step reads of the cache, and at batch 8 about half of what they cost
    is reading them (`static.WINDOW_COPY_MIN_ROWS`, now every batch: 0.95-0.97x a step at batch 1-2). The copy
    is exact (a window holds fp16 values in fp32: `stored`). The kernel's choices and placements,
    which change the windows at every choice and eviction, write the copy as they write the window;
    whatever else writes a row's window (the torch ops, a window that grows, a row copied in) marks
    the row (`H2OCache.window_changed`), and `current` copies the marked rows again before a step
    (~0.4 ms a row on the default model). While no step reads it (`read` False: a batch of fewer rows
    than `static.WINDOW_COPY_MIN_ROWS`), the kernel's writers mark the rows they write instead of
    writing it, ~2,000 slots a step less at a choice by every step."""

    def __init__(self, cache: H2OCache, rows: int):
        spec = cache.spec
        self.data = torch.zeros(2, spec.num_layers, rows, spec.num_kv_heads, cache.config.recall_budget,
                                spec.head_dim, dtype=torch.float16, device=spec.device)
        self.stale: set[int] = set(range(cache.batch_size))
        self.read = True

    @torch.no_grad()
    def current(self, cache: H2OCache) -> torch.Tensor:
        """The copy, every row's window copied again where it changed since."""
        for row in sorted(self.stale):
            r = cache.recalled[row] if row < cache.batch_size else 0
            if r:
                self.data[0, :, row, :, :r] = cache._rotated[:, row, :, :r]
                self.data[1, :, row, :, :r] = cache._values[:, row, :, :r]
        self.stale.clear()
        return self.data


@torch.no_grad()
def grow(cache: H2OCache, row: int, fill_newest: bool = True) -> bool:
    """Widen the row's window to `window_size` (its own tokens move right, re-rotated); the new window
    holds the archive's newest full blocks until queries choose (fill_newest False: the caller's
    choice follows at once and writes every slot, since a grown window holds no known token).
    Returns whether it grew."""
    want, have = window_size(cache, row), cache.recalled[row]
    if want <= have:
        return False
    n = cache.lengths[row]
    shift = want - have
    cache._reserve(cache.batch_size, n + shift)
    for buffer in (cache._keys, cache._values, cache._scores, cache._origins, cache._pinned):
        if buffer is not None:
            buffer[:, row, :, want:n + shift] = buffer[:, row, :, have:n].clone()
    cos, sin = cache.spec.rope.get(n + shift)
    rotate_into(cache._rotated[:, row, :, want:n + shift], cache._keys[:, row, :, want:n + shift],
                cos[want:n + shift], sin[want:n + shift])
    cache._pinned[:, row, :, :want] = True
    cache.window_changed(row)
    cache.lengths[row] = n + shift
    cache.recalled[row] = want
    cache.windows[row] = None
    if fill_newest:
        newest_blocks(cache, row)
    return True


def newest_blocks(cache: H2OCache, row: int) -> None:
    """Fill the row's whole window with the archive's newest full blocks."""
    archive, r = cache.archives[row], cache.recalled[row]
    end = archive.full_blocks * archive.block
    fill(cache, row, torch.arange(end - r, end).expand(*archive.shape, r))


@torch.no_grad()
def refresh(cache: H2OCache, queries: torch.Tensor, scaling: float, rows: list[int] | None = None,
            done: list[int] | None = None, few: set[int] | frozenset[int] = frozenset()) -> None:
    """Between decode steps: widen the window of every row of `rows` (default all) that can grow, then
    fill it with what the row's queries ([L, B, H_q, D] before RoPE, one token per row) point at
    (`choose_rows`: the rows' windows written together where the kernel chooses for a device; the rows
    of `few` by the votes of `recall_voters`' layers). The rows that chose go to `done`; a row whose
    choice raises ends the call, and a window it grew holds the archive's newest blocks."""
    rows = list(range(cache.batch_size) if rows is None else rows)
    if len(rows) < max(2, torch.get_num_threads()):  # rows choosing one after the other (`choose_rows`):
        rows = _again(cache, queries, scaling, rows, done, few)  # each, where it can, as its last one was made
        if not rows:
            return
    grown = [row for row in rows if grow(cache, row, fill_newest=False)]  # the choice writes every slot of it
    chose: list[int] = []
    asked = [row for row in rows if cache.recalled[row]]
    if len(asked) > 1:  # the choices run on the host: one download for all the rows' queries
        host = torch.stack([queries[:, row] for row in asked], dim=1).cpu()
        asked_queries = [(row, host[:, i, :, None]) for i, row in enumerate(asked)]
    else:
        asked_queries = [(row, queries[:, row, :, None]) for row in asked]
    try:
        choose_rows(cache, asked_queries, scaling, everywhere=True, done=chose, few=few)
    except Exception:
        for row in grown:
            if row not in chose:
                newest_blocks(cache, row)
        raise
    finally:
        if done is not None:
            done.extend(chose)


def _again(cache: H2OCache, queries: torch.Tensor, scaling: float, rows: list[int], done: list[int] | None,
           few: set[int] | frozenset[int]) -> list[int]:
    """Make the decode choice of each of `rows` that can be made as its last one was
    (`native_recall.choose_again`: nothing it was built from has changed, so the window cannot grow,
    and the kernel chooses); those go to `done`. Returns the others, in order."""
    few_layers = cache.config.voter_layers(cache.spec.num_layers) if few else None
    rest = []
    for row in rows:
        voters, margin = (few_layers, cache.config.recall_margin) if row in few else (None, 0.0)
        if native_recall.choose_again(cache, row, queries, scaling, voters, margin):
            if done is not None:
                done.append(row)
        else:
            rest.append(row)
    return rest


@torch.no_grad()
def choose(cache: H2OCache, row: int, queries: torch.Tensor, scaling: float, layers: slice = slice(None),
           everywhere: bool = False, per_layer: bool = False) -> None:
    """Fill the row's window in `layers` with the archived tokens `queries` ([L', H_q, Q, D] before
    RoPE, the row's queries of those layers) would attend to most (`Archive.select`, its `everywhere`
    and `per_layer` as given), per KV head. On the CPU a decode step's choice over all layers, and a
    prefill chunk's for its layers, run in one kernel call each (`native_recall`) where it can; on
    another device or dtype the kernel still makes the choice (the archive is host memory) and
    `write_rows` writes the window where it lives."""
    choose_rows(cache, [(row, queries)], scaling, layers, everywhere, per_layer)


@torch.no_grad()
def choose_rows(cache: H2OCache, asked: list[tuple[int, torch.Tensor]], scaling: float, layers: slice = slice(None),
                everywhere: bool = False, per_layer: bool = False, done: list[int] | None = None,
                few: set[int] | frozenset[int] = frozenset()) -> None:
    """`choose` for each (row, queries) of `asked`, in turn. Where the kernel chooses for a window it
    cannot write (a GPU's: `native_recall.ranks`), it names each row's new tokens and the windows of
    all the rows are written together after (`write_rows`: on a GPU two uploads and one set of ops,
    not per row). In a choice over all layers (everywhere) the rows of `few` (the choices after a
    reply's burst) pool the votes of `recall_voters`' layers alone (`CacheConfig.voter_layers`) and
    favour their held tokens by `recall_margin`; a burst's choices follow their queries as they are.
    The rows that chose go to `done`; a row that raises ends the call, after the windows of the rows
    before it are written."""
    kernel_chooses = (everywhere and layers == slice(None)) or (not everywhere and not per_layer and (layers.step or 1) == 1)
    few_layers = cache.config.voter_layers(cache.spec.num_layers) if everywhere and layers == slice(None) else None
    voters = {row: few_layers if row in few else None for row, _ in asked}  # None: every layer of `layers` votes
    margins = {row: cache.config.recall_margin if everywhere and row in few else 0.0 for row, _ in asked}
    if everywhere and kernel_chooses and native_recall.supports(cache) and len(asked) >= max(2, torch.get_num_threads()):
        grouped = [(row, by_kv_head(cache, queries)) for row, queries in asked if cache.recalled[row]]
        if done is not None:
            done.extend(row for row, _ in asked if not cache.recalled[row])
        native_recall.choose_many(cache, grouped, scaling, cache.config.recall_span, done, voters, margins)  # side by side
        return
    pending: list[tuple[int, torch.Tensor]] = []
    try:
        for row, queries in asked:
            r = cache.recalled[row]
            if r:
                grouped = by_kv_head(cache, queries)
                if kernel_chooses and native_recall.supports(cache):  # choice and window in one call
                    if everywhere:
                        native_recall.choose(cache, row, grouped, scaling, cache.config.recall_span, voters[row],
                                             margins[row])
                    else:
                        native_recall.choose_blocks(cache, row, grouped, scaling, layers)
                elif kernel_chooses and native_recall.ranks(cache):  # the choice on the host, the window where it lives
                    before = held(cache, row)[layers].clone()
                    native_recall.assign(cache, row, grouped, scaling, layers, everywhere, voters[row], margins[row])
                    pending.append((row, before))
                else:
                    margin = margins[row]
                    chosen = cache.archives[row].select(grouped, scaling, r, layers, everywhere, per_layer,
                                                        cache.config.recall_span, voters[row],
                                                        held(cache, row)[layers] if margin else None, margin,
                                                        cache.config.recall_sweep)
                    fill(cache, row, chosen, layers)
            if done is not None:
                done.append(row)
    finally:
        write_rows(cache, pending, layers)


def by_kv_head(cache: H2OCache, queries: torch.Tensor) -> torch.Tensor:
    """A row's queries [L', H_q, Q, D] grouped by the KV head they share (query head h_kv * group + g
    reads KV head h_kv): [L', H_kv, group * Q, D]."""
    spec = cache.spec
    return queries.reshape(queries.shape[0], spec.num_kv_heads, -1, spec.head_dim)


def held(cache: H2OCache, row: int) -> torch.Tensor:
    """[L, H_kv, recalled[row]] int64 on the host: the archive token each window slot holds (-1: not
    known, as after the archive dropped blocks or the window grew)."""
    archive, r = cache.archives[row], cache.recalled[row]
    current = cache.windows[row]
    if current is None or current[0] != archive.epoch or current[1].shape[-1] != r:
        current = (archive.epoch, torch.full((*archive.shape, r), -1, dtype=torch.int64))
        cache.windows[row] = current
    return current[1]


@torch.no_grad()
def fill(cache: H2OCache, row: int, chosen: torch.Tensor, layers: slice = slice(None)) -> None:
    """Make the window of `layers` hold `chosen` ([L', H_kv, r] archive token indices, ascending, r
    filling the window), rewriting only the slots whose token changed (`assign`: a token that stays
    chosen stays in its slot)."""
    window = held(cache, row)[layers]
    before = window.clone()
    window.copy_(assign(before, chosen))
    write_rows(cache, [(row, before)], layers)


_WRITTEN_AT_ONCE = 1 << 16  # slots placed together: their rows' origins gathered, [slots, capacity] int64


@torch.no_grad()
def write_rows(cache: H2OCache, pending: list[tuple[int, torch.Tensor]], layers: slice = slice(None)) -> None:
    """Copy into the windows of `layers` of each (row, before) of `pending` the archived tokens of the
    slots whose token `held` names now and did not in `before` ([L', H_kv, r]): keys, values,
    origins, keys rotated to where their tokens stood in the text among the row's own tokens, scores
    0. All the rows at once: on a device one upload of the slots' indices and origins and one of their
    keys and values (`transfer.upload`: no wait for the device's queued work), then one set of ops."""
    first = layers.start or 0
    indices, vectors = [], []
    for row, before in pending:
        now = held(cache, row)[layers]
        layer_ids, head_ids, slots = (now != before).nonzero(as_tuple=True)
        if not len(slots):
            continue
        cache.window_changed(row)
        tokens = now[layer_ids, head_ids, slots]
        keys, values, origins = cache.archives[row].gather_heads(layer_ids + first, head_ids, tokens[:, None],
                                                                 ("keys", "values", "origins"))
        shared = torch.tensor([[row], [cache.recalled[row]], [cache.lengths[row]]]).expand(3, len(slots))
        indices.append(torch.cat([torch.stack([layer_ids + first, head_ids, slots, origins[:, 0]]), shared]))
        vectors.append(torch.stack([keys[:, 0], values[:, 0]]))
        cache.recall_count[row] += len(slots)
    if not indices:
        return
    device = cache.spec.device
    at = upload(torch.cat(indices, dim=1), device)  # [7, slots]: layer, head, slot, origin, row, r, n
    copied = upload(torch.cat(vectors, dim=1), device, cache._keys.dtype)  # [2, slots, D]: keys, values
    for start in range(0, at.shape[1], _WRITTEN_AT_ONCE):
        part = slice(start, start + _WRITTEN_AT_ONCE)
        layer, head, slot, origin, row, r, n = at[:, part]
        keys = copied[0, part]
        cache._keys[layer, row, head, slot] = keys
        cache._values[layer, row, head, slot] = stored(copied[1, part], keys.dtype)
        cache._origins[layer, row, head, slot] = origin
        cos, sin = cache.spec.rope.at(slot_positions(cache._origins[layer, row, head], origin, r, n))
        cache._rotated[layer, row, head, slot] = stored(rotate(keys.float(), cos, sin), keys.dtype)
        if cache._scores is not None:
            cache._scores[layer, row, head, slot] = 0.0


def slot_positions(origins: torch.Tensor, recalled: torch.Tensor, r: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """`text_positions` of single window slots, each of its own row: origins [m, capacity], the origins
    of each slot's row, layer and head (own tokens in slots r .. n - 1, ascending); recalled [m], the
    slots' own origins; r, n [m]. Returns [m] fp32, as text_positions computes them."""
    capacity = origins.shape[-1]
    own = torch.arange(capacity, device=origins.device)
    own = (own >= r[:, None]) & (own < n[:, None])
    after = ((origins < recalled[:, None]) & own).sum(-1)  # own tokens older than each
    at = r + after  # the slot of the first own token newer
    since = torch.where(after > 0, origins.gather(-1, (at - 1).clamp(min=0)[:, None])[:, 0], torch.full_like(after, -1))
    until = torch.where(at < n, origins.gather(-1, at.clamp(max=capacity - 1)[:, None])[:, 0], recalled + 1)
    share = (recalled - since).double() / (until - since).clamp(min=1).double()
    return (r - 1 + after + share).float()


def assign(held: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The tokens each window slot is to hold ([..., r] each: held, the slots' tokens now, -1 for
    unknown; chosen, the tokens to hold, ascending): a slot whose token is still chosen keeps it, and
    the chosen tokens it does not hold yet go to the other slots, both taken in ascending order (as
    `kernels/recall_choice.cpp`'s `fill_head`). So a choice rewrites only the tokens that changed,
    wherever they sit: a decode choice over a 2k-token archive keeps ~half of a head's tokens but,
    compared slot by slot with the ascending list, only ~3% of its slots. The order of the window's
    slots means nothing: each key is placed by its token's position in the text (`place`)."""
    stays = _within(held, chosen)  # [..., r]: the slot's token is chosen
    new = ~_within(chosen, held.sort(dim=-1).values)  # [..., r]: the chosen token is not held
    free = (~stays).to(torch.int8).argsort(dim=-1, descending=True, stable=True)  # free slots first, ascending
    incoming = new.to(torch.int8).argsort(dim=-1, descending=True, stable=True)  # new tokens first, ascending
    k = torch.arange(held.shape[-1], device=held.device)
    tokens = torch.where(k < new.sum(-1, keepdim=True), chosen.gather(-1, incoming), held.gather(-1, free))
    return held.scatter(-1, free, tokens)


def _within(values: torch.Tensor, ascending: torch.Tensor) -> torch.Tensor:
    """Per head ([..., r] each), whether each of `values` is among `ascending` (sorted per head): a
    binary search per value, rather than comparing every pair."""
    at = torch.searchsorted(ascending.contiguous(), values.contiguous()).clamp_(max=ascending.shape[-1] - 1)
    return ascending.gather(-1, at) == values


@torch.no_grad()
def place(cache: H2OCache, rows: list[int]) -> None:
    """Rotate the window keys of each of `rows` to where their tokens stood in the text among the row's
    own tokens (`text_positions`), after an eviction moved those (`fill` and the kernel's choices place
    what they write); on the CPU in one kernel call for all the rows (`native_recall.place`), else
    with one set of torch ops for all the rows of the same window and length (an eviction cuts its
    rows to the same length: on a GPU ~20 launches, not ~20 per row)."""
    rows = [row for row in rows if 0 < cache.recalled[row] < cache.lengths[row]]
    if not rows:
        return
    if native_recall.supports(cache):  # which rewrites the keys of the windows' copy too
        native_recall.place(cache, rows)
        return
    for row in rows:
        cache.window_changed(row)
    groups: dict[tuple[int, int], list[int]] = {}
    for row in rows:
        groups.setdefault((cache.recalled[row], cache.lengths[row]), []).append(row)
    for (r, n), group in groups.items():
        at = as_slice(group) or upload(group, cache.spec.device)
        origins = cache._origins[:, at, :, :n]  # [L, rows, H, n]
        cos, sin = cache.spec.rope.at(text_positions(origins[..., :r], origins[..., r:], r))
        keys = cache._keys[:, at, :, :r]
        cache._rotated[:, at, :, :r] = stored(rotate(keys.float(), cos, sin), keys.dtype)


def held_ranks(origins: torch.Tensor) -> torch.Tensor:
    """origins [..., n] of a row's held tokens (window and own, any order) -> [..., n] int64: each
    token's rank in the order of the text among them, a permutation of 0..n-1 (`recall_positions`
    "rank"). A phrase recalled whole gets one position per word, as its own tokens have, where
    `text_positions` puts it within one slot; the newest tokens, never archived, keep their slots, so
    a pass's queries stand where they are. Fixed shapes, no host reads."""
    order = origins.argsort(dim=-1, stable=True)
    count = torch.arange(origins.shape[-1], device=origins.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, count)


def rank_rotated(cache: H2OCache, step, layer: int, keys: torch.Tensor) -> torch.Tensor:
    """`keys` ([B, H_kv, K, D], this pass's visible keys) with the held keys of each row that is fed and
    has a window rotated to their `held_ranks`, from the keys as fed (a copy: the buffers keep the text
    layout); other rows as they were (without a window a row's ranks are its slots). The pass's new
    tokens are the row's newest, at their slots either way, as a decode step's query is. The window's
    keys are held as its keys always are (`stored`: in fp16 in an fp32 cache) after their rotation. The
    native decode step and `decode.decode_step` read the same ranks (`recall_positions` "rank")."""
    rows = [row for row in range(keys.shape[0]) if step.n_new[row] and cache.ranked(row, step.n_new[row])]
    if not rows:
        return keys
    keys = keys.clone()
    for row in rows:
        n, r = cache.lengths[row] + step.n_new[row], cache.recalled[row]
        if native_recall.rank_rotate(cache, layer, row, r, n, keys[row]):
            continue
        _rotate_to_ranks(cache, keys[row, :, :n], cache._keys[layer, row, :, :n], cache._origins[layer, row, :, :n])
        keys[row, :, :r] = stored(keys[row, :, :r], cache.spec.dtype)  # a window's keys, at any position
    return keys


def _rotate_to_ranks(cache: H2OCache, out: torch.Tensor, keys: torch.Tensor, origins: torch.Tensor) -> None:
    """out[..., n, D] = `keys` (unrotated) rotated to the `held_ranks` of `origins` [..., n], from the
    cache's RoPE table (ranks are whole positions), without full-size temporaries (`rotate_into`)."""
    cos, sin = cache.spec.rope.get(origins.shape[-1])
    ranks = held_ranks(origins)
    half = cos.shape[-1] // 2  # transformers' layout: cos and sin repeat one half (`rotate_into`)
    at, shape = ranks.flatten(), (*ranks.shape, half)
    rotate_into(out, keys, cos[:, :half].index_select(0, at).view(shape), sin[:, :half].index_select(0, at).view(shape))


def text_positions(recalled: torch.Tensor, own: torch.Tensor, first: int) -> torch.Tensor:
    """Positions for recalled tokens among a row's own (position rolling keeps those at their slots).

    recalled: [L, H, r] origins of a window's tokens; own: [L, H, m] origins of the row's own tokens
    in slots first .. first + m - 1, ascending (slots keep the order of the text). Returns [L, H, r]
    fp32: a token whose origin o lies between those of the own tokens in slots s and s + 1 takes
    s + (o - origin(s)) / (origin(s + 1) - origin(s)), so that recalled and own tokens interleave in
    the order of the text and the recalled ones of one gap keep theirs; one older than every own token
    sits in (first - 1, first), one newer than all in (first + m - 1, first + m). Fixed shapes, no
    host reads: a device computes it where the window lives."""
    m = own.shape[-1]
    if own.device.type == "cpu":  # own tokens older than each [L, H, r]: a binary search on the CPU,
        after = torch.searchsorted(own.contiguous(), recalled.contiguous())
    else:  # one parallel comparison on a device (which also runs where searchsorted has no kernel)
        after = (own[..., None, :] < recalled[..., None]).sum(-1)
    before = own.gather(-1, (after - 1).clamp(min=0))
    since = torch.where(after > 0, before, torch.full_like(before, -1))
    until = torch.where(after < m, own.gather(-1, after.clamp(max=m - 1)), recalled + 1)
    share = (recalled - since).double() / (until - since).clamp(min=1).double()
    return (first - 1 + after + share).float()
