"""Snapshots of one `H2OCache` row as bytes (safetensors), to resume a sequence in another process.

A snapshot holds every buffer the cache has, sliced to the row's resident tokens, and every per-row
Python list (`lengths`, `seen`, `pending`, ...). Both are found on the cache object rather than
listed here, so a buffer or a per-row list added to `H2OCache` is saved without changing this file:
buffers are the tensors laid out [L, rows, H_kv, capacity, ...] (the token axis is dim 3, the
layout `H2OCache._copy_row` relies on), per-row state is every list attribute. The row's archive
of evicted tokens (recall) rides along as tensors named `archive.*`.

Restoring refuses (`SnapshotMismatch`) a snapshot written by another format version, for another
model fingerprint or cache config, or whose buffers are not the ones this cache allocates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from h2o_cache.cache import H2OCache

FORMAT_VERSION = 3  # 2: recall (the archive, pinned flags and counts); 3: the recall window in front
ARCHIVE = "archive."


class SnapshotMismatch(ValueError):
    """The snapshot cannot be restored into this cache; the reason is the message."""


def model_fingerprint(model) -> str:
    """What identifies a model's numerics: its config, dtype, and a sample of its weights.

    The weight sample (the first 256 values of the first and last parameters) tells apart two
    checkpoints of one architecture; hashing every weight would take seconds at start-up.
    """
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    digest.update(str(params[0].dtype).encode())
    for param in (params[0], params[-1]):
        digest.update(param.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def cache_identity(cache: H2OCache, fingerprint: str) -> str:
    """The model fingerprint, the cache geometry and its config: two caches with the same identity
    evolve identically from the same state."""
    spec = cache.spec
    geometry = [spec.num_layers, spec.num_kv_heads, spec.head_dim, str(spec.dtype)]
    config = {name: value for name, value in dataclasses.asdict(cache.config).items() if name not in _HOW}
    return json.dumps([fingerprint, geometry, config], sort_keys=True)


# Settings that choose how a cache computes, not what it holds: a snapshot moves between them.
_HOW = ("recall_kernel",)


def _row_buffers(cache: H2OCache) -> dict[str, torch.Tensor]:
    return {name: value for name, value in vars(cache).items()
            if isinstance(value, torch.Tensor) and value.dim() >= 4 and value.shape[0] == cache.spec.num_layers}


def _row_lists(cache: H2OCache) -> dict[str, list]:
    return {name: value for name, value in vars(cache).items() if isinstance(value, list) and name not in ("archives", "windows", "epochs")}


def dump_row(cache: H2OCache, row: int, identity: str, extra: dict[str, str] | None = None) -> bytes:
    """Row `row` of `cache` as safetensors bytes; `extra` strings ride along in the metadata."""
    length = cache.lengths[row]
    tensors = {name: buffer[:, row, :, :length].contiguous().cpu() for name, buffer in _row_buffers(cache).items()}
    archive = cache.archives[row]
    if archive is not None:
        tensors.update({ARCHIVE + name: tensor for name, tensor in archive.state().items()})
    state = {name: values[row] for name, values in _row_lists(cache).items()}
    metadata = {"format": str(FORMAT_VERSION), "identity": identity, "state": json.dumps(state), **(extra or {})}
    return save_tensors(tensors, metadata=metadata)


def read_metadata(blob: bytes) -> dict[str, str]:
    """The snapshot's metadata (safetensors header), without reading its tensors."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + size]).get("__metadata__", {})


def load_row(blank: H2OCache, blob: bytes, identity: str) -> H2OCache:
    """Fill `blank` (a new 1-row cache of the right model and config) with the snapshot; returns it."""
    metadata = read_metadata(blob)
    if metadata.get("format") != str(FORMAT_VERSION):
        raise SnapshotMismatch(f"snapshot format {metadata.get('format')!r}, this server reads {FORMAT_VERSION}")
    if metadata.get("identity") != identity:
        raise SnapshotMismatch("snapshot of another model or cache config")
    if blank.batch_size != 1 or blank.lengths[0]:
        raise ValueError("load_row needs a new, empty 1-row cache")
    tensors = load_tensors(blob)
    archived = {name[len(ARCHIVE):]: tensors.pop(name) for name in list(tensors) if name.startswith(ARCHIVE)}
    state = json.loads(metadata["state"])
    length = state["lengths"]
    blank.reserve(1, length)
    buffers = _row_buffers(blank)
    if set(tensors) != set(buffers) or set(state) != set(_row_lists(blank)):
        raise SnapshotMismatch(f"snapshot holds {sorted(tensors)} and {sorted(state)}; this cache has "
                               f"{sorted(buffers)} and {sorted(_row_lists(blank))}")
    with torch.no_grad():
        for name, saved in tensors.items():
            target = buffers[name][:, 0, :, :length]
            if saved.shape != target.shape or saved.dtype != target.dtype:
                raise SnapshotMismatch(f"{name}: snapshot {tuple(saved.shape)} {saved.dtype}, "
                                       f"cache {tuple(target.shape)} {target.dtype}")
            target.copy_(saved)
    for name, value in state.items():
        setattr(blank, name, [value])
    if archived:
        blank.archives = [blank.new_archive()]
        blank.archives[0].load_state(archived)
    return blank
