"""A row's recall window chosen in one C++ call on the CPU: a decode step's over all layers, a prefill
chunk's for its layer.

`recall.choose(everywhere=True)` is `Archive.select` (bound over every archived block, exact logits
over the candidates, votes pooled by position over the 90 heads, every archived token scored) and
`recall.fill` (the changed slots' tokens copied and rotated into the window): ~40 torch ops, most of
them over small shapes, ~13 ms per row on a 2-core CPU for a 2k-token conversation, more than the
decode step it precedes. `kernels/recall_choice.cpp` runs the same math with no per-op cost and
breaks exact ties the same way (the lower index first); its choice equals `Archive.select`'s up to
the order of fp32 sums, by which a near-tie could go the other way
(`tests/h2o_cache/test_native_recall.py` compares them). A prefill chunk's choice (whole blocks, by
the chunk's queries, before each layer's attention) is the same two stages for many queries (a
query group times the chunk), where the products dominate: there they run as products with packed
tiles of digests and keys (AVX-512 where the CPU has it), 2.3 -> 0.8 ms per layer at the end of a 2k
prompt. The torch functions stay the reference and the path of every other device and dtype.

Both choices write each changed slot's key rotated to where its token stood in the text among the
row's own tokens (`recall.text_positions`; the slots they keep have not moved), and `place` puts the
windows of all the rows of an eviction back in the text in one call: ~2 ms of torch ops per row
before, ~0.3 ms per row here (`kernels/placement.h`: the slot's RoPE rotation composed with the
fraction's, whose sine and cosine are short series, so no sine or cosine is called).
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from h2o_cache import recall
from h2o_cache.archive import CANDIDATES, POSITIONS
from h2o_cache.quantized import kernel

_INTS = ("layers", "heads", "dim", "group", "blocks", "block", "capacity", "digest_capacity",
         "window", "candidates", "span", "positions", "threads")
_POINTERS = ("queries", "lo", "hi", "keys", "values", "origins", "cos", "sin",
             "cache_keys", "cache_rotated", "cache_values")


class _Choice(ctypes.Structure):
    """The kernel's `Choice`: one row's archive, queries and window, as shapes, pointers and strides."""

    _fields_ = ([(name, ctypes.c_int64) for name in _INTS] + [("scaling", ctypes.c_double)]
                + [(name, ctypes.c_void_p) for name in _POINTERS]
                + [("kv_layer_stride", ctypes.c_int64), ("kv_head_stride", ctypes.c_int64),
                   ("cache_scores", ctypes.c_void_p), ("score_layer_stride", ctypes.c_int64),
                   ("score_head_stride", ctypes.c_int64), ("cache_origins", ctypes.c_void_p),
                   ("origin_layer_stride", ctypes.c_int64), ("origin_head_stride", ctypes.c_int64),
                   ("held", ctypes.c_void_p), ("frequencies", ctypes.c_void_p), ("length", ctypes.c_int64),
                   ("half", ctypes.c_void_p), ("half_bf16", ctypes.c_int64), ("archive_fp16", ctypes.c_int64),
                   ("window_keys", ctypes.c_void_p), ("window_values", ctypes.c_void_p),
                   ("window_layer_stride", ctypes.c_int64), ("window_head_stride", ctypes.c_int64),
                   ("voters", ctypes.c_void_p), ("voter_layers", ctypes.c_int64), ("margin", ctypes.c_double),
                   ("query_layer_stride", ctypes.c_int64),
                   ("index", ctypes.c_void_p), ("index_rows", ctypes.c_int64), ("index_state", ctypes.c_void_p),
                   ("total", ctypes.c_void_p),
                   ("kept", ctypes.c_void_p), ("question", ctypes.c_void_p), ("kept_count", ctypes.c_void_p), ("sweep_cursor", ctypes.c_void_p),
                   ("sweep", ctypes.c_int64)])


class _Placement(ctypes.Structure):
    """The kernel's `Placement`: the windows of a few rows of a cache, to place in the text."""

    _fields_ = ([(name, ctypes.c_int64) for name in ("layers", "rows_capacity", "heads", "capacity", "dim")]
                + [(name, ctypes.c_void_p) for name in ("keys", "rotated", "origins", "cos", "sin", "frequencies",
                                                        "row_ids", "recalled", "lengths")]
                + [(name, ctypes.c_int64) for name in ("rows", "threads")]
                + [("window_keys", ctypes.c_void_p)]
                + [(name, ctypes.c_int64) for name in ("window_layer_stride", "window_row_stride", "window_head_stride")])


