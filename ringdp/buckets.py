"""Buckets: how RingDDP groups gradients for reduction, and what hooks and observers see.

Buckets. Gradients are grouped by dtype and device in reverse parameter order (the order
backward usually produces them), each bucket up to `cap_bytes` (the first of each kind up
to `first_cap_bytes`, so communication starts early). Storage: one arena per dtype and
device from ``ringdp.empty`` (registered memory: the reduction needs no staging copy),
buckets at aligned offsets inside it. With ``gradient_as_bucket_view`` the parameters'
``.grad`` are views into the buckets.

Reduced in .grad. Without bucket views and without a comm hook, a gradient of at least
``in_grad_min_bytes`` (RINGDP_DDP_IN_GRAD_MIN_BYTES, ringdp/policy.py IN_GRAD_MIN_BYTES)
gets a bucket of its own that is reduced in the parameter's ``.grad`` itself: ringdp stages
it through its transport on its worker thread, instead of the backward copying it into a
bucket and the end of backward copying it back. Such a bucket gets storage only when it
needs it (an unused parameter, a join shadow). -1 turns it off.

Complex parameters. As in torch's DDP, a complex parameter's gradient is held, reduced and
shown to hooks as its real view (``torch.view_as_real``: the last dimension of 2 holds the
real and imaginary parts): its bucket is of the real dtype and never shared with real
parameters, and the parameter's ``.grad`` stays complex (``stored`` and ``as_grad_of``).

Observers. An :class:`Observer` is told what happens (ready, launch, done, wait, finalize);
it records and never changes what the Reducer does (ringdp.trace.DDPTrace writes the Chrome
trace).

The Reducer (ringdp/reducer.py) drives them through a backward pass.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["Bucket", "GradBucket", "Observer", "as_future", "as_grad_of", "assign_buckets", "future_tensor", "now_us",
           "stored", "stored_dtype", "stored_shape", "stored_strides"]

ALIGN_BYTES = 256  # bucket starts inside an arena are aligned to this


def stored(t: torch.Tensor) -> torch.Tensor:
    """A gradient as its bucket holds it: a complex one as its real view (module doc)."""
    return torch.view_as_real(t) if t.is_complex() else t


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """A bucket's dtype for gradients of `dtype` (complex: the real one)."""
    return dtype.to_real() if dtype.is_complex else dtype


def stored_shape(p: torch.Tensor) -> torch.Size:
    """The shape of parameter p's slot in its bucket (a complex one's real view)."""
    return p.shape + (2,) if p.is_complex() else p.shape


