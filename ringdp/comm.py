"""The communicator: ringdp's state for one process group in one process.

Set-up (collective, ringdp.init or the first collective of the group):
  1. Config.from_env(): every RINGDP_* setting, read once (ringdp/config.py);
  2. Rendezvous (ringdp/rendezvous.py) under a prefix unique to the group and its
     incarnation (Rendezvous.incarnation: never one of an earlier set-up, even of a
     torchrun attempt that died; the store keeps its keys): rank 0's job id, every rank's
     host key (RINGDP_HOST_ID, else hostname + boot id: the topology; local rank and local
     size by host, in rank order);
  3. ranks of one host: the shared-memory endpoint (csrc/transport/shm): create this rank's
     segment, exchange local_blob()s, connect(), barrier, unlink the name. The CUDA
     endpoint (ringdp/cuda_comm.py) follows the same lifecycle on the first CUDA call.
     A group that spans hosts: a host-local shared-memory endpoint (this host's ranks) and
     gloo subgroups across hosts (ringdp/hosts.py, README "Across hosts"; for a group of
     ringdp's backend too, its gloo subgroups made from its store): the CPU collectives run
     hierarchically there; ringdp.empty comes from this host's arena.

Fingerprints: every collective carries a tag (the caller's name for it: ``tag=``, else the
thread's ``collective_tag`` block, else empty) beside its call number and kind; ranks that
pair different calls (one rank skipped or repeated one) get a RingError naming both sides.

Diagnosis: a collective that has waited RINGDP_STALL_WARN_S (default 60 s) for a peer logs
a stall report once (logger "ringdp": which ranks have not entered it; every rank's last
finished and current call); a timeout's RingError carries the same. Each communicator keeps
its last calls (the flight record, ``Communicator.flight_record()``), written to
RINGDP_TRACE's folder as ``ringdp_flight.rank<r>.json`` (r: the global rank; a group other
than the world adds its name: ``.rank<r>.g<name>.json``) on a stall or a failed collective.

Collectives: all_reduce, reduce_scatter_tensor, all_gather_into_tensor and broadcast, on CPU
tensors (the shared-memory transport, or hierarchically across hosts) and on CUDA tensors (the
CUDA IPC or NCCL transport; the three besides all_reduce run the ring only there, no one-shot
path); csrc/ring/ring.cpp runs all four on every transport, with torch.distributed's semantics
and the same validation, Work / async_op / tag / timeout behaviour. (CUDA transports do not
carry the tag yet: it is validated, not compared across ranks.)

Execution: validation and the algorithm (ringdp/policy.py) on the calling thread, then the
collective runs in submission order: inline when nothing is queued and the call is
synchronous, else on one background worker thread. Futures' callbacks run on the worker; a
callback that waits for a later queued call runs the queue itself (_run_queued_until), and
a call that waits behind a callback stuck for longer than the timeout is dropped with a
RingError (_await_queued), so no wait on the worker's calls is without end. CPU
collectives complete on the host.
CUDA collectives are stream-ordered like torch's NCCL ones: ringdp's stream waits for the
caller's stream (an event), the ring runs on ringdp's stream, and the caller's stream waits
for the result at once (inline, the transport orders the current stream itself) or in
Work.wait() (ringdp/work.py); the host never waits for the GPU (docs/cuda.md, "The Python
side").
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as _FutureTimeout

import torch
import torch.distributed as dist

from . import _types, cuda_comm, hosts, inflight, policy
from ._eager import eager, eager_methods
from ._native import RingError, _C
from .config import ALGOS, Config, trace_path
from .rendezvous import Rendezvous
from .work import Work, _settle

__all__ = ["Communicator", "RingError", "Work", "build_info", "collective_tag", "destroy", "get_communicator",
           "init"]

log = logging.getLogger("ringdp")
TAG_BYTES = _C.TAG_BYTES  # a tag has at most TAG_BYTES - 1 bytes (csrc/common/types.h)


class _ThreadTag(threading.local):
    tag = ""  # a class default: reading it never raises (getattr with a default did: 0.4 us)


_tags = _ThreadTag()


def _check_tag(tag) -> str:
    if not isinstance(tag, str):
        raise TypeError(f"a ringdp collective's tag must be a str, got {type(tag).__name__}")
    if len(tag.encode()) >= TAG_BYTES:
        raise ValueError(f"a ringdp collective's tag has at most {TAG_BYTES - 1} bytes, got {tag!r}")
    return tag


@contextlib.contextmanager
def collective_tag(tag: str):
    """Tag the ringdp collectives this thread issues inside the block (those without tag=),
    e.g. the ones a DDP comm hook makes: every rank must issue them with the same tags, in
    the same order, or they fail with a RingError naming both sides."""
    old = _tags.tag
    _tags.tag = _check_tag(tag)
    try:
        yield
    finally:
        _tags.tag = old


def _current_tag(tag) -> str:
    return _tags.tag if tag is None else _check_tag(tag)



_SUPPORTED_DTYPES = frozenset(_C.supported_dtypes())


def _group_key(group) -> str:
    """The name of `group` in the communicator table and rendezvous keys: the same on every
    rank of the group, and its own (torch's group name: two groups of the same ranks are two
    groups, whose collectives must never pair with each other's)."""
    if group is None or group is dist.group.WORLD:
        return "world"
    return "g" + dist.distributed_c10d._get_process_group_name(group)


def _is_world(group) -> bool:
    return group is None or group is dist.group.WORLD


def _live_group(group):
    """The ProcessGroup `group` stands for (None: the default group), which must be alive:
    a RingError when it was destroyed, a RuntimeError when torch.distributed is not set up."""
    if _is_world(group):
        if not dist.is_available() or not dist.is_initialized():
            old = _comms.get("world")
            if old is not None:
                raise RingError(old._gone())
            raise RuntimeError(
                "ringdp needs torch.distributed to be initialised first: call "
                "torch.distributed.init_process_group(...) (torchrun sets the environment for it)"
            )
        return dist.distributed_c10d._get_default_group()
    if group not in dist.distributed_c10d._world.pg_map:
        old = next((c for c in _comms.values() if c._pg() is group), None)
        raise RingError(old._gone() if old is not None else (
            f"ringdp: process group {getattr(group, 'group_name', group)!r} is not (or no longer) a process "
            f"group of torch.distributed: it was destroyed (torch.distributed.destroy_process_group)"))
    return group


def overlaps_apart_from_block(small, large, rank: int) -> bool:
    """Whether `small` (a reduce-scatter's output, an all-gather's input) shares bytes with
    `large` other than as exactly its block `rank` (world blocks of small's size), which
    the transports cannot run in place (Communicator._check_pair)."""
    nbytes = small.numel() * small.element_size()
    if not nbytes:
        return False
    start, end = small.data_ptr(), small.data_ptr() + nbytes
    lo, hi = large.data_ptr(), large.data_ptr() + large.numel() * large.element_size()
    return start < hi and lo < end and start != lo + rank * nbytes


class Communicator:
    """ringdp's state for one process group in this process. Created by ringdp.init() or
    lazily by the first collective; every rank of the group must create it (collectively).

    It lives as long as its process group: it holds the group weakly and the store not at
    all (looked up at each use), so torch.distributed.destroy_process_group() frees both as
    if ringdp had never been used. Calls on a communicator whose group was destroyed raise
    a RingError; ringdp's module functions then create a new one for a new group."""

    def __init__(self, group=None, timeout=None, config: Config | None = None, *, backend=None):
        # backend: ringdp's torch.distributed backend (ringdp/backend.py) making its own
        # communicator while init_process_group/new_group runs, before the group exists: it
        # gives rank, size, store and liveness (rank(), size(), _ringdp_store(), _ringdp_alive())
        pg = _live_group(group) if backend is None else backend
        cfg = config if config is not None else Config.from_env()
        self.config = cfg.replace(timeout_s=policy.timeout_s(timeout, cfg.timeout_s))
        self._world_group = _is_world(group) and backend is None
        self._backend = backend is not None
        self._pg = weakref.ref(pg)  # never a strong reference: see the class doc
        self.rank = dist.get_rank(group) if backend is None else backend.rank()
        self.world = dist.get_world_size(group) if backend is None else backend.size()
        self.timeout = self.config.timeout_s
        # A prefix per group and incarnation (Rendezvous.incarnation): a re-created group's
        # communicator, or one of a job torchrun restarted, never reads the keys of an earlier
        # one, which the store may still hold (torchrun's agent store outlives process groups
        # and worker processes).
        if backend is None:  # the default store: a prefix per group
            key = _group_key(group)
            gen = Rendezvous(f"ringdp/{key}/", self.rank, self.world, self.timeout, store=self._store).incarnation()
        else:  # the group's own store (torch prefixes it per group), drawn by the backend
            key = "backend"
            gen = backend._ringdp_incarnation()
        self.rendezvous = Rendezvous(f"ringdp/{key}/{gen}/", self.rank, self.world, self.timeout, store=self._store)
        self._lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._worker_done = threading.Event()  # set as the worker's loop ends (close(): _join_worker)
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._closed = False
        self._torn_down = False  # the endpoints released (close(); queued calls left then fail: _refusal)
        self._lock_owner: int | None = None  # the thread holding _lock (_locked)
        self._release_deferred = False  # close() left the teardown to the call holding _lock (_locked)
        self._callbacks_since: float | None = None  # the worker runs callbacks since (_run_item)
        self.host = socket.gethostname()
        self.host_key = self.config.host_id or _host_key(self.host)
        # every rank's host key, by rank; how many of the group's ranks share this machine
        self.hosts, self.machine_ranks = self._topology()
        # the shared-memory waits' spin (ns): (inline calls, calls on the worker beside the caller's compute)
        self._spins = (policy.spin_ns(self.machine_ranks, self.config),
                       policy.spin_ns(self.machine_ranks, self.config, torch.get_num_threads()))
        self._spin_set = self._spins[False]
        self._spin_lock = threading.Lock()  # _spin_set and the endpoint's spin, from either thread
        self._waiters = 0  # threads blocked in Work.wait() on a CPU call (_caller_waits)
        self._thresholds: dict[tuple[str, int], int] = {}  # _decide: (transport, capacity) -> one-shot threshold
        self.host_order = list(dict.fromkeys(self.hosts))  # the hosts, by their first rank
        self.host_ranks = [r for r, h in enumerate(self.hosts) if h == self.host_key]  # this host's ranks
        self.local_rank = self.host_ranks.index(self.rank)
        self.local_size = len(self.host_ranks)
        self.local_sizes = [self.hosts.count(h) for h in self.host_order]
        self._shm = None  # the shared-memory endpoint (ranks of one host)
        self._shm_error: str | None = None  # why there is none
        self._cuda: cuda_comm.CudaEndpoint | None = None
        self._cuda_failed = ""  # why the CUDA set-up failed (it is not tried again)
        self.across: hosts.CrossHost | None = None  # a group that spans hosts: its CPU collectives
        if len(self.host_order) > 1:  # CUDA tensors use NCCL; CPU all_reduce runs hierarchically
            where = ", ".join(f"rank {r} on {h}" for r, h in enumerate(self.hosts))
            self._shm_error = (
                f"rank {self.rank}: the group spans {len(self.host_order)} hosts ({where}). Across hosts ringdp "
                f"runs the CPU collectives hierarchically (README 'Across hosts'); registered memory "
                f"(ringdp.empty) needs an in-host step (not with RINGDP_HIERARCHY=0 or one rank per host); "
                f"CUDA tensors across hosts use the NCCL transport.")
            self.across = hosts.CrossHost.create(self)
        else:
            self._shm = self._connect_shm()

    # ---- lifetime -----------------------------------------------------------------------
    @property
    def cross_path(self) -> str | None:
        """Across hosts: the path of the CPU collectives (policy.cross_host_path); else None."""
        return self.across.path if self.across is not None else None

    @property
    def group(self):
        """The process group (None for the default group's communicator)."""
        return None if self._world_group else self._pg()

    @property
    def group_alive(self) -> bool:
        """Whether the process group this communicator was made for still exists."""
        pg = self._pg()
        if self._backend:
            return pg is not None and pg._ringdp_alive()
        return pg is not None and pg in dist.distributed_c10d._world.pg_map

    def _gone(self) -> str:
        what = "the default process group" if self._world_group else "its process group"
        return (f"rank {self.rank}: ringdp's communicator cannot be used: {what} was destroyed "
                f"(torch.distributed.destroy_process_group()), and ringdp's communicators live as long as their "
                f"group. Create the group again (init_process_group / new_group) and call ringdp with it.")

    def _unusable(self) -> str | None:
        """Why this communicator cannot run collectives any more (None: it can)."""
        if not self.group_alive:
            return self._gone()
        if self._closed:
            return f"rank {self.rank}: this ringdp communicator was destroyed (ringdp.destroy())"
        return None

    def _closed_error(self) -> RingError:
        """What a call on this communicator raises once it was closed (or its group destroyed)."""
        return RingError(self._unusable() or f"rank {self.rank}: this ringdp communicator was closed")

    def _wait_timed_out(self, timeout: float, where: str = "") -> RingError:
        """What Work.wait(timeout) raises when the collective did not finish in time."""
        return RingError(f"rank {self.rank}: a collective did not finish within {timeout:g} s of Work.wait(){where}")

    def _abandon(self, e: BaseException, when: str) -> None:
        """A signal's handler raised `e` on this thread (Ctrl-C: KeyboardInterrupt) `when`
        a collective was in flight: the program leaves it, so its endpoints abort, as the
        backend's abort() does without the teardown. The call in flight fails within
        milliseconds (on the worker thread too), the peers blocked on this rank fail naming
        it, and the next call here raises a RingError saying why. (Inside the shared-memory
        transport's waits the transport itself aborts: csrc/common/interrupt.h.) The CUDA
        endpoint's device work is halted too, last (CudaEndpoint.halt: an NCCL abort may
        take seconds): a collective left on one transport leaves the whole communicator.
        A second Ctrl-C meanwhile is let go: every step runs (the caller raises `e`)."""
        how = "KeyboardInterrupt: Ctrl-C" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}"
        why = f"rank {self.rank}: interrupted ({how}) {when}"
        shm, across, cuda = self._inhost_endpoint(), self.across, self._cuda
        if isinstance(shm, _C.ShmComm):
            _regardless(shm.abort, why)
        if across is not None:  # (the store, where the other hosts' waits look)
            _regardless(lambda: across.abort(why, self._last_store() or self._store()))
        if cuda is not None:
            cuda.halt(why)

    def _store(self):
        """The store the rendezvous uses, looked up at each use (class doc)."""
        if not self.group_alive:
            raise RingError(self._gone())
        if self._backend:
            return self._pg()._ringdp_store()
        return dist.distributed_c10d._get_default_store()

    def _last_store(self):
        """The backend group's store while the group object lives, alive or not (its abort()
        marks it gone first; CrossHost.abort still leaves its note there); None elsewhere."""
        pg = self._pg() if self._backend else None
        return None if pg is None else pg._ringdp_store()

    # ---- set-up -------------------------------------------------------------------------
    def _topology(self) -> tuple[list[str], int]:
        """Every rank's host key (RINGDP_HOST_ID, else hostname and boot id), by rank, and the
        number of the group's ranks on this machine (hostname and boot id, whatever
        RINGDP_HOST_ID says: hosts simulated on one machine share its cores, and the spin
        policy must know)."""
        machine = _host_key(self.host)
        agree = {"RINGDP_HIERARCHY": self.config.hierarchy, "RINGDP_TRANSPORT": self.config.transport}
        recs = [json.loads(r) for r in self.rendezvous.exchange(
            "host", json.dumps([self.host_key, machine, agree]), "the host records")]
        for name in agree:  # settings that choose the set-up's path: every rank must take the same
            seen = [rec[2][name] for rec in recs]
            if len(set(map(json.dumps, seen))) > 1:
                raise RingError(f"rank {self.rank}: the group's ranks disagree on {name}: "
                                + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(seen))
                                + f". Set {name} alike on every rank (or on none)")
        return [rec[0] for rec in recs], sum(rec[1] == machine for rec in recs)

    def _connect_shm(self, rdv: Rendezvous | None = None, rank_names: list[int] | None = None):
        """This rank's segment, connected to every peer's (module doc, step 3). `rdv`: the
        rendezvous of the endpoint's ranks (default: the communicator's); `rank_names`: the
        communicator's rank of each of them, how the endpoint's messages name them (a
        host's endpoint across hosts; default: its own numbers).

        Nothing is left in /dev/shm when a rank dies during set-up: every rank is here (the
        host exchange) before any segment exists; an exception unlinks this rank's name, a
        SIGTERM too (a handler, while the name exists: csrc/transport/shm/names.h); a name
        left by SIGKILL carries its creator's pid, and the next set-up on the machine removes
        names whose creator is dead (_C.reap_stale_segments)."""
        rdv = self.rendezvous if rdv is None else rdv
        cfg = self.config
        self._reap_stale_segments()
        if rdv.rank == 0:
            rdv.publish("uid", uuid.uuid4().hex[:12])
        uid = rdv.read("uid", "the job id").decode()
        c = _C.ShmConfig()
        c.rank, c.world, c.name, c.host = rdv.rank, rdv.world, _C.shm_segment_name(uid, rdv.rank), self.host
        c.fifo_slots, c.slot_bytes, c.oneshot_bytes = cfg.fifo_slots, cfg.slot_bytes, cfg.oneshot_bytes
        c.arena_bytes = int(cfg.arena_gb * (1 << 30))
        c.spin_ns = self._spin_set = self._spins[False]
        c.stall_warn_s = cfg.stall_warn_s
        c.flight_calls = policy.FLIGHT_RECORD_CALLS
        if rank_names is not None:
            c.rank_names = list(rank_names)
        native = _C.ShmComm(c)  # creates (and owns) this rank's segment
        native.set_stall_handler(functools.partial(_on_stall, weakref.ref(self)))
        try:
            native.connect(rdv.exchange("shm", native.local_blob(), "the shared-memory segments"))
            rdv.barrier("shm-mapped", "peers to map the segments")
            native.unlink_own()  # every peer has mapped it: nothing left to leak in /dev/shm
        except BaseException:
            native.unlink_own()
            self._reap_stale_segments()  # a peer that died during set-up left its name
            raise
        return native

    def _reap_stale_segments(self) -> None:
        removed = _C.reap_stale_segments()
        if removed:
            log.info(
                "ringdp rank %d: removed %d segment(s) of dead processes from /dev/shm: %s",
                self.rank, len(removed), ", ".join(removed))

    @property
    def shm(self):
        """The shared-memory endpoint (_C.ShmComm: segment name, calls, arena use), None when
        the group spans hosts (then the all-reduce uses a host-local one of its own)."""
        return self._shm

    def _cuda_endpoint(self, device) -> "cuda_comm.CudaEndpoint":
        """The CUDA endpoint, created (collectively) on first use: never on a communicator that
        was closed or whose group is gone (its set-up would wait for peers that are not
        setting up, and close() would never free it). One device per communicator: a tensor
        on another is refused by _check, before the call."""
        ep = self._cuda  # (read once: close() on another thread clears it, under _lock)
        reason = self._unusable()
        if reason is not None:
            raise RingError(reason)
        if ep is not None:
            return ep  # (a close() from now on: the call fails in _call, under _lock)
        with self._locked():  # the set-up against close(): made before it tears down, or not at all
            if self._torn_down:
                raise self._closed_error()
            if self._cuda is None:
                if self._cuda_failed:  # a second set-up would read the first one's records from the store
                    raise RingError(f"rank {self.rank}: this communicator's CUDA set-up failed "
                                    f"({self._cuda_failed}); call ringdp.destroy() and initialise again")
                try:
                    self._cuda = cuda_comm.CudaEndpoint.create(self, torch.device(device))
                except RuntimeError as e:  # (RingError is one)
                    self._cuda_failed = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                    raise
            return self._cuda

    # ---- execution ----------------------------------------------------------------------
    def _start_worker(self):
        """(under _pending_lock: one worker, whichever threads queue the first calls; kept
        only once it runs)"""
        q = queue.Queue()
        worker = threading.Thread(target=self._run_worker, args=(q, self._worker_done),
                                  name=f"ringdp-worker-r{self.rank}", daemon=True)
        worker.start()
        self._queue, self._worker = q, worker
        _working.add(self)  # (closed at exit if still open: _close_at_exit)

    def _run_worker(self, q: queue.Queue, done: threading.Event):
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                self._run_item(item)
                del item  # hold no tensor of a finished collective while idle
        finally:
            done.set()

    def _run_item(self, item) -> None:
        """Run one queued call (fn, future) on the worker thread and settle its future.
        _callbacks_since: when the worker started running callbacks (None: it is not), for
        the waiters of later calls (_await_queued); a call run from inside a callback
        (_run_queued_until) restarts the callback's clock: it made progress."""
        fn, fut = item
        outer = self._callbacks_since
        try:
            with self._pending_lock:  # (against _await_queued dropping it meanwhile)
                refused = self._refusal(fut)  # (then its callbacks run here, on the worker, never on its waiter)
                fut.set_running_or_notify_cancel()  # (never cancelled: a dropped call is refused instead)
            if refused is None:
                fut._ringdp_refuse = None  # (holds the tensor: not needed once the call runs)
                error = self._call_catching(fn)
            else:
                error = refused
                refuse, fut._ringdp_refuse = getattr(fut, "_ringdp_refuse", None), None
                if refuse is not None and getattr(fut, "_ringdp_dropped", False):
                    # take part in it as a rejected call (_reject: the call's transport, under the
                    # lock): the peers fail it at once, naming this rank, and every rank's next
                    # call is the same call. Its own outcome is the drop's, whatever the peers did.
                    try:
                        refuse(str(refused))
                    except Exception:  # noqa: BLE001 -- the peers failed first, or left: they know
                        pass
            self._callbacks_since = time.monotonic()
            _settle(fut, error)  # (its callbacks, here: a collective made in one runs now)
        finally:
            self._callbacks_since = None if outer is None else time.monotonic()
            with self._pending_lock:  # after the callbacks: no other call runs inline beside them
                self._pending -= 1

    def _refusal(self, fut: Future) -> RingError | None:
        """(under _pending_lock, as the worker takes a queued call) Why it does not run: its
        waiter dropped it (_await_queued), or the communicator was torn down meanwhile (close()
        from a callback on the worker, with calls still queued); None: it runs."""
        if getattr(fut, "_ringdp_dropped", False):
            return RingError(f"rank {self.rank}: this collective was dropped before it ran: it waited behind a "
                             f"callback stuck on ringdp's worker thread")
        if self._torn_down:
            return self._closed_error()
        return None

    def _run_queued_until(self, fut: Future, timeout: float | None = None) -> None:
        """On the worker thread, in a callback of a call it finished (a future's then()): a
        Work waited for there whose call is still queued would wait for this thread, which
        waits for it. Run the queued calls instead, in queue order (the order the worker
        would have run them in, on every rank), until `fut`'s call is done. `timeout` (s,
        Work.wait(timeout)): a RingError once it passed, looked at before each queued call
        (one that started runs to its end; the rest stay queued for the worker)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise self._wait_timed_out(timeout, " (waited in a callback on ringdp's worker thread)")
            try:
                item = self._queue.get_nowait()
            except queue.Empty:  # (a call is queued before its Work exists: not expected)
                raise RingError(f"rank {self.rank}: a callback on ringdp's worker thread waits for a "
                                f"collective that is neither queued nor done") from None
            if item is None:  # close(): the worker loop stops when this callback returns
                self._queue.put(None)
                raise self._closed_error()
            self._run_item(item)

    def _call_catching(self, fn) -> BaseException | None:
        """_call(fn); its failure returned, for the Work's waiter, instead of raised."""
        try:
            self._call(fn)
        except BaseException as e:  # noqa: BLE001 -- handed to the waiter
            return e
        return None

    def _call(self, fn):
        """Run one collective (on whichever thread runs it); a failure leaves the flight record.
        The shared-memory waits spin as policy.spin_ns says for the thread: on the worker the
        caller computes meanwhile (async_op), inline it waits. On the worker inside a callback
        (a collective made there), the callback's clock stops meanwhile and restarts after
        (_run_item): it made progress."""
        on_worker = threading.current_thread() is self._worker
        in_callback = on_worker and self._callbacks_since is not None
        if in_callback:
            self._callbacks_since = None
        try:
            with self._locked():
                self._set_spin(on_worker)
                if self._torn_down:  # (an inline call past _take_inline's check as close() came)
                    raise self._closed_error()
                fn()
        except RingError as e:
            self.dump_flight_record("failed collective", str(e))
            raise
        except BaseException as e:
            if not isinstance(e, Exception):  # (Ctrl-C in a wait of Python's: the steps across hosts)
                self._abandon(e, "during a collective")
            raise
        finally:
            if in_callback:
                self._callbacks_since = time.monotonic()

    def _locked(self) -> "_Held":
        """_lock, held by a call or a move (register_in_place). close() on another thread
        tears the endpoints down after it; close() on this thread inside it (a signal
        handler's destroy()) and close() that gave up waiting leave the teardown to it
        (_release_deferred): it runs as the lock is let go (_let_go). The flag is read and the
        lock let go under _pending_lock, where close() sets it (after a failed try for the
        lock), so that a teardown is never left to a holder that already looked."""
        return _Held(self)

    def _let_go(self) -> None:
        """(_Held's exit) Let _lock go, after the teardown close() left to its holder."""
        with self._pending_lock:
            deferred, self._release_deferred = self._release_deferred, False
            if not deferred:
                self._lock_owner = None
                self._lock.release()
        if deferred:
            try:
                self._release_endpoints()
            except Exception as e:  # noqa: BLE001 -- not the call's failure: it ran
                log.warning("ringdp rank %d: releasing the endpoints after destroy() failed: %s", self.rank, e)
            finally:
                self._lock_owner = None
                self._lock.release()

    def _set_spin(self, on_worker: bool) -> None:
        """Set the shared-memory endpoint's spin for the next call (under the lock, between
        calls): the worker's short one while the caller computes beside it, the inline one
        while a caller waits for it (_caller_waits)."""
        if self._spin_set == self._spins[on_worker and self._waiters == 0]:
            return  # (unchanged; a waiter that comes meanwhile sets its own spin after this read)
        with self._spin_lock:
            self._apply_spin(self._spins[on_worker and self._waiters == 0])

    def _inhost_endpoint(self):
        """The shared-memory endpoint of this host's ranks: the group's own, or the in-host
        one of a group across hosts (None: a rank alone on its host, or released)."""
        across = self.across  # (read once: close() may clear it meanwhile, from another thread)
        return self._shm if self._shm is not None else (across.inhost if across is not None else None)

    def _apply_spin(self, spin: int) -> None:
        """(under _spin_lock) The endpoint's spin, set when it changes."""
        if spin != self._spin_set:
            shm = self._inhost_endpoint()
            if shm is not None:
                shm.spin_ns = spin
            self._spin_set = spin

    @contextlib.contextmanager
    def _caller_waits(self, fut: Future, cpu: bool = True, timeout: float | None = None):
        """Wait for the queued call of `fut` (Work.waiting), then enter the block. On the
        worker thread itself (a callback): its queued calls run first, up to that one
        (_run_queued_until). Elsewhere: _await_queued; for a CPU call the worker meanwhile
        spins as an inline call does (policy.spin_ns), since a thread blocked in a wait
        computes nothing: raised at once, during the call too (the endpoint's spin is
        atomic); the worker's next call picks its own."""
        if threading.current_thread() is self._worker:
            self._run_queued_until(fut, timeout)
            yield
            return
        if not cpu:
            self._await_queued(fut, timeout)
            yield
            return
        with self._spin_lock:
            self._waiters += 1
            self._apply_spin(self._spins[False])
        try:
            self._await_queued(fut, timeout)
            yield
        finally:
            with self._spin_lock:
                self._waiters -= 1

    _POLL_S = 1.0  # how often a waiter looks whether the worker is stuck in a callback

    def _await_queued(self, fut: Future, timeout: float | None) -> None:
        """Block until the queued call of `fut` is done; a RingError after `timeout` s
        (None: no limit), or when the call has not started while the worker has been
        running one callback (a future's then()) for longer than this communicator's
        timeout: a callback that waits for something this thread does after the call (a
        lock it holds, an event it sets) never returns, since the call waits for the
        worker. The call is then dropped (never run: the peers' fail in their timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self._POLL_S if deadline is None else min(self._POLL_S, deadline - time.monotonic())
            try:
                fut.exception(timeout=max(left, 0))
                return
            except _FutureTimeout:
                pass
            except BaseException as e:  # a signal's handler raised meanwhile (Ctrl-C: KeyboardInterrupt; any
                # exception here is one: the future is never cancelled, its own failure is not raised here)
                self._abandon(e, "while waiting for a collective queued on ringdp's worker thread")
                raise
            since = self._callbacks_since
            if since is not None and time.monotonic() - since > self.timeout and self._drop(fut):
                raise RingError(
                    f"rank {self.rank}: a collective waited to start behind ringdp's worker thread, which "
                    f"has been running a callback of an earlier one (a future's then()) for over "
                    f"{self.timeout:g} s: a callback that waits for what this thread does after the call (a "
                    f"lock it holds, an event it sets, a torch future derived from a later call) never "
                    f"returns. The call was dropped; ranks that ran it fail in their timeout")
            if deadline is not None and time.monotonic() >= deadline:
                raise self._wait_timed_out(timeout)

    def _drop(self, fut: Future) -> bool:
        """Mark the queued call of `fut` dropped, if the worker has not taken it: the worker
        then fails it instead of running it (_refusal), and its callbacks run there."""
        with self._pending_lock:
            if fut.running() or fut.done():
                return False
            fut._ringdp_dropped = True
            return True

    def _submit(self, fn, async_op: bool, outputs=(), nbytes: int | None = None, refuse=None) -> Work | None:
        """Run collectives in submission order: inline when nothing is queued and the call is
        synchronous, or asynchronous on shared memory (`nbytes`: its size; None elsewhere)
        and small (policy.inline_async: handing it to the worker would cost more than it
        takes), or made on the worker itself (_take_inline), else behind the queued ones on
        the worker thread. An asynchronous call run
        inline returns a completed Work; its failure is raised by wait(), as the worker's."""
        small = async_op and nbytes is not None and policy.inline_async(nbytes, self.config)
        if not self._take_inline(async_op and not small):
            return self._enqueue(fn, async_op, outputs, refuse=refuse)
        if not async_op:
            self._call(fn)
            return None
        error = self._call_catching(fn)
        if error is not None and not isinstance(error, Exception):
            raise error  # (an interrupt on the calling thread is not the collective's failure)
        fut = Future()
        _settle(fut, error)
        return Work(fut, list(outputs))

    def _take_inline(self, async_op: bool) -> bool:
        """Whether this call runs inline, on the calling thread: synchronous with nothing
        pending (a worker call counts until its callbacks ran), or made on the worker thread itself,
        by a callback of a call it just finished (a future's then(): torch's PowerSGD comm
        hook all-reduces and waits there). The worker runs that one now, right after the
        call whose callback made it, as every rank does (the callback registered before the
        next collective, as DDP's hooks do); queued, it would wait for itself. Another
        thread's call meanwhile waits in the queue, so it comes after it on every rank. If
        not inline, the call is counted as pending until the worker has run it (_enqueue)."""
        if self._closed or not self.group_alive:
            raise RingError(self._unusable())
        if self._worker is not None and threading.current_thread() is self._worker:
            return True
        with self._pending_lock:
            inline = self._pending == 0 and not async_op
            if not inline:
                self._pending += 1
        return inline

    def _enqueue(self, fn, async_op: bool, outputs, cuda=None, refuse=None) -> Work | None:
        """Queue `fn` (counted pending by _take_inline) behind the worker's queued calls.
        Under _pending_lock, as close() stops the worker: never behind its stop. `refuse`: a
        collective's rejection (_prepare), what the worker runs instead if it is dropped."""
        fut = Future()
        fut._ringdp_refuse = refuse
        with self._pending_lock:
            try:
                if self._closed:
                    raise self._closed_error()
                if self._worker is None:
                    self._start_worker()
                self._queue.put((fn, fut))
            except BaseException:
                self._pending -= 1  # (counted by _take_inline, never queued)
                raise
        work = Work(fut, list(outputs), cuda, functools.partial(self._caller_waits, cpu=cuda is None))
        if async_op:
            return work
        work.wait()
        return None

    def _prepare(self, tensor, check, timeout, algo, tag, what="all_reduce"):
        """The start every collective (`what`) shares: (timeout s, check()'s result, forced
        algorithm, tag, refuse). Bad input (check() or the arguments raising TypeError/ValueError) is
        announced to the peers, in order, so that they fail at once, then re-raised.
        `refuse(why)`: the same announcement, made by the worker in place of the call if the
        call is dropped while queued (_run_item), so that this rank's calls stay in step with
        its peers' (a call skipped silently would pair its next call with their dropped one).
        A CUDA call while the current stream captures a CUDA graph is refused first, without
        an announcement (which would itself be CUDA work inside the capture)."""
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            # not announced: no CUDA call may be made here (a first call would set the endpoint
            # up inside the capture); every rank captures the same calls, so every rank stops here
            raise ValueError(
                f"ringdp.{what} on rank {self.rank}: the current CUDA stream is capturing a CUDA graph, and "
                "ringdp's CUDA collectives cannot be captured (a call's kernels wait for its peers' counters "
                "at values fixed when it is enqueued, so a replay would not wait for them): make the call "
                "outside the capture (the torch.distributed backend hands captured calls to its inner NCCL "
                "group)"
            )
        t = self.timeout  # (the rejection's, when `timeout` itself is bad)
        try:
            t = policy.timeout_s(timeout, self.timeout)
            return t, check(), self._forced(algo), _current_tag(tag), functools.partial(self._reject, tensor,
                                                                                     timeout_s=t, what=what)
        except (TypeError, ValueError) as e:
            self._reject(tensor, str(e), t, what)
            raise

    def _shm_algo(self, nbytes: int, forced: str) -> int:
        """The algorithm code of a collective of `nbytes` on the shared-memory endpoint."""
        shm = self._shm  # (read once: destroy() on another thread may clear it meanwhile)
        if shm is None:
            raise self._closed_error()
        return policy.ALGO_CODES[self._decide(nbytes, forced, "shm", shm.oneshot_bytes)]

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False, timeout=None, algo=None, tag=None):
        t, code, forced, tag, refuse = self._prepare(tensor, lambda: self._check(tensor, op), timeout, algo, tag)
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.is_cuda:
            return self._all_reduce_cuda(tensor, code, forced, nbytes, async_op, t, tag, refuse)
        if self.across is not None:
            return self._submit(lambda: self.across.all_reduce(tensor, code, forced, t, tag), async_op,
                                outputs=[tensor], refuse=refuse)
        if self._shm_error:
            raise RingError(self._shm_error)
        a = self._shm_algo(nbytes, forced)
        return self._submit(lambda: self._shm.all_reduce(tensor, code, a, t, tag), async_op, outputs=[tensor],
                            nbytes=nbytes, refuse=refuse)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, async_op=False, tag=None, timeout=None,
                              algo=None):
        """torch's reduce_scatter_tensor: `input` holds world x output.numel() elements (block q
        for rank q); rank r's `output` gets the reduction (SUM, AVG, MIN, MAX) of every rank's
        block r. The input is not modified. PREMUL_SUM is the caller's: scale the input, then
        SUM. Direct when every rank's input is registered (ringdp.empty: each rank reduces its
        block from the peers' inputs where they lie, shm_comm.cpp run_direct), else the ring,
        staged through the FIFOs (in place, its partial sums would overwrite the input), or
        one-shot for small inputs (policy.py); CUDA tensors:
        the ring, staged, or one-shot (IPC), on ringdp's stream (as CUDA all_reduce)."""
        t, code, forced, tag, refuse = self._prepare(
            output, lambda: self._check_pair(output, input, op, "reduce_scatter_tensor"), timeout, algo, tag,
            "reduce_scatter")
        if output.is_cuda and self._cuda_endpoint(output.device).hier is not None:
            return self._run_hier(output.device, [output, input], async_op, t,
                                  lambda h: h.reduce_scatter(output, input, code, forced, t, tag), refuse)
        if output.is_cuda:  # one-shot stages the whole input
            a = self._cuda_algo(output.device, input.numel() * input.element_size(), forced)
            return self._run_cuda(
                output.device, [output, input], [output], async_op,
                lambda ep, stream: ep.native.reduce_scatter_tensor(output, input, code, stream, a, t), refuse)
        self._cpu_path()
        if self.across is not None:
            return self._submit(lambda: self.across.reduce_scatter(output, input, code, forced, t, tag), async_op,
                                outputs=[output], refuse=refuse)
        nbytes = input.numel() * input.element_size()
        a = self._shm_algo(nbytes, forced)
        return self._submit(lambda: self._shm.reduce_scatter(output, input, code, a, t, tag), async_op,
                            outputs=[output], nbytes=nbytes, refuse=refuse)

    def all_gather_into_tensor(self, output, input, async_op=False, tag=None, timeout=None, algo=None):
        """torch's all_gather_into_tensor: `output` holds world x input.numel() elements and
        block q of it becomes rank q's `input` (which may itself be block r of `output`).
        Direct, with no staging copy, when every rank's output is registered (ringdp.empty:
        each rank copies the peers' blocks from their outputs, shm_comm.cpp run_direct);
        one-shot for small inputs (policy.py). CUDA tensors: the ring on ringdp's stream (the
        input copied into its block first, unless it is that block; on the IPC transport a
        registered output (ringdp.empty(device="cuda")) is read in place by the successor),
        or one-shot (IPC)."""
        t, _, forced, tag, refuse = self._prepare(
            output, lambda: self._check_pair(output, input, None, "all_gather_into_tensor"), timeout, algo, tag,
            "all_gather")
        if output.is_cuda and self._cuda_endpoint(output.device).hier is not None:
            return self._run_hier(output.device, [output, input], async_op, t,
                                  lambda h: h.all_gather(output, input, forced, t, tag), refuse)
        if output.is_cuda:  # one-shot stages this rank's input
            a = self._cuda_algo(output.device, input.numel() * input.element_size(), forced)
            return self._run_cuda(output.device, [output, input], [output], async_op,
                                  lambda ep, stream: ep.native.all_gather_tensor(output, input, stream, a, t), refuse)
        self._cpu_path()
        if self.across is not None:
            return self._submit(lambda: self.across.all_gather(output, input, forced, t, tag), async_op,
                                outputs=[output], refuse=refuse)
        a = self._shm_algo(input.numel() * input.element_size(), forced)
        return self._submit(lambda: self._shm.all_gather(output, input, a, t, tag), async_op, outputs=[output],
                            nbytes=output.numel() * output.element_size(), refuse=refuse)

    def broadcast(self, tensor, src, async_op=False, tag=None, timeout=None, algo=None, root_error=None):
        """Copy `tensor` of rank `src` (a rank of this communicator's group) into `tensor` on
        every rank: a pipelined chain src -> src+1 -> ... along the ring (direct when every
        rank's tensor is registered: each copies src's where it lies, shm_comm.cpp
        run_direct), or one-shot for small tensors (policy.py). CUDA tensors:
        the chain on ringdp's stream (IPC: registered tensors read in place), or one-shot
        (IPC). `root_error`: what the caller found wrong with the root it was given
        (ringdp.broadcast: src and group_src both or neither, a src outside the group),
        a ValueError announced to the peers as any bad input is."""
        def check():
            self._check(tensor, None, "broadcast")
            if root_error is not None:
                raise ValueError(root_error)
            if isinstance(src, bool) or not isinstance(src, int):
                raise TypeError(f"ringdp.broadcast: src must be an int rank, got {type(src).__name__}")
            if not 0 <= src < self.world:
                raise ValueError(f"ringdp.broadcast on rank {self.rank}: src={src} is not a rank of this group "
                                 f"(world size {self.world})")

        t, _, forced, tag, refuse = self._prepare(tensor, check, timeout, algo, tag, "broadcast")
        if tensor.is_cuda and self._cuda_endpoint(tensor.device).hier is not None:
            return self._run_hier(tensor.device, [tensor], async_op, t,
                                  lambda h: h.broadcast(tensor, src, forced, t, tag), refuse)
        if tensor.is_cuda:
            a = self._cuda_algo(tensor.device, tensor.numel() * tensor.element_size(), forced)
            return self._run_cuda(tensor.device, [tensor], [tensor], async_op,
                                  lambda ep, stream: ep.native.broadcast_tensor(tensor, src, stream, a, t), refuse)
        self._cpu_path()
        if self.across is not None:
            return self._submit(lambda: self.across.broadcast(tensor, src, forced, t, tag), async_op,
                                outputs=[tensor], refuse=refuse)
        nbytes = tensor.numel() * tensor.element_size()
        a = self._shm_algo(nbytes, forced)
        return self._submit(lambda: self._shm.broadcast(tensor, src, a, t, tag), async_op, outputs=[tensor],
                            nbytes=nbytes, refuse=refuse)

    def _cuda_algo(self, device, nbytes: int, forced: str) -> int:
        """The algorithm code of a CUDA collective that one-shot would stage `nbytes` for
        (policy.choose_algo against the endpoint's one-shot capacity)."""
        ep = self._cuda_endpoint(device)
        return policy.ALGO_CODES[self._decide(nbytes, forced, ep.kind, ep.native.oneshot_bytes)]

    def _all_reduce_cuda(self, tensor, code, forced, nbytes, async_op, t, tag, refuse=None):
        if self._cuda_endpoint(tensor.device).hier is not None:
            return self._run_hier(tensor.device, [tensor], async_op, t,
                                  lambda h: h.all_reduce(tensor, code, forced, t, tag), refuse)
        a = self._cuda_algo(tensor.device, nbytes, forced)
        return self._run_cuda(tensor.device, [tensor], [tensor], async_op,
                              lambda ep, stream: ep.native.all_reduce_tensor(tensor, code, stream, a, t), refuse)

    def _run_hier(self, device, tensors, async_op, t, call, refuse=None):
        """A CUDA collective across hosts on the hierarchy (ringdp/hosts.py on_cuda): `call(h)`
        with the endpoint's CUDA CrossHost h, inside h.on_stream, ordered as _run_cuda orders
        a transport's call; tensors[0] is the output."""
        return self._run_cuda(device, tensors, tensors[:1], async_op,
                              lambda ep, stream: ep.hier.on_stream(stream, t, lambda: call(ep.hier)), refuse)

    def _run_cuda(self, device, tensors, outputs, async_op, enqueue, refuse=None):
        """A CUDA collective, stream-ordered like torch's NCCL ones (module doc).
        `enqueue(endpoint, stream)` makes ringdp's stream wait for `stream`, puts the ring on
        ringdp's stream and makes `stream` wait for its end (csrc/cuda, no host sync).
        Inline (synchronous, nothing queued): `stream` is the current stream, nothing else
        (no record_stream either: that stream waits for ringdp's before anything after the
        call, so memory freed there is reused only after the ring). An async call inline
        (made on the worker: _take_inline) also records `done` on that stream for its Work.
        Queued (on the worker, later): an event on the current stream, recorded on the
        calling thread, and every tensor it touches recorded on ringdp's stream (the caching
        allocator keeps them until ringdp is done); then, in submission order, ringdp's stream
        waits on the event, `enqueue` runs with ringdp's own stream as `stream`, and an event
        `done` after it is what Work.wait() makes the waiter's stream wait on."""
        ep = self._cuda_endpoint(device)
        if self._take_inline(async_op):
            caller = torch.cuda.current_stream(device)
            if not async_op:
                self._call(lambda: enqueue(ep, caller.cuda_stream))
                return None
            cuda = cuda_comm.Enqueued(ep, torch.cuda.Event())
            cuda.begin()
            self._call(lambda: enqueue(ep, caller.cuda_stream))
            # async inline (made on the worker, by a callback): the caller may free the
            # tensors before waiting; the allocator keeps them until the ring is done
            for x in tensors:
                x.record_stream(caller)
            cuda.enqueued()
            cuda.done.record(caller)
            fut = Future()
            _settle(fut, None)
            return Work(fut, list(outputs), cuda)
        try:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # on the calling thread
            cuda = cuda_comm.Enqueued(ep, torch.cuda.Event())
            for x in tensors:
                x.record_stream(ep.stream)
        except BaseException:
            with self._pending_lock:  # (counted by _take_inline, never queued)
                self._pending -= 1
            raise

        def run():
            ep.stream.wait_event(ready)
            cuda.begin()
            enqueue(ep, ep.stream.cuda_stream)
            cuda.enqueued()
            cuda.done.record(ep.stream)

        return self._enqueue(run, async_op, outputs, cuda=cuda, refuse=refuse)

    def _decide(self, nbytes: int, forced: str, transport: str, capacity: int) -> str:
        key = (transport, capacity)
        threshold = self._thresholds.get(key)
        if threshold is None:  # (a pure function of the configuration, read once, and of the key)
            threshold = self._thresholds[key] = policy.oneshot_threshold(transport, self.world, self.config, capacity)
        return policy.choose_algo(nbytes, forced, threshold, capacity)

    def _forced(self, algo) -> str:
        if algo is None:
            return self.config.algo
        forced = str(algo).strip().lower()
        if forced not in ALGOS:
            raise ValueError(f"ringdp.all_reduce: algo={algo!r}: expected one of {', '.join(ALGOS)}")
        return forced

    def transport(self, device="cpu") -> str:
        """The transport a tensor on `device` goes through: "shm", "ipc" or "nccl"."""
        if torch.device(device).type == "cuda":
            return self._cuda.kind if self._cuda is not None else policy.transport_for(self.hosts, self.config)
        return "shm"

    def algo_for(self, nbytes: int, device="cpu", algo=None) -> str:
        """The algorithm ("ring" or "oneshot") this communicator runs for an all-reduce of
        `nbytes` bytes on `device` with the given `algo` (None: RINGDP_ALGO, else auto).
        For a CUDA device this sets the CUDA endpoint up if needed (collective)."""
        forced = self._forced(algo)
        if torch.device(device).type == "cuda":
            ep = self._cuda_endpoint(device)
            return self._decide(nbytes, forced, ep.kind, ep.native.oneshot_bytes)
        if self._shm_error:
            raise RingError(self._shm_error)
        return self._decide(nbytes, forced, "shm", self._shm.oneshot_bytes)

    def _check(self, tensor, op, what="all_reduce", name="tensor") -> int:
        """Validate one tensor argument of collective `what` (and the op, when not None);
        returns the op's code (SUM's when op is None)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ringdp.{what} expects a torch.Tensor as {name}, got {type(tensor).__name__}")
        code = _types.op_code(op) if op is not None else _types.SUM
        if tensor.dtype not in _SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in _C.supported_dtypes())
            raise TypeError(f"ringdp.{what} does not support dtype {tensor.dtype}; supported: {names}")
        if tensor.layout != torch.strided:
            raise ValueError(f"ringdp.{what} needs a dense (strided) {name}, got layout {tensor.layout}")
        if not (tensor.is_cpu or (tensor.is_cuda and _C.WITH_CUDA)):
            raise ValueError(
                f"ringdp.{what} on rank {self.rank}: {name} is on {tensor.device}, which this ringdp "
                f"build does not reduce (build_info(): {build_info(self.config)})"
            )
        ep = self._cuda  # (read once: close() on another thread may clear it)
        if tensor.is_cuda and ep is not None and tensor.device != ep.device:
            raise ValueError(
                f"ringdp.{what} on rank {self.rank}: {name} is on {tensor.device}, but this communicator's CUDA "
                f"collectives run on {ep.device} (set up by its first CUDA call): one GPU per rank "
                f"and group, as with torch's NCCL groups"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"ringdp.{what} needs a contiguous {name} (shape {tuple(tensor.shape)}, strides "
                f"{tensor.stride()}); pass t.contiguous() and copy the result back"
            )
        if code == _types.AVG and not tensor.dtype.is_floating_point:
            raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
        return code

    def _check_pair(self, output, input, op, what: str) -> int:
        """Validate output and input of reduce_scatter_tensor / all_gather_into_tensor:
        each as _check, then the same dtype and device, and the sizes (output * world ==
        input for reduce_scatter, output == input * world for all_gather)."""
        code = self._check(output, op, what, "output")
        self._check(input, op, what, "input")
        if output.dtype != input.dtype:
            raise TypeError(f"ringdp.{what}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        if output.device != input.device:
            raise ValueError(f"ringdp.{what}: output is on {output.device}, input on {input.device}")
        n = self.world
        if what == "reduce_scatter_tensor" and output.numel() * n != input.numel():
            raise ValueError(
                f"ringdp.reduce_scatter_tensor on rank {self.rank}: input has {input.numel()} elements, expected "
                f"output.numel() x world size = {output.numel()} x {n} = {output.numel() * n}")
        if what == "all_gather_into_tensor" and input.numel() * n != output.numel():
            raise ValueError(
                f"ringdp.all_gather_into_tensor on rank {self.rank}: output has {output.numel()} elements, expected "
                f"input.numel() x world size = {input.numel()} x {n} = {input.numel() * n}")
        # The smaller tensor is either this rank's block of the larger one (in place) or
        # apart from it: peers read the other blocks while the call runs (the direct path
        # reads them where they lie), so a partial overlap would race with them.
        # (The backend runs such a call on a copy of the smaller tensor, as gloo allows it.)
        small, large = (output, input) if what == "reduce_scatter_tensor" else (input, output)
        if overlaps_apart_from_block(small, large, self.rank):
            nbytes = small.numel() * small.element_size()
            start, end, lo = small.data_ptr(), small.data_ptr() + nbytes, large.data_ptr()
            names = ("output", "input") if small is output else ("input", "output")
            raise ValueError(
                f"ringdp.{what} on rank {self.rank}: the {names[0]} overlaps the {names[1]} other than as "
                f"its block {self.rank} (bytes {start - lo}..{end - lo} of it, block {self.rank} is "
                f"{self.rank * nbytes}..{(self.rank + 1) * nbytes}); pass a separate tensor or exactly that block")
        return code

    def _cpu_path(self) -> None:
        """CPU reduce_scatter, all_gather and broadcast run on the shared-memory transport, or
        across hosts (ringdp/hosts.py): a RingError saying why when this communicator has
        neither (closed, or its group was destroyed)."""
        if self._shm_error and self.across is None:
            raise RingError(self._shm_error)

    def _reject(self, tensor, why: str, timeout_s: float, what: str = "all_reduce") -> None:
        """Take part in this collective (`what`) without data, on the transport of the tensor's
        device, so that the peers fail at once naming this rank and `why` (across hosts:
        CrossHost.reject, the rejection itself not raising here: the caller raises `why`)."""
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda and _C.WITH_CUDA:
            ep = self._cuda_endpoint(tensor.device)
            if ep.hier is not None:  # its peers: in-host (IPC) and the call check
                tag = _tags.tag
                try:
                    self._submit(lambda: ep.hier.reject(what, why, timeout_s, tag), async_op=False)
                except RingError:
                    pass
                return
            self._submit(lambda: ep.native.reject(why), async_op=False)
        elif self._shm is not None:
            tag = _tags.tag
            self._submit(lambda: self._shm.reject(why, timeout_s, tag), async_op=False)
        elif self.across is not None:
            tag = _tags.tag
            try:
                self._submit(lambda: self.across.reject(what, why, timeout_s, tag), async_op=False)
            except RingError:
                pass

    # ---- registered memory --------------------------------------------------------------
    def empty(self, size, dtype=torch.float32, device="cpu") -> torch.Tensor:
        device = torch.device(device)
        sizes = [int(s) for s in size]
        if device.type == "cuda":
            try:
                return self._cuda_endpoint(device).arena.empty(sizes, dtype)
            except RingError as e:  # arena exhausted: callers fall back to ordinary memory
                raise ValueError(str(e)) from None
        if device.type != "cpu":
            raise ValueError(f"ringdp.empty: device {device} is not supported")
        shm = self._cpu_arena()
        if shm is None and self.cross_path == policy.LEADERS and self.local_size == 1:
            return torch.empty(sizes, dtype=dtype)  # alone on its host: nothing in-host to register for
        if shm is None:
            raise ValueError(self._shm_error)
        return shm.empty(sizes, dtype)

    def _cpu_arena(self):
        """The endpoint whose arena registered CPU tensors come from: the group's (one host),
        else this host's (a group that spans hosts: its in-host steps then run in place);
        None on the flat path across hosts (nothing in-host) or once closed."""
        if self._shm is not None:
            return self._shm
        return self.across.inhost if self.across is not None else None

    def register_in_place(self, tensor: torch.Tensor) -> bool | None:
        """Move a CPU tensor's memory into registered shared memory (the arena of
        ringdp.empty) in place, so that ringdp reduces it without staging copies: its values
        are copied there and its storage's memory pointer swapped (torch's
        UntypedStorage._swap_data_ptr_, as share_memory_() does), so every view of the storage
        follows and the old memory is freed. Memory that something outside torch still points
        at (a numpy array from .numpy(), a DLPack export) would NOT follow: callers decide
        which tensors may move (ringdp/backend.py: only with RINGDP_BACKEND_ADOPT_MIN_BYTES).
        The moved storage cannot be resized (it is the arena's, as a ringdp.empty tensor's).

        Ordered with this communicator's calls, as a collective is: with none pending it
        moves now and returns whether it did; else it is queued behind them (a collective
        still running on the tensor finishes first, a later one finds it moved) and returns
        None. Never raises: it does not move (False) a tensor that is not a whole contiguous
        CPU storage of a dtype ringdp reduces (a registered all_reduce of any of them runs
        direct, float16 and bfloat16 included), pinned, shared or already registered, nor when the arena or /dev/shm is full, the
        communicator is closed, or torch lacks the swap."""
        if not self._movable(tensor):
            return False
        try:
            inline = self._take_inline(async_op=False)
        except RingError:  # closed, or its group destroyed
            return False
        if inline:
            with self._locked():
                return self._move(tensor)
        try:
            self._enqueue(lambda: self._move(tensor), True, [tensor])
        except RingError:  # closed meanwhile
            return False
        return None

    def _movable(self, tensor: torch.Tensor) -> bool:
        return (hasattr(torch.UntypedStorage, "_swap_data_ptr_") and isinstance(tensor, torch.Tensor)
                and tensor.device.type == "cpu" and tensor.dtype in _SUPPORTED_DTYPES
                and tensor.layout == torch.strided
                and tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.numel() > 0
                and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
                and not tensor.is_pinned() and not tensor.is_shared())

    def _move(self, tensor: torch.Tensor) -> bool:
        """register_in_place's move, on the thread that runs this communicator's calls."""
        try:
            if self.is_registered(tensor):
                return False
            reg = self.empty((tensor.numel(),), tensor.dtype)
            if not self.is_registered(reg):  # (a rank alone on its host gets ordinary memory)
                return False
            reg.copy_(tensor.view(-1))
            tensor.untyped_storage()._swap_data_ptr_(reg.untyped_storage())  # reg now holds the old memory
            return True
        except (RuntimeError, ValueError, TypeError) as e:  # the arena or /dev/shm full (RingError), ...
            log.debug("ringdp rank %d: register_in_place: not moved (%s)", self.rank, e)
            return False

    def is_registered(self, tensor: torch.Tensor) -> bool:
        if tensor.is_cuda:
            return self._cuda is not None and bool(self._cuda.arena.is_registered(tensor))
        shm = self._cpu_arena()
        return tensor.device.type == "cpu" and shm is not None and bool(shm.is_registered(tensor))

    def synchronize(self):
        """Wait for queued collectives (and, on CUDA, for ringdp's stream); raise failures."""
        self._submit(lambda: None, async_op=False)
        if self._cuda is not None:
            self._cuda.synchronize()

    # ---- diagnosis ----------------------------------------------------------------------
    def flight_record(self) -> list[dict]:
        """This rank's last collectives on the shared-memory transport, oldest first: seq,
        kind, count, dtype, op, algo (asked for), path (what moved the data: none, oneshot,
        ring_staged, direct), tag, status (running, ok, failed), start and end
        (microseconds since the epoch; end 0 while running)."""
        shm = self._cpu_arena()
        if shm is None:
            return []
        names = {code: name for name, code in policy.ALGO_CODES.items()}
        recs = shm.flight_record()
        for r in recs:
            r["algo"] = names.get(r["algo"], r["algo"])
            r["transport"] = "shm"
        return recs

    def dump_flight_record(self, reason: str, report: str = "") -> str | None:
        """Write the flight record, with `reason` and `report`, to RINGDP_TRACE's folder as
        ringdp_flight.rank<r>.json, r the global rank, with the group's name for a group other
        than the world (ringdp_flight.rank<r>.g<name>.json: config.trace_path, the one rule);
        returns the path (None when RINGDP_TRACE is not set). Never raises: a diagnosis must
        not hide the failure it describes."""
        if not self.config.trace:
            return None
        try:
            pg = self._pg()
            if pg is None or not dist.is_initialized():
                raise RuntimeError("its process group is gone")
            global_rank, group = dist.get_rank(), (None if _is_world(pg) else _group_key(pg))
            path = trace_path(self.config.trace, global_rank, group, kind="flight")
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {"rank": self.rank, "world": self.world, "global_rank": global_rank, "group": group,
                   "host": self.host, "pid": os.getpid(), "time": time.time(), "reason": reason,
                   "report": report, "calls": self.flight_record()}
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, path)
            return str(path)
        except Exception as e:  # noqa: BLE001
            log.warning("ringdp rank %d: could not write the flight record: %s", self.rank, e)
            return None

    # ---- teardown -----------------------------------------------------------------------
    def set_timeout(self, timeout) -> float:
        """This communicator's timeout from now on (seconds or a timedelta; policy.timeout_s):
        its calls made after this, its rendezvous, and across hosts its cross-host gloo
        groups (CrossHost.set_timeout). A call already made keeps its own. Returns seconds."""
        secs = policy.timeout_s(timeout, None)
        self.config = self.config.replace(timeout_s=secs)
        self.timeout = self.rendezvous.timeout_s = secs
        if self.across is not None:
            self.across.set_timeout(secs)
        return secs

    def close(self, wait: bool = True, limit: float | None = None, abandon: BaseException | None = None):
        """Stop the worker and release the endpoints. Collective while the group is alive
        (the CUDA endpoint's teardown barrier); local once the group was destroyed. wait: the
        worker's queued calls run first, within `limit` seconds (None: the timeout).
        wait=False (the backend's abort()): returns at once, waiting for nothing. The
        shared-memory endpoint is aborted (ShmComm.abort, from this thread): a call in flight
        on it fails within milliseconds, and peers blocked on this rank fail fast naming it;
        the calls still queued then fail unrun as the worker comes to them. A cross-host
        step's wait (a group across hosts) ends within 0.1 s here and within about a second
        on the other ranks (CrossHost.abort). The CUDA endpoint is halted
        (CudaEndpoint.halt: its collectives on the device give up). A call still being
        enqueued on CUDA keeps the endpoints until it returns, then releases them (_locked).
        A wait for the worker, or for the CUDA work on ringdp's streams (_wait_for_device),
        that lasts says so (_join_worker). Ctrl-C in it (any exception raised there by a signal's
        handler) leaves the calls as Ctrl-C in a call does, tears down locally and raises
        the KeyboardInterrupt; `abandon` (the KeyboardInterrupt another communicator's close
        raised: destroy(), the exit) leaves them so at once (_leave_on)."""
        with self._pending_lock:  # (a call being queued is queued before the stop, or refused: _enqueue)
            if self._closed:
                return
            self._closed = True
            if self._worker is not None:
                self._queue.put(None)
        limit = (self.timeout if limit is None else limit) if wait else 0.0
        deadline = time.monotonic() + limit  # (one wait in all: the worker's call, then the lock)
        interrupted = None  # this close's own wait was interrupted: raised at the end
        if abandon is None and wait and self._worker is not None and self._worker is not threading.current_thread():
            try:  # (from a callback on it: it stops after the callback)
                self._join_worker(deadline)
            except BaseException as e:  # noqa: BLE001 -- Ctrl-C: raised once the teardown is done
                interrupted = abandon = e
        # An inline call in flight on another thread (past _take_inline's check before the
        # stop) finishes first; one that takes the lock after finds _torn_down (_call). A call
        # still running at the deadline (its own timeout may be longer) keeps its endpoints,
        # and so does a call on this thread (close() from a signal handler inside it, which
        # must not wait for itself): the call releases them as it ends (_locked).
        with self._pending_lock:
            self._torn_down = True
        if abandon is not None:  # (after _torn_down: the queued calls are refused unrun)
            self._leave_on(abandon, own=interrupted is not None)
            deadline = time.monotonic()
        if not wait:  # (after _torn_down: the worker refuses the queued calls once the one in flight fails)
            shm, across, cuda = self._inhost_endpoint(), self.across, self._cuda
            if across is not None:  # (first: an in-host step the abort fails finds it marked) a cross-host
                across.abort("ProcessGroup.abort() was called", self._last_store())  # wait ends too, everywhere
            if isinstance(shm, _C.ShmComm):
                shm.abort("ProcessGroup.abort() was called")
            if cuda is not None:  # its collectives give up, as torch's NCCL abort() ends its own; last, as
                cuda.halt(f"rank {self.rank}: ProcessGroup.abort() was called")  # in _abandon (NCCL: seconds)
        mine = self._lock_owner == threading.get_ident()
        got = not mine and self._lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        if not got:
            with self._pending_lock:  # (the holder reads the flag and lets go under it: _locked)
                got = self._lock.acquire(blocking=False)
                self._release_deferred = not got
        try:
            if got:
                try:  # (after Ctrl-C, no teardown barrier with the peers: they are failing)
                    self._release_endpoints(collective=abandon is None)
                finally:
                    self._lock.release()
            elif not mine and wait and abandon is None:
                log.warning("ringdp rank %d: destroy() while a collective still runs after %g s: its "
                            "endpoints are released when it ends", self.rank, limit)
        finally:  # (a failed CUDA teardown too)
            self._shm_error = self._unusable()  # what CPU calls on this communicator raise from now on
        if interrupted is not None:
            raise interrupted

    def _leave_on(self, e: BaseException, own: bool) -> None:
        """(close(), after _torn_down) Leave the calls still unfinished as a Ctrl-C in a call
        does (_abandon: the call in flight fails within milliseconds, the peers fail naming
        this rank and why), say so, and give the worker policy.ABANDON_WAIT_S to leave the
        call and refuse the queued ones: a daemon thread still inside C++ when Python
        finalizes ends the process in std::terminate. `own`: the interrupt came in this
        communicator's wait (else in another's: destroy(), the exit). A second Ctrl-C in
        that wait is let go: the teardown goes on, and the first one is raised."""
        self._abandon(e, "while closing, in the wait for its unfinished collectives" if own else
                      "while closing (in another communicator's wait)")
        if own:
            log.warning("ringdp rank %d: interrupted while closing: its unfinished collectives were left "
                        "(their peers fail naming this rank)", self.rank)
        if self._worker is not None and self._worker is not threading.current_thread():
            try:
                self._worker_done.wait(timeout=policy.ABANDON_WAIT_S)
            except BaseException:  # noqa: BLE001 -- a second Ctrl-C: see above
                pass

    def _join_worker(self, deadline: float) -> None:
        """close()'s wait, until `deadline`, for the worker to run the calls queued before the
        stop and end. One that lasts policy.CLOSE_NOTE_S says so on stderr (log), naming the
        calls: a program that ends with a collective it never waited for (async_op), which its
        peers have not made, would otherwise sit silent at exit for up to the timeout."""
        done = self._worker_done  # (not Thread.join: one that Ctrl-C interrupted marks the thread
        # stopped while it runs, CPython 3.11's _wait_for_tstate_lock, and a join after returns at once)
        if done.wait(timeout=max(0.0, min(deadline - time.monotonic(), policy.CLOSE_NOTE_S))):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        with self._pending_lock:
            n = max(1, self._pending)
        running = [f"{r['kind']} #{r['seq']}" for r in self.flight_record() if r["status"] == "running"]
        log.warning("ringdp rank %d: closing waits for %d unfinished call%s on ringdp's worker%s, at most %.0f s "
                    "more; Ctrl-C leaves %s", self.rank, n, "s" if n > 1 else "",
                    f" ({', '.join(running)} running: it waits for its peers to make it too)" if running else "",
                    left, "them" if n > 1 else "it")
        done.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _release_endpoints(self, collective: bool = True) -> None:
        """(close(), or the call close() left it to: under _lock) Let the CUDA endpoint, the
        shared-memory one and the cross-host groups go; `collective` False: the CUDA
        endpoint's teardown without its barrier with the peers (after a Ctrl-C). The CUDA
        work still queued is waited for first (_wait_for_device): Ctrl-C there leaves it,
        tears down locally and is raised at the end."""
        ep, interrupted = self._cuda, None
        try:
            if ep is not None:  # (its teardown barrier may fail: a peer died)
                try:
                    self._wait_for_device(ep)
                except BaseException as e:  # noqa: BLE001 -- Ctrl-C: raised once the teardown is done
                    interrupted, collective = e, False
                    self._abandon(e, "while closing, in the wait for its CUDA collectives")
                    _regardless(log.warning, "ringdp rank %d: interrupted while closing: its CUDA collectives were "
                                "left (their peers fail, naming this rank over CUDA IPC)", self.rank)
                self._cuda = None
                try:  # (every transport is freed, whatever one raised: CudaEndpoint.close)
                    ep.close(self.rendezvous if self.group_alive and collective else None)
                except BaseException as e:  # noqa: BLE001 -- after the interrupt: it is what is raised
                    if interrupted is None:
                        raise
                    _regardless(log.warning, "ringdp rank %d: the CUDA teardown after the interrupt raised %s: %s",
                                self.rank, type(e).__name__, e)
        finally:  # the others go whatever it did
            # Registered tensors still alive keep the native object (and its mapping) alive.
            self._shm = None
            if self.across is not None:
                across, self.across = self.across, None
                across.close()  # (a backend's ProcessGroupGloo across hosts holds the store)
        if interrupted is not None:
            raise interrupted

    def _wait_for_device(self, ep) -> None:
        """(closing) Wait for the CUDA work still queued on ringdp's streams where Ctrl-C
        reaches the wait (CudaEndpoint.wait_queued). One that lasts policy.CLOSE_NOTE_S says so
        on stderr: a program that ends with a collective its peers have not made would
        otherwise sit silent at exit until the device gives up on it (the timeout)."""
        def lasting():
            log.warning("ringdp rank %d: closing waits for the CUDA collectives queued on %s (they wait for "
                        "their peers to make them too; the device gives up on them within the timeout, %g s); "
                        "Ctrl-C leaves them", self.rank, ep.device, self.timeout)

        ep.wait_queued(lasting)


