"""The CUDA endpoint of a Communicator: transport choice (CUDA IPC inside a host, NCCL across
hosts, ringdp/policy.py transport_for), creation and teardown through the communicator's
Rendezvous, and ringdp's stream as torch sees it. The transports themselves are in
csrc/cuda (see docs/cuda.md). Only used when ringdp was built with CUDA."""
from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import socket
import time

import torch

from . import _types, policy
from ._native import RingError, _C
from .rendezvous import Rendezvous


def nccl_library(cfg) -> str:
    """RINGDP_NCCL_LIBRARY if set, else libnccl.so.2 of the nvidia-nccl wheel CUDA torch depends
    on ("" lets the C++ side take what is loaded, then the loader's path)."""
    if cfg.nccl_library:
        return cfg.nccl_library
    try:
        import nvidia.nccl  # type: ignore

        for base in nvidia.nccl.__path__:
            p = pathlib.Path(base) / "lib" / "libnccl.so.2"
            if p.exists():
                return str(p)
    except Exception:
        pass
    return ""


class CudaEndpoint:
    """One rank's CUDA transport (a csrc/cuda Comm) for one device, plus ringdp's stream.
    Across hosts on a hierarchical path (policy.cuda_hierarchical) it also holds the CUDA
    collectives' hierarchy (`hier`, a CUDA CrossHost of ringdp/hosts.py) and that one's
    endpoints: CUDA IPC among this host's ranks (none for a rank alone on its host), NCCL
    across hosts among the ranks of this local rank (TWO_LEVEL) or the hosts' first ranks
    (LEADERS; none for the others)."""

    def __init__(self, kind: str, native, device: torch.device):
        self.kind = kind  # "ipc" or "nccl"
        self.native = native
        self.device = device
        # The stream the transport enqueues on, for events and record_stream.
        self.stream = torch.cuda.ExternalStream(native.stream, device=device)
        self.hier = None  # across hosts, hierarchical: the CUDA CrossHost of the collectives
        self._halted = False  # halt() ran: close() tells the peers
        self._parts: list[tuple["CudaEndpoint", object]] = []  # its endpoints, each with its Rendezvous

    @classmethod
    def create(cls, comm, device: torch.device) -> "CudaEndpoint":
        """Create and connect the CUDA transport of Communicator `comm` for `device` (and,
        across hosts on a hierarchical path, the hierarchy's). Collective: every rank of the group
        calls it (on its first CUDA call)."""
        if not _C.WITH_CUDA:
            raise ValueError(f"rank {comm.rank}: ringdp was built without CUDA (build_info(): no cuda); "
                             "rebuild with a CUDA build of torch and nvcc, RINGDP_BUILD_CUDA=1")
        kind = policy.transport_for(comm.hosts, comm.config)
        ep = cls._connect(comm, kind, comm.rank, comm.world, comm.rendezvous, device)
        try:
            if policy.cuda_hierarchical(comm.cross_path, comm.config):
                ep._hierarchy(comm)
        except BaseException:
            ep.close(None)
            raise
        return ep

    @classmethod
    def _connect(cls, comm, kind: str, rank: int, world: int, rendezvous, device, names=None) -> "CudaEndpoint":
        """One native endpoint of `kind` for rank `rank` of `world`, connected through
        `rendezvous` (collective among those ranks). `names`: the group's ranks of its ranks,
        as its messages name them (across hosts; None: the group's own)."""
        cfg = comm.config
        o = _C.CudaOptions()
        o.kind, o.rank, o.world = kind, rank, world
        o.device = device.index if device.index is not None else torch.cuda.current_device()
        o.timeout_s = comm.timeout
        o.slot_bytes, o.slots, o.channels = cfg.cuda_slot_bytes, cfg.cuda_slots, cfg.cuda_channels
        o.oneshot_bytes = cfg.cuda_oneshot_bytes
        o.registered = cfg.cuda_registered
        if names is not None:
            o.rank_names = list(names)
        if kind == "ipc":
            o.arena_bytes = int(cfg.cuda_arena_mb * (1 << 20))
        else:
            o.nccl_library = nccl_library(cfg)
            if cfg.nccl_hostid_per_rank:  # tests and benchmarks: several ranks on one GPU
                os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-ringdp-r{comm.rank}"
        native = _C.cuda_create(o)
        native.connect(rendezvous.exchange(f"cuda-{kind}", native.local_blob(), f"the CUDA {kind} records"))
        return cls(kind, native, torch.device("cuda", o.device))

    def _hierarchy(self, comm) -> None:
        """The collectives across hosts on the CPU path's hierarchy (policy.cuda_hierarchical):
        CUDA IPC among this host's ranks (if it has others), ringdp's NCCL transport among the
        members of this rank's cross-host gloo group (if it is in one: TWO_LEVEL the ranks
        with this local rank, one per host; LEADERS the hosts' first ranks), each through a
        Rendezvous of its own. NCCL
        carries the cross-host step through ringdp's transport rather than a torch.distributed
        nccl group: its failures are RingErrors within ringdp's timeout (torch's NCCL watchdog
        ends the process on a timeout by default) and it is ordered on streams as the IPC
        steps are, without a host wait."""
        across = comm.across
        prefix = comm.rendezvous._prefix
        inhost = between = None
        if comm.local_size > 1:
            host = Rendezvous(f"{prefix}cuda-host{across.host_index}/", comm.local_rank, comm.local_size,
                              comm.timeout, store=comm._store)
            inhost = self._connect(comm, "ipc", comm.local_rank, comm.local_size, host, self.device,
                                   across.by_host[across.host_index])
            self._parts.append((inhost, host))
        if across.cross_ranks:
            me, name = across.cross_ranks.index(comm.rank), f"local{comm.local_rank}" if across.path == policy.TWO_LEVEL else "leaders"
            net = Rendezvous(f"{prefix}cuda-{name}/", me, len(across.cross_ranks), comm.timeout, store=comm._store)
            between = self._connect(comm, "nccl", me, len(across.cross_ranks), net, self.device, across.cross_ranks)
            self._parts.append((between, net))
        if inhost is not None and between is not None:
            # The in-host steps after the cross-host one read its result: an abort of the NCCL
            # endpoint halts the IPC one first, so that they fail on this rank and on the host's
            # ranks that read them, rather than pass on what the abort left (cuda_api.h follow).
            inhost.native.follow(between.native)
        self.hier = across.on_cuda(None if inhost is None else _InHost(inhost),
                                   None if between is None else _Across(between, torch.cuda.Stream(self.device)),
                                   self.device, poison=self._poison)

    def _ordered(self) -> list["CudaEndpoint"]:
        """Every native endpoint, the NCCL ones first: their waits are bounded (on a timeout
        they abort, and a kernel stuck on a dead peer returns), while an IPC drain waits on
        its stream, which may wait (through a hierarchical call's streams) for an NCCL step."""
        eps = [self] + [ep for ep, _ in self._parts]
        return [ep for ep in eps if ep.kind == "nccl"] + [ep for ep in eps if ep.kind != "nccl"]

    def _poison(self, why: str) -> None:
        """A hierarchical call failed on this rank (a failed call check, a cross-host step that
        failed, its own rejected input: CrossHost._fail, .reject): abort the NCCL endpoints (a
        step queued on them returns; peers see NCCL's error or their timeout), so that the IPC
        endpoint's rejection, queued behind them, reaches this host's peers. The whole CUDA
        endpoint is unusable afterwards, as after any CUDA rejection: ringdp.destroy() and
        initialise again."""
        for ep in self._ordered():
            if ep.kind == "nccl":
                ep.native.abort(why)

    @property
    def arena(self):
        """The native endpoint whose registered memory (ringdp.empty) the all-reduce reads in
        place: this host's IPC endpoint on a hierarchical path, else this one."""
        ipc = [ep for ep, _ in self._parts if ep.kind == "ipc"]
        return ipc[0].native if ipc else self.native

    def check(self) -> None:
        """Raise what the device reported so far (a RingError), on any of this endpoint's transports."""
        self.native.check()
        for ep, _ in self._parts:
            ep.native.check()

    def marks(self) -> tuple:
        """Where each of this endpoint's transports stands: (native, its calls()) pairs, read
        right after a collective was enqueued on this thread (that collective's numbers).
        The natives answer for their collectives after close() too (cuda_api.h failure_of)."""
        return tuple((native, native.calls()) for native in (self.native, *(ep.native for ep, _ in self._parts)))

    def synchronize(self) -> None:
        """Wait for everything queued on this endpoint's transports (NCCL first: _ordered)
        and, on a hierarchy, on its stream (a call's last steps: copies, AVG's division);
        raise their failures."""
        for ep in self._ordered():
            ep.native.synchronize()
        if self.hier is not None:
            self.hier.stream.synchronize()

    def wait_queued(self, lasting=None) -> None:
        """Wait until the device work queued so far on this endpoint's streams (its
        transports', its hierarchy's) has ended, in Python, so that Ctrl-C (any exception
        a signal's handler raises) reaches the waiting thread and ends the wait: the
        transports' own waits (quiesce(), synchronize()) are CUDA calls that would hold the
        signal until the work ends, and a collective whose peers never come ends only at
        the device's timeout. For closing (Communicator._wait_for_device): it polls every
        policy.DEVICE_POLL_S, too coarse for synchronize(), whose latency counts. `lasting()`
        is called once when the wait has lasted policy.CLOSE_NOTE_S. A device that refuses
        the events (a sticky CUDA error) ends the wait at once: the transports' own waits
        report it."""
        streams = [ep.stream for ep in self._ordered()] + ([self.hier.stream] if self.hier is not None else [])
        try:
            queued = []
            for stream in streams:
                ev = torch.cuda.Event()
                ev.record(stream)
                queued.append(ev)
            start = time.monotonic()
            while not all(ev.query() for ev in queued):
                if lasting is not None and time.monotonic() - start >= policy.CLOSE_NOTE_S:
                    lasting, told = None, lasting
                    told()
                time.sleep(policy.DEVICE_POLL_S)
        except RuntimeError:  # (torch's CUDA errors; not a KeyboardInterrupt)
            return

    def halt(self, why: str) -> None:
        """Stop this rank's device work from any thread (Communicator._abandon: Ctrl-C, the
        backend's abort()): on every transport the collectives queued or running give up
        and every later call raises a RingError; the endpoint is unusable from then on.
        CUDA IPC: within milliseconds, and the peers waiting on this rank fail with `why`
        (a kernel raises this rank's abort flag with it; close() has check() raise it
        where no kernel was left to meet the halt). NCCL: its abort (up to 2 s behind an
        NCCL call that blocks), and the peers learn nothing: they fail at their timeout.
        Never raises; a second Ctrl-C meanwhile is let go (every transport is halted)."""
        self._halted = True
        for ep in self._ordered():
            try:
                ep.native.halt(why)
            except BaseException:  # noqa: BLE001 -- see above
                pass

    def close(self, rendezvous) -> None:
        """Collective teardown: drain, drop peers' mappings, barrier, free own memory (the
        hierarchy's endpoints after this one, each with its own peers).
        `rendezvous` None (the process group was destroyed): no barrier, local teardown.
        A failed drain or barrier (a dead peer) tears the parts down locally, without
        their barriers (each would wait its timeout for the same peer); every endpoint is
        freed whatever another raised, and the first error is raised after."""
        ordered = self._ordered()
        parts, self._parts, self.hier = self._parts, [], None
        first = None
        try:
            if self._halted:  # (halt()) check() tells the peers of a transport no kernel of which met it
                for ep in ordered:
                    with contextlib.suppress(Exception):  # (it raises the halt: a RingError)
                        ep.native.check()
            for ep in ordered:  # drain every transport, NCCL first (_ordered); quiesce() runs once
                ep.native.quiesce()
            if rendezvous is not None:
                rendezvous.barrier("cuda-closed", "peers to close the CUDA transport")
        except BaseException as e:  # noqa: BLE001 -- raised below, once everything is freed
            first, rendezvous = e, None
        for free in [self.native.destroy] + [functools.partial(ep.close, rdv if rendezvous is not None else None)
                                             for ep, rdv in parts]:
            try:
                free()
            except BaseException as e:  # noqa: BLE001
                first = first or e
        if first is not None:
            raise first