def stored_strides(p: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of parameter p's slot in its bucket: p's own (as stored) when its elements
    lie dense in memory in some order of its dimensions (contiguous, channels_last, a
    transposed weight), as torch's reducer lays its bucket views out, since autograd's
    gradients follow the parameter's layout: they copy in as one run, and a bucket-view
    .grad keeps it. None (row-major) for a parameter with gaps or overlaps."""
    st = stored(p.detach())
    expect = 1
    for stride, size in sorted((st_, sz) for st_, sz in zip(st.stride(), st.shape) if sz != 1):
        if stride != expect:
            return None
        expect *= size
    return tuple(st.stride())


def as_grad_of(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A bucket's slot (or a copy of it) as parameter p's .grad: complex again for a complex p."""
    return torch.view_as_complex(view) if p.is_complex() else view


def now_us() -> float:
    """Microseconds on the monotonic clock shared by the machine's processes."""
    return time.perf_counter_ns() / 1000.0


def assign_buckets(order: list[int], nbytes: list[int], keys: list[Any], cap_bytes: int,
                   first_cap_bytes: int, in_grad_bytes: int | None = None) -> list[list[int]]:
    """Group the tensors `order` (indices, in the order they should fill buckets) into
    buckets of one key (dtype, device) each. A bucket is closed once it holds at least
    its limit (so a tensor larger than the cap gets a bucket of its own); the first bucket
    of each key has limit `first_cap_bytes`, the others `cap_bytes`. With `in_grad_bytes`,
    a tensor of at least that size (reduced in its .grad) closes the open bucket of its key
    and takes a bucket of its own. Buckets come back ordered by the position of their
    first tensor in `order`."""
    open_: dict[Any, tuple[list[int], int, int]] = {}
    closed_count: dict[Any, int] = {}
    done: list[tuple[int, list[int]]] = []

    def close(k, members, first):
        done.append((first, members))
        closed_count[k] = closed_count.get(k, 0) + 1
        open_.pop(k, None)

    for pos, i in enumerate(order):
        k = keys[i]
        if in_grad_bytes is not None and nbytes[i] >= in_grad_bytes:
            if k in open_:
                members, _size, first = open_[k]
                close(k, members, first)
            close(k, [i], pos)
            continue
        members, size, first = open_.get(k, ([], 0, pos))
        members.append(i)
        size += nbytes[i]
        limit = first_cap_bytes if closed_count.get(k, 0) == 0 else cap_bytes
        if size >= limit:
            close(k, members, first)
        else:
            open_[k] = (members, size, first)
    for members, _size, first in open_.values():
        done.append((first, members))
    done.sort(key=lambda t: t[0])
    return [m for _, m in done]


class Bucket:
    """One bucket: a contiguous slice of a registered arena and views of its parameters.
    An in-grad bucket (a single large gradient, normally reduced in its own .grad) gets its
    storage only when it needs it."""

    def __init__(self, index: int, params: list[int], shapes: list[torch.Size], dtype: torch.dtype,
                 device: torch.device, storage: torch.Tensor | None = None,
                 alloc: Callable[[], torch.Tensor] | None = None, in_grad: bool = False,
                 strides: list[tuple[int, ...] | None] | None = None):
        self.index = index
        self.params = params  # parameter indices, in bucket order
        self.shapes = shapes
        self.strides = strides or [None] * len(shapes)  # each slot's (stored_strides; None: row-major)
        self.numels = [s.numel() for s in shapes]
        self.offsets = [sum(self.numels[:k]) for k in range(len(shapes))]
        self.dtype = dtype
        self.device = device
        self.numel = sum(self.numels)
        self.nbytes = self.numel * torch.empty((), dtype=dtype).element_size()
        self.in_grad = in_grad
        self._storage = storage
        self._alloc = alloc
        self._views: list[torch.Tensor] | None = None
        self.workspaces: dict[torch.dtype, torch.Tensor] = {}
        self.reset()

    @property
    def has_storage(self) -> bool:
        return self._storage is not None

    @property
    def buffer(self) -> torch.Tensor:
        if self._storage is None:
            self._storage = self._alloc()
        return self._storage

    @property
    def views(self) -> list[torch.Tensor]:
        if self._views is None:
            buf = self.buffer
            self._views = [buf[o:o + n].view(s) if st is None else buf.as_strided(s, st, buf.storage_offset() + o)
                           for o, n, s, st in zip(self.offsets, self.numels, self.shapes, self.strides)]
        return self._views

    def reset(self) -> None:
        """Per-backward state."""
        self.pending = len(self.params)  # gradients still to arrive
        self.future: torch.futures.Future | None = None  # the running reduction
        self.target: torch.Tensor | None = None  # what it reduces
        self.grad: torch.Tensor | None = None  # the .grad reduced in place instead of the buffer


class GradBucket:
    """What a communication hook sees of a bucket (the subset of torch's GradBucket API).
    `params`: every parameter of the model (the bucket holds indices); `alloc(numel, dtype,
    device)`: registered memory for workspaces."""

    def __init__(self, bucket: Bucket, is_last: bool, params: list[nn.Parameter], group,
                 alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor]):
        self._b = bucket
        self._is_last = is_last
        self._params = params
        self._group = group
        self._alloc = alloc

    def index(self) -> int:
        return self._b.index

    def buffer(self) -> torch.Tensor:
        """The flat bucket (registered memory): local summed gradients, reduced in place."""
        return self._b.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._b.buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's part of the buffer, row-major in its shape whatever its slot's
        layout, as torch's GradBucket gives them (hooks such as PowerSGD .view() them)."""
        b = self._b
        buf = b.buffer
        return [buf[o:o + n].view(s) for o, n, s in zip(b.offsets, b.numels, b.shapes)]

    def parameters(self) -> list[nn.Parameter]:
        return [self._params[i] for i in self._b.params]

    def is_last(self) -> bool:
        return self._is_last

    @property
    def process_group(self):
        return self._group

    def workspace(self, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of the bucket's length in `dtype`, in registered memory when the
        device has it; allocated once per bucket and dtype (for compression hooks)."""
        ws = self._b.workspaces.get(dtype)
        if ws is None:
            ws = self._alloc(self._b.numel, dtype, self._b.device)
            self._b.workspaces[dtype] = ws
        return ws


class Observer:
    """What a Reducer reports about each synchronised backward `step` (times in microseconds
    from now_us()). Observers record; they never change what the Reducer does. on_done may
    be called from ringdp's worker thread, and after the wait for that bucket returned
    (on_wait's t_done is then the better figure)."""

    def on_forward(self, t_start: float, t_end: float, outputs) -> None:
        """RingDDP's forward ran (reported by RingDDP, not by the Reducer)."""

    def on_backward(self, step: int, t: float) -> None:
        """The first gradient of a synchronised backward arrived."""

    def on_ready(self, step: int, bucket: Bucket, t: float) -> None:
        """The bucket's last gradient arrived."""

    def on_launch(self, step: int, bucket: Bucket, t: float) -> None:
        """The bucket's reduction was submitted."""

    def on_done(self, step: int, bucket: Bucket, t: float) -> None:
        """The bucket's reduction finished."""

    def on_wait(self, step: int, bucket: Bucket, t_wait: float, t_done: float, t_written: float) -> None:
        """finalize() waited for the bucket from t_wait to t_done, wrote it back by t_written."""

    def on_finalize(self, step: int, buckets: list[Bucket], t_bwd_end: float, t_end: float,
                    exposed_us: float, writeback_us: float) -> None:
        """The backward ended: autograd finished at t_bwd_end, finalize() at t_end."""


def as_future(result, buffer: torch.Tensor) -> torch.futures.Future:
    """A comm hook's result as the one future contract: a torch.futures.Future whose value
    is the reduced tensor (or a list/tuple holding it first). Accepts a Future, a Work with
    get_future() (torch.distributed's, ringdp's), or None (the buffer is already reduced)."""
    if isinstance(result, torch._C.Future):  # torch.futures.Future, and what its then() returns
        return result
    if result is None:
        fut = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    get = getattr(result, "get_future", None)
    if callable(get):
        return get()
    raise TypeError(f"a RingDDP comm hook must return a torch.futures.Future (or a Work with get_future()), "
                    f"got {type(result).__name__}")


def future_tensor(fut: torch.futures.Future, target: torch.Tensor) -> torch.Tensor:
    """Wait for `fut`; the tensor holding the result (`target` when the value names none)."""
    res = fut.wait()
    if isinstance(res, (list, tuple)):
        res = res[0] if len(res) else None
    return res if isinstance(res, torch.Tensor) else target