class _Held:
    """Communicator._locked(): a class, not a contextlib generator, since every call takes
    it (the generator cost 1-2 us of a small call's ~5)."""
    __slots__ = ("comm",)

    def __init__(self, comm: Communicator):
        self.comm = comm

    def __enter__(self) -> None:
        comm = self.comm
        comm._lock.acquire()
        comm._lock_owner = threading.get_ident()

    def __exit__(self, *exc) -> bool:
        self.comm._let_go()
        return False


def _regardless(fn, *args) -> None:
    """fn(*args), whatever it raises, a second Ctrl-C included: a step of leaving a call
    (Communicator._abandon), whose caller raises the interrupt that started it."""
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 -- see above
        pass


def _host_key(hostname: str) -> str:
    """This machine's key: the hostname and the kernel's boot id (two containers with one
    hostname are told apart; a machine that rebooted is a new host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{hostname}/{boot}" if boot else hostname


def _on_stall(ref, report: str) -> None:
    """The shared-memory endpoint's stall handler (on the waiting thread, once per call)."""
    log.warning("%s", report)
    c = ref()
    if c is not None:
        path = c.dump_flight_record("stall", report)
        if path:
            log.warning("ringdp rank %d: flight record written to %s", c.rank, path)


_comms: dict[str, Communicator] = {}
# Every communicator whose worker thread was started, until it is collected (_close_at_exit)
_working: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
# The table's lock, held only to read or change it (never while a communicator is set up,
# which waits for the peers). Reentrant: a signal handler that calls destroy() (a graceful
# shutdown on torchrun's SIGTERM) may run on a thread that holds it.
_comms_lock = threading.RLock()
# One lock per group key, held while that group's communicator is set up: a second thread
# asking for the same group waits for it, while set-ups of different groups (on threads of
# their own, started in any order) go on side by side.
_setup_locks: dict[str, threading.RLock] = {}