def supports(cache) -> bool:
    """Whether the kernel is to choose and place this cache's windows: asked for
    (`CacheConfig.recall_kernel`), fp32 buffers on the CPU (the archive fp32 or fp16), rolling, RoPE's frequencies
    known and <= 1 (`RopeTable.placeable`: the window's keys are placed by position x frequency),
    head_dim a multiple of 8, and the kernel built."""
    known = _supported.get(cache)  # asked before every decode choice: answered once per buffers and config
    if known is not None and known[0]() is cache._keys and known[1] is cache.config:
        return known[2]
    spec = cache.spec
    answer = bool(cache.config.recall_kernel and spec.device.type == "cpu" and spec.dtype == torch.float32
                  and spec.head_dim % 8 == 0 and cache._rotated is not None and cache._keys.is_contiguous()
                  and spec.rope.placeable and kernel() is not None)
    if cache._keys is not None:  # no buffers yet: asked again once they exist
        _supported[cache] = (weakref.ref(cache._keys), cache.config, answer)
    return answer


# cache -> (its keys buffer when asked, weakly; its config; whether the kernel chooses and places its windows)
_supported: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ranks(cache) -> bool:
    """Whether the kernel is to make this cache's choices whatever its device and dtype, the window
    then written by `recall.write_rows` where the cache lives (`assign`): asked for, the archive in host
    memory ranking by 16-bit keys the kernel reads (an fp32 archive's fp16 copies, or an fp16 or bf16
    archive's own keys), head_dim a multiple of 8, and the kernel built. The choice reads only the
    archive and the queries, which the host has; on a GPU this takes a row's choice from ~40 torch ops
    on small host tensors to one multi-threaded call."""
    spec = cache.spec
    return (cache.config.recall_kernel and spec.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and spec.head_dim % 8 == 0 and kernel() is not None)


def rank_rotate(cache, layer: int, row: int, r: int, n: int, out: torch.Tensor) -> bool:
    """`recall.rank_rotated` for one row of a prefill pass in one C++ call: out[:, :n] ([H_kv, K, D] of
    the pass's copy of the keys) <- the row's held keys of `layer` rotated to their `held_ranks`, the
    window's r stored as a window stores them. The torch ops' ~20 calls took ~0.6 ms a layer and chunk
    (~0.6 s of a 4k prompt's prefill). False, nothing written, where it cannot (not an fp32 cache on the
    CPU, no kernel, shapes it does not take): the torch ops then."""
    keys, origins = cache._keys[layer, row], cache._origins[layer, row]
    if (keys.dtype != torch.float32 or keys.device.type != "cpu" or out.dtype != torch.float32
            or keys.stride()[1:] != (keys.shape[-1], 1) or out.stride()[1:] != (out.shape[-1], 1)
            or origins.stride(1) != 1 or kernel() is None):
        return False
    cos, sin = cache.spec.rope.get(n)
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32):
        return False
    return kernel().h2o_rank_rotate(keys.data_ptr(), keys.stride(0), origins.data_ptr(), origins.stride(0),
                                    keys.shape[0], r, n, keys.shape[-1], cos.data_ptr(), sin.data_ptr(),
                                    out.data_ptr(), out.stride(0)) == 0


