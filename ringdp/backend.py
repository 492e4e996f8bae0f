"""ringdp as a torch.distributed backend: ``import ringdp`` registers the name "ringdp".

    import torch.distributed as dist, ringdp
    dist.init_process_group("cpu:ringdp,cuda:nccl")     # or "ringdp", "cpu:ringdp,cuda:ringdp"
    g = dist.new_group(backend="cpu:ringdp")             # a group of its own beside gloo's
    model = torch.nn.parallel.DistributedDataParallel(model, process_group=g)   # stock DDP/FSDP2

Mechanism. torch 2.13's ``Backend.register_backend(name, creator, devices=[...])`` calls the
creator with (store, rank, size, timeout) while ``init_process_group``/``new_group`` runs.
c10d's ``Backend`` class has no Python constructor (a Python subclass raises "No constructor
defined!"), so a Python backend must be a subclass of ``ProcessGroup`` (as torch's own
"threaded" test group and test_c10d_pypg.py's groups are): torch then uses the object as the
whole process group. C++ callers (the DDP Reducer, _broadcast_coalesced, functional
collectives) reach its methods through pybind11's trampoline, Python callers directly. A
C++ c10d Backend would need the extension to link torch's c10d and re-implement Work and
futures there; not needed for what follows.

Routing (``ProcessGroupRingdp``):
  * native on ringdp's communicator (CPU tensors, shared memory): allreduce (SUM, AVG, MIN,
    MAX, PREMUL_SUM = multiply by the factor, then SUM), allreduce_coalesced,
    reduce_scatter_tensor (_reduce_scatter_base) and reduce_scatter (list),
    all_gather_into_tensor (_allgather_base) and allgather (list), broadcast, barrier.
    reduce_scatter, all_gather and broadcast use the communicator's own methods when it has
    them (``Communicator.reduce_scatter_tensor``/``all_gather_into_tensor``/``broadcast``);
    until then reduce_scatter is an all-reduce of the whole input (its own chunk copied
    out) and all-gather/broadcast run on the inner gloo group (exact copies).
    A non-contiguous CPU tensor runs there too, through a contiguous copy copied back
    (_staged): the ranks' routing never depends on their tensors' layouts (one rank's
    strided view on gloo and another's contiguous tensor on ringdp waited for each other
    until the timeout), and gloo, which mishandles some layouts (a strided broadcast), never
    sees them. allreduce and broadcast of a list of several tensors are c10d's multi-tensor
    forms, one logical tensor over every entry of every rank (broadcast: the root's
    opts.rootTensor): the inner group's, whatever the dtype.
  * a group whose ranks are on several hosts: its CPU collectives above run on the
    communicator's hierarchical paths (README "Across hosts", ringdp/hosts.py: two-level,
    leaders on uneven hosts, flat gloo with RINGDP_HIERARCHY=0 or one rank per host; its
    cross-host gloo groups are made here, in the constructor, from the store).
  * CUDA tensors, when the extension has CUDA and the group was made with "cuda:ringdp" (or
    plain "ringdp"): the same collectives as for CPU tensors (allreduce, allreduce_coalesced,
    reduce_scatter_tensor and the list reduce_scatter, all_gather_into_tensor and the list
    allgather, broadcast) on ringdp's CUDA transport (IPC or NCCL, ringdp/cuda_comm.py),
    stream-ordered like torch's NCCL group. They go to an inner NCCL group made on first use
    instead when ringdp cannot run them: a group made with "cuda:nccl" (or an extension built
    without CUDA), an op other than SUM/AVG/MIN/MAX/PREMUL_SUM (AVG of integers too), a
    dtype ringdp does not reduce, a non-contiguous or sparse tensor, a tensor on another
    CUDA device than the one ringdp's CUDA endpoint was made for, a call made while the
    current stream captures a CUDA graph (ringdp's CUDA collectives cannot be captured;
    NCCL's can, and every rank captures the same calls), list forms with tensors of
    different shapes, sizes that do not match the world size, and every collective not
    listed here.
  * everything else (send/recv, all_to_all, gather, scatter, reduce, object collectives,
    monitored_barrier via ``group.monitored_barrier``, sparse or unsupported dtypes/ops):
    the inner gloo group (CPU) or nccl group (CUDA), made from the same store under a
    prefix of its own, so that no program fails because ringdp lacks a collective.
    (``dist.monitored_barrier`` itself refuses every backend whose name is not "gloo".)

Work objects (``RingWork``) behave as torch's: wait() (re-raises the failure),
is_completed(), is_success(), exception(), get_future() (a torch.futures.Future of the
output tensors; DDP's comm hooks use it; a CUDA Work is completed once the GPU ran it, as
NCCL's). Every call returns a Work. One that c10d marks
synchronous (asyncOp=False: dist.all_reduce(..., async_op=False) and the other Python calls
without async_op, which wait on the Work at once) runs as ringdp's own synchronous calls do,
inline on the calling thread when nothing is queued (_async); the others, and every call
from C++ (DDP's reducer, FSDP2), run on ringdp's worker thread in the order they came.

One communicator per group: the backend creates it from the store/rank/size torch gives it,
and ``ringdp.get_communicator(group)`` (so ``ringdp.all_reduce`` and ``RingDDP``) returns
that one for the group. Failures (mismatch, dead peer, timeout) are ringdp's RingError,
naming the rank, within the group's timeout (or the call's own, when its c10d options set one).

Group-level calls torch makes: set_timeout (torch's _set_pg_timeout, so dist.breakpoint(),
routed here by register()) sets the communicator's and the inner groups' timeouts;
_start_coalescing/_end_coalescing (torch's _coalescing_manager(device=...)) give a Work of
every call made in the block; abort() returns at once (the call in flight on shared memory
fails within milliseconds, the queued ones unrun, and peers waiting for this rank fail fast;
a cross-host wait ends within 0.1 s here and about a second on the other ranks, a CUDA call
in flight in its timeout), where shutdown()
(destroy_process_group) waits for the queued calls.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
# c10d's options classes, from where they all are (torch 2.13's torch.distributed lacks AllgatherOptions)
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                        BarrierOptions, BroadcastOptions, ReduceScatterOptions)
from torch.distributed.distributed_c10d import ProcessGroupGloo

from . import _types, inflight, policy
from ._eager import eager, eager_methods
from ._native import _C
from .comm import Communicator, RingError, overlaps_apart_from_block
from .rendezvous import Rendezvous
from .work import HelpingFuture, _completed, fail_future, set_outputs

__all__ = ["BACKEND_NAME", "ProcessGroupRingdp", "RingWork", "register"]

BACKEND_NAME = "ringdp"
_RedOpType = dist.ReduceOp.RedOpType
_NATIVE_OPS = {_RedOpType.SUM: _types.SUM, _RedOpType.AVG: _types.AVG, _RedOpType.MIN: _types.MIN,
               _RedOpType.MAX: _types.MAX}
_SUPPORTED_DTYPES = frozenset(_C.supported_dtypes())


def _op_of(reduce_op):
    """(RedOpType, premul factor or None) of a ReduceOp or RedOpType."""
    if isinstance(reduce_op, _RedOpType):
        return reduce_op, None
    kind = reduce_op.op
    if kind == _RedOpType.PREMUL_SUM:
        # (op, factor): the pickled state, in every torch from 2.11 (which has no `factor` attribute)
        f = reduce_op.__getstate__()[1]
        return kind, (f.item() if isinstance(f, torch.Tensor) else float(f))
    return kind, None


def _options(opts, cls, field: str):
    """c10d's options object of a call: `cls()` for None, as given when it is one, else the
    short positional form (a bare op or root) put into `field` of a fresh one."""
    if opts is None:
        return cls()
    if isinstance(opts, cls):
        return opts
    out = cls()
    setattr(out, field, opts)
    return out


# ============================================================================ Work
_DONE = threading.Event()  # the done flag of every RingWork complete when made (parts run inline)
_DONE.set()


class RingWork(dist.Work):
    """A torch.distributed Work over ringdp collectives (module doc). `parts`: ringdp Works
    (or None for parts done inline) that complete in order (one worker thread runs them);
    `finalize()` runs once after the last (copy-out); the future's value is `outputs`.
    CUDA: the copy-out runs on the stream that was current where the call was made (whichever
    thread completes the work: the caller's, or ringdp's worker), after that stream waited
    for the parts; wait() makes the waiter's stream wait for the copy-out's end."""

    def __init__(self, parts, outputs, finalize=None, cuda_devices=None):
        super().__init__()
        self._outputs = outputs
        pending = [w for w in parts if w is not None]
        self._done = threading.Event() if pending else _DONE  # (a set Event, shared: cheaper than a new one)
        self._exc = None
        self._lock = threading.Lock()
        self._finalize = finalize
        self._stream = torch.cuda.current_stream(cuda_devices[0]) if cuda_devices else None
        self._finished = None  # CUDA: an event after the copy-out, on self._stream
        self._parts = pending
        self._devices = cuda_devices
        # complete when made: the future is made on demand (get_future), complete at once
        self._tf = HelpingFuture(pending[-1].waiting, devices=cuda_devices) if pending else None
        if not pending:
            self._complete()
        else:
            # the future keeps its callbacks: a one-shot box, so that nothing holds this Work
            # once it completed (a cycle through it would leave ~30 objects a call to the GC)
            box = [self]
            pending[-1]._future.add_done_callback(lambda _f: box.pop()._complete())

    def _complete(self):
        exc = next((w._future.exception() for w in self._parts if w._future.exception() is not None), None)
        cuda = [w._cuda for w in self._parts if w._cuda is not None]
        finalized = False
        if exc is None and self._finalize is not None:
            try:
                with self._on_call_stream():
                    for w in self._parts:  # CUDA parts: the call's stream waits for ringdp's
                        if w._cuda is not None:
                            w.wait()
                    self._finalize()
                    if self._stream is not None:
                        self._finished = torch.cuda.Event()
                        self._finished.record(self._stream)
                finalized = True
            except BaseException as e:  # noqa: BLE001 -- handed to the waiter
                exc = e
        self._finalize = None
        self._exc = exc
        if exc is None and not self._parts and self._stream is not None and self._finished is None:
            # (done inline, on the call's stream: a waiter on another stream joins it, as on NCCL's)
            self._finished = torch.cuda.Event()
            self._finished.record(self._stream)
        tf = _completed(self._tf)
        if self._done is not _DONE:
            self._done.set()
        if tf is not None:  # (no parts: get_future makes it, complete)
            # a CUDA-aware future records its event on the current stream: ringdp's, after it
            # waited for the collectives (after a copy-out, the call's stream, where the copy ran)
            self._settle(tf, cuda if cuda and not finalized else None)

    def _settle(self, tf, cuda=None) -> None:
        """Complete the torch future `tf` with this Work's outcome: its failure, or the
        outputs, set on ringdp's stream or else on the call's. `cuda`: the CUDA parts'
        records (cuda_comm.Enqueued); ringdp's stream first waits on each one's `done`
        event, recorded after its collective: a call made on ringdp's worker (a callback) ran
        on the stream current there, and a hierarchical one on the hierarchy's stream,
        neither of which ringdp's stream had waited for (comm._run_cuda)."""
        if self._exc is not None:
            fail_future(tf, self._exc)
            return
        if cuda:
            stream = cuda[-1].endpoint.stream
            for c in cuda:
                stream.wait_event(c.done)
            on = torch.cuda.stream(stream)
        else:
            on = self._on_call_stream()
        with on:
            set_outputs(tf, self._outputs)

    def _on_call_stream(self):
        """The stream current where the call was made, made current (CUDA; else nothing)."""
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _waiting(self, timeout: float | None = None):
        """A context that returns once the last part ended (work.Work.waiting)."""
        return self._parts[-1].waiting(timeout) if self._parts else contextlib.nullcontext()

    def wait(self, timeout=timedelta(0)):
        if self._done is _DONE and self._exc is None and self._finished is None:
            return True  # (done when made, nothing to join: a synchronous call, _async)
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        secs = min(secs, policy.MAX_TIMEOUT_S)  # (threading's waits stop at 9.2e9 s; inf too)
        deadline = time.monotonic() + secs if secs > 0 else None
        with self._waiting(secs if secs > 0 else None):  # (raises, naming the rank, after secs)
            done = self._done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not done and self._parts[-1]._future.done():
                # the collective ended in time; the thread that ended it runs the copy-out,
                # which completes this Work: the timeout bounds the collective, not that
                done = self._done.wait()
        if not done:
            raise RingError(f"ringdp: a collective did not finish within {secs:g} s of Work.wait()")
        if self._exc is not None:
            raise self._exc
        if self._finished is not None:  # after the copy-out, itself after the parts
            torch.cuda.current_stream(self._stream.device).wait_event(self._finished)
            return True
        for w in self._parts:
            if w._cuda is not None:
                w.wait()
        return True

    def is_completed(self):
        """Done, and on CUDA finished on the GPU too (as torch's NCCL Work and work.Work
        answer: the end event queried), not just enqueued; or failed."""
        if not self._done.is_set():
            return False
        if self._exc is not None:
            return True
        if self._finished is not None:  # (after the copy-out, or a call done inline, on the call's stream)
            ran = self._finished.query()
        else:
            ran = all(w.is_completed() for w in self._parts if w._cuda is not None)
        return ran or self._struck() is not None

    def is_success(self):
        return self.exception() is None and self.is_completed()

    def exception(self):
        """The failure of a part, or one that struck a CUDA part on the device after it was
        enqueued (work.Work.exception); None while none failed."""
        return self._exc if self._exc is not None else self._struck()

    def _struck(self):
        """The first failure that struck a CUDA part after its call returned, or None."""
        if not self._done.is_set():
            return None
        return next((e for e in (w._cuda.failure() for w in self._parts if w._cuda is not None) if e is not None),
                    None)

    def get_future(self):
        if self._tf is None:  # complete when made (_complete): made now, complete, once
            with self._lock:
                if self._tf is None:
                    tf = HelpingFuture(None, devices=self._devices)
                    self._settle(tf)
                    self._tf = tf
        return self._tf

    def result(self):
        self.wait()
        return self._outputs

    def synchronize(self):
        self.wait()