def _check_timeout(c: Communicator, timeout) -> None:
    """init(timeout=) on an existing communicator: the same timeout, or a clear error."""
    if timeout is not None and policy.timeout_s(timeout, c.timeout) != c.timeout:
        raise ValueError(
            f"rank {c.rank}: ringdp.init(timeout={timeout!r}): this group's communicator exists already, "
            f"with a timeout of {c.timeout:g} s (set by an earlier ringdp call on the group, which set it up). "
            f"Call ringdp.init(group, timeout=...) before the group's first ringdp call, or pass timeout= to a call")


@eager
def init(group=None, timeout=None) -> Communicator:
    """Set ringdp up for `group` (default: the default process group). Collective. Optional:
    every ringdp call initialises lazily. Communicators left from destroyed groups are closed
    (locally) first. A group of ringdp's backend: its own."""
    _live_group(group)
    c = _backend_communicator(group)
    if c is not None:
        _check_timeout(c, timeout)
        return c
    key = _group_key(group)
    with _comms_lock:
        setup = _setup_locks.setdefault(key, threading.RLock())
    with setup:
        with _comms_lock:
            c = _comms.get(key)
            if c is not None and c.group_alive:
                _check_timeout(c, timeout)
                return c
            stale = [_comms.pop(k) for k, old in list(_comms.items()) if not old.group_alive]
        for old in stale:  # (local: their groups are gone)
            old.close()
        c = Communicator(group, timeout)
        with _comms_lock:
            _comms[key] = c
        return c


