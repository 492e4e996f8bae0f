"""RingDDP: a drop-in replacement for torch's DistributedDataParallel whose gradient
all-reduce runs on ringdp, bucketed and overlapped with the backward pass.

    model = ringdp.RingDDP(net)            # instead of DistributedDataParallel(net)
    loss = loss_fn(model(x), y)
    loss.backward()                         # gradients are averaged when this returns
    opt.step()

How it works
------------
* Gradients are grouped into buckets by dtype and device, in reverse parameter order (the
  order backward usually produces them), each up to ``bucket_cap_mb`` (default 25 MiB, with
  a 1 MiB first bucket so communication starts early). After the first synchronised
  backward the buckets are rebuilt once in the order the gradients actually became ready;
  rank 0's order is broadcast so that every rank has the same buckets.
* Bucket storage comes from ``ringdp.empty`` (registered shared memory), so the all-reduce
  of a bucket needs no staging copy. With ``gradient_as_bucket_view=True`` the parameters'
  ``.grad`` are views into the buckets, which also saves the copy back out of them.
* A post-accumulate-grad hook per parameter copies the fresh gradient into its bucket;
  when a bucket is complete and every lower-indexed bucket has started, its all-reduce
  (ReduceOp.AVG: the division is fused into the reduction) is submitted to ringdp's
  background worker while autograd carries on. Buckets start strictly in index order on
  every rank.
* Exception, for speed: without bucket views and without a comm hook, a gradient of at
  least DIRECT_MIN_BYTES (1 MiB) gets a bucket of its own and is reduced in place in
  ``.grad``. ringdp then stages it through its transport on its worker thread, instead of
  the hook copying it into the bucket on the backward's critical path and the end of
  backward copying it back (measured on the 2-core CI machine, world 2, 4x
  Linear(2560, 2560): ~90 ms per step with it vs ~100-110 ms through the buckets).
  RINGDP_DDP_DIRECT_MIN_BYTES=-1 turns it off.
* An end-of-backward autograd callback waits for the outstanding all-reduces in bucket
  order and writes each bucket's averaged gradients into ``.grad`` as soon as it is done
  (while later buckets are still being reduced), before ``backward()`` returns.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook, Joinable, _JoinConfig
from torch.utils._pytree import tree_leaves

import ringdp


def _now_us() -> float:
    """Microseconds on the monotonic clock shared by the machine's processes (as
    ringdp.trace.now_us; ringdp.trace itself is imported only when tracing)."""
    return time.perf_counter_ns() / 1000.0


__all__ = ["RingDDP", "GradBucket", "assign_buckets"]

_MiB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_MB = 1
_ALIGN_BYTES = 256  # bucket starts inside an arena are aligned to this
# A bucket holding a single gradient at least this large is, when .grad are not bucket
# views and no comm hook is set, reduced in place in .grad: ringdp then stages it through
# its transport on the worker thread, off the backward's critical path, instead of the
# hook copying it into the bucket and the end of backward copying it back.
# RINGDP_DDP_DIRECT_MIN_BYTES overrides it (-1: never).
DIRECT_MIN_BYTES = 1 << 20


def _ring_error(msg: str) -> Exception:
    cls = getattr(ringdp, "RingError", RuntimeError)
    try:
        return cls(msg)
    except Exception:  # a native exception type that cannot be built from Python
        return RuntimeError(msg)


def assign_buckets(order: list[int], nbytes: list[int], keys: list[Any], cap_bytes: int,
                   first_cap_bytes: int, solo_bytes: int | None = None) -> list[list[int]]:
    """Group the tensors `order` (indices, in the order they should fill buckets) into
    buckets of one key (dtype, device) each. A bucket is closed once it holds at least
    its limit (so a tensor larger than the cap gets a bucket of its own); the first bucket
    of each key has limit `first_cap_bytes`, the others `cap_bytes`. With `solo_bytes`, a
    tensor of at least that size closes the open bucket of its key and takes a bucket of
    its own. Buckets come back ordered by the position of their first tensor in `order`."""
    open_: dict[Any, tuple[list[int], int, int]] = {}
    closed_count: dict[Any, int] = {}
    done: list[tuple[int, list[int]]] = []

    def close(k, members, first):
        done.append((first, members))
        closed_count[k] = closed_count.get(k, 0) + 1
        open_.pop(k, None)

    for pos, i in enumerate(order):
        k = keys[i]
        if solo_bytes is not None and nbytes[i] >= solo_bytes:
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


class _Bucket:
    """One bucket: a contiguous slice of a registered arena and its parameters' views.
    A bucket whose gradient is normally reduced in place in .grad (direct_ok) gets its
    storage only when it needs it (an unused parameter, a join shadow, ...)."""

    def __init__(self, index: int, pidxs: list[int], params: list[nn.Parameter], buffer: torch.Tensor | None,
                 offsets: list[int], alloc: Callable[[], torch.Tensor] | None = None):
        self.index = index
        self.pidxs = pidxs
        self.offsets = offsets
        self._shapes = [params[i].shape for i in pidxs]
        self._numels = [params[i].numel() for i in pidxs]
        p0 = params[pidxs[0]]
        self.dtype = p0.dtype
        self.device = p0.device
        self.numel = sum(self._numels)
        self.nbytes = self.numel * p0.element_size()
        self._buffer = buffer
        self._views: list[torch.Tensor] | None = None
        self._alloc = alloc
        self.direct_ok = False  # set by RingDDP._build_buckets
        self.workspaces: dict[torch.dtype, torch.Tensor] = {}
        self.reset()

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = self._alloc()
        return self._buffer

    @property
    def views(self) -> list[torch.Tensor]:
        if self._views is None:
            buf = self.buffer
            self._views = [buf[o:o + n].view(shape) for o, n, shape in zip(self.offsets, self._numels, self._shapes)]
        return self._views

    def reset(self):
        self.pending = len(self.pidxs)
        self.handle = None
        self.target: torch.Tensor | None = None  # what the running reduction works on
        self.done_event: threading.Event | None = None
        self.result = None
        self.error: BaseException | None = None
        self.t_ready = self.t_launch = self.t_done = None
        self.t_wait = None  # (wait start, wait end, write-back end) in finalize
        self.direct: torch.Tensor | None = None  # the .grad reduced in place instead of buffer


class GradBucket:
    """What a communication hook sees of a bucket (the subset of torch's GradBucket API)."""

    def __init__(self, ddp: "RingDDP", bucket: _Bucket, is_last: bool):
        self._ddp = ddp
        self._b = bucket
        self._is_last = is_last

    def index(self) -> int:
        return self._b.index

    def buffer(self) -> torch.Tensor:
        """The flat bucket (registered memory): local summed gradients, reduced in place."""
        return self._b.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._b.buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._b.views)

    def parameters(self) -> list[nn.Parameter]:
        return [self._ddp._params[i] for i in self._b.pidxs]

    def is_last(self) -> bool:
        return self._is_last

    @property
    def process_group(self):
        return self._ddp.process_group

    def workspace(self, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of the bucket's length in `dtype`, in registered memory when the
        device has it; allocated once per bucket and dtype (for compression hooks)."""
        ws = self._b.workspaces.get(dtype)
        if ws is None:
            ws = self._ddp._alloc(self._b.numel, dtype, self._b.device)
            self._b.workspaces[dtype] = ws
        return ws


def _wait_handle(handle, buffer: torch.Tensor) -> torch.Tensor:
    """Wait for a hook's (or ringdp's) handle; return the tensor holding the result."""
    if handle is None:
        return buffer
    res = handle.wait()
    if isinstance(res, (list, tuple)):
        res = res[0] if len(res) else None
    return res if isinstance(res, torch.Tensor) else buffer


class _JoinHookImpl(JoinHook):
    def __init__(self, ddp: "RingDDP", divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._join_shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._join_finish(is_last_joiner)


class RingDDP(nn.Module, Joinable):
    """DistributedDataParallel on ringdp. Arguments mean what they mean for
    :class:`torch.nn.parallel.DistributedDataParallel`.

    Args:
        module: the model (already on its device); the same model on every rank.
        device_ids: for a single-device CUDA module, ``[device]`` (inputs are moved there);
            None for CPU modules.
        output_device: accepted for compatibility (single-device modules only).
        broadcast_buffers: broadcast the module's buffers from rank 0 before each forward.
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: bucket size in MiB; None means 25 MiB with a 1 MiB first bucket, a
            number means that cap for every bucket.
        find_unused_parameters: find, after each forward, the parameters that do not take
            part in the loss, and mark them ready (their gradient is zero in the average;
            a parameter unused on every rank keeps ``.grad`` None).
        gradient_as_bucket_view: make ``.grad`` views into the buckets (saves a copy in and
            a copy out per step and the gradients' memory).
        static_graph: the set of used parameters is the same every iteration: it is found
            once, in the first iteration, and reused.
        trace: a path for a Chrome trace of this rank's backward passes (default: the
            ``RINGDP_TRACE`` environment variable); see :mod:`ringdp.trace`.
        overlap: start each bucket's all-reduce as soon as it is complete (default; else
            all of them at the end of backward, to measure what overlap brings). The
            environment variable ``RINGDP_DDP_OVERLAP=0`` sets the default to False.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, broadcast_buffers: bool = True,
                 process_group=None, bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, *, trace=None,
                 overlap: bool | None = None):
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("RingDDP needs torch.distributed to be initialised first: call "
                               "torch.distributed.init_process_group(...) (torchrun sets its environment)")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError("RingDDP: the module has no parameter that requires a gradient")
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        devices = {p.device for p in self._params}
        if len(devices) > 1 and device_ids:
            raise ValueError(f"RingDDP: device_ids is for single-device modules; the module spans {sorted(map(str, devices))}")
        if device_ids is not None:
            if len(device_ids) != 1:
                raise ValueError("RingDDP supports single-device modules: device_ids must be None or [device]")
            if next(iter(devices)).type == "cpu":
                raise ValueError("RingDDP: device_ids must be None for CPU modules (as for torch DDP)")
        self.device_ids = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
                           for d in device_ids] if device_ids else None
        self.output_device = output_device
        self._device = next(iter(devices))

        self._direct_min_bytes = int(os.environ.get("RINGDP_DDP_DIRECT_MIN_BYTES", DIRECT_MIN_BYTES))
        if bucket_cap_mb is None:
            self._cap_bytes = DEFAULT_BUCKET_CAP_MB * _MiB
            self._first_cap_bytes = DEFAULT_FIRST_BUCKET_MB * _MiB
        else:
            self._cap_bytes = self._first_cap_bytes = max(1, int(bucket_cap_mb * _MiB))

        # start-up: ringdp communicator (collective), same model everywhere, rank 0's state
        if self.world_size > 1:
            ringdp.init(process_group)
        self._verify_same_model()
        self._broadcast_state(src=0)

        # per-iteration state
        self._pidx_of = {id(p): i for i, p in enumerate(self._params)}
        self._nbytes = [p.numel() * p.element_size() for p in self._params]
        self._keys = [(p.dtype, p.device) for p in self._params]
        self._buckets: list[_Bucket] = []
        self._loc: list[tuple[_Bucket, int]] = []
        self._arenas: list[torch.Tensor] = []
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._rebuilt = False
        self._ready = [False] * len(self._params)
        self._ready_order: list[int] = []
        self._next_launch = 0
        self._in_backward = False
        self._sync_this_backward = False
        self._divisor = self.world_size
        self._comm_hook: Callable | None = None
        self._set_scale()
        self._auth_rank = 0
        self._divide_by_initial_world_size = True
        self._unused: list[int] = []  # locally unused in the latest forward
        self._static_unused: set[int] | None = None  # globally unused, for static_graph
        self._static_unused_local: list[int] = []  # locally unused, for static_graph
        self._usage = None
        self._usage_handle = None
        self._comm_state = None
        self._control = None
        self._step = 0
        self._t_fwd = (None, None)
        self._t_bwd_start = None
        self.last_exposed_comm_ms: float | None = None

        if overlap is None:
            overlap = os.environ.get("RINGDP_DDP_OVERLAP", "1").strip().lower() not in ("0", "false", "no", "off")
        self.overlap = bool(overlap)
        trace = os.environ.get("RINGDP_TRACE") if trace is None else trace
        self._tracer = None
        if trace:
            from . import trace as _trace

            self._tracer = _trace.Tracer(trace, self.rank, self.world_size)

        self._hook_handles = []
        selfref = weakref.ref(self)
        for i, p in enumerate(self._params):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_grad_hook(selfref, i)))

    # ------------------------------------------------------------------ properties
    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in bucket (= reduction) order."""
        return [[self._param_names[i] for i in b.pidxs] for b in self._buckets]

    # ------------------------------------------------------------------ start-up
    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None or self.process_group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _signature(self) -> list[tuple]:
        sig = [("parameter", n, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
               for n, p in self.module.named_parameters()]
        sig += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in self.module.named_buffers()]
        return sig

    def _verify_same_model(self) -> None:
        """Every rank must hold the same parameters and buffers (names, shapes, dtypes, in
        order): compare a digest first, and the full lists only when digests differ."""
        if self.world_size == 1:
            return
        sig = self._signature()
        digest = (len(sig), hashlib.sha256(repr(sig).encode()).hexdigest())
        digests: list = [None] * self.world_size
        dist.all_gather_object(digests, digest, group=self.process_group)
        if all(d == digests[0] for d in digests):
            return
        sigs: list = [None] * self.world_size
        dist.all_gather_object(sigs, sig, group=self.process_group)
        ref = sigs[0]
        for r in range(1, self.world_size):
            other = sigs[r]
            if other == ref:
                continue
            for i in range(max(len(ref), len(other))):
                a = ref[i] if i < len(ref) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    raise _ring_error(
                        f"RingDDP: the model on rank {r} differs from rank 0's at entry #{i}: "
                        f"rank 0 has {_describe(a)}, rank {r} has {_describe(b)}. Every rank must "
                        f"build the same model (same parameters and buffers, same shapes and dtypes, "
                        f"same order) before wrapping it in RingDDP. (seen from rank {self.rank})")

    @torch.no_grad()
    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcast `tensors` from group rank `src` through torch.distributed, coalesced
        into one flat tensor per dtype and device (at most ~256 MiB each)."""
        if self.world_size == 1 or not tensors:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        limit = 256 * _MiB
        gsrc = self._global_rank(src)
        for ts in groups.values():
            chunk, size = [], 0
            for t in ts + [None]:
                if t is not None:
                    chunk.append(t)
                    size += t.numel() * t.element_size()
                if chunk and (t is None or size >= limit):
                    flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                    dist.broadcast(flat, src=gsrc, group=self.process_group)
                    if self.rank != src:
                        o = 0
                        for c in chunk:
                            c.copy_(flat[o:o + c.numel()].view_as(c))
                            o += c.numel()
                    chunk, size = [], 0

    def _broadcast_state(self, src: int) -> None:
        self._broadcast_tensors(list(self.module.parameters()) + list(self.module.buffers()), src)

    def _sync_buffers(self, src: int) -> None:
        bufs = list(self.module.buffers())
        if bufs:
            self._broadcast_tensors(bufs, src)

    # ------------------------------------------------------------------ buckets
    def _alloc(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor in ringdp's registered memory (plain memory when there is no
        communication or the device has no registered memory)."""
        if self.world_size > 1:
            try:
                return ringdp.empty(numel, dtype=dtype, device=device, group=self.process_group)
            except ValueError as e:
                if not getattr(self, "_warned_alloc", False):
                    warnings.warn(f"RingDDP: no registered memory ({e}); buckets use ordinary memory", stacklevel=3)
                    self._warned_alloc = True
        return torch.empty(numel, dtype=dtype, device=device)

    def _solo_bytes(self) -> int | None:
        """Gradients reduced in place in .grad get buckets of their own (see
        DIRECT_MIN_BYTES); not with bucket views, where .grad must live in a bucket."""
        if self.gradient_as_bucket_view or self._direct_min_bytes < 0 or self.world_size == 1:
            return None
        return self._direct_min_bytes

    @torch.no_grad()
    def _build_buckets(self, order: list[int]) -> None:
        assignment = assign_buckets(order, self._nbytes, self._keys, self._cap_bytes, self._first_cap_bytes,
                                    self._solo_bytes())
        old_loc = self._loc
        # one arena per (dtype, device), buckets at aligned offsets inside it
        per_key: dict[tuple, list[int]] = {}
        for bi, pidxs in enumerate(assignment):
            per_key.setdefault(self._keys[pidxs[0]], []).append(bi)
        solo = self._solo_bytes()
        direct_ok = [solo is not None and len(pidxs) == 1 and self._nbytes[pidxs[0]] >= solo
                     for pidxs in assignment]
        layout: dict[int, tuple[tuple, int, list[int], int]] = {}
        arenas: dict[tuple, torch.Tensor] = {}
        for key, bis in per_key.items():
            dtype, _device = key
            esize = torch.empty((), dtype=dtype).element_size()
            align = max(1, _ALIGN_BYTES // esize)
            total = 0
            for bi in bis:
                offs, o = [], 0
                for i in assignment[bi]:
                    offs.append(o)
                    o += self._params[i].numel()
                layout[bi] = (key, total, offs, o)
                if not direct_ok[bi]:
                    total += (o + align - 1) // align * align
            # no zeroing: every slot is written (gradient or zeros) before each reduction
            if total:
                arenas[key] = self._alloc(total, dtype, key[1])
        buckets = []
        for bi, pidxs in enumerate(assignment):
            key, start, offs, n = layout[bi]
            if direct_ok[bi]:
                dtype, device = key
                b = _Bucket(bi, pidxs, self._params, None, offs,
                            alloc=lambda n=n, dtype=dtype, device=device: self._alloc(n, dtype, device))
                b.direct_ok = True
            else:
                b = _Bucket(bi, pidxs, self._params, arenas[key][start:start + n], offs)
            buckets.append(b)
        loc: list = [None] * len(self._params)
        for b in buckets:
            for slot, i in enumerate(b.pidxs):
                loc[i] = (b, slot)
        if self.gradient_as_bucket_view and old_loc:
            for i, p in enumerate(self._params):
                ob, oslot = old_loc[i]
                if p.grad is not None and _same_view(p.grad, ob.views[oslot]):
                    nb, nslot = loc[i]
                    nb.views[nslot].copy_(p.grad)
                    p.grad = nb.views[nslot]
        self._buckets = buckets
        self._loc = loc
        self._arenas = list(arenas.values())

    def _rebuild_buckets(self, src: int) -> None:
        """Adopt rank `src`'s gradient-ready order of the first synchronised backward."""
        self._rebuilt = True
        obj = [list(self._ready_order) if self.rank == src else None]
        if self.world_size > 1:
            dist.broadcast_object_list(obj, src=self._global_rank(src), group=self.process_group)
        order = [int(i) for i in (obj[0] or [])]
        seen = set()
        order = [i for i in order if 0 <= i < len(self._params) and not (i in seen or seen.add(i))]
        order += [i for i in reversed(range(len(self._params))) if i not in seen]
        current = [b.pidxs for b in self._buckets]
        new = assign_buckets(order, self._nbytes, self._keys, self._cap_bytes, self._first_cap_bytes,
                                    self._solo_bytes())
        if new != current:
            self._build_buckets(order)

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs, **kwargs):
        tr = self._tracer
        t0 = _now_us() if tr else None
        if self._in_backward:  # the previous backward died before its end (an exception)
            self._abandon_backward()
        if self._join_config.enable:
            self._join_pre_forward()
        else:
            self._divisor = self.world_size
            self._auth_rank = 0
        if self.broadcast_buffers and self.require_forward_param_sync:
            self._sync_buffers(self._auth_rank)
        self._set_scale()
        self._sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), self.device_ids[0])
        out = self.module(*inputs, **kwargs)
        # as torch DDP: buffers are synchronised before a forward that follows a forward
        # whose gradients were synchronised
        self.require_forward_param_sync = self._sync_this_backward
        if self._sync_this_backward and self._tracks_unused():
            self._unused = self._find_unused(out)
        if tr is not None:
            self._t_fwd = (t0, _now_us())
            if torch.is_grad_enabled():
                self._t_bwd_start = None
                selfref = weakref.ref(self)
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(_make_bwd_start_hook(selfref))
        return out

    def _tracks_unused(self) -> bool:
        """Whether this iteration finds and all-reduces parameter usage."""
        return self.find_unused_parameters or (self.static_graph and self._static_unused is None)

    def _find_unused(self, out) -> list[int]:
        """Indices of parameters not reachable from the outputs' autograd graph."""
        used: set[int] = set()
        seen = set()
        stack = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if t.grad_fn is None:
                    used.add(id(t))
                else:
                    stack.append(t.grad_fn)
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None:
                used.add(id(var))
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    stack.append(nxt)
        return [i for i, p in enumerate(self._params) if id(p) not in used]

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes whose forward ran inside accumulate locally."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """hook(state, bucket: GradBucket) -> handle; see ringdp.comm_hooks. Call before the
        first backward, at most once."""
        if self._comm_hook is not None:
            raise RuntimeError("RingDDP: register_comm_hook can only be called once")
        if not callable(hook):
            raise TypeError("RingDDP.register_comm_hook: hook must be callable")
        if self._step > 0:
            raise RuntimeError("RingDDP: register_comm_hook must be called before the first backward")
        self._comm_hook = hook
        self._comm_state = state
        self._set_scale()

    # ------------------------------------------------------------------ backward
    def _begin_backward(self) -> None:
        self._in_backward = True
        self._next_launch = 0
        for b in self._buckets:
            b.reset()
        self._ready = [False] * len(self._params)
        self._usage_handle = None
        torch.autograd.Variable._execution_engine.queue_callback(_make_finalize(weakref.ref(self)))
        if self._tracer is not None and self._t_bwd_start is None:
            self._t_bwd_start = _now_us()
        if self._tracks_unused():
            unused = self._unused
            if self._usage is None:
                self._usage = self._alloc(len(self._params), torch.int32, self._device)
            self._usage.fill_(1)
            if unused:
                self._usage[torch.tensor(unused, dtype=torch.long, device=self._usage.device)] = 0
            if self.world_size > 1:
                self._usage_handle = ringdp.all_reduce(self._usage, group=self.process_group, async_op=True)
            for i in unused:
                self._mark_ready(i, None)
        elif self._static_unused_local:
            for i in self._static_unused_local:
                self._mark_ready(i, None)

    @torch.no_grad()
    def _mark_ready(self, i: int, param: nn.Parameter | None) -> None:
        """Parameter i's gradient is final for this backward (param None: unused)."""
        if self._ready[i]:
            raise RuntimeError(
                f"RingDDP: parameter {self._param_names[i]!r} received its gradient twice in one backward "
                f"pass (reentrant backward, e.g. activation checkpointing with use_reentrant=True, or a "
                f"parameter shared between several RingDDP models); RingDDP supports one gradient per "
                f"parameter per backward")
        self._ready[i] = True
        if not self._rebuilt:
            self._ready_order.append(i)
        b, slot = self._loc[i]
        grad = None if param is None else param.grad
        scale = self._scale
        if (b.direct_ok and grad is not None and self._comm_hook is None and grad.layout == torch.strided
                and grad.is_contiguous() and grad.dtype == b.dtype and grad.device == b.device):
            if scale != 1.0:
                grad.mul_(scale)
            b.direct = grad  # reduced in place, nothing to copy in or back
        else:
            view = b.views[slot]
            if grad is None:
                view.zero_()
            elif self.gradient_as_bucket_view and _same_view(grad, view):
                if scale != 1.0:
                    view.mul_(scale)
            else:
                if scale != 1.0:
                    torch.mul(grad, scale, out=view)
                else:
                    view.copy_(grad)
                if self.gradient_as_bucket_view:
                    param.grad = view
        b.pending -= 1
        if b.pending == 0:
            if self._tracer is not None:
                b.t_ready = _now_us()
            if self.overlap:
                self._launch_ready()

    def _set_scale(self) -> None:
        """How gradients are averaged this iteration: by ringdp's AVG (the division is
        fused into the reduction) when dividing by the group size without a hook, else by a
        scale folded into the copy into the bucket (join with a smaller divisor); a comm
        hook gets the raw sums and divides itself."""
        self._use_avg = self._comm_hook is None and self._divisor == self.world_size
        self._scale = 1.0 if (self._comm_hook is not None or self._use_avg) else 1.0 / self._divisor

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            b = buckets[self._next_launch]
            self._next_launch += 1
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        tr = self._tracer
        if tr is not None:
            b.t_launch = _now_us()
        if self._comm_hook is not None:
            b.target = b.buffer
            b.handle = self._comm_hook(self._comm_state, GradBucket(self, b, b.index == len(self._buckets) - 1))
        elif self.world_size > 1:
            op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
            b.target = b.direct if b.direct is not None else b.buffer
            b.handle = ringdp.all_reduce(b.target, op=op, group=self.process_group, async_op=True)
        else:
            b.target = b.direct if b.direct is not None else b.buffer
            b.handle = None
        if tr is not None:
            _watch(b)

    def _wait_bucket(self, b: _Bucket) -> None:
        if b.done_event is not None:
            b.done_event.wait()
            if b.error is not None:
                raise b.error
            res = b.result
        else:
            res = _wait_handle(b.handle, b.target)
        if res is not b.target and res is not None:
            b.target.copy_(res.reshape(b.target.shape))
        b.handle = None

    def _finalize_backward(self) -> None:
        """End of backward (autograd callback): wait for the buckets in order and write
        each one's averaged gradients back as soon as it is done (while the next ones are
        still being reduced)."""
        now = _now_us
        t_bwd_end = now()
        tr = self._tracer
        try:
            self._launch_ready()  # without overlap nothing was launched yet
            if self._next_launch < len(self._buckets):
                missing = [i for i in range(len(self._params)) if not self._ready[i]]
                self._abandon_backward()
                raise RuntimeError(self._unused_message(missing))
            wait_us = 0.0
            wb_us = 0.0
            globally_unused: set[int] = set()
            if self._tracks_unused():
                if self._usage_handle is not None:  # submitted first, so done first
                    t0 = now()
                    self._usage_handle.wait()
                    wait_us += now() - t0
                    self._usage_handle = None
                globally_unused = {i for i, v in enumerate(self._usage.tolist()) if v == 0}
            elif self._static_unused:
                globally_unused = self._static_unused
            for b in self._buckets:
                t0 = now()
                self._wait_bucket(b)
                t1 = now()
                self._write_back(b, globally_unused)
                t2 = now()
                wait_us += t1 - t0
                wb_us += t2 - t1
                if tr is not None:
                    b.t_wait = (t0, t1, t2)
            if self.static_graph and self._static_unused is None:
                self._static_unused = globally_unused
                self._static_unused_local = list(self._unused)
            self.last_exposed_comm_ms = wait_us / 1e3
            if tr is not None:
                self._record_trace(t_bwd_end, now(), wait_us, wb_us)
            if not self._rebuilt:
                self._rebuild_buckets(self._auth_rank)
        finally:
            self._in_backward = False
            self._step += 1

    def _abandon_backward(self) -> None:
        for b in self._buckets[:self._next_launch]:
            with contextlib.suppress(Exception):
                self._wait_bucket(b)
        with contextlib.suppress(Exception):
            if self._usage_handle is not None:
                self._usage_handle.wait()
        self._usage_handle = None
        self._in_backward = False

    @torch.no_grad()
    def _write_back(self, b: _Bucket, globally_unused: set[int]) -> None:
        if b.direct is not None:  # the reduction ran on .grad itself
            b.direct = None
            return
        for slot, i in enumerate(b.pidxs):
            if i in globally_unused:
                continue
            p = self._params[i]
            view = b.views[slot]
            if self.gradient_as_bucket_view:
                if p.grad is None or not _same_view(p.grad, view):
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def _unused_message(self, missing: list[int]) -> str:
        names = ", ".join(self._param_names[i] for i in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        if self.find_unused_parameters or self.static_graph:
            why = ("These parameters were reachable from the forward outputs but received no gradient, "
                   "or were used without going through RingDDP's forward.")
        else:
            why = ("This usually means that your module has parameters that were not used in producing "
                   "the loss. Pass find_unused_parameters=True to RingDDP (as to torch's "
                   "DistributedDataParallel) to mark such parameters ready (their gradient then counts as "
                   "zero in the average), or make sure every parameter takes part in the loss. If the same "
                   "parameters are always unused, static_graph=True also works.")
        return (f"RingDDP on rank {self.rank}: backward finished but {len(missing)} parameter(s) received no "
                f"gradient, so their buckets (and every bucket after them) could not be reduced: {names}{more}. "
                f"{why}")

    def _record_trace(self, t_bwd_end: float, t_end: float, wait_us: float, wb_us: float) -> None:
        buckets = [{"index": b.index, "nbytes": b.nbytes, "params": len(b.pidxs), "t_ready": b.t_ready,
                    "t_launch": b.t_launch, "t_done": b.t_done, "t_wait": getattr(b, "t_wait", None)}
                   for b in self._buckets]
        t_start = self._t_bwd_start if self._t_bwd_start is not None else t_bwd_end
        self._tracer.record_step({"step": self._step, "t_fwd_start": self._t_fwd[0], "t_fwd_end": self._t_fwd[1],
                                  "t_bwd_start": t_start, "t_bwd_end": t_bwd_end, "t_end": t_end,
                                  "exposed_us": wait_us, "writeback_us": wb_us, "buckets": buckets})
        self._t_bwd_start = None

    def trace_summary(self) -> dict | None:
        """Exposed communication and overlap per traced step and on average (None when
        tracing is off)."""
        return self._tracer.summary() if self._tracer is not None else None

    def flush_trace(self):
        """Write the trace file now (it is also written at exit); returns its path."""
        return self._tracer.flush() if self._tracer is not None else None

    # ------------------------------------------------------------------ join
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs, as torch DDP's join(): ranks that ran out of
        data shadow the collectives of the others until all are done; then every rank
        takes the parameters of a rank that joined last. Gradients are divided by the
        initial world size (default) or by the number of ranks still training."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinHookImpl(self, kwargs.get("divide_by_initial_world_size", True))

    def _control_allreduce(self, active: bool) -> bool:
        """One small all-reduce per iteration inside join(): which ranks still train and
        whether they will synchronise gradients. Sets divisor and authoritative rank."""
        if self._control is None:
            self._control = self._alloc(self.world_size + 1, torch.int32, self._device)
        c = self._control
        c.zero_()
        if active:
            c[0] = int(torch.is_grad_enabled() and self.require_backward_grad_sync)
            c[1 + self.rank] = 1
        if self.world_size > 1:
            ringdp.all_reduce(c, group=self.process_group)
        vals = c.tolist()
        alive = [r for r in range(self.world_size) if vals[1 + r] > 0]
        self._auth_rank = max(alive) if alive else 0  # as torch DDP
        self._divisor = self.world_size if self._divide_by_initial_world_size else max(1, len(alive))
        self._set_scale()
        return vals[0] > 0

    def _join_pre_forward(self) -> None:
        work = Join.notify_join_context(self)
        self._control_allreduce(active=True)
        if work is not None:
            work.wait()

    @torch.no_grad()
    def _join_shadow_iteration(self) -> None:
        """On a rank without data: match one iteration of the others' collectives."""
        sync = self._control_allreduce(active=False)
        if self.broadcast_buffers and self.require_forward_param_sync:
            self._sync_buffers(self._auth_rank)
        self.require_forward_param_sync = sync
        if not sync:
            return
        tracks = self._tracks_unused()
        if tracks:
            if self._usage is None:
                self._usage = self._alloc(len(self._params), torch.int32, self._device)
            self._usage.zero_()
            if self.world_size > 1:
                ringdp.all_reduce(self._usage, group=self.process_group)
        for b in self._buckets:
            b.reset()
            b.buffer.zero_()
            self._launch(b)
        for b in self._buckets:
            self._wait_bucket(b)
        if tracks and self.static_graph and self._static_unused is None:
            self._static_unused = {i for i, v in enumerate(self._usage.tolist()) if v == 0}
        if not self._rebuilt:
            self._rebuild_buckets(self._auth_rank)

    def _join_finish(self, is_last_joiner: bool) -> None:
        """After all ranks joined: everyone takes the model of a rank that joined last."""
        t = torch.tensor([self.rank if is_last_joiner else -1], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        src = int(t.item())
        if src >= 0:
            self._broadcast_state(src)
        self._auth_rank = 0
        self._divisor = self.world_size
        self._set_scale()
        self._join_config = _JoinConfig.construct_disabled_join_config()

    # ------------------------------------------------------------------ teardown
    def _remove_hooks(self) -> None:
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles = []

    def __del__(self):
        with contextlib.suppress(Exception):
            self._remove_hooks()


# ---------------------------------------------------------------------- helpers
def _describe(entry) -> str:
    if entry is None:
        return "nothing (fewer parameters/buffers)"
    kind, name, shape, dtype, req = entry
    extra = "" if kind == "buffer" else ("" if req else ", requires_grad=False")
    return f"{kind} {name!r} of shape {tuple(shape)} and dtype {dtype}{extra}"


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _make_grad_hook(selfref, i: int):
    def hook(param):
        ddp = selfref()
        if ddp is None or not ddp._sync_this_backward:
            return
        if not ddp._in_backward:
            ddp._begin_backward()
        ddp._mark_ready(i, param)

    return hook


def _make_finalize(selfref):
    def finalize():
        ddp = selfref()
        if ddp is not None:
            ddp._finalize_backward()

    return finalize


def _make_bwd_start_hook(selfref):
    def hook(grad):
        ddp = selfref()
        if ddp is not None and ddp._t_bwd_start is None:
            ddp._t_bwd_start = _now_us()

    return hook


def _watch(b: _Bucket) -> None:
    """When tracing: note when the bucket's reduction really finished. Uses the handle's
    add_done_callback when it has one, otherwise a helper thread that waits for it."""
    h = b.handle
    b.done_event = threading.Event()
    if h is None:
        b.result = b.target
        b.t_done = _now_us()
        b.done_event.set()
        return

    def finish():
        try:
            b.result = _wait_handle(h, b.target)
        except BaseException as e:  # re-raised on the main thread by _wait_bucket
            b.error = e
        b.t_done = _now_us()
        b.done_event.set()

    add = getattr(h, "add_done_callback", None)
    if add is not None and not isinstance(h, torch.futures.Future):
        try:
            add(lambda _w: finish())
            return
        except AttributeError:
            pass
    threading.Thread(target=finish, name=f"ringdp-trace-bucket{b.index}", daemon=True).start()
