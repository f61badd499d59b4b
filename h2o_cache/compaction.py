"""Eviction of cache rows down to their budget: which tokens each layer and KV head keeps
(`eviction.keep_indices` over the policy's priority), the kept ones compacted to the front of the row and
re-rotated to their new slots (position rolling), and with recall the others moved to the row's archive.

Operates on an `H2OCache`'s buffers; the cache calls `evict` from `advance`, for exactly the rows that
crossed the budget, so a row evolves the same whatever its batch. On the CPU in fp32 the kept vectors
move and rotate in one C++ call (`kernels/compaction.cpp`, in place, the torch path's results bit for
bit); `move_kept` is the torch path, for every other device and dtype.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from h2o_cache import recall
from h2o_cache.eviction import keep_indices, take_vectors
from h2o_cache.quantized import kernel
from h2o_cache.rope import rotate_into
from h2o_cache.transfer import as_slice, download, upload

if TYPE_CHECKING:
    from h2o_cache.cache import H2OCache


def evict(cache: H2OCache, rows: list[int]) -> None:
    """Cut each of `rows` to the target (plus its pinned tokens): its sinks, its recent window, its
    pinned tokens and, per layer and KV head, the tokens of highest priority; kept keys are
    re-rotated to their new slots when rolling. With recall, the others go to the row's archive."""
    spec, config = cache.spec, cache.config
    device = spec.device
    own = config.target  # a property: read once, not per row
    keep = [own + cache.recalled[row] for row in rows]
    target = max(keep)
    held = [cache.lengths[row] for row in rows]
    longest = max(held)
    row_ids, lengths, kept, first = upload([rows, held, keep, [cache.recalled[row] for row in rows]], device)
    picked = as_slice(rows) or row_ids
    scores = cache._scores[:, picked, :, :longest] if cache._scores is not None else None
    priority = cache.policy.priority(scores, torch.arange(longest, device=device))
    priority = priority.expand(spec.num_layers, len(rows), spec.num_kv_heads, longest)
    pinned = cache._pinned[:, picked, :, :longest] if cache._pinned is not None else None
    index = keep_indices(  # [L, rows, H, target]; the sinks are a row's first own tokens, after its window
        priority, lengths, kept, config.sinks, config.recent, width=target, pinned=pinned,
        first=first if config.recalls else None,
    )
    if config.recalls:
        archive(cache, rows, row_ids, index, lengths, keep, longest)
        real = (torch.arange(target, device=device) < kept[:, None])[None, :, None]  # [1, rows, 1, target]
        cache._pinned[:, picked, :, :target] = pinned.gather(3, index) & real
        cache._pinned[:, picked, :, target:longest] = False
    if scores is not None:
        cache._scores[:, picked, :, :target] = scores.gather(3, index)
    cache._origins[:, picked, :, :target] = cache._origins[:, picked, :, :longest].gather(3, index)
    # A recall window's slots [0, recalled) are pinned and the first slots: kept where they are, so
    # their vectors are not copied (`recall.place` re-rotates their keys once the own tokens moved).
    still = min(cache.recalled[row] for row in rows) if config.recalls else 0
    index = index[..., still:]
    if native_compaction(cache):
        compact_natively(cache, row_ids, index, still, *spec.rope.get(target))
    else:
        move_kept(cache, picked, row_ids, index, still, target)
    for row, n in zip(rows, keep):
        cache.lengths[row] = n
    if config.recalls:  # the rows' own tokens moved: their windows' places among them with them (the
        recall.place(cache, rows)  # window slots moved above did not: their values and copies stand)


def move_kept(cache: H2OCache, picked: slice | torch.Tensor, row_ids: torch.Tensor, index: torch.Tensor,
              still: int, target: int) -> None:
    """`evict`'s moves with torch ops, for any device and dtype: slot still + j of each layer, row and
    head takes the key and value of slot index[..., j] ([L, rows, H, width]), gathered first, and with
    rolling every kept key is rotated to its slot."""
    device = cache.spec.device
    # index's row (l, rows[i], h) starts at vector ((l * R + rows[i]) * H + h) * capacity of a buffer
    layers, rows_capacity, heads, capacity, _ = cache._keys.shape
    starts = (torch.arange(layers, device=device)[:, None, None] * rows_capacity
              + row_ids[None, :, None]) * heads + torch.arange(heads, device=device)
    starts = starts[..., None] * capacity
    kept_keys = kept_vectors(cache, cache._keys, starts, index)
    if cache.config.rolling:
        # Slots moved: every kept key takes the RoPE rotation of its new slot.
        cos, sin = cache.spec.rope.get(target)
        cos, sin = cos[still:], sin[still:]
        if isinstance(picked, slice):
            rotate_into(cache._rotated[:, picked, :, still:target], kept_keys, cos, sin)
        else:
            rotated = torch.empty_like(kept_keys)
            rotate_into(rotated, kept_keys, cos, sin)
            cache._rotated[:, picked, :, still:target] = rotated
    cache._keys[:, picked, :, still:target] = kept_keys
    cache._values[:, picked, :, still:target] = kept_vectors(cache, cache._values, starts, index)