@eager
def get_communicator(group=None) -> Communicator:
    """The communicator of `group` (None: the default group), created on first use
    (collective). RingError when the group was destroyed. A group whose backend is ringdp's
    (ringdp/backend.py) has its communicator already: the backend's."""
    global _default_comm
    if group is None:  # the common call: the default group's communicator, as last found
        c = _default_comm()
        if c is not None and not c._closed:
            pg = c._pg()  # (None once the group is gone, as default_pg is after destroy_process_group)
            if pg is not None and pg is dist.distributed_c10d._world.default_pg:
                return c
    c = _backend_communicator(group)
    if c is None:
        if _is_world(group):
            c = _comms.get("world")
        elif group in dist.distributed_c10d._world.pg_map:
            c = _comms.get(_group_key(group))
        if c is None or not c.group_alive:
            c = init(group)  # set up, or say why not
    if _is_world(group):
        _default_comm = weakref.ref(c)  # (weakly: it goes with its group, as ever)
    return c


def _no_comm():
    return None


# get_communicator(None)'s last answer, checked at each use: still open, still the default group's
_default_comm = _no_comm


def _backend_communicator(group):
    """The communicator of ringdp's torch.distributed backend when `group` (None: the default
    group) is one of its process groups, else None."""
    if _is_world(group):
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    fn = getattr(group, "_ringdp_communicator", None)
    return fn() if fn is not None else None