@torch.no_grad()
def assign(cache, row: int, queries: torch.Tensor, scaling: float, layers: slice, everywhere: bool,
           voters: list[int] | None = None, margin: float = 0.0) -> None:
    """Make the choice of `choose` (everywhere: over all layers; voters as there) or `choose_blocks`
    (else, for the contiguous `layers`) and write only which slot takes which token into the row's
    `recall.held` (a slot whose token stays chosen keeps it), not the window itself:
    `recall.write_rows` copies the tokens of the slots that changed to where the window lives."""
    function = kernel().h2o_recall_choose if everywhere else kernel().h2o_recall_choose_blocks
    _run(function, cache, row, queries, scaling, layers, cache.config.recall_span if everywhere else 0, window=False,
         voters=voters, margin=margin, indexed=everywhere)


@torch.no_grad()
def choose(cache, row: int, queries: torch.Tensor, scaling: float, span: int, voters: list[int] | None = None,
           margin: float = 0.0) -> None:
    """`recall.choose(cache, row, ..., everywhere=True)`: fill the row's window (r = recalled[row] slots
    per layer and KV head) with the r archived tokens per head whose positions, with their neighbours'
    within `span`, drew the most of `queries`' ([L, H_kv, Q, D] before RoPE, grouped by KV head)
    pooled attention (of the heads of the layers `voters` alone, where given), each head's held tokens
    ranked by their votes x (1 + margin); only the slots whose token changed are rewritten."""
    _run(kernel().h2o_recall_choose, cache, row, queries, scaling, slice(None), span, voters=voters, margin=margin,
         indexed=True)


@torch.no_grad()
def choose_blocks(cache, row: int, queries: torch.Tensor, scaling: float, layers: slice) -> None:
    """`recall.choose(cache, row, queries, scaling, layers)` (a prefill chunk's choice, `Archive.select`
    by whole blocks, votes pooled over the heads of `layers`, a contiguous range): fill the window of
    `layers` with the blocks `queries` ([L', H_kv, Q, D] before RoPE) draw the most mass to."""
    _run(kernel().h2o_recall_choose_blocks, cache, row, queries, scaling, layers, 0)


def _run(function, cache, row: int, queries: torch.Tensor, scaling: float, layers: slice, span: int,
         window: bool = True, voters: list[int] | None = None, margin: float = 0.0, indexed: bool = False) -> None:
    """Call a choice of the kernel on the row's archive and window, for the layers `layers` (window
    False: only the row's `recall.held` is written; voters, margin, indexed: see `_prepare`)."""
    choice, written, total, keep = _prepare(cache, row, queries, scaling, layers, span, window, voters, margin,
                                            indexed)
    status = function(ctypes.byref(choice), written.data_ptr())
    if status:
        raise ValueError(f"the native recall choice refused its input (status {status})")
    if window:
        _chose(cache, row, choice, total)


def _chose(cache, row: int, choice: _Choice, total: ctypes.c_int64) -> None:
    """After a row's choice wrote its window: count the slots rewritten (`total`, which the kernel
    wrote: a torch sum of the counts per layer and head took ~60 µs of a batch-1 step after the kernel's
    pass over the archive, a Python one ~40), and mark the row where the Choice had no window copy to
    write (a copy no step reads now: it is copied again before one does)."""
    cache.recall_count[row] += total.value
    if not choice.window_keys:
        cache.window_changed(row)


