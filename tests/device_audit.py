"""What a decode step asks of the host, audited op by op: one harness for the CPU twin of the step and
for the whole GPU path run on a fake CUDA device.

`HostReads` flags every op that reads a value of a `device` tensor back to the host, or whose output
shape depends on tensor values (what a CUDA graph cannot capture and what costs a sync outside one).

`FakeCuda` runs code on a `cuda` device that does not exist: tensors created on or moved to `cuda`
are FakeTensors (shapes, dtypes and devices propagate, values do not), host tensors stay real, so
host-side bookkeeping runs as written. On top of `HostReads` it fails on any op mixing a device
tensor with a host tensor that is not a 0-dim scalar, and it counts host syncs as CUDA has them:
a blocking copy either way, a copy to pageable host memory, an explicit synchronize. Copies are
recorded with their contiguity and pinning. A device-to-host copy returns zeros: the fake device
holds no values, and zeros are a valid token id, logprob, slot and origin.

What FakeTensorMode cannot model on a CPU-only build is stubbed, and only that:
- pinned memory (no allocator without CUDA): `pin_memory=True` allocates ordinary memory that the
  audit remembers as pinned, and `is_pinned` answers from that record;
- events, streams and CUDA graphs: an event's `query` answers True (the copies it waits for were
  issued a step earlier, and the step's token download has synchronized the stream since); its
  `synchronize` counts a sync; a graph's capture runs its body once under the audit, `replay` does
  nothing (fake tensors hold no values to recompute); `timeline` lists replays, event records and
  waits, and other syncs in order (what a step waits for once its graph is queued);
- `Tensor.copy_`, `__getitem__`, `__setitem__`, `__invert__` and `item`, whose Python bindings take a CUDA device guard that a
  CPU-only build cannot create: routed to the aten ops the bindings call (views for basic
  indices, then `index` / `index_put_`, `copy_` or `fill_`).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# Ops that copy a value to the host, or whose output shape depends on tensor values.
HOST_READS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.equal.default,
    aten.is_nonzero.default, aten.repeat_interleave.Tensor, aten.masked_scatter.default,
}
_INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)


class HostReads(TorchDispatchMode):
    """Records every op dispatched while active; `forbidden` lists the HOST_READS among them whose
    tensors are on `device` (any device when None), and every op indexing with a boolean mask (which
    needs a nonzero of the mask)."""

    def __init__(self, device: str | None = None):
        super().__init__()
        self.device = device
        self.ops, self.forbidden = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        watched = self.device is None or any(t.device.type == self.device for t in tensors)
        boolean_index = func in _INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if watched and (func in HOST_READS or boolean_index):
            self.forbidden.append(func)
        return self.run(func, args, kwargs, tensors)

    def run(self, func, args, kwargs, tensors):
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Copy:
    """One copy between host and device."""

    upload: bool  # host to device (else device to host)
    non_blocking: bool
    pinned: bool  # the host side is pinned memory
    contiguous: bool  # both sides are
    numel: int

    @property
    def syncs(self) -> bool:
        """Whether the host waits for the device: PyTorch synchronizes the stream after a blocking
        copy, and CUDA completes a copy to pageable host memory before returning."""
        return not self.non_blocking or not self.upload and not self.pinned


class FakeCuda(HostReads):
    """Fake `cuda` tensors, real host tensors, and the audit of what passes between them (see the module
    docstring). Use as a context manager; `syncs` counts host syncs, `copies` lists the copies."""

    def __init__(self):
        super().__init__("cuda")
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.copies: list[Copy] = []
        self.explicit_syncs = 0  # event, stream and device synchronize calls
        # in order: ("replay",) a graph's replay, ("record", e) and ("wait", e) an event's record and
        # synchronize, ("sync",) any other host sync
        self.timeline: list[tuple] = []
        self.mixed: list = []
        self.casts: list[tuple[torch.dtype, torch.dtype, int]] = []  # (from, to, elements) on the device
        self._pinned: set[int] = set()  # storage addresses of memory allocated as pinned

    @property
    def syncs(self) -> int:
        return self.explicit_syncs + sum(c.syncs for c in self.copies) + len(self.forbidden)

    def pinned(self, t: torch.Tensor) -> bool:
        return not isinstance(t, FakeTensor) and t.untyped_storage().data_ptr() in self._pinned

    def __enter__(self):
        self._stack = _patched(self)
        self._stack.__enter__()
        self.fake.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.fake.__exit__(*exc)
        self._stack.__exit__(*exc)

    def run(self, func, args, kwargs, tensors):
        on_device = [t for t in tensors if isinstance(t, FakeTensor) and t.device.type == "cuda"]
        to = kwargs.get("device")
        if func is aten._to_copy.default and on_device and kwargs.get("dtype") not in (None, args[0].dtype):
            self.casts.append((args[0].dtype, kwargs["dtype"], args[0].numel()))
        if func is aten.is_pinned.default:
            return self.pinned(args[0])
        if func is aten._pin_memory.default:
            with unset_fake_temporarily():
                out = args[0].clone()
            self._pinned.add(out.untyped_storage().data_ptr())
            return out
        if func is aten._to_copy.default and on_device and to is not None and torch.device(to).type == "cpu":
            return self._download(args[0], kwargs)
        if func is aten.copy_.default and on_device and not isinstance(args[0], FakeTensor):
            return self._download_into(args[0], args[1], bool(args[2]) if len(args) > 2 else False)
        if func is aten._to_copy.default and not on_device and to is not None and torch.device(to).type == "cuda":
            self._record(True, args[0], args[0], kwargs.get("non_blocking", False))
        elif func is aten.copy_.default and on_device and args[1].device.type == "cpu":
            self._record(True, args[1], args[0], bool(args[2]) if len(args) > 2 else False)
        elif on_device and func not in (aten.copy_.default, aten._to_copy.default):
            host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
            if host:
                self.mixed.append(func)
                raise RuntimeError(f"{func} mixes cuda tensors with host tensors of shapes "
                                   f"{[tuple(t.shape) for t in host]}: an implicit upload")
        if on_device or (to is not None and torch.device(to).type == "cuda") or any(
                isinstance(t, FakeTensor) for t in tensors):
            return func(*args, **kwargs)
        pin = kwargs.pop("pin_memory", None)
        with unset_fake_temporarily():
            out = func(*args, **kwargs)
        if pin:
            self._pinned.add(out.untyped_storage().data_ptr())
        return out

    def _record(self, upload: bool, host: torch.Tensor, other: torch.Tensor, non_blocking: bool) -> None:
        self._copied(Copy(upload, non_blocking, self.pinned(host), host.is_contiguous() and other.is_contiguous(),
                          host.numel()))

    def _copied(self, copy: Copy) -> None:
        self.copies.append(copy)
        if copy.syncs:
            self.timeline.append(("sync",))

    def _download(self, source: torch.Tensor, kwargs: dict) -> torch.Tensor:
        non_blocking = kwargs.get("non_blocking", False)
        with unset_fake_temporarily():
            out = torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
        # PyTorch stages a non-blocking download in pinned memory
        self._copied(Copy(False, non_blocking, non_blocking, source.is_contiguous(), source.numel()))
        return out

    def _download_into(self, target: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        self._record(False, target, source, non_blocking)
        with unset_fake_temporarily():
            target.zero_()
        return target


@contextmanager
def _patched(audit: FakeCuda):
    made = itertools.count()

    class Event:
        def __init__(self, *args, **kwargs):
            self.n = next(made)

        def record(self, stream=None):
            audit.timeline.append(("record", self.n))

        def query(self) -> bool:
            return True

        def wait(self, stream=None):
            pass

        def synchronize(self):
            audit.explicit_syncs += 1
            audit.timeline.append(("wait", self.n))

    class Stream(Event):
        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

    class Graph:
        def replay(self):
            audit.timeline.append(("replay",))

        def pool(self):
            return None

    @contextmanager
    def passthrough(*args, **kwargs):
        yield

    def synchronize(device=None):
        audit.explicit_syncs += 1
        audit.timeline.append(("sync",))

    def copy_(self, src, non_blocking=False):
        return aten.copy_.default(self, src, non_blocking)

    cuda = torch.cuda
    with mock.patch.object(cuda, "Event", Event), mock.patch.object(cuda, "Stream", Stream), \
            mock.patch.object(cuda, "current_stream", lambda device=None: Stream()), \
            mock.patch.object(cuda, "stream", passthrough), mock.patch.object(cuda, "graph", passthrough), \
            mock.patch.object(cuda, "CUDAGraph", Graph), mock.patch.object(cuda, "synchronize", synchronize), \
            mock.patch.object(torch.Tensor, "copy_", copy_), mock.patch.object(torch.Tensor, "__setitem__", _setitem), \
            mock.patch.object(torch.Tensor, "__getitem__", _getitem), \
            mock.patch.object(torch.Tensor, "__invert__", lambda self: aten.bitwise_not.default(self)), \
            mock.patch.object(torch.Tensor, "item", lambda self: aten._local_scalar_dense.default(self)):
        yield


def _indexed(self: torch.Tensor, index) -> tuple[torch.Tensor, list]:
    """What PyTorch's indexing binding computes: the view the basic indices (ints, slices, None,
    Ellipsis) give, and the tensor indices over that view's dims (None where sliced)."""
    index = index if isinstance(index, tuple) else (index,)
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                   for i in index if i is not None and i is not Ellipsis)
    view, dim, indices = self, 0, []
    for i in index:
        if i is Ellipsis:
            skipped = self.dim() - consumed
            indices += [None] * skipped
            dim += skipped
        elif i is None:
            view = view.unsqueeze(dim)
            indices.append(None)
            dim += 1
        elif isinstance(i, bool) or not isinstance(i, (int, slice, torch.Tensor, list, tuple)):
            raise TypeError(f"unsupported index {i!r}")
        elif isinstance(i, int):
            view = view.select(dim, i)
        elif isinstance(i, slice):
            view = aten.slice.Tensor(view, dim, i.start, i.stop, 1 if i.step is None else i.step)
            indices.append(None)
            dim += 1
        else:
            tensor = i if isinstance(i, torch.Tensor) else torch.tensor(i)
            indices.append(tensor)
            dim += tensor.dim() if tensor.dtype == torch.bool else 1
    while indices and indices[-1] is None:
        indices.pop()
    return view, indices


def _getitem(self: torch.Tensor, index) -> torch.Tensor:
    view, indices = _indexed(self, index)
    return aten.index.Tensor(view, indices) if indices else aten.alias.default(view) if view is self else view


def _setitem(self: torch.Tensor, index, value) -> None:
    view, indices = _indexed(self, index)
    if not isinstance(value, torch.Tensor):
        if not indices:
            aten.fill_.Scalar(view, value)
            return
        value = torch.tensor(value, dtype=self.dtype)
    if indices:
        aten.index_put_.default(view, indices, value)
    else:
        aten.copy_.default(view, value)