@eager
def destroy(group=None):
    """Release ringdp's resources for `group` (all groups when None): collective for a group
    that is alive, local for one that was destroyed."""
    with _comms_lock:  # (taken from the table under the lock, closed outside it: a callback on a
        if group is None:  # worker that close() joins may look a communicator up meanwhile)
            keys = list(_comms)
        elif _is_world(group) or group in dist.distributed_c10d._world.pg_map:
            keys = [_group_key(group)]
        else:  # a destroyed group: the communicator made for it, if any
            keys = [k for k, c in _comms.items() if c._pg() is group]
        comms = [c for c in (_comms.pop(k, None) for k in keys) if c is not None]
    first, interrupt = _close_each(comms)
    if interrupt is not None:  # (Ctrl-C: raised before any other error)
        raise interrupt
    if first is not None:
        raise first


def _close_each(comms, limit: float | None = None, interrupt: BaseException | None = None):
    """Close every one of `comms`, whatever one of them raised; after a Ctrl-C (`interrupt`,
    or one raised in a close()'s wait) the others' calls are left at once (close(abandon=)).
    Returns (the first error, the interrupt)."""
    first = None
    for c in comms:
        try:
            c.close(limit=limit, abandon=interrupt)
        except Exception as e:  # noqa: BLE001
            first = first or e
        except BaseException as e:  # noqa: BLE001 -- Ctrl-C
            interrupt = e
    return first, interrupt