@torch.no_grad()
def choose_many(cache, asked: list[tuple[int, torch.Tensor]], scaling: float, span: int,
                done: list[int] | None = None, voters: dict[int, list[int] | None] | None = None,
                margins: dict[int, float] | None = None) -> None:
    """`choose` for each (row, queries) of `asked` in one kernel call, each row's choice on one
    thread, as many rows at a time as threads: a row's choice is bound by memory and has a serial
    stage (the votes, in head order), so two rows side by side take less than one after the other on
    two threads. Each row's result is the one `choose` gives (it does not depend on the threads).
    The rows that chose go to `done`; where a row's choice was refused, the others still chose and
    this raises after. voters[row]: the layers whose heads alone vote in the row's choice (absent or
    None: all); margins[row]: its margin for held tokens (absent: 0)."""
    voters, margins = voters or {}, margins or {}
    prepared = [(row, *_prepare(cache, row, queries, scaling, slice(None), span, True, voters.get(row),
                                margins.get(row, 0.0), indexed=True))
                for row, queries in asked]
    choices = (_Choice * len(prepared))(*[choice for _, choice, _, _, _ in prepared])
    written = (ctypes.c_void_p * len(prepared))(*[w.data_ptr() for _, _, w, _, _ in prepared])
    statuses = torch.zeros(len(prepared), dtype=torch.int32)
    kernel().h2o_recall_choose_rows(choices, len(prepared), written, statuses.data_ptr(), torch.get_num_threads())
    refused = []
    for (row, choice, _, total, _), status in zip(prepared, statuses.tolist()):
        if status:
            refused.append((row, status))
            continue
        _chose(cache, row, choice, total)
        if done is not None:
            done.append(row)
    if refused:
        raise ValueError(f"the native recall choice refused its input (row, status: {refused})")


def _prepare(cache, row: int, queries: torch.Tensor, scaling: float, layers: slice, span: int,
             window: bool, voters: list[int] | None = None, margin: float = 0.0,
             indexed: bool = False) -> tuple[_Choice, torch.Tensor, ctypes.Array, tuple]:
    """The kernel's `Choice` for the row's archive and window in `layers` (voters: for a choice over
    all layers, the layers whose heads alone vote; None: all of them; margin: a decode choice ranks
    the held tokens by their votes x (1 + margin); indexed: a decode choice over all layers, which
    reads the row's `PositionIndex`), the [L', H] counts it writes (and a ctypes view of
    them), and the tensors its pointers read (to keep alive until the call returns). A row's `Choice` is kept between calls and
    built again only where what it was built from moved (`_sources`: storage grown, blocks formed, a
    window grown or reallocated, other layers or voters); else only its queries, length and margin are
    set: building one is ~50 fields and a dozen tensor calls, ~0.2 ms, paid at every decode step where
    a row chooses at every step."""
    r = cache.recalled[row]
    archive = cache.archives[row]
    storage = archive.storage()  # forms the blocks archived since: before anything is read
    first, end, step = layers.indices(archive.shape[0])
    if step != 1 or end <= first:
        raise ValueError(f"the recall kernel chooses for a contiguous range of layers, not {layers}")
    # read in place where each layer's [H_kv, group, D] is contiguous (a row of a batch's query buffer:
    # its layers max_rows rows apart), else copied (~55 µs cold for the default model's 30 layers)
    _, heads, group, dim = queries.shape
    if (queries.dtype != torch.float32 or queries.device.type != "cpu"
            or queries.stride()[1:] != (group * dim, dim, 1)):
        queries = queries.to(torch.float32).cpu().contiguous()
    cos, sin = cache.spec.rope.get(cache.lengths[row]) if window else (None, None)
    # a decode choice's running candidates, emptied here where the blocks were renumbered
    sweep = _sweep(cache, row) if indexed and first == 0 and end == archive.shape[0] else None
    sources = _sources(cache, row, storage, span, scaling, window, voters, queries.shape[2], cos, sin, sweep)
    kept = _prepared.setdefault(cache, {})
    entry = kept.get((row, first, end, window))
    if entry is not None and entry[0] != sources and _grown_only(entry[0], sources):
        # blocks formed since, nothing moved (a prefill's next chunk): only the counts they set change
        entry[1].blocks, entry[1].candidates = _block_counts(archive, r)
        entry = kept[(row, first, end, window)] = (sources, *entry[1:])
    if entry is None or entry[0] != sources:
        entry = (sources, *_build(cache, row, storage, first, end, span, scaling, window, voters,
                                  queries.shape[2], cos, sin, sweep))
        kept[(row, first, end, window)] = entry
    _, choice, written, total, keep = entry
    choice.queries = queries.data_ptr()
    choice.query_layer_stride = queries.stride(0)
    choice.length = cache.lengths[row]
    choice.margin = margin
    index = _index(cache, row, archive) if indexed and first == 0 and end == archive.shape[0] else None
    if index is None:
        choice.index = choice.index_state = None
    else:
        choice.index, choice.index_rows, choice.index_state = index.table_pointer, index.rows, index.state_pointer
        if window:
            _again.setdefault(cache, {})[row] = _Again(cache, row, archive, choice, written, total, (queries, *keep),
                                                       voters, margin, index)
    return choice, written, total, (queries, *keep)