class Enqueued:
    """A CUDA collective's record for its Work (ringdp/work.py): the endpoint, the event
    recorded after the collective (`done`), and, once enqueued, where the endpoint's
    transports stood (`marks`, set by `enqueued()` on the thread that enqueued it). Its end
    event completes even when a failure struck it (an aborted NCCL kernel returns, an IPC
    kernel gives up), so failure() asks the transports whether its result is valid. With
    `begin()` called on that thread just before the enqueue, only the transports whose
    count it advanced are marked: one it ran nothing on (0 elements, one rank) does not
    answer for it, so a no-op never takes the previous collective's verdict."""

    __slots__ = ("endpoint", "done", "marks", "_before")

    def __init__(self, endpoint: CudaEndpoint, done):
        self.endpoint, self.done, self.marks, self._before = endpoint, done, None, None

    def begin(self) -> None:
        self._before = self.endpoint.marks()

    def enqueued(self) -> None:
        marks = self.endpoint.marks()
        if self._before is not None:  # (the same transports in the same order: CudaEndpoint.marks)
            marks = tuple(m for m, (_, was) in zip(marks, self._before) if m[1] != was)
        self.marks = marks

    def failure(self) -> RingError | None:
        """The RingError of a failure that struck this collective on any of the transports it
        ran on (cuda_api.h failure_of), or None (also while it is not enqueued yet: a failure
        before that is its future's). Across hosts, a rank whose in-host result comes from
        another rank's cross-host step (LEADERS' broadcast, TWO_LEVEL's all-gather) is told
        through its IPC transport: that step's abort halts the other rank's IPC endpoint
        (CudaEndpoint._hierarchy, cuda_api.h follow), whose next kernel fails, and this rank's
        kernel that reads it with it."""
        for native, call in self.marks or ():
            why = native.failure_of(call)
            if why:
                return RingError(why)
        return None