class _Compaction(ctypes.Structure):
    """The kernel's `Compaction` (`kernels/compaction.cpp`)."""

    _fields_ = ([(name, ctypes.c_int64) for name in ("layers", "rows_capacity", "heads", "capacity", "dim")]
                + [(name, ctypes.c_void_p) for name in ("keys", "values", "rotated", "cos", "sin", "row_ids")]
                + [("rows", ctypes.c_int64), ("index", ctypes.c_void_p)]
                + [(name, ctypes.c_int64) for name in ("still", "width", "threads")])


def native_compaction(cache: H2OCache) -> bool:
    """Whether an eviction's compaction runs in one C++ call: fp32 buffers on the CPU, head_dim a
    multiple of 16, and the kernel built (the same results as the torch ops, bit for bit)."""
    spec = cache.spec
    return (spec.device.type == "cpu" and spec.dtype == torch.float32 and spec.head_dim % 16 == 0
            and cache._keys.is_contiguous() and kernel() is not None)


def compact_natively(cache: H2OCache, row_ids: torch.Tensor, index: torch.Tensor, still: int,
                     cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`evict`'s moves for the rows `row_ids`: slot still + j of each layer, row and head takes the key
    and value of slot index[..., j] ([L, rows, H, width], ascending), and with rolling every kept key
    is rotated to its slot; in place, no scratch."""
    index, row_ids, cos, sin = index.contiguous(), row_ids.contiguous(), cos.contiguous(), sin.contiguous()
    layers, rows_capacity, heads, capacity, dim = cache._keys.shape
    rotated = cache._rotated if cache.config.rolling else None
    job = _Compaction(layers=layers, rows_capacity=rows_capacity, heads=heads, capacity=capacity, dim=dim,
                      keys=cache._keys.data_ptr(), values=cache._values.data_ptr(),
                      rotated=None if rotated is None else rotated.data_ptr(),
                      cos=cos.data_ptr(), sin=sin.data_ptr(), row_ids=row_ids.data_ptr(),
                      rows=row_ids.shape[0], index=index.data_ptr(), still=still, width=index.shape[-1],
                      threads=torch.get_num_threads())
    status = kernel().h2o_compact(ctypes.byref(job))
    if status:
        raise ValueError(f"the native compaction refused its input (status {status})")


def kept_vectors(cache: H2OCache, buffer: torch.Tensor, starts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The vectors `index` ([L, rows, H, width]) keeps of `buffer`, [L, rows, H, width, D]
    (`take_vectors`); in the eviction scratch (`reserve`) when the cache keeps one, so valid until
    the next call. Measured for the keys of 8 rows at 384 slots, one thread: 117 ms for a gather
    with the index expanded to every channel into a fresh tensor, 58 ms for index_select into a
    fresh tensor (page faults), 15 ms into the scratch.
    """
    if not cache._keeps_scratch:
        return take_vectors(buffer, starts, index)
    size = index.numel() * buffer.shape[-1]
    if cache._scratch is None or cache._scratch.numel() < size:
        cache._scratch = torch.empty(size, device=buffer.device, dtype=buffer.dtype)
    return take_vectors(buffer, starts, index, out=cache._scratch)

def archive(cache: H2OCache, rows: list[int], row_ids: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
            keep: list[int], longest: int) -> None:
    """Move what an eviction drops to each row's archive: per layer and head, the slots below the
    row's length that `index` ([L, rows, H, width], see `evict`; row_ids: `rows` on the device) does
    not keep, in slot order."""
    spec = cache.spec
    if native_compaction(cache):
        archive_natively(cache, rows, index, keep)
        return
    slots = torch.arange(longest, device=spec.device)
    shape = (spec.num_layers, len(rows), spec.num_kv_heads, longest)
    kept = torch.zeros(shape, dtype=torch.bool, device=spec.device).scatter_(3, index, True)
    dropped = ~kept & (slots < lengths[:, None, None])
    order = (~dropped).to(torch.int8).argsort(dim=-1, stable=True)  # dropped slots first, ascending
    # rows dropping as many tokens (an eviction cuts its rows to the same length) are taken together:
    # on a GPU a few launches per group, not per row
    groups: dict[int, list[int]] = {}
    for i, (row, n) in enumerate(zip(rows, keep)):
        groups.setdefault(cache.lengths[row] - n, []).append(i)
    fields = []  # per group: keys, values, scores (None without), origins of its rows' dropped tokens
    layers, rows_capacity, heads, capacity, _ = cache._keys.shape
    for m, members in groups.items():
        at = as_slice(members) or upload(members, spec.device)  # the group's places in this eviction
        ids = as_slice([rows[i] for i in members]) or row_ids[at]
        gone = order[:, at, :, :m]  # [L, g, H, m]
        # (l, row, h) starts at vector ((l * R + row) * H + h) * capacity: whole vectors, no expanded index
        starts = ((torch.arange(layers, device=spec.device)[:, None, None] * rows_capacity + row_ids[at, None]) * heads
                  + torch.arange(heads, device=spec.device)) * capacity
        starts = starts[..., None]
        fields.append((take_vectors(cache._keys, starts, gone), take_vectors(cache._values, starts, gone),
                       cache._scores[:, ids].gather(3, gone) if cache._scores is not None else None,
                       cache._origins[:, ids].gather(3, gone)))
    copied = None
    if spec.device.type == "cuda":
        fields, copied = download(fields)
    for members, group_fields in zip(groups.values(), fields):
        for j, i in enumerate(members):
            row = rows[i]
            if cache.archives[row] is None:
                cache.archives[row] = cache.new_archive()
            cache.archives[row].append(*(None if f is None else f[:, j] for f in group_fields), copied=copied)


class _Dropping(ctypes.Structure):
    """The kernel's `Dropping` (`kernels/compaction.cpp`)."""

    _fields_ = ([(name, ctypes.c_int64) for name in ("layers", "rows_capacity", "heads", "capacity", "dim")]
                + [(name, ctypes.c_void_p) for name in ("keys", "values", "scores", "origins")]
                + [(name, ctypes.c_int64) for name in ("row", "length")] + [("index", ctypes.c_void_p)]
                + [(name, ctypes.c_int64) for name in ("width", "dropped")]
                + [(name, ctypes.c_void_p) for name in ("out_keys", "out_values", "out_scores", "out_origins")]
                + [(name, ctypes.c_int64) for name in ("out_capacity", "offset", "threads", "out_fp16")])


def archive_natively(cache: H2OCache, rows: list[int], index: torch.Tensor, keep: list[int]) -> None:
    """`archive` in one C++ call per row: each row's dropped tokens (slots below its length that
    `index` does not keep, in slot order) copied straight into its archive's storage."""
    layers, rows_capacity, heads, capacity, dim = cache._keys.shape
    scores = cache._scores
    for i, (row, n) in enumerate(zip(rows, keep)):
        if cache.archives[row] is None:
            cache.archives[row] = cache.new_archive()
        store = cache.archives[row]
        dropped = cache.lengths[row] - n
        if dropped <= 0:
            continue
        start = store.reserve(dropped)
        data = store._data
        kept = index[:, i].contiguous()
        job = _Dropping(layers=layers, rows_capacity=rows_capacity, heads=heads, capacity=capacity, dim=dim,
                        keys=cache._keys.data_ptr(), values=cache._values.data_ptr(),
                        scores=None if scores is None else scores.data_ptr(), origins=cache._origins.data_ptr(),
                        row=row, length=cache.lengths[row], index=kept.data_ptr(), width=kept.shape[-1],
                        dropped=dropped, out_keys=data["keys"].data_ptr(), out_values=data["values"].data_ptr(),
                        out_scores=data["scores"].data_ptr(), out_origins=data["origins"].data_ptr(),
                        out_capacity=data["keys"].shape[2], offset=start, threads=torch.get_num_threads(),
                        out_fp16=int(store.dtype == torch.float16))
        status = kernel().h2o_archive_dropped(ctypes.byref(job))
        if status:
            store.stored = start  # nothing half-written is ever read
            raise ValueError(f"the native archiving refused an eviction (status {status})")