class _Again:
    """What a row's last decode choice over all layers was made with (`_prepare`), and what it would
    have to equal for the next to be made with the same `Choice` (`choose_again`): the row's archive (held
    weakly) at the same version, the same buffers and window copy (`H2OCache.layout`), the same row
    (`epochs`), window and held tokens' tensor, RoPE table, config, threads, voters and margin."""

    __slots__ = ("archive", "stamp", "windows", "cos", "config", "choice", "written", "total", "keep", "votes",
                 "queries", "index", "call")

    def __init__(self, cache, row, archive, choice, written, total, keep, voters, margin, index):
        self.archive = weakref.ref(archive)
        self.stamp = _stamp(cache, row, archive)
        self.windows = cache.windows[row]  # the tuple whose tensor the Choice's `held` points into
        self.cos = cache.spec.rope.cos  # the table its cos and sin point into
        self.config = cache.config
        self.choice, self.written, self.total, self.keep = choice, written, total, keep
        self.votes = (None if voters is None else tuple(voters), margin)
        self.queries = None  # the batch's queries it was last made again with, as checked (`choose_again`)
        self.index = index  # the position index it points at
        self.call = (kernel().h2o_recall_choose, ctypes.byref(choice), written.data_ptr())


def _stamp(cache, row: int, archive) -> tuple:
    return (*archive.version, cache.layout, cache.epochs[row], cache.recalled[row], torch.get_num_threads())


def choose_again(cache, row: int, queries: torch.Tensor, scaling: float, voters: list[int] | None,
                 margin: float) -> bool:
    """`choose` for the row with queries[:, row] ([L, B, H_q, D], the batch's queries), made with the
    `Choice` of the row's last decode choice where nothing it points at or was built from has changed
    since (`_Again`): its queries, length and index set, nothing else read or built. The whole way there,
    `recall.refresh` to `_prepare`, took ~0.3 ms of Python a choice, cold after the step, at every step
    of a conversation choosing at every step (~4% of a batch-1 step); made again, ~0.1 ms. Returns
    False, having done nothing, where it cannot."""
    entry = _again.get(cache, {}).get(row)
    archive = cache.archives[row]
    if (entry is None or archive is None or entry.archive() is not archive or entry.stamp != _stamp(cache, row, archive)
            or cache.windows[row] is not entry.windows or cache.config is not entry.config
            or cache.spec.rope.cos is not entry.cos or cache.lengths[row] > entry.cos.shape[0]
            or entry.votes != (None if voters is None else tuple(voters), margin)
            or entry.choice.scaling != scaling):
        return False
    choice = entry.choice
    if queries is not entry.queries:  # the same tensor as last time: its row where the Choice reads (a
        # tensor's place and strides change only where it is replaced: the cache's own is, with its buffers)
        if (queries.dtype != torch.float32 or queries.device.type != "cpu" or queries.stride(3) != 1
                or queries.stride(2) != queries.shape[3] or queries.stride(0) != choice.query_layer_stride
                or queries.data_ptr() + row * queries.stride(1) * queries.element_size() != choice.queries):
            return False
        entry.queries = queries
    choice.length = cache.lengths[row]
    if entry.index.rows < min(cache.seen[row], POSITIONS):  # outgrown: made again (the epoch is the stamp's)
        index = entry.index = _index(cache, row, archive)
        choice.index, choice.index_rows, choice.index_state = index.table_pointer, index.rows, index.state_pointer
    function, *args = entry.call
    status = function(*args)
    if status:
        raise ValueError(f"the native recall choice refused its input (status {status})")
    _chose(cache, row, choice, entry.total)
    return True