# under torch.compile: ringdp's calls run eagerly (ringdp/_eager.py)
eager_methods(Communicator)
eager_methods(Work)


def _close_at_exit() -> None:
    """At interpreter exit, while threads still run: destroy() (ringdp's own communicators),
    then every communicator still open, a backend group's that torch never shut down
    included (a script that ends without destroy_process_group), each waiting at most
    policy.EXIT_WAIT_S for its worker. The workers are daemon threads: one still inside a
    call when Python finalizes (calls queued behind a failure: DDP's buckets after a peer
    died) dies taking back the GIL on its way out of C++, and the process ends in
    std::terminate (exit code -6: tests/test_failures.py::test_peer_dies_in_training). Last,
    the backend's gloo collectives still in flight get policy.GLOO_DRAIN_S to end, and are then
    kept from gloo's thread for the rest of the process (ringdp/inflight.py)."""
    interrupt = None
    try:
        destroy()
    except KeyboardInterrupt as e:  # (Ctrl-C in a close()'s wait, which said so: the exit goes on)
        interrupt = e
    finally:  # (at exit: nothing to raise their errors to)
        try:
            _, interrupt = _close_each([c for c in list(_working) if not c._closed], policy.EXIT_WAIT_S, interrupt)
        finally:
            inflight.GLOO.at_exit(policy.GLOO_DRAIN_S, interrupt is not None, policy.CLOSE_NOTE_S)


atexit.register(_close_at_exit)


def build_info(config: Config | None = None) -> dict:
    """This build: version, transports, the torch it was built with and runs on, and on a
    CUDA build the NCCL it would load (RINGDP_NCCL_LIBRARY of `config`, default: the
    environment's valid settings: never raises for an invalid one)."""
    transports = ["shm"] + (["cuda_ipc", "nccl"] if _C.WITH_CUDA else [])
    extra = {}
    if _C.WITH_CUDA:
        cfg = config if config is not None else Config.from_env_and_errors()[0]
        extra["nccl"] = tuple(_C.cuda_nccl_info(cuda_comm.nccl_library(cfg)))
    return {
        **extra,
        "version": __import__("ringdp").__version__,
        "cuda": bool(_C.WITH_CUDA),
        "transports": transports,
        "torch": torch.__version__,
        "built_with_torch": _C.BUILT_WITH_TORCH,
        "compiler": _C.COMPILER,
        "torch_cuda": torch.version.cuda,
    }