# ==================================================================== the CPU backend view
class _CpuBackendView:
    """ProcessGroupRingdp._get_backend's answer for CPU: the optional c10d Backend features
    torch's Python code asks about, all declined. Not a c10d Backend: isinstance checks for
    gloo or NCCL backends (torch's timeout helpers) skip it."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def supports_tensor_alloc(self, device) -> bool:
        # Registered memory would let ringdp all-gather in place, but the arena commits and
        # pre-faults a block on each allocation and punches it out on free: FSDP2's buffers,
        # new every step, would fault their pages every step (issue 12 measured a fresh
        # buffer's first touch as dearer than the copies it saves).
        return False

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self):
        return "ringdp CPU backend view"


_CPU_BACKEND_VIEW = _CpuBackendView()


# ==================================================================== registered in place
class _Adopter:
    """Which CPU tensors the group's all-reduce moves into registered memory in place
    (Communicator.register_in_place), with RINGDP_BACKEND_ADOPT_MIN_BYTES set: one at least
    that large that comes a second time (the same memory and size), as torch DDP's buckets
    do every step; a temporary seen once is not worth the copy. Its reductions then need no
    staging copies (stock DDP on this backend: README "As a torch.distributed backend").
    Off by default: memory that something outside torch points at (a numpy array from
    .numpy(), a DLPack export) would not follow the move. The move is ordered with the
    communicator's calls (a collective still running on the tensor finishes first). The key
    is the memory's address: a temporary that the allocator places where the last one was
    counts as seen again and moves (one copy into the arena instead of the staged copies;
    correct either way). Ranks decide alone; DDP's buckets
    come the same way on every rank, and a call where some ranks' tensors are registered and
    others' not is staged, as ever (correct, just not in place)."""

    _SEEN_MAX = 4096  # remembered tensors (a bucket is remembered until it moves; more buckets
    # than this per step would push each out before its second sighting)

    def __init__(self, comm: Communicator):
        self._comm = comm
        self._min = comm.config.backend_adopt_min_bytes
        self._seen: dict[tuple[int, int], int] = {}

    def see(self, t: torch.Tensor) -> None:
        if self._min < 0 or t.device.type != "cpu":
            return
        nbytes = t.numel() * t.element_size()
        if nbytes < max(self._min, 1):
            return
        key = (t.data_ptr(), nbytes)
        if key not in self._seen:
            if len(self._seen) >= self._SEEN_MAX:
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = 1
            return
        del self._seen[key]
        self._comm.register_in_place(t)