class _InHost:
    """This host's CUDA IPC endpoint in the shared-memory endpoint's call shape (what
    ringdp/hosts.py's in-host steps call), each call ordered on the current stream."""

    def __init__(self, ep: CudaEndpoint):
        self.ep, self.native = ep, ep.native

    @property
    def oneshot_bytes(self) -> int:
        return self.native.oneshot_bytes

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.ep.device).cuda_stream

    def reduce_scatter(self, output, input, op, algo, timeout_s, tag="") -> None:
        self.native.reduce_scatter_tensor(output, input, op, self._stream(), algo, timeout_s)

    def all_gather(self, output, input, algo, timeout_s, tag="") -> None:
        self.native.all_gather_tensor(output, input, self._stream(), algo, timeout_s)

    def all_reduce(self, tensor, op, algo, timeout_s, tag="") -> None:
        self.native.all_reduce_tensor(tensor, op, self._stream(), algo, timeout_s)

    def broadcast(self, tensor, root, algo, timeout_s, tag="") -> None:
        self.native.broadcast_tensor(tensor, root, self._stream(), algo, timeout_s)

    def reject(self, why: str, timeout_s=None, tag="") -> None:
        """Tell this host's peers (CrossHost._fail, .reject; after the NCCL endpoints were
        aborted: CudaEndpoint._poison): IPC's rejection poisons the IPC endpoint, and peers
        waiting on this rank fail at once."""
        self.native.reject(why)


