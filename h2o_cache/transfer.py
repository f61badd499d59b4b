"""Copies between host and device that never make the host wait for the device.

A blocking copy, or one from or to pageable memory, waits for everything queued on the device
before it; these go through pinned memory and return at once. A decode step's only wait is the
download of its sampled tokens.
"""

from __future__ import annotations

import torch


def as_slice(rows: list[int]) -> slice | None:
    """The slice of `rows` where they are consecutive and ascending, else None: indexing a batch axis
    by a slice is a view, with nothing to upload (the usual case: a batch's rows in order)."""
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else None


def upload(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host numbers (a nested list or a host tensor) -> a tensor on `device` in one copy, asynchronous
    from pinned memory on a GPU (PyTorch's pinned cache keeps the block until the copy is done)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def download(fields: list[tuple[torch.Tensor | None, ...]]) -> tuple[list[tuple[torch.Tensor | None, ...]], torch.cuda.Event]:
    """Device tensors (None kept as None) -> host views of them, all filled by one asynchronous copy
    into pinned memory, and that copy's event: read the views after it. Their bytes are packed on
    the device widest type first, so every view starts at a multiple of its itemsize."""
    tensors = [t for row in fields for t in row if t is not None]
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    packed = torch.cat([tensors[i].reshape(-1).view(torch.uint8) for i in order])
    host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    views: dict[int, torch.Tensor] = {}
    offset = 0
    for i in order:
        size = tensors[i].numel() * tensors[i].element_size()
        views[i] = host[offset:offset + size].view(tensors[i].dtype).view(tensors[i].shape)
        offset += size
    rest = iter(views[i] for i in range(len(tensors)))
    return [tuple(None if t is None else next(rest) for t in row) for row in fields], copied