# A cache's rows' last decode choices: row -> _Again
_again: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# A cache's kept `Choice`s: (row, first layer, end, window) -> (sources, Choice, written, its total, tensors kept)
_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PositionIndex:
    """A row's archived tokens by position, for a decode choice's heads to find theirs at the best
    positions (`update_index` in the kernel): [rows + 1, L x H] int32 host memory, the rows the
    positions seen so far (at most `POSITIONS`), grown as the conversation goes on; the kernel indexes
    the full blocks formed since its last call and starts again (`state` 0) for another archive or
    epoch. Without it each head read all its archived origins at every choice, ~1.4 MB on the default
    model at a 2k-token history, cold after the step; with it ~360 bytes a position (~0.7 MB at 2k,
    1.4% of the archive's host memory). It is derived: never saved, rebuilt from the archive."""

    __slots__ = ("archive", "epoch", "rows", "table", "state", "table_pointer", "state_pointer")

    def __init__(self, archive, rows: int):
        heads = archive.shape[0] * archive.shape[1]
        self.archive = weakref.ref(archive)
        self.epoch = archive.epoch
        self.rows = rows
        self.table = torch.empty((rows + 1) * heads, dtype=torch.int32)
        self.state = torch.zeros(1, dtype=torch.int64)  # tokens per head indexed: 0, cleared by the kernel
        self.table_pointer, self.state_pointer = self.table.data_ptr(), self.state.data_ptr()


_INDEX_ROWS = 4096  # a row's index grows by whole multiples of this many positions