class _Across:
    """ringdp's NCCL endpoint between hosts in the shape of a gloo group's allreduce,
    _reduce_scatter_base, _allgather_base and broadcast (what ringdp/hosts.py's cross-host
    steps call), ordered as torch's NCCL collectives are: on a
    side stream that first waits for the current stream; the returned work's wait() makes
    the current stream wait for it. So the next piece's in-host step, enqueued before that
    wait, runs beside it."""

    def __init__(self, ep: CudaEndpoint, side: torch.cuda.Stream):
        self.ep, self.side = ep, side
        self.timeout_s = 0.0  # the call's (CrossHost.on_stream); 0: the endpoint's

    def allreduce(self, tensors, opts) -> "_StreamWork":
        (tensor,) = tensors
        return self._on_side(lambda st, ring, t: self.ep.native.all_reduce_tensor(
            tensor, _types.op_code(opts.reduceOp), st, ring, t))

    def _reduce_scatter_base(self, output, input, opts) -> "_StreamWork":
        return self._on_side(lambda st, ring, t: self.ep.native.reduce_scatter_tensor(
            output, input, _types.op_code(opts.reduceOp), st, ring, t))

    def _allgather_base(self, output, input, opts=None) -> "_StreamWork":
        return self._on_side(lambda st, ring, t: self.ep.native.all_gather_tensor(output, input, st, ring, t))

    def broadcast(self, tensors, opts) -> "_StreamWork":
        (tensor,) = tensors
        return self._on_side(lambda st, ring, t: self.ep.native.broadcast_tensor(tensor, opts.rootRank, st, ring, t))

    def _on_side(self, enqueue) -> "_StreamWork":
        """The side stream waits for the current one, `enqueue(side stream, ring, timeout)`
        puts the NCCL step on it, and the work's event is recorded after it."""
        self.side.wait_stream(torch.cuda.current_stream(self.ep.device))
        enqueue(self.side.cuda_stream, policy.ALGO_CODES[policy.RING], self.timeout_s)
        done = torch.cuda.Event()
        done.record(self.side)
        return _StreamWork(done, self.ep.device)


class _StreamWork:
    def __init__(self, done, device):
        self.done, self.device = done, device

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return True