# ==================================================================== the group
class ProcessGroupRingdp(dist.ProcessGroup):
    """ringdp's process group (module doc). Made by torch through the registered creator."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, cuda_ringdp: bool | None = None):
        super().__init__(rank, size)
        self._store_obj = store
        self._timeout = timeout
        self._rank_, self._size_ = rank, size
        self._named = False  # set once torch named (registered) the group
        self._shut = False
        self._cuda_ringdp = cuda_ringdp  # None: decided from the group's backend string on first use
        # This group's incarnation (Rendezvous.incarnation): every key ringdp and its inner
        # groups write goes under it, so that a group of a job torchrun restarted never reads
        # the dead attempt's keys (gloo's addresses, NCCL's unique id, ringdp's segments),
        # which torchrun's agent store keeps.
        self._incarnation = Rendezvous("ringdp/backend/", rank, size, policy.timeout_s(timeout, policy.MAX_TIMEOUT_S),
                                       store=store).incarnation()  # (the communicator's timeout: comm.py)
        # the inner groups: gloo now (every rank creates the backend together), nccl on demand
        self._gloo = ProcessGroupGloo(self._inner_store("gloo"), rank, size, timeout=timeout)
        self._nccl = None
        self._nccl_lock = threading.Lock()
        self._comm = Communicator(timeout=timeout.total_seconds(), backend=self)
        self._adopt = _Adopter(self._comm)
        self._coalescing = None  # torch's _coalescing_manager(device=...) block: its Works (_Coalescing)

    # -- what the communicator asks of its backend (ringdp/comm.py) ----------------------
    def _ringdp_store(self):
        return self._store_obj

    def _ringdp_incarnation(self) -> int:
        return self._incarnation

    def _inner_store(self, name: str):
        """The store of the inner group `name` (gloo, nccl): this incarnation's."""
        return dist.PrefixStore(f"ringdp-inner-{name}/{self._incarnation}/", self._store_obj)

    def _ringdp_alive(self) -> bool:
        if self._shut:
            return False
        # before torch registered the group (during its creation) it is alive; after, as
        # long as torch.distributed knows it
        return not self._named or self in dist.distributed_c10d._world.pg_map

    def _ringdp_communicator(self) -> Communicator:
        return self._comm

    @property
    def communicator(self) -> Communicator:
        return self._comm

    # c10d's ProcessGroup keeps its name and description in its backends, and this group
    # has none: it keeps them itself
    def _set_group_name(self, name):
        self._group_name = name
        self._named = True

    @property
    def group_name(self):
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_desc(self):
        return getattr(self, "_group_desc", "")

    # -- identity -------------------------------------------------------------------------
    def getBackendName(self):
        return BACKEND_NAME

    def _get_backend(self, device):
        """torch's Python code asks a group for its per-device c10d Backend: FSDP2's
        set_allocate_memory_from_process_group_for_comm (supports_tensor_alloc), torch's
        timeout, split, shrink and time-estimate helpers. This group is its own backend and
        registers none per device, so c10d raises "No backend type associated with device
        type cpu", which failed FSDP2's first all-gather with that option on. For CPU it now
        answers with _CpuBackendView, which declines every optional feature (callers take
        their default path: FSDP2 its own torch.empty buffers, as without the option); other
        devices as before (torch's NCCL split-source lookup must not get a non-NCCL object)."""
        try:
            cpu = torch.device(device).type == "cpu"
        except (TypeError, RuntimeError):
            cpu = False
        return _CPU_BACKEND_VIEW if cpu else super()._get_backend(device)

    def _get_backend_name(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    def __repr__(self):
        return f"ProcessGroupRingdp(rank={self._rank_}, size={self._size_})"

    def shutdown(self):
        if not self._shut:
            self._shut = True
            self._comm.close()
            self._gloo = None
            self._nccl = None
            _recording(self, None)

    def abort(self):
        """torch's abort (_abort_process_group): returns at once, as gloo's does, where
        shutdown() (destroy_process_group) waits up to the timeout for the calls queued on
        ringdp's worker. The communicator is closed without that wait (close(wait=False)),
        and its shared-memory endpoint aborted: a call in flight on it (in the ring, waiting
        for its peers) fails within milliseconds with a RingError naming the abort, peers
        blocked on this rank fail fast naming it, and the calls still queued then fail
        without running. On a group across hosts a wait in a cross-host (gloo) step ends
        within 0.1 s too, and every other rank's within about a second, naming this rank's
        abort (the note CrossHost.abort leaves in the store; gloo itself cannot end a
        collective in flight, which runs on to gloo's timeout, its group held on a thread
        meanwhile). The CUDA collectives are halted, as torch's NCCL abort() ends its own:
        over CUDA IPC they give up within milliseconds and the peers waiting on this rank
        fail naming it; over NCCL the communicator is aborted (its peers fail at their
        timeout). The endpoints are released when the call in flight ends; new calls raise
        at once."""
        if self._shut:
            return
        self._shut = True
        self._comm.close(wait=False)
        self._gloo = None
        self._nccl = None
        _recording(self, None)

    def set_timeout(self, timeout: timedelta) -> None:
        """The group's timeout from now on (torch's ProcessGroup.set_timeout; torch's
        _set_pg_timeout, which dist.breakpoint() calls on every group, reaches it through
        register()): the communicator's, for the calls made after this, and its inner gloo
        (and nccl) group's; across hosts, its cross-host gloo groups' too
        (policy.cross_host_timeout of it). A call already made keeps its own."""
        secs = self._comm.set_timeout(timeout)
        self._timeout = timedelta(seconds=secs)
        for g in (self._gloo, self._nccl):
            if g is not None:
                g._set_default_timeout(self._timeout)

    # -- inner groups ---------------------------------------------------------------------
    def _inner(self, tensors):
        """The inner group for these tensors: gloo for CPU, nccl (made now) for CUDA."""
        if self._shut:
            raise RingError(self._comm._unusable() or f"rank {self._rank_}: this ringdp process group was shut down")
        if any(t.is_cuda for t in tensors):
            with self._nccl_lock:
                if self._nccl is None:
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = self._timeout
                    self._nccl = dist.ProcessGroupNCCL(self._inner_store("nccl"),
                                                       self._rank_, self._size_, opts)
            return self._nccl
        return self._gloo

    def _delegated(self, name, *args, outputs=None, **kwargs):
        """The inner group's `name`(*args) for the tensors in `args` (gloo for CPU, nccl for
        CUDA). gloo gets contiguous copies of non-contiguous CPU tensors, copied back when
        its Work completes: gloo (torch 2.13) writes a strided tensor's result as if it were
        contiguous in allreduce, reduce_scatter (list), broadcast, reduce and scatter, a
        wrong result with no error (pytorch issues 192920, 129337), and refuses one in
        send/recv and all_to_all_single. `outputs`: the future's value (None: the inner
        future's, each copy in it replaced by its tensor). A gloo Work is held until a while
        after it ends (ringdp/inflight.py: none is left to gloo's thread at exit)."""
        tensors = _tensors_in(args)
        inner = self._inner(tensors)
        if inner is not self._gloo:
            w = getattr(inner, name)(*args, **kwargs)
            return w if outputs is None else _Chain([w], outputs)
        pairs = _contiguous_copies(tensors)
        w = getattr(inner, name)(*(_swap(args, {id(t): c for t, c in pairs}) if pairs else args), **kwargs)
        return _GlooWork(w, inner, name, pairs, outputs)

    def _use_ringdp_cuda(self) -> bool:
        if not _C.WITH_CUDA:
            return False
        if self._cuda_ringdp is None:
            cfg = dist.distributed_c10d._world.pg_backend_config.get(self, "")
            self._cuda_ringdp = "cuda:" not in cfg or "cuda:ringdp" in cfg
        return self._cuda_ringdp

    def _native(self, tensors, op=None) -> bool:
        """Whether ringdp's communicator runs this collective of `tensors` (with `op`); a
        group that spans hosts too (ringdp/hosts.py)."""
        if op is not None:
            kind, _ = _op_of(op)
            if kind not in _NATIVE_OPS and kind != _RedOpType.PREMUL_SUM:
                return False
            if kind == _RedOpType.AVG and not all(t.dtype.is_floating_point for t in tensors):
                return False
        for t in tensors:
            if t.layout != torch.strided or t.dtype not in _SUPPORTED_DTYPES:
                return False
            if t.is_cpu:  # (a non-contiguous one runs through a contiguous copy: _staged)
                if self._comm.shm is None and self._comm.across is None:
                    return False  # a closed communicator: gloo (which says so)
            elif t.is_cuda:
                if not t.is_contiguous() or not self._use_ringdp_cuda():
                    return False
                if torch.cuda.is_current_stream_capturing():  # (ringdp's cannot be captured;
                    return False                              # NCCL's can: every rank captures alike)
                ep = self._comm._cuda  # one device per endpoint: tensors elsewhere go to nccl
                if ep is not None and t.device != ep.device:
                    return False
            else:
                return False
        return True

    # -- all-reduce -----------------------------------------------------------------------
    def _all_reduce(self, t, reduce_op, timeout=None, async_op=True, adopt=True):
        kind, factor = _op_of(reduce_op)
        if factor is not None:
            _scale(t, factor)  # (before see(): a move it queues must not race this write)
            code = _types.SUM
        else:
            code = _NATIVE_OPS[kind]
        if adopt:  # (not a temporary of ours: _staged)
            self._adopt.see(t)
        return self._comm.all_reduce(t, op=_OP_NAMES[code], async_op=async_op, timeout=timeout)

    def _all_reduce_each(self, tensors, reduce_op, opts):
        """Each of `tensors` all-reduced on its own, non-contiguous ones and those sharing
        memory with an earlier one (_aliasing) through a copy made now, copied back in order:
        every entry is reduced from the values before the call, once, as gloo's coalesced
        all-reduce does (in place, a tensor passed twice came out world x world times its
        value), and every rank makes one collective per entry whatever its tensors' aliasing."""
        copied = [how is not None for how in _aliasing(tensors)] if len(tensors) > 1 else None
        run, copy_back = _staged(tensors, copied=copied)
        timeout, async_op = _timeout_s(opts), _async(opts)
        return RingWork([self._all_reduce(r, reduce_op, timeout, async_op, adopt=r is t) for r, t in zip(run, tensors)],
                        tensors, copy_back, cuda_devices=_devices(tensors))

    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = _options(opts, AllreduceOptions, "reduceOp")  # allreduce(tensors, op) too
        # several tensors: c10d's multi-tensor form, one logical tensor reduced over every
        # entry of every rank (gloo's; nccl refuses it): the inner group's
        if len(tensors) != 1 or not self._native(tensors, opts.reduceOp):
            return self._delegated("allreduce", tensors, _premultiplied(tensors, opts, AllreduceOptions))
        return self._all_reduce_each(tensors, opts.reduceOp, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        if opts is None:
            opts = AllreduceCoalescedOptions()
        if not self._native(tensors, opts.reduceOp):
            return self._delegated("allreduce_coalesced", tensors,
                                   _premultiplied(tensors, opts, AllreduceCoalescedOptions))
        return self._all_reduce_each(tensors, opts.reduceOp, opts)

    # -- reduce-scatter -------------------------------------------------------------------
    def _reduce_scatter_flat(self, output, flat, reduce_op, keep, timeout=None, async_op=True, shown=None):
        """Reduce-scatter of the contiguous `flat` (world x output.numel()) into `output`;
        the future holds `shown` (default [output]: a complex call's, its complex output)."""
        kind, factor = _op_of(reduce_op)
        native = getattr(self._comm, "reduce_scatter_tensor", None)
        devices = _devices([output])
        shown = [output] if shown is None else shown
        if native is not None:
            if factor is not None:
                if keep:
                    flat = flat.clone()
                flat.mul_(factor)
            op = _OP_NAMES[_types.SUM if factor is not None else _NATIVE_OPS[kind]]
            if output.is_contiguous():
                return RingWork([native(output, flat, op=op, async_op=async_op, timeout=timeout)], shown,
                                cuda_devices=devices)
            out = torch.empty_like(output, memory_format=torch.contiguous_format)
            return RingWork([native(out, flat, op=op, async_op=async_op, timeout=timeout)], shown,
                            lambda: _copy_into(output, out), cuda_devices=devices)
        # composition: all-reduce the whole input, keep this rank's chunk
        buf = flat.clone() if keep else flat
        n = output.numel()
        r = self._rank_
        return RingWork([self._all_reduce(buf, reduce_op, timeout, async_op)], shown,
                        lambda: _copy_into(output, buf[r * n:(r + 1) * n].view_as(output)), cuda_devices=devices)

    def _reduce_scatter_base(self, output, input, opts=None):
        if opts is None:
            opts = ReduceScatterOptions()
        o, i = self._summed_as_real([output, input], opts.reduceOp)
        if not self._native([o, i], opts.reduceOp) or i.numel() != o.numel() * self._size_:
            if _op_of(opts.reduceOp)[1] is not None and not input.is_cuda:
                input = input.clone()
            return self._delegated("_reduce_scatter_base", output, input,
                                   _premultiplied([input], opts, ReduceScatterOptions))
        # a contiguous input: a view of it (kept: copied before a PREMUL_SUM's multiply); another,
        # or one the output overlaps other than as this rank's block (gloo reads the input
        # before it writes the output: i[0:n] as the output works there), a copy
        keep = i.is_contiguous() and not overlaps_apart_from_block(o, i, self._rank_)
        flat = i.reshape(-1) if keep else i.clone(memory_format=torch.contiguous_format).view(-1)
        return self._reduce_scatter_flat(o, flat, opts.reduceOp, keep=keep, timeout=_timeout_s(opts),
                                         async_op=_async(opts), shown=[output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = ReduceScatterOptions()
        _same_length("reduce_scatter_tensor_coalesced", outputs, inputs)
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _chain(works, outputs)

    def reduce_scatter(self, output_tensors, input_tensor_lists, opts=None):
        if isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensor_lists = [output_tensors], [input_tensor_lists]
        if opts is None:
            opts = ReduceScatterOptions()
        out, *ins = self._summed_as_real([output_tensors[0], *input_tensor_lists[0]], opts.reduceOp)
        if (len(output_tensors) != 1 or len(ins) != self._size_
                or not self._native([out, *ins], opts.reduceOp) or any(t.shape != out.shape for t in ins)):
            if _op_of(opts.reduceOp)[1] is not None and not out.is_cuda:  # (premultiplied copies, never the inputs)
                input_tensor_lists = [[t.clone() for t in ts] for ts in input_tensor_lists]
                opts = _premultiplied([t for ts in input_tensor_lists for t in ts], opts, ReduceScatterOptions)
            return self._delegated("reduce_scatter", output_tensors, input_tensor_lists, opts)
        flat = torch.cat([t.reshape(-1) for t in ins])
        return self._reduce_scatter_flat(out, flat, opts.reduceOp, keep=False, timeout=_timeout_s(opts),
                                         async_op=_async(opts), shown=[output_tensors[0]])

    def _summed_as_real(self, tensors, reduce_op):
        """Complex tensors that ringdp sums (SUM, AVG, PREMUL_SUM by a real factor) as their
        real views (torch.view_as_real), as torch's all_reduce passes them on (its
        reduce-scatters pass complex tensors); `tensors` as they are otherwise: not all
        complex, another op, a conjugate view (it has no real view). The callers check that
        ringdp runs the result natively; otherwise the inner group gets what the caller gave."""
        if not tensors or not all(t.is_complex() and not t.is_conj() for t in tensors):
            return tensors
        kind, factor = _op_of(reduce_op)
        if kind not in (_RedOpType.SUM, _RedOpType.AVG, _RedOpType.PREMUL_SUM) or isinstance(factor, complex):
            return tensors
        return [torch.view_as_real(t) for t in tensors]

    # -- all-gather -----------------------------------------------------------------------
    def _allgather_base(self, output, input, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        native = getattr(self._comm, "all_gather_into_tensor", None)
        if (native is None or not self._native([output, input])
                or output.numel() != input.numel() * self._size_):
            # gloo's future holds the input; torch's contract (and ringdp's): the output
            return self._delegated("_allgather_base", output, input, opts, outputs=[output])
        (out,), copy_back = _staged([output])
        src = input.contiguous()
        if overlaps_apart_from_block(src, out, self._rank_):  # (gloo reads the input first: a copy)
            src = src.clone()
        return RingWork([native(out, src, async_op=_async(opts), timeout=_timeout_s(opts))], [output],
                        copy_back, cuda_devices=_devices([output]))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if opts is None:
            opts = AllgatherOptions()
        _same_length("allgather_into_tensor_coalesced", outputs, inputs)
        return _chain([self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    def allgather(self, output_tensors, input_tensors, opts=None):
        if isinstance(input_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        if opts is None:
            opts = AllgatherOptions()
        native = getattr(self._comm, "all_gather_into_tensor", None)
        outs, inp = output_tensors[0], input_tensors[0]
        if (native is None or len(input_tensors) != 1 or len(outs) != self._size_
                or not self._native([inp, *outs]) or any(o.shape != inp.shape or o.dtype != outs[0].dtype for o in outs)):
            # (its future's value as the native one's, the output lists, not gloo's first list)
            return self._delegated("allgather", output_tensors, input_tensors, opts, outputs=output_tensors)
        # (of the outputs' dtype: one other than the input's is refused, as gloo refuses it, never cast)
        flat = torch.empty((self._size_ * inp.numel(),), dtype=outs[0].dtype, device=inp.device)

        def copy_out():
            for r, o in enumerate(outs):
                _copy_into(o, flat[r * inp.numel():(r + 1) * inp.numel()].view_as(o))

        return RingWork([native(flat, inp.contiguous().view(-1), async_op=_async(opts), timeout=_timeout_s(opts))],
                        output_tensors, copy_out, cuda_devices=_devices([inp]))

    # -- broadcast, barrier ---------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = _options(opts, BroadcastOptions, "rootRank")  # broadcast(tensors, root) too
        native = getattr(self._comm, "broadcast", None)
        # several tensors: c10d's multi-tensor form (the root's opts.rootTensor into every
        # entry of every rank: gloo's; nccl refuses it): the inner group's
        if native is None or len(tensors) != 1 or not self._native(tensors):
            return self._delegated("broadcast", tensors, opts)
        (run,), copy_back = _staged(tensors)
        return RingWork([native(run, opts.rootRank, async_op=_async(opts), timeout=_timeout_s(opts))],
                        tensors, copy_back, cuda_devices=_devices(tensors))

    # torch's _coalescing_manager(device=...): the calls inside the block run as they come;
    # the Work it takes instead of theirs (the fast path's too, made after the block) is all
    # of them (_Coalescing: this thread's calls between start and end, recorded by
    # _recording), so that cm.wait() waits for each, the inner groups' included, and raises
    # their failure
    def _start_coalescing(self, device):
        _recording(self, _Coalescing())

    def _end_coalescing(self, device):
        rec = self._coalescing
        _recording(self, None)
        works = rec.works if rec is not None else []
        return _chain(works, []) if works else RingWork([None], [])

    def barrier(self, opts=None):
        """Every rank's ringdp collectives issued before it have run (an all-reduce of one
        element behind them), and so have its gloo ones (gloo's barrier)."""
        opts = opts if opts is not None else BarrierOptions()
        t = torch.zeros(1)
        w = self._comm.all_reduce(t, async_op=_async(opts))
        g = _GlooWork(self._gloo.barrier(opts), self._gloo, "barrier", [])
        return _chain([RingWork([w], [t]), g], [])  # (its future's value: [], as gloo's)


_OP_NAMES = {_types.SUM: dist.ReduceOp.SUM, _types.AVG: dist.ReduceOp.AVG, _types.MIN: dist.ReduceOp.MIN,
             _types.MAX: dist.ReduceOp.MAX}


def _async(opts) -> bool:
    """Whether the caller may go on before the collective ends. c10d's Python API sets
    asyncOp=False for a synchronous call (dist.all_reduce(..., async_op=False) waits on the
    Work at once): such a call runs as ringdp's own synchronous calls do, inline on the
    calling thread when nothing is queued (Communicator._submit), without the handoff to
    ringdp's worker thread and back. Unset (c10d's default, True: DDP's reducer, FSDP2):
    asynchronous, on the worker."""
    return getattr(opts, "asyncOp", True) is not False


def _timeout_s(opts):
    """The per-call timeout of c10d options in seconds, None when unset (c10d's kUnsetTimeout,
    negative): the group's timeout applies."""
    t = getattr(opts, "timeout", None)
    s = t.total_seconds() if t is not None else -1.0
    return s if s > 0 else None


def _premultiplied(tensors, opts, options_type):
    """Options for the inner gloo group: gloo has no PREMUL_SUM, so the tensors (CPU ones)
    are multiplied by the factor here and summed there; other ops are passed on as they are."""
    kind, factor = _op_of(opts.reduceOp)
    if factor is None or any(t.is_cuda for t in tensors):
        return opts
    aliasing = _aliasing(tensors)
    if "partly" in aliasing:
        raise ValueError(f"ringdp: PREMUL_SUM of a list whose tensors partly overlap (entry {aliasing.index('partly')}): "
                         f"their shared elements cannot be scaled once each; scale them and use SUM")
    for t, how in zip(tensors, aliasing):  # (each element once: a tensor again, or a view inside one, is not)
        if how is None:
            _scale(t, factor)
    new = options_type()
    new.reduceOp = dist.ReduceOp.SUM
    new.timeout = opts.timeout
    return new


def _span(t):
    """(storage, first byte, end byte) of the memory that `t`'s elements lie in; None when empty."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    lo = t.storage_offset() * size
    return t.untyped_storage().data_ptr(), lo, lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * size


def _aliasing(tensors) -> list:
    """For each of `tensors`, how it shares memory with an earlier one: None (it does not,
    or it is empty), "within" (every element of it lies in one earlier contiguous tensor:
    that tensor again, another view or a slice of it) or "partly"."""
    spans, out = [], []
    for t in tensors:
        sp = _span(t)
        how = None
        if sp is not None:
            for (ptr, lo, hi), contiguous in spans:
                if ptr == sp[0] and lo < sp[2] and sp[1] < hi:
                    if contiguous and lo <= sp[1] and sp[2] <= hi:
                        how = "within"
                        break
                    how = "partly"
            spans.append((sp, t.is_contiguous()))
        out.append(how)
    return out


def _same_length(what, outputs, inputs) -> None:
    """A coalesced call's lists pair up one to one (gloo refuses others; zip() dropped the
    extra entries, leaving those outputs unwritten)."""
    if len(outputs) != len(inputs):
        raise ValueError(f"ringdp {what}: {len(outputs)} outputs for {len(inputs)} inputs; the lists must have "
                         f"the same length")


def _devices(tensors):
    devs = sorted({t.device for t in tensors if t.is_cuda}, key=str)
    return devs or None


def _staged(tensors, copied=None):
    """(the tensors a collective runs on, the copy-out or None): a non-contiguous CPU tensor
    (and each one that `copied` flags) runs through a contiguous copy of it, copied back
    when the collective ends (RingWork's finalize), in order; the others as they are. So the
    ranks' routing never depends on their layouts, and no layout reaches gloo, which
    mishandles some (a strided broadcast)."""
    run, back = [], []
    for k, t in enumerate(tensors):
        if (t.is_contiguous() or t.is_cuda) and not (copied and copied[k]):
            run.append(t)
        else:
            c = t.clone(memory_format=torch.contiguous_format)
            run.append(c)
            back.append((t, c))
    if not back:
        return run, None
    return run, lambda: [_copy_into(t, c) for t, c in back]


def _copy_into(dst, src) -> None:
    """dst.copy_(src) into a caller's tensor (below autograd: _types.below_autograd)."""
    with _types.below_autograd():
        dst.copy_(src)


def _scale(t, factor) -> None:
    """t.mul_(factor) of a caller's tensor (below autograd: _types.below_autograd)."""
    with _types.below_autograd():
        t.mul_(factor)


@contextlib.contextmanager
def _waiting_for(works, timeout=None):
    """The waiting contexts of `works` (RingWork's and _Chain's: on ringdp's worker thread,
    it runs the queued calls up to theirs), one after another; an inner group's Work has
    none (its calls do not wait for ringdp's worker)."""
    with contextlib.ExitStack() as stack:
        for w in works:
            waiting = getattr(w, "_waiting", None)
            if waiting is not None:
                stack.enter_context(waiting(timeout))
        yield


class _Chain(dist.Work):
    """Several Works (ringdp's or an inner group's) as one: done when all are."""

    def __init__(self, works, outputs):
        super().__init__()
        self._works = works
        self._outputs = outputs
        self._lock = threading.Lock()
        self._tf = None  # made on demand: its callback would run on a gloo part's thread (inflight.py)

    def _waiting(self, timeout=None):
        return _waiting_for(self._works, timeout)

    def wait(self, timeout=timedelta(0)):
        """Each part in turn, within `timeout` for them all (each part gets what is left of
        it); once one failed, the others are waited for at most policy.GLOO_DRAIN_S each
        (none left in flight: policy.py), then the first failure is raised."""
        failure = None
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        deadline = time.monotonic() + secs if secs > 0 else None
        for w in self._works:
            try:
                if failure is not None:
                    w.wait(timedelta(seconds=policy.GLOO_DRAIN_S))
                elif deadline is None:
                    w.wait()
                else:  # (at least 1 ms: a zero timedelta is "no timeout" to torch's Works)
                    w.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except BaseException as e:  # noqa: BLE001 -- the first is raised, after the drain
                failure = failure if failure is not None else e
        if failure is not None:
            raise failure
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def is_success(self):
        return all(w.is_success() for w in self._works)

    def exception(self):
        for w in self._works:
            try:
                e = w.exception()
            except Exception as x:  # noqa: BLE001 -- torch's Work raises when there is none
                e = None if w.is_success() else x
            if e is not None:
                return e
        return None

    def get_future(self):
        if not self._works:
            f = torch.futures.Future()
            set_outputs(f, self._outputs)
            return f
        with self._lock:
            if self._tf is None:
                self._tf = _chain_future(self._works, self._outputs)
            return self._tf

    def result(self):
        self.wait()
        return self._outputs


def _chain_future(works, outputs):
    """_Chain's future: the outputs once every part's future completed, or the first
    failure, itself (a RingError stays one). A HelpingFuture: its wait() on ringdp's worker
    thread (a callback) runs the parts' queued calls there instead of waiting for itself.
    (CUDA: as before, a future without devices; the callback's stream joins each part's.)"""
    futs = [w.get_future() for w in works]
    tf = HelpingFuture(functools.partial(_waiting_for, works))

    def done(_all):
        _completed(tf)  # (lets the parts go: the parts' futures hold this callback until they complete)
        try:
            for f in futs:
                f.wait()
        except BaseException as e:  # noqa: BLE001 -- handed to the waiter
            fail_future(tf, e)
            return
        set_outputs(tf, outputs)

    torch.futures.collect_all(futs).add_done_callback(done)
    return tf


def _chain(works, outputs):
    return works[0] if len(works) == 1 else _Chain(works, outputs)


class _CopyBack:
    """Copies each (tensor, copy) pair's copy back into its tensor, once, whichever thread
    asks first (_GlooWork)."""

    def __init__(self, pairs):
        self.pairs = pairs
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if not self._done:
                for t, c in self.pairs:
                    _copy_into(t, c)
                self._done = True


class _GlooWork(dist.Work):
    """A Work of the inner gloo group (ProcessGroupRingdp._delegated, barrier), held in
    inflight.GLOO from its start until policy.GLOO_LET_GO_S after it is seen to end (its wait(),
    is_completed() answering True, this wrapper dropped, or inflight's own look), and kept
    for good if the exit comes first (ringdp/inflight.py).
    Non-contiguous CPU tensors ran on contiguous copies (`pairs`): each copy is copied back
    into its tensor once, by the first of wait(), is_completed() answering True or the
    future's completion, so that the tensors hold the result whichever of them the caller
    uses. get_future(): the inner Work's future (gloo has none for some calls: send, recv,
    ...) then the copy-back; its value is the inner one's with the copies replaced by their
    tensors (`outputs` if given)."""

    _held = inflight.GLOO  # (a class attribute: __del__ may run after the module's globals are gone)

    def __init__(self, work, group, name, pairs, outputs=None):
        super().__init__()
        self._work = work
        self._held.hold(work, group, name)
        self._back = _CopyBack(pairs)
        self._outputs = outputs
        self._lock = threading.Lock()
        self._tf = None

    def __del__(self):
        self._held.settle(self._work)

    def wait(self, timeout=timedelta(0)):
        try:
            self._work.wait(timeout) if timeout else self._work.wait()
        finally:
            self._held.settle(self._work)
        self._back()
        return True

    def is_completed(self):
        if not self._work.is_completed():
            return False
        self._held.settle(self._work)
        if self._back.pairs and self._work.is_success():  # (asked only with copies: it warns, deprecated)
            self._back()
        return True

    def is_success(self):
        return self.is_completed() and self._work.is_success()

    def exception(self):
        return self._work.exception()

    def _source_rank(self):  # (recv_anysource's: torch's dist.recv(src=None) asks for it)
        return self._work._source_rank()

    def source_rank(self):
        return self._work.source_rank()

    def synchronize(self):
        return self._work.synchronize()

    def get_future(self):
        if not self._back.pairs and self._outputs is None:
            return self._work.get_future()  # (as it is: no Python callback on gloo's thread)
        with self._lock:
            if self._tf is None:
                back, outputs, originals = self._back, self._outputs, {id(c): t for t, c in self._back.pairs}

                def then(f):  # (holds no reference to this Work: the inner future keeps it)
                    value = f.value()  # (raises the inner failure: nothing is copied back then)
                    back()
                    return outputs if outputs is not None else _swap(value, originals)

                self._tf = self._work.get_future().then(then)
            return self._tf

    def result(self):
        self.wait()
        if self._outputs is not None:
            return self._outputs
        return _swap(self._work.result(), {id(c): t for t, c in self._back.pairs})


# Everything else goes to the inner group of the tensors' device (gloo for CPU).
def _tensors_in(args) -> list:
    """The tensors among `args`, in nested lists and tuples too (not recursive: a nested
    function that calls itself is a reference cycle, garbage left to the GC every call)."""
    found, todo = [], list(args)
    while todo:
        a = todo.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            todo.extend(a)
    return found


def _contiguous_copies(tensors) -> list:
    """[(t, a contiguous copy of t)] for each distinct non-contiguous dense CPU tensor of
    `tensors` (ProcessGroupRingdp._delegated)."""
    pairs, seen = [], set()
    for t in tensors:
        if t.layout == torch.strided and t.is_cpu and not t.is_contiguous() and id(t) not in seen:
            seen.add(id(t))
            pairs.append((t, t.contiguous()))
    return pairs


def _swap(obj, by_id: dict):
    """`obj` with each tensor whose id is a key of `by_id` replaced by its value, in nested
    lists and tuples too (their copies; everything else as it is)."""
    if isinstance(obj, torch.Tensor):
        return by_id.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap(x, by_id) for x in obj)
    return obj


def _delegate(name, inner_name=None):
    def method(self, *args, **kwargs):
        return self._delegated(inner_name or name, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"{name}: on the inner gloo (CPU) / nccl (CUDA) group."
    return method


for _name in ("send", "recv", "recv_anysource", "alltoall", "alltoall_base", "gather", "scatter", "reduce",
              "allgather_coalesced"):
    setattr(ProcessGroupRingdp, _name, _delegate(_name))
ProcessGroupRingdp.all_to_all_single = _delegate("all_to_all_single", "alltoall_base")


# torch 2.13's ProcessGroup names for the single-tensor forms
ProcessGroupRingdp.reduce_scatter_single = ProcessGroupRingdp._reduce_scatter_base
ProcessGroupRingdp.all_gather_single = ProcessGroupRingdp._allgather_base
ProcessGroupRingdp.reduce_scatter_single_coalesced = ProcessGroupRingdp.reduce_scatter_tensor_coalesced
ProcessGroupRingdp.all_gather_single_coalesced = ProcessGroupRingdp.allgather_into_tensor_coalesced


# ----------------------------------------------------- torch's _coalescing_manager(device=...)
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "_reduce_scatter_base", "reduce_scatter_single",
                "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "reduce_scatter",
                "_allgather_base", "all_gather_single", "allgather_into_tensor_coalesced",
                "all_gather_single_coalesced", "allgather", "broadcast", "barrier", "send", "recv", "recv_anysource",
                "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter", "reduce",
                "allgather_coalesced")  # the group's methods that return a Work


class _Coalescing:
    """The Works of the calls one thread makes on the group between _start_coalescing and
    _end_coalescing (the outermost call's: a method that calls another records one Work).
    Recorded by the group's collectives replaced on the instance meanwhile (_recording):
    nothing is paid outside a block. A block that raised never ends (torch skips
    _end_coalescing): the next start replaces it, and until then the Works that completed
    well are let go as more come, so that none accumulate."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.works = []
        self.depth = 0
        self.prune_at = 64

    def add(self, work) -> None:
        self.works.append(work)
        if len(self.works) >= self.prune_at:
            self.works = [w for w in self.works if not (w.is_completed() and w.is_success())]
            self.prune_at = 2 * max(len(self.works), 32)


@eager
def _record(rec, method, *args, **kwargs):
    """`method(*args, **kwargs)` (a bound collective of the group), its Work recorded in `rec`
    when it is this thread's outermost call."""
    if rec.depth or rec.thread != threading.get_ident():
        return method(*args, **kwargs)
    rec.depth += 1
    try:
        work = method(*args, **kwargs)
    finally:
        rec.depth -= 1
    rec.add(work)
    return work


def _recording(pg, rec) -> None:
    """Record `pg`'s calls in `rec` (None: stop): its collectives replaced on the instance."""
    pg._coalescing = rec
    for name in _COLLECTIVES:
        if rec is None:
            pg.__dict__.pop(name, None)
        else:
            setattr(pg, name, functools.partial(_record, rec, getattr(type(pg), name).__get__(pg)))


def _monitored_barrier(self, timeout=None, wait_all_ranks=False):
    if timeout is None:
        timeout = self._timeout
    return self._inner([]).monitored_barrier(timeout, wait_all_ranks)  # (a RingError once shut down)


ProcessGroupRingdp.monitored_barrier = _monitored_barrier


def _create(store, rank, size, timeout):
    return ProcessGroupRingdp(store, rank, size, timeout)


def register():
    """Register the backend "ringdp" (devices cpu and cuda); ``import ringdp`` does it. Also
    routes torch's _set_pg_timeout (dist.breakpoint() calls it on every group) to
    ProcessGroupRingdp.set_timeout for a ringdp group: torch's own sets only gloo and NCCL
    backends (a ringdp group kept its timeout, and the ranks waiting for a debugged one
    failed in it)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    c10d = dist.distributed_c10d
    if not getattr(c10d._set_pg_timeout, "_ringdp", False):
        torch_set_pg_timeout = c10d._set_pg_timeout

        @functools.wraps(torch_set_pg_timeout)
        def _set_pg_timeout(timeout, group=None):
            pg = c10d._get_default_group() if group is None else group
            if isinstance(pg, ProcessGroupRingdp):
                return pg.set_timeout(timeout)
            return torch_set_pg_timeout(timeout, group)

        _set_pg_timeout._ringdp = True
        c10d._set_pg_timeout = _set_pg_timeout


# under torch.compile: what c10d calls runs eagerly (ringdp/_eager.py)
eager_methods(ProcessGroupRingdp, dist.ProcessGroup)
eager_methods(RingWork, dist.Work)
eager_methods(_Chain, dist.Work)
eager_methods(_CpuBackendView)