def _index(cache, row: int, archive) -> PositionIndex:
    """The row's `PositionIndex`: made again where the archive is another or the positions seen outgrew
    it, and emptied (the kernel indexes it again) where the archive's blocks were renumbered
    (`Archive.epoch`)."""
    indexes = _indexes.setdefault(cache, {})
    index = indexes.get(row)
    seen = min(cache.seen[row], POSITIONS)
    if index is None or index.rows < seen or index.archive() is not archive:
        rows = min(POSITIONS, -(-max(seen, 1) // _INDEX_ROWS) * _INDEX_ROWS)
        index = indexes[row] = PositionIndex(archive, rows)
    elif index.epoch != archive.epoch:
        index.epoch = archive.epoch
        index.state[0] = 0
    return index


# A cache's position indexes: row -> PositionIndex
_indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sweep(cache, row: int):
    """The row's `archive.Sweep` for its decode choices (None: `recall_sweep` 0, every choice ranks every
    block)."""
    if not cache.config.recall_sweep:
        return None
    return cache.archives[row].sweep(cache.recalled[row])


def _sources(cache, row: int, storage: dict, span: int, scaling: float, window: bool, voters: list[int] | None,
             group: int, cos, sin, sweep=None) -> tuple:
    """What a row's `Choice` for given layers is built from, but its queries, length and margin: equal
    where the kept one holds (the layers are in the key it is kept under)."""
    archive = cache.archives[row]
    held = recall.held(cache, row)
    # the full blocks second: `_grown_only` compares all but them
    fields = (id(archive), archive.full_blocks, cache.recalled[row], held.data_ptr(), held.shape[-1],
              *(storage[name].data_ptr() for name in ("keys", "values", "origins", "lo", "hi", "half")),
              storage["keys"].shape[2], storage["lo"].shape[2], span, scaling, group, torch.get_num_threads(),
              None if voters is None else tuple(voters), None if sweep is None else sweep.candidates.data_ptr())
    if window:
        buffers = cache.buffers()
        copy = cache.window_copy(current=False)
        fields += (cos.data_ptr(), sin.data_ptr(), buffers.keys.data_ptr(), buffers.rotated.data_ptr(),
                   buffers.values.data_ptr(), buffers.origins.data_ptr(), tuple(buffers.keys.shape),
                   None if buffers.scores is None else buffers.scores.data_ptr(),
                   None if copy is None else (copy.data_ptr(), tuple(copy.shape)))
    return fields


def _grown_only(kept: tuple, now: tuple) -> bool:
    """Whether `_sources` now differ from the kept ones only in the archive's full blocks (field 1),
    which set nothing in a `Choice` but its `blocks` and `candidates`."""
    return kept[0] == now[0] and kept[2:] == now[2:]


def _block_counts(archive, r: int) -> tuple[int, int]:
    """A `Choice`'s `blocks` and `candidates` for an archive and a window of r slots: its full blocks,
    and CANDIDATES per block the window takes, at most all of them."""
    return archive.full_blocks, min(CANDIDATES * (r // archive.block), archive.full_blocks)


def _build(cache, row: int, storage: dict, first: int, end: int, span: int, scaling: float, window: bool,
           voters: list[int] | None, group: int, cos, sin, sweep=None) -> tuple[_Choice, torch.Tensor, ctypes.Array, tuple]:
    """A row's `Choice` (queries, length and margin unset), the counts it writes (and a ctypes view of
    them, read while `written` lives) and the tensors it reads."""
    r = cache.recalled[row]
    archive = cache.archives[row]
    heads = archive.shape[1]
    written = torch.zeros(end - first, heads, dtype=torch.int32)
    total = ctypes.c_int64(0)
    full_blocks, candidates = _block_counts(archive, r)
    ranked = storage["half"] if archive.dtype == torch.float32 else storage["keys"]  # 16-bit keys
    fields = dict(
        layers=end - first, heads=heads, dim=archive.head_dim, group=group, blocks=full_blocks,
        block=archive.block, capacity=storage["keys"].shape[2], digest_capacity=storage["lo"].shape[2],
        window=r, candidates=candidates, span=span,
        positions=POSITIONS, threads=torch.get_num_threads(), scaling=scaling,
        lo=storage["lo"][first].data_ptr(), hi=storage["hi"][first].data_ptr(),
        origins=storage["origins"][first].data_ptr(), half=ranked[first].data_ptr(),
        half_bf16=int(archive.dtype == torch.bfloat16), archive_fp16=int(archive.dtype == torch.float16),
        held=recall.held(cache, row)[first:end].data_ptr(),  # a view: contiguous, as the layers are
        total=ctypes.addressof(total))
    keep: tuple = ()  # what the Choice points at that nothing else holds; not the archive's storage,
    # which a kept Choice must not hold on to after the archive grows (the sources then differ)
    if voters is not None:  # only these layers' keys are read; every head takes its tokens by their votes
        voting = torch.tensor(voters, dtype=torch.int64)
        keep += (voting,)
        fields |= dict(voters=voting.data_ptr(), voter_layers=len(voters))
    if sweep is not None:  # a decode choice's running candidates
        keep += (sweep.candidates, sweep.question, sweep.counts, sweep.cursor)
        fields |= dict(kept=sweep.candidates.data_ptr(), question=sweep.question.data_ptr(),
                       kept_count=sweep.counts.data_ptr(),
                       sweep_cursor=sweep.cursor.data_ptr(), sweep=cache.config.recall_sweep)
    if window:  # what the kernel copies the chosen tokens from and into
        cos, sin = cos.contiguous(), sin.contiguous()
        keep += (cos, sin)
        buffers = cache.buffers()
        keys, scores, origins = buffers.keys, buffers.scores, buffers.origins
        fields |= dict(
            keys=storage["keys"][first].data_ptr(), values=storage["values"][first].data_ptr(),
            cos=cos.data_ptr(), sin=sin.data_ptr(), frequencies=cache.spec.rope.frequencies.data_ptr(),
            cache_keys=keys[first, row].data_ptr(), cache_rotated=buffers.rotated[first, row].data_ptr(),
            cache_values=buffers.values[first, row].data_ptr(), kv_layer_stride=keys.stride(0),
            kv_head_stride=keys.stride(2),
            cache_scores=None if scores is None else scores[first, row].data_ptr(),
            score_layer_stride=0 if scores is None else scores.stride(0),
            score_head_stride=0 if scores is None else scores.stride(2),
            cache_origins=origins[first, row].data_ptr(), origin_layer_stride=origins.stride(0),
            origin_head_stride=origins.stride(2))
        copy = cache.window_copy(current=False)  # kept equal to the window where it was: the kernel writes both
        if copy is not None:
            fields |= dict(window_keys=copy[0, first, row].data_ptr(), window_values=copy[1, first, row].data_ptr(),
                           window_layer_stride=copy.stride(1), window_head_stride=copy.stride(3))
    return _Choice(**fields), written, total, keep


@torch.no_grad()
def place(cache, rows: list[int]) -> None:
    """`recall.place` for each of `rows` in one call: every window key rotated to where its token stood
    in the text among the row's own tokens."""
    buffers = cache.buffers()
    layers, rows_capacity, heads, capacity, dim = buffers.keys.shape
    row_ids, recalled, lengths = (torch.tensor(v, dtype=torch.int64) for v in
                                  (rows, [cache.recalled[row] for row in rows], [cache.lengths[row] for row in rows]))
    cos, sin = (t.contiguous() for t in cache.spec.rope.get(int(lengths.max())))
    job = _Placement(layers=layers, rows_capacity=rows_capacity, heads=heads, capacity=capacity, dim=dim,
                     keys=buffers.keys.data_ptr(), rotated=buffers.rotated.data_ptr(),
                     origins=buffers.origins.data_ptr(),
                     cos=cos.data_ptr(), sin=sin.data_ptr(), frequencies=cache.spec.rope.frequencies.data_ptr(),
                     row_ids=row_ids.data_ptr(), recalled=recalled.data_ptr(), lengths=lengths.data_ptr(),
                     rows=len(rows), threads=torch.get_num_threads())
    copy = cache.window_copy(current=False)  # the windows' keys rewritten there too
    if copy is not None:
        job.window_keys = copy[0].data_ptr()
        job.window_layer_stride, job.window_row_stride, job.window_head_stride = copy.stride(1), copy.stride(2), copy.stride(3)
    else:  # a copy no step reads now (or none): copied again before one does
        for row in rows:
            cache.window_changed(row)
    status = kernel().h2o_recall_place(ctypes.byref(job))
    if status:
        raise ValueError(f"the native placement refused its input (status {status})")


# The stages of a decode choice, as the kernel times them (`h2o_recall_stages`)
STAGES = ("rank", "votes", "index", "picks", "fill")


def stages(on: bool | None = None) -> dict[str, float] | None:
    """The kernel's decode choices timed by stage: `on` True starts counting from zero, False stops it,
    None leaves it. Returns what was counted so far, {"choices": n, "rank": seconds, ...} summed over
    the choices ("rank": the voting heads' bound and exact stages; "votes": their votes pooled and the
    best positions found; "index": the position index brought up to date; "picks": every head's tokens;
    "fill": their copies into the window), or None without the kernel. Counting costs two clock reads
    a stage; off (the default), a choice reads one flag."""
    lib = kernel()
    if lib is None:
        return None
    out = (ctypes.c_double * (1 + len(STAGES)))()
    lib.h2o_recall_stages(-1 if on is None else int(on), out)
    return {"choices": out[0], **dict(zip(STAGES, out[1:]))}
