"""Across hosts: the CPU collectives of a communicator whose group spans hosts (README
"Across hosts", docs/hierarchy.md).

A ``CrossHost`` is made by the Communicator at set-up (collective) when its ranks sit on
more than one host, and holds what the hierarchy needs: the path (policy.cross_host_path),
this host's shared-memory endpoint (its ranks only; None on the flat path or for a rank
alone on its host) and the gloo group of this rank's cross-host step (None for a rank in
none: a non-leader on the uneven path). Its collectives run where the Communicator runs
every collective (inline or on its worker thread, under its lock):

    path        all_reduce                 reduce_scatter / all_gather / broadcast
    TWO_LEVEL   in-host RS, gloo AR of     blocks ordered by local rank, then host: in-host
    (even)      each block, in-host AG,    step over H blocks, cross-host step one block per
                pipelined in pieces        host (RS: in-host first; AG: across first;
                                           broadcast: across to src's local rank, then in-host)
    LEADERS     in-host AR, leaders' gloo  the host's part inside the host (RS: in-host AR
    (uneven)    AR, in-host broadcast,     of the input; AG: in-host AG), the leaders' gloo
                pipelined in pieces        step over host segments padded to the largest
                                           host, then in-host broadcast from the leader
                                           (broadcast: in src's host first, then across)
    FLAT        gloo on the whole group    gloo on the whole group

Every rank ends with the same bytes: gloo gives its members one result and the in-host
steps copy it. AVG is SUM, then one division by the world size. A failed cross-host step
(a host died, a timeout) is a RingError naming the gloo group's ranks, and this host's
peers, waiting in the next in-host step, are told at once (a rejected call). A cross-host
step waits policy.cross_host_timeout of the call's timeout, a little less than the in-host
waits, so that it fails (and tells) before a peer's in-host wait for this rank ends: every
rank's error then names the cross-host step, the cause. An abort() (torch's
_abort_process_group) ends a wait in a cross-host step within ABORT_POLL_S on its rank, and
on the others, through a note it leaves in the store, within about ABORT_STORE_POLL_S
(CrossHost.abort, _await): gloo itself cannot end a collective in flight.

Every call starts the same way (CrossHost._begin): it names itself (kind, count, dtype, op
or src) in the header of every in-host step it makes (CrossHost._announce: ShmComm's
set_outer, compared with each step's shape), then its first in-host step (the data step,
or a header-only one where the data crosses hosts first: all_gather, broadcast), which
fails on every rank of the host alike when one of them rejected its input or called
something else, even where the steps themselves look alike (counts that pad to the same
blocks, AVG and SUM, whose steps carry SUM, an all_reduce and a reduce_scatter with the
same in-host reduce-scatter, the counts of an uneven all_reduce whose first pieces
agree); then the call
check, an all-gather (sent as gloo's all-to-all: one network step whatever the number of
hosts) of (kind, count, dtype, op, root) in the rank's check group (its
cross-host group: on uneven hosts the leaders', who check for their hosts; the whole group
on the flat path), where a rank whose in-host step failed, or that rejected its
input itself (CrossHost.reject), puts a FAILED row and its reason in the store. Every rank
of every check group then sees the failure before any gloo step moves data, so no rank
waits for a peer that left: one rank's bad input or odd call is a RingError on every rank
within seconds, naming it and why, and the communicator stays usable (a CUDA CrossHost's
failed call poisons the CUDA endpoint instead: below). Each row also has a
payload slot of one fixed size per group (policy.check_payload_bytes); an all_reduce whose
cross-host part fits it travels in it and every member reduces the gathered rows in member
order (_reduce_rows): one gloo round trip for a small all-reduce instead of two. The other
collectives' cross-host step goes in the rows the same way when its data fits (what each
member would send: the reduce-scatter's blocks, the all-gather's input, the broadcast's
tensor), and each member makes the step's result from the rows.

A two-level all_reduce whose cross-host data does not fit the slot (above it, or in pieces)
sends its check first instead, so that the check's round trip overlaps the first in-host
step (CrossHost._overlaps, _begin_overlapped): after the step, a second, header-only check
carries each member's outcome (a FAILED row where its step failed) beside the first
cross-host step, which every member of the group starts, one whose step failed too, so
that the group's gloo collectives stay paired; the step's result is used only when every
outcome is good. A call in one piece whose block is at most policy.FOLD_MAX_BLOCK_BYTES
sends no second check: each member's outcome goes as a flag beside its block in the data's
all-reduce itself (_fold_start; the in-host steps then run out of place, in a scratch
buffer), read by every member when it ends (_Folded.verdict). A rank whose step failed
still raises its own error, every other rank a RingError naming it, and the communicator
stays usable, as above. Where no data goes with the check, its row carries the elements of
the call's first pipeline piece, so that members whose pieces differ (a setting that
differs between ranks) fail in the check rather than in mismatched gloo collectives.

CUDA tensors (on_cuda, made by ringdp/cuda_comm.py on the TWO_LEVEL and LEADERS paths): the
same collectives with this host's CUDA IPC endpoint for the in-host steps and ringdp's NCCL
endpoint of the rank's cross-host group for the cross-host steps, ordered on streams
(on_stream), with the same call check in the same gloo group (no data in its rows; the
header-only in-host agreement of all_gather and broadcast is a no-op on IPC). The
IPC steps report failures from the device, at this rank's next check: a rank whose peer
failed may return from a call and raise at its next call or synchronize(), and a call that
differs between the ranks of one host only is caught there, on the device, not by the
check. A failed call check or cross-host step aborts the NCCL endpoints and rejects the
next IPC call (the host's peers fail at once); the CUDA endpoint is then unusable until
ringdp.destroy(), as after any CUDA rejection.

The cross-host gloo groups are never the backend's inner gloo group (ringdp/backend.py):
these steps run on ringdp's worker thread and would interleave with the inner group's
calls differently on different ranks. They are called through the group's own methods:
each is a bare ProcessGroupGloo that torch.distributed does not know (CrossHost.create).
"""
from __future__ import annotations

import copy
import functools
import threading
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions, BroadcastOptions, ReduceScatterOptions
from torch.distributed.distributed_c10d import ProcessGroupGloo

from . import _types, inflight, policy
from ._native import RingError
from .rendezvous import LookupStore, Rendezvous

_KINDS = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2, "broadcast": 3}
_FAILED = -1  # a check row's kind: the rank failed the call before its cross-host step (row: -1, n, 0, ...)
_HEADER = 6  # int64 words of a check row before its payload slot: kind, count, dtype, op, root, and the payload
# bytes it carries, or minus the elements of the first pipeline piece where it carries none (_check)
_GLOO_OPS = {_types.SUM: dist.ReduceOp.SUM, _types.MIN: dist.ReduceOp.MIN, _types.MAX: dist.ReduceOp.MAX}
ABORT_POLL_S = 0.1  # a cross-host wait's slice: how soon it sees this rank's abort() (CrossHost._await)
ABORT_STORE_POLL_S = 0.5  # how often a cross-host wait that lasts looks in the store for a peer's abort()
ABORT_LOOK_S = 0.5  # how long a failed cross-host step waits for that look (_gloo_failed: was an abort the cause?)
REASON_WAIT_S = 5.0  # how long a rank waits for a failed member's reason in the store (_reason)


def _by_host(comm) -> list[list[int]]:
    """Each host's ranks (of the communicator's group), in rank order, hosts in host order."""
    return [[r for r, h in enumerate(comm.hosts) if h == k] for k in comm.host_order]


def _gloo_opts(cls, timeout_s: float, **fields):
    """c10d options for a step of a call of timeout `timeout_s` on a cross-host gloo group:
    `cls()` with `fields` set and gloo's timeout the step's (policy.cross_host_timeout; the
    group's default is the communicator's, and a call's longer timeout= failed at it)."""
    opts = cls()
    opts.timeout = timedelta(seconds=policy.cross_host_timeout(timeout_s))
    for k, v in fields.items():
        setattr(opts, k, v)
    return opts


def _below_autograd(collective):
    """A collective whose steps write the caller's tensors with torch ops (copies, AVG's
    division), run below autograd as on one host, where the C++ transports write them
    (_types.below_autograd: a Parameter, a view of one, an inference tensor; they raised
    across hosts, 2026-12-07). Every step of a call runs inside it, and so does every wait
    for a gloo work (_await, _drain): the temporaries a call makes are inference tensors,
    which gloo may write in its wait() (a reduce-scatter's output). The lasting scratch
    buffers (_scratch) are made as normal tensors."""
    @functools.wraps(collective)
    def run(*args, **kwargs):
        with _types.below_autograd():
            return collective(*args, **kwargs)

    return run


class CrossHost:
    """The cross-host part of one communicator (module doc)."""

    def __init__(self, comm, path: str, inhost, cross, cross_ranks: list[int]):
        self.rank, self.world, self.config = comm.rank, comm.world, comm.config
        self.hosts, self.host_order = comm.hosts, comm.host_order  # every rank's host key; hosts by first rank
        self.by_host = _by_host(comm)  # each host's ranks, hosts in host order
        self.local_rank, self.local_size = comm.local_rank, comm.local_size
        self.every_rank = list(range(self.world))
        # TWO_LEVEL's block order (reduce_scatter, all_gather): position l*H + k -> the rank
        # with local rank l on host k
        self._by_local_then_host = (torch.tensor([ranks[lr] for lr in range(self.local_size) for ranks in self.by_host])
                                    if path == policy.TWO_LEVEL else None)
        # LEADERS' host segments (reduce_scatter, all_gather): host k's ranks, in its local order
        self._host_rank_index = ([torch.tensor(ranks) for ranks in self.by_host] if path == policy.LEADERS
                                 else None)
        self.path = path
        self.inhost = inhost  # this host's endpoint: shared memory (CPU), CUDA IPC (a CUDA CrossHost)
        self.cross = cross  # the gloo group of this rank's cross-host step (a CUDA CrossHost: NCCL)
        self.cross_ranks = cross_ranks  # its members (ranks of the communicator's group)
        self.checker = cross  # the gloo group of its call check (the same members; host memory rows)
        self.net_name = "gloo"  # what carries the cross-host step, for messages
        self.device = torch.device("cpu")  # where the tensors and the scratch buffers are
        self.host_kind = "shm"  # the in-host transport, for policy.oneshot_threshold
        self.fuse = True  # an all-reduce's data may go with the call check (host memory only)
        # the in-host steps keep a host's ranks in step after a failed call (_announce,
        # _close); not on IPC, whose failures poison the CUDA endpoint instead
        self.host_in_step = True
        self.stream = None  # a CUDA CrossHost: the stream its own work runs on (on_stream)
        self.poison = None  # a CUDA CrossHost: what a failed call does to the CUDA endpoint (_fail)
        self.host_index = comm.host_order.index(comm.host_key)  # this rank's host: by_host[host_index]
        self.whole = cross if path == policy.FLAT else None  # the gloo group of every rank (the flat path's)
        # scratch buffers by role (_scratch: grow, reused): a fresh buffer's first touch costs
        # more than the copies through it (issue 12: 2-8x a gloo step's time on this VM)
        self._buffers: dict[str, torch.Tensor] = {}
        self._store = comm._store  # (a function) where a failed rank leaves its reason for the call check
        self._reasons = f"{comm.rendezvous._prefix}failed/"
        self._failures = 0  # this rank's failures published so far (a FAILED row carries the number)
        self._aborts = _Aborts(comm._store, f"{comm.rendezvous._prefix}aborted")  # (the CUDA copy's too)
        self._abandoned: list = []  # gloo works an abort or a failed call left in flight (close: inflight)
        self.fused_calls = 0  # all-reduces whose data went with the call check (policy.check_payload_bytes)
        self.folded_calls = 0  # two-level all-reduces whose first step's outcome went with their data (_fold_start)
        self._lookup = None  # the LookupStore under the gloo groups (create)

    @classmethod
    def create(cls, comm) -> "CrossHost":
        """Set the cross-host collectives up (collective, every rank of the group): the path,
        this host's shared-memory endpoint (through the communicator's own set-up) and the
        gloo group(s) across hosts, each with the cross-host part of ringdp's timeout
        (policy.cross_host_timeout).

        A group of any backend: the gloo groups are ProcessGroupGloo objects made by their
        members only, on the group's store under a prefix of the communicator's and the
        subgroup's (as the backend's inner gloo group is), ranks numbered as in its group,
        through a LookupStore, so that they hold no store. Not torch.distributed groups
        (dist.new_group): a group made with local synchronization is named after the number
        of groups its rank knows, which differs between ranks that are members of different
        groups (a,a,b,b with subgroups [1,2,3] and [0,3]: ranks 1 and 3 waited for each other
        under two names until the timeout); and a group of ringdp's backend sets up inside
        init_process_group/new_group, where new_group cannot run."""
        path = policy.cross_host_path(comm.local_sizes, comm.config.hierarchy)
        by_host = _by_host(comm)
        if path == policy.FLAT:
            members, name = list(range(comm.world)), "flat"
        elif path == policy.TWO_LEVEL:  # the ranks with this rank's local rank, one per host
            members, name = [ranks[comm.local_rank] for ranks in by_host], f"local{comm.local_rank}"
        else:  # LEADERS: the first rank of every host
            members, name = ([ranks[0] for ranks in by_host] if comm.local_rank == 0 else []), "leaders"
        inhost = None
        if path != policy.FLAT and comm.local_size > 1:
            k = comm.host_order.index(comm.host_key)
            rdv = Rendezvous(f"{comm.rendezvous._prefix}host{k}/", comm.local_rank, comm.local_size, comm.timeout,
                             store=comm._store)
            inhost = comm._connect_shm(rdv, by_host[k])  # (its messages name the group's ranks)
        cross, lookup = None, LookupStore(comm._store)
        if members:
            store = dist.PrefixStore(f"{comm.rendezvous._prefix}cross-{name}/", lookup)
            try:
                cross = ProcessGroupGloo(store, members.index(comm.rank), len(members),
                                         timeout=timedelta(seconds=policy.cross_host_timeout(comm.timeout)))
            except Exception as e:  # (a peer that never came: the store's wait; gloo's own errors)
                inhost = None  # (its segment let go now, not when the traceback that holds this frame goes)
                raise RingError(f"rank {comm.rank}: setting up the gloo group across hosts (ranks {members}, "
                                f"{path} path) failed: {type(e).__name__}: {e}") from e
        made = cls(comm, path, inhost, cross, members if members else [])
        made._lookup = lookup  # (the Python object must live as long as the group: torch calls its methods)
        return made

    def set_timeout(self, secs: float) -> None:
        """The cross-host gloo groups' default timeout from now on: policy.cross_host_timeout
        of the communicator's (Communicator.set_timeout)."""
        cross = timedelta(seconds=policy.cross_host_timeout(secs))
        for g in (self.cross, self.checker, self.whole):
            if isinstance(g, ProcessGroupGloo):
                g._set_default_timeout(cross)

    def _piece_units(self, nbytes: int, unit: int) -> int:
        """Units of `unit` bytes per pipeline piece of a call of `nbytes`
        (policy.two_level_piece_bytes), rounded up: rounded down, a piece that is not a whole
        number of units made one piece more than the rule allows."""
        return max(1, -(-policy.two_level_piece_bytes(nbytes, self.config.hier_piece_bytes) // unit))

    def close(self) -> None:
        """Let the endpoint and the gloo groups go (they hold no store: create).
        A gloo work still in flight (left by an abort or a failed call) is held, with the
        groups, until a while after it ends (ringdp/inflight.py): a gloo group's destructor
        waits for its works (gloo's timeout), and gloo's thread must not drop a work's last
        reference as Python finalizes."""
        groups = (self.cross, self.checker, self.whole, self._lookup)
        self.inhost = self.cross = self.checker = self.whole = self._lookup = None
        self._buffers.clear()
        self._aborts.store = None
        left, self._abandoned = self._abandoned, []
        for w in left:  # (the ended ones too: gloo's thread may not have let them go yet)
            inflight.GLOO.hold(w, groups, "a step across hosts")

    def _leave(self, works) -> None:
        """Keep `works`, left in flight, until close() (those already done go; each once)."""
        kept = [w for w in self._abandoned if not w.is_completed()]
        self._abandoned = kept + [w for w in works if not any(w is k for k in kept)]

    def _drain(self, works, wait: bool = True) -> None:
        """A call that fails midway (a later piece's in-host step raised: a peer of the host
        rejected it) waits briefly for the cross-host steps it started (gloo works, or a CUDA
        CrossHost's events), so that none still writes into the tensor or a scratch buffer
        after the call raised; one stuck on a dead peer is left in flight (it fails in its
        own timeout, writing nothing: _leave). After an abort() nothing is waited for, nor
        when the call was interrupted (`wait` False: a signal's handler raised, Ctrl-C)."""
        aborted = not wait or self._aborts.mine is not None or self._aborts.seen is not None
        left = []
        for w in works:
            if w is None:
                continue
            gloo = hasattr(w, "is_completed")  # (a CUDA CrossHost's work only orders streams: always)
            if not (aborted and gloo):
                try:
                    w.wait(timeout=timedelta(seconds=policy.GLOO_DRAIN_S))
                except Exception:  # noqa: BLE001 -- its failure is not the call's: the call already failed
                    pass
            if gloo and not w.is_completed():
                left.append(w)
        self._leave(left)

    def abort(self, reason: str, store=None) -> None:
        """This rank's abort() (Communicator.close(wait=False), after the in-host endpoint's):
        a cross-host wait in flight here ends within ABORT_POLL_S (_await), and the other
        ranks' within ABORT_STORE_POLL_S, when they look for the key this leaves in `store`
        (the group's, which torch already calls gone; written on a thread of its own: abort()
        returns at once, even when the store cannot be reached). gloo cannot end a
        collective in flight (ProcessGroupGloo.abort() leaves it running): the works are
        left to end in gloo's own timeout."""
        if self._aborts.mine is not None:
            return
        self._aborts.mine = reason
        key, note = self._aborts.key, f"rank {self.rank} aborted the group ({reason})"

        def publish():
            try:
                store.set(key, note)  # (None: no group store to write to, an AttributeError)
            except Exception:  # noqa: BLE001 -- the peers still fail, in their timeouts
                pass
        threading.Thread(target=publish, name="ringdp-abort-note", daemon=True).start()

    def on_cuda(self, inhost, net, device: torch.device, poison=None) -> "CrossHost":
        """The collectives of this communicator (TWO_LEVEL or LEADERS) for CUDA tensors on
        `device` (ringdp/cuda_comm.py makes it with the CUDA endpoint;
        policy.cuda_hierarchical): the same algorithm and call check (in the same gloo check
        group, rows in host memory), with `inhost`, this host's CUDA IPC transport in the
        shared-memory endpoint's call shape (None alone on the host), for the in-host steps
        and `net`, a cross-host NCCL transport in a gloo group's allreduce shape (None for a
        rank in no cross-host group: a non-leader), for the cross-host step. No data with
        the call check (the rows are host memory: a copy to the host would synchronise). Each
        call runs inside on_stream. `poison(why)`: what a failed call does to the CUDA
        endpoint first (_fail, reject)."""
        if self.path not in (policy.TWO_LEVEL, policy.LEADERS):
            raise ValueError(f"rank {self.rank}: the CUDA all-reduce across hosts has no hierarchy on path {self.path}")
        c = copy.copy(self)
        c.inhost, c.cross, c.device = inhost, net, device
        c.net_name, c.host_kind, c.fuse, c.poison, c.host_in_step = "NCCL", "ipc", False, poison, False
        c._buffers = {}
        if self._by_local_then_host is not None:  # (index tensors where the data is)
            c._by_local_then_host = self._by_local_then_host.to(device)
        if self._host_rank_index is not None:
            c._host_rank_index = [index.to(device) for index in self._host_rank_index]
        c._reasons = f"{self._reasons}cuda/"  # its own failure numbers: keys apart from the CPU ones
        c.fused_calls = c.folded_calls = 0
        c.stream = torch.cuda.Stream(device)
        return c

    def on_stream(self, stream: int, t: float, call) -> None:
        """A CUDA CrossHost's collective (`call()`: all_reduce, reduce_scatter, all_gather or
        broadcast of this CrossHost), ordered on the CUDA stream `stream` (the caller's, or
        ringdp's on the worker) as the transports' calls are: its own stream waits for
        `stream`, every step is ordered on it (the cross-host step on `net`'s side stream,
        beside the next piece's in-host step), and `stream` waits for it at the end; no
        host synchronisation but the call check. One stream for every call keeps the
        reused scratch buffers in order across callers' streams."""
        caller = torch.cuda.current_stream(self.device)  # (inline: the caller's stream is current; it may be
        if caller.cuda_stream != stream:                 # the legacy default stream, handle 0)
            caller = torch.cuda.ExternalStream(stream, device=self.device)
        self.stream.wait_stream(caller)
        if self.cross is not None:
            self.cross.timeout_s = policy.cross_host_timeout(t)
        try:
            with torch.cuda.stream(self.stream):
                call()
        finally:  # (a failed call too: steps already queued still use the tensor)
            if self.cross is not None:
                self.stream.wait_stream(self.cross.side)
            caller.wait_stream(self.stream)

    # ---- all_reduce ------------------------------------------------------------------------
    @_below_autograd
    def all_reduce(self, tensor, code, forced, t, tag) -> None:
        """All-reduce `tensor` across hosts on this communicator's path (module doc)."""
        n = tensor.numel()
        red = _types.SUM if code == _types.AVG else code
        dop = _GLOO_OPS[red]
        flat = tensor.view(-1)
        begin = functools.partial(self._begin, "all_reduce", tensor, code, 0, t, tag)
        if n == 0:  # the first in-host step and the call check still run: a rank with another count fails at once
            step, ring = None, policy.ALGO_CODES[policy.RING]
            if self.inhost is not None:  # the same kind of step as a non-empty call's
                two = self.path == policy.TWO_LEVEL
                step = (functools.partial(self.inhost.reduce_scatter, flat, flat, red, ring, t, tag) if two
                        else functools.partial(self.inhost.all_reduce, flat, red, ring, t, tag))
            begin(step)
            self._close(t, tag)
            return
        if self.path == policy.TWO_LEVEL:
            blk = -(-n // self.local_size)
            full = flat if blk * self.local_size == n else self._padded(flat, blk * self.local_size)
            self._two_level(full, blk, red, dop, code == _types.AVG, forced, t, tag, begin)
            if full is not flat:
                flat.copy_(full[:n])
            return
        if self.path == policy.LEADERS:
            self._leaders(flat, red, dop, code == _types.AVG, forced, t, tag, begin)
            return
        rows = begin(None, flat)
        if rows is not None:
            _reduce_rows(flat, rows, red)
        else:
            self._gloo(flat, dop, t)
        if code == _types.AVG:
            flat.div_(self.world)

    def _padded(self, flat, size: int):
        """`flat` copied into the first elements of a reused buffer of `size`, the rest zero
        (its values never reach the result: each rank keeps only its first n elements)."""
        full = self._scratch("pad", size, flat.dtype)
        full[:flat.numel()].copy_(flat)
        full[flat.numel():].zero_()
        return full

    def _two_level(self, full, blk, red, dop, avg, forced, t, tag, begin) -> None:
        """The two-level all-reduce of `full` (local size x `blk` elements) in place, pipelined
        by pieces of policy.two_level_piece_bytes (local size x m elements each): the in-host
        reduce_scatter of a piece leaves this rank's block of it (m elements, local rank's
        position) reduced over the host, in place; gloo all-reduces that block across hosts
        while the next piece is reduce-scattered; the piece is then all-gathered inside the
        host from each rank's block, in place. No copy beyond the transports' own, no buffer
        (a fresh buffer's first touch cost more than the copies: issue 12), but where the
        first step's outcome is folded into the data (one piece, policy.folds_outcome): the
        block then lives in a reused scratch buffer with the flags after it, the in-host steps
        out of place (one copy of the block more, in the all-gather). The in-host calls
        come in the same order on every rank of the host (rs 0, rs 1, ag 0, rs 2, ag 1, ...).
        The first reduce_scatter is the call's first in-host step (`begin`: _begin)."""
        L, lr = self.local_size, self.local_rank
        # block elements per piece: at most policy.HIER_MAX_PIECES pieces, each at least RINGDP_HIER_PIECE_BYTES
        per = self._piece_units(full.numel() * full.element_size(), L * full.element_size())
        pending, started = None, []
        try:
            for off in range(0, blk, per):
                m = min(per, blk - off)
                piece = full[off * L:(off + m) * L]
                mine = piece[lr * m:(lr + 1) * m]
                overlap = off == 0 and self._overlaps(None if per < blk else mine)
                # one piece, too big for the check, its block small enough to fold the outcome in
                fold = overlap and per >= blk and policy.folds_outcome(m * full.element_size())
                if fold:  # (the block, then a flag per member; the in-host steps out of place)
                    buf = self._scratch("fold", m + len(self.cross_ranks), full.dtype)
                    mine = buf[:m]
                step = functools.partial(self.inhost.reduce_scatter, mine, piece, red, self._host_algo(piece, forced),
                                         t, tag)
                rows, work = None, None
                if fold:
                    work = begin(step, start=functools.partial(self._fold_start, buf, m, red, dop, t, tag), fold=True,
                                 piece=m * L)
                elif overlap:
                    work = begin(step, start=functools.partial(self._gloo_start, mine, dop, t, self.inhost, tag),
                                 piece=m * L)
                elif off == 0:  # (one piece: its block may go with the call check)
                    rows = begin(step, mine if per >= blk else None, piece=m * L)
                else:
                    step()
                if rows is not None:
                    _reduce_rows(mine, rows, red)
                elif work is None:
                    work = self._gloo_start(mine, dop, t, self.inhost, tag)
                started.append(work)
                if pending is not None:
                    self._gather_piece(*pending, avg, forced, t, tag)
                pending = (work, mine, piece)
            self._gather_piece(*pending, avg, forced, t, tag)
        except BaseException as e:  # (Ctrl-C: nothing waited for; the caller aborts: Communicator._abandon)
            self._drain(started, wait=isinstance(e, Exception))
            raise

    def _leaders(self, flat, red, dop, avg, forced, t, tag, begin) -> None:
        """The uneven-hosts all-reduce of `flat`, pipelined by the pieces of the two-level path
        (the same on every rank: they depend on the size alone): each piece all-reduced inside
        the host, then across hosts by the hosts' first ranks (gloo) while the next piece is
        all-reduced inside the host, then broadcast inside the host from the first rank. In-host
        calls in the same order on every rank of the host (ar 0, ar 1, bc 0, ar 2, bc 1, ...);
        a rank alone on its host has only the gloo steps. The first in-host all-reduce is the
        call's first in-host step (`begin`: _begin; the leaders' gloo group is the check group)."""
        n, esz = flat.numel(), flat.element_size()
        per = self._piece_units(n * esz, esz)
        pending, started = None, []
        try:
            for off in range(0, n, per):
                piece = flat[off:off + per]
                step = (functools.partial(self.inhost.all_reduce, piece, red, self._host_algo(piece, forced), t, tag)
                        if self.inhost is not None else None)
                rows = None
                if off == 0:  # (one piece: it may go with the leaders' call check)
                    rows = begin(step, piece if per >= n and self.cross is not None else None, piece=piece.numel())
                elif step is not None:
                    step()
                work = None
                if rows is not None:
                    _reduce_rows(piece, rows, red)
                elif self.cross is not None:
                    work = self._gloo_start(piece, dop, t, self.inhost, tag)
                started.append(work)
                if pending is not None:
                    self._spread_piece(*pending, avg, forced, t, tag)
                pending = (work, piece)
            self._spread_piece(*pending, avg, forced, t, tag)
        except BaseException as e:  # (Ctrl-C: nothing waited for; the caller aborts: Communicator._abandon)
            self._drain(started, wait=isinstance(e, Exception))
            raise

    def _spread_piece(self, work, piece, avg, forced, t, tag) -> None:
        if work is not None:
            self._gloo_wait(work, t, self.inhost, tag)
        if self.inhost is not None:
            self.inhost.broadcast(piece, 0, self._host_algo(piece, forced), t, tag)
        if avg:
            piece.div_(self.world)

    def _gather_piece(self, work, mine, piece, avg, forced, t, tag) -> None:
        if work is not None:  # (None: the block went with the call check)
            self._gloo_wait(work, t, self.inhost, tag)
        if isinstance(work, _Folded):
            work.verdict(self, t, tag)
        if avg:
            mine.div_(self.world)
        self.inhost.all_gather(piece, mine, self._host_algo(mine, forced), t, tag)

    # ---- reduce_scatter, all_gather, broadcast -----------------------------------------------
    # TWO_LEVEL (H hosts of L ranks): the cross-host group of local rank l holds, in host
    # order, the rank with local rank l of every host, so its member k is host k's. Blocks
    # are ordered "by local rank, then host" (l*H + k) for the in-host step, which then moves
    # H blocks per rank, and the cross-host step 1 block per rank and host: both ring-optimal.
    # LEADERS (hosts of different sizes): the leaders' group (member k: host k's first rank)
    # moves host segments (host k's ranks' blocks, in its local order) padded to the largest
    # host's, since gloo's collectives move blocks of one size; each host's part of the work
    # is done inside the host before (RS, AG) or after (broadcast) it, and every rank of a
    # host ends in an in-host step after the leader's gloo step, so that a leader's failed
    # check or gloo step reaches its host's ranks in the same call.
    # FLAT: gloo on the group of every rank (`whole`).
    @_below_autograd
    def reduce_scatter(self, output, input, code, forced, t, tag) -> None:
        """reduce_scatter_tensor across hosts. TWO_LEVEL: the input's blocks reordered by local
        rank then host, reduce-scattered inside the host (H blocks each: this local rank's
        rank on every host, summed over this host), then reduce-scattered across hosts by the
        gloo group of this local rank (block k: host k's). LEADERS: the input all-reduced
        inside the host (a copy), reduce-scattered across hosts by the leaders in padded host
        segments, each host's segment broadcast inside the host. AVG: SUM, then / world size.
        A cross-host step whose input fits the call check's rows goes with them (_begin)."""
        red = _types.SUM if code == _types.AVG else code
        opts = _gloo_opts(ReduceScatterOptions, t, reduceOp=_GLOO_OPS[red])
        n, out = output.numel(), output.view(-1)  # (contiguous: Communicator._check)
        blocks = input.reshape(self.world, n)

        def scatter(group, result, send, me, ranks=None, tell=None):
            """The cross-host step: `result` = block `me` of `send` reduced over `group`."""
            if rows is not None:
                _reduce_rows(result, [x[me * result.numel():(me + 1) * result.numel()] for x in rows], red)
            elif n and self._nan_rule(_GLOO_OPS[red], send):
                send = send.clone()  # (the NaN rule of _NanAware; the input is not modified)
                nan = _NanAware(send, _GLOO_OPS[red])
                every = torch.empty(result.numel(), dtype=torch.uint8)
                self._across("reduce_scatter", lambda: group._reduce_scatter_base(result, send, opts), t, tell, tag,
                             ranks)
                self._across("reduce_scatter", lambda: group._reduce_scatter_base(every, nan.mask, _gloo_opts(
                    ReduceScatterOptions, t, reduceOp=dist.ReduceOp.MIN)), t, tell, tag, ranks)
                result.masked_fill_(every.view(result.shape).bool(), float("nan"))
            elif n:
                self._across("reduce_scatter", lambda: group._reduce_scatter_base(result, send, opts), t, tell, tag,
                             ranks)

        if self.path == policy.FLAT:
            send = blocks.reshape(-1)
            rows = self._begin("reduce_scatter", output, code, 0, t, tag, None, send)
            scatter(self.whole, out, send, self.rank, self.every_rank)
        elif self.path == policy.LEADERS:
            summed = self._scratch("input", input.numel(), input.dtype)
            summed.copy_(input.reshape(-1))  # (the input is not modified)
            seg = self._segment_elements(n)
            leader = self.cross is not None and n > 0
            padded = self._scratch("segments", len(self.by_host) * seg, output.dtype) if leader else None
            step = None if self.inhost is None else functools.partial(
                self.inhost.all_reduce, summed, red, self._host_algo(summed, forced), t, tag)
            rows = self._begin("reduce_scatter", output, code, 0, t, tag, step, functools.partial(
                self._host_segments, padded, summed.view(self.world, n), seg) if leader else None)
            if n:
                mine = self._scratch("segment", seg, output.dtype)
                if leader:
                    scatter(self.cross, mine, padded, self.host_index, tell=self.inhost)
                self._host_broadcast(mine[:self.local_size * n], 0, forced, t, tag)
                out.copy_(mine[self.local_rank * n:(self.local_rank + 1) * n])
            else:
                self._close(t, tag)
        else:
            ordered = self._scratch("input", input.numel(), input.dtype)
            torch.index_select(blocks, 0, self._by_local_then_host, out=ordered.view(self.world, n))
            part = self._scratch("segment", len(self.host_order) * n, output.dtype)
            rows = self._begin("reduce_scatter", output, code, 0, t, tag, functools.partial(
                self.inhost.reduce_scatter, part, ordered, red, self._host_algo(ordered, forced), t, tag), part)
            scatter(self.cross, out, part, self.host_index, tell=self.inhost)
            self._close(t, tag)  # (its last step is across hosts)
        if code == _types.AVG:
            out.div_(self.world)

    @_below_autograd
    def all_gather(self, output, input, forced, t, tag) -> None:
        """all_gather_into_tensor across hosts. TWO_LEVEL: this rank's input all-gathered
        across hosts by the gloo group of its local rank (one block per host), those H blocks
        all-gathered inside the host, then put in rank order. LEADERS: the inputs all-gathered
        inside the host (the host's segment), the segments, padded, all-gathered across hosts
        by the leaders and put in rank order, the result broadcast inside the host. A
        cross-host step whose input fits the call check's rows goes with them (_begin)."""
        n = input.numel()
        mine, out, opts = input.reshape(-1), output.view(-1), _gloo_opts(AllgatherOptions, t)

        def gather(group, result, send, ranks=None, tell=None):
            """The cross-host step: `result` = every member's `send`, in member order."""
            if rows is not None:
                for k, x in enumerate(rows):
                    result[k * send.numel():(k + 1) * send.numel()].copy_(x)
            elif n:
                self._across("all_gather", lambda: group._allgather_base(result, send, opts), t, tell, tag, ranks)

        if self.path == policy.FLAT:
            rows = self._begin("all_gather", input, -1, 0, t, tag, None, mine)
            gather(self.whole, out, mine, self.every_rank)
            return
        if self.path == policy.LEADERS:
            seg = self._segment_elements(n)
            host = self._scratch("segment", seg, input.dtype)
            part = host[:self.local_size * n]
            if self.inhost is None:
                part.copy_(mine)
            host[part.numel():].zero_()
            rows = self._begin("all_gather", input, -1, 0, t, tag, None if self.inhost is None else functools.partial(
                self.inhost.all_gather, part, mine, self._host_algo(part, forced), t, tag),
                host if self.cross is not None else None)
            if n == 0:
                self._close(t, tag)
                return
            if self.cross is not None:
                every = self._scratch("segments", len(self.by_host) * seg, input.dtype)
                gather(self.cross, every, host, tell=self.inhost)
                blocks = out.view(self.world, n)
                for k, index in enumerate(self._host_rank_index):
                    blocks.index_copy_(0, index, every[k * seg:k * seg + index.numel() * n].view(-1, n))
            self._host_broadcast(out, 0, forced, t, tag)
            return
        rows = self._begin("all_gather", input, -1, 0, t, tag, self._host_agree(t, tag), mine)
        if n == 0:
            self._close(t, tag)
            return
        across = self._scratch("segment", len(self.host_order) * n, input.dtype)
        gather(self.cross, across, mine, tell=self.inhost)
        full = self._scratch("segments", self.world * n, input.dtype)
        self.inhost.all_gather(full, across, self._host_algo(across, forced), t, tag)
        out.view(self.world, n).index_copy_(0, self._by_local_then_host, full.view(self.world, n))

    @_below_autograd
    def broadcast(self, tensor, src, forced, t, tag) -> None:
        """broadcast across hosts. TWO_LEVEL: the gloo group of src's local rank broadcasts
        from src's host to the rank with that local rank on every host, then each host
        broadcasts from that rank inside the host. LEADERS: src's host broadcasts from src
        inside the host (its first in-host step: its leader has the data), the leaders'
        group across hosts from src's host's leader, then every other host from its leader
        inside the host (src's host: a header-only in-host step after the leader's gloo
        step). A tensor that fits the call check's rows goes with them (_begin)."""
        flat = tensor.view(-1)  # (contiguous: Communicator._check)
        if self.path == policy.FLAT:
            rows = self._begin("broadcast", tensor, -1, src, t, tag, None, flat)
            if rows is not None:
                flat.copy_(rows[src])
            elif flat.numel():
                opts = _gloo_opts(BroadcastOptions, t, rootRank=src)
                self._across("broadcast", lambda: self.whole.broadcast([flat], opts), t, ranks=self.every_rank)
            return
        k_src = self.host_order.index(self.hosts[src])
        lr_src = self.by_host[k_src].index(src)

        def across():
            """The cross-host step of the group that carries it: from its member k_src."""
            if rows is not None:
                if self.host_index != k_src:
                    flat.copy_(rows[k_src])
            elif flat.numel():
                opts = _gloo_opts(BroadcastOptions, t, rootRank=k_src)
                self._across("broadcast", lambda: self.cross.broadcast([flat], opts), t, self.inhost, tag)

        if self.path == policy.LEADERS:
            on_src_host = k_src == self.host_index
            first = (functools.partial(self.inhost.broadcast, flat, lr_src, self._host_algo(flat, forced), t, tag)
                     if on_src_host and self.inhost is not None
                     else self._host_agree(t, tag))
            rows = self._begin("broadcast", tensor, -1, src, t, tag, first, flat if self.cross is not None else None)
            if flat.numel() == 0:
                self._close(t, tag)
                return
            if self.cross is not None:
                across()
            if not on_src_host:
                self._host_broadcast(flat, 0, forced, t, tag)
            else:
                self._close(t, tag)
            return
        carries = self.local_rank == lr_src  # (the other local ranks' cross groups move nothing)
        rows = self._begin("broadcast", tensor, -1, src, t, tag, self._host_agree(t, tag), flat if carries else None)
        if flat.numel() == 0:
            self._close(t, tag)
            return
        if carries:
            across()
        self.inhost.broadcast(flat, lr_src, self._host_algo(flat, forced), t, tag)

    def _host_segments(self, padded, blocks, seg: int):
        """LEADERS: `padded` = `blocks` (a row per rank) in host segments of `seg` elements,
        host k's ranks' rows in its local order, then zeros; returns `padded`."""
        n = blocks.shape[1]
        for k, index in enumerate(self._host_rank_index):
            used = index.numel() * n
            torch.index_select(blocks, 0, index, out=padded[k * seg:k * seg + used].view(-1, n))
            padded[k * seg + used:(k + 1) * seg].zero_()
        return padded

    def _scratch(self, role: str, numel: int, dtype) -> torch.Tensor:
        """A buffer of `numel` elements of `dtype` for `role` (one per role, so that the roles
        of one call never overlap), grown when too small and reused: one call at a time runs
        here (the Communicator's lock). Its contents are the caller's to set."""
        nbytes = numel * dtype.itemsize
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < nbytes:
            with torch.inference_mode(False):  # (a normal tensor, though made inside _below_autograd)
                buf = self._buffers[role] = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=self.device)
        return buf[:nbytes].view(dtype)

    def _segment_elements(self, n: int) -> int:
        """LEADERS: elements of one host's segment in the leaders' gloo steps, `n` per rank of
        the largest host (gloo moves blocks of one size)."""
        return max(len(ranks) for ranks in self.by_host) * n

    def _host_broadcast(self, tensor, root: int, forced, t, tag) -> None:
        """Broadcast `tensor` inside this host from local rank `root` (nothing alone on it)."""
        if self.inhost is not None:
            self.inhost.broadcast(tensor, root, self._host_algo(tensor, forced), t, tag)

    # ---- the start of every call: first in-host step, then the call check ---------------------
    def _begin(self, what: str, tensor, code: int, root: int, t, tag, step, payload=None, start=None,
               fold=False, piece=0):
        """Start a call (module doc): its first in-host step (`step()`; None: none), then the
        call check in this rank's check group with the step's outcome. Raises the step's own
        error on a rank whose step failed (after its FAILED row is in), a RingError naming
        the ranks and their calls or reasons on the others.

        `start`: the start of the call's first cross-host step (returns its work), given
        where its data cannot go with the check (_overlaps): the check then goes out before
        the step, so that its round trip overlaps the step, and the step's outcome follows in
        a second, header-only check that goes out with the cross-host step (_begin_overlapped);
        returns that step's work. `fold`: `start(failure)` puts the step's outcome (None, or
        this rank's RingError) in the cross-host step's own data instead (_fold_start), and no
        second check goes out.

        `piece`: the elements of an all_reduce's first pipeline piece, in its check row where
        no data goes with it, so that members whose pieces differ (RINGDP_HIER_PIECE_BYTES set
        apart) fail in the check instead of in gloo's mismatched collectives.

        `payload`: what this rank's cross-host step would send (a tensor, read after the
        step, or a function making it after the step). When it fits the check row's slot
        (policy.check_payload_bytes) it travels with the check, and the members' payloads
        come back, in member (host) order, as tensors of its dtype and size: the caller makes
        its cross-host step's result from them instead of running it (one gloo round trip
        instead of two). None: it did not go. A payload function that raises fails the call
        on this rank as a failed step would (a FAILED row, then a RingError with its error
        as the cause), and this host's peers, past the step, meet a rejected in-host call.

        After an abort() of this rank's or one it saw a peer's (Communicator._abandon: a call
        left midway, Ctrl-C) a call raises here, before any gloo operation: the members' are
        paired no more (a check row sent where a peer waited for an abandoned call's
        header-only outcome, or for its data, made gloo terminate the peer's process:
        "Received data size doesn't match expected size")."""
        why = self._aborts.why()
        if why is not None:
            raise RingError(f"rank {self.rank}: this ringdp communicator cannot run collectives across hosts any "
                            f"more: {why}; call ringdp.destroy() and initialise again")
        self._announce(what, tensor, code, root)
        if start is not None:
            return self._begin_overlapped(what, tensor, code, root, t, tag, step, start, fold, piece)
        failure = self._first_step(step)
        group, ranks = self._check_group()
        rows = None
        if callable(payload):  # made from the step's result
            try:
                payload = payload() if failure is None else None
            except Exception as e:  # noqa: BLE001 -- this rank fails the call after the step; everyone must hear it
                payload = None
                failure = RingError(f"rank {self.rank}: {what} across hosts failed after its first in-host step: "
                                    f"{type(e).__name__}: {e}")
                failure.__cause__ = e
                # this host's peers passed the step: they meet a rejected in-host call next
                self._tell(str(failure), self.inhost, t, tag)
        if group is not None:  # (no data with the check where its rows cannot take it: a CUDA CrossHost)
            check = self._check(what, tensor, code, root, t, tag, group, ranks,
                                None if failure is None else str(failure), payload if self.fuse else None,
                                piece=piece)
            try:
                check.wait()
            except RingError:
                if failure is None:
                    raise
                raise failure  # (this rank's own step failed first: the cause, as _begin_overlapped)
            rows = check.payloads(payload)
        if failure is not None:
            raise failure
        if rows is not None:
            self.fused_calls += 1
        return rows

    def _first_step(self, step) -> RingError | None:
        """Run a call's first in-host step (None: none); its RingError, or None. This rank's
        abort() (ProcessGroup.abort) raises at once: no call check, it would wait for the hosts."""
        if step is not None:
            try:
                step()
            except RingError as e:
                if self._aborts.mine is not None:
                    raise
                return e
        return None

    def _overlaps(self, payload) -> bool:
        """Whether the two-level all-reduce's first cross-host step starts through
        _begin(start=...): the call check before the first in-host step, the step's outcome
        with the cross-host data (in a second check, or folded into the data: _fold_start).
        For host memory (a CUDA CrossHost's steps are queued on
        streams: they overlap the check already), when what the cross-host step sends
        (`payload`: None for a call in pieces) cannot go with the check. Every member of a
        check group decides alike when their calls agree (the count, dtype and piece rule
        make `payload`); members whose calls differ decide apart only where the check,
        which each sends first, fails them all. Not on the leaders' path (uneven hosts),
        where it measured slower: 1.12-1.26x the time at 256 KiB-16 MiB on a,a,b (this
        2-core VM, 3 processes; bench/results/compare_overlapped_check_allreduce_cpu_w3_hosts2.json),
        a rank alone on its host having no step to overlap."""
        if not self.fuse or self.checker is None:
            return False
        slot = policy.check_payload_bytes(len(self.cross_ranks))
        return payload is None or payload.numel() * payload.element_size() > slot

    def _begin_overlapped(self, what: str, tensor, code: int, root: int, t, tag, step, start, fold=False,
                          piece=0):
        """_begin with `start` (after _announce): the call check (this call's row) goes out, the
        first in-host step runs while it travels, then the step's outcome goes out in a
        header-only check beside the cross-host step, which every member starts, a rank whose
        step failed too (its data is never used), so that the gloo group's collectives stay
        paired on every member. Returns the cross-host step's work; raises as _begin does,
        after that work has ended (_drain). A rank whose step failed raises its own error
        and tells no one: its host's peers failed in the same step. `fold`: no second check:
        `start(failure)` carries the outcome in the step's data (_fold_start), and the other
        members read it when the step has ended (_Folded.verdict)."""
        group, ranks = self._check_group()
        check = self._check(what, tensor, code, root, t, tag, group, ranks, None, piece=piece)
        try:
            failure = self._first_step(step)
        except BaseException:
            self._leave([check.work])
            raise
        if failure is not None:
            check.tell = None  # (its host's peers failed in the step: nothing to tell)
            try:
                check.wait()
            except RingError:  # (the members see the disagreement; this rank, its own error)
                raise failure
        else:
            check.wait()
        if fold:
            work = start(failure)
            if failure is not None:
                self._drain([work])
                raise failure
            return work
        outcome = self._check(what, tensor, code, root, t, tag, group, ranks,
                              None if failure is None else str(failure), header_only=True)
        try:
            work = start()
        except BaseException as e:  # (Ctrl-C: nothing waited for; the caller aborts: Communicator._abandon)
            self._drain([outcome.work], wait=isinstance(e, Exception))
            raise
        try:
            outcome.wait()
        except BaseException as e:  # (Ctrl-C: nothing waited for; the caller aborts: Communicator._abandon)
            self._drain([work], wait=isinstance(e, Exception))
            raise
        if failure is not None:
            self._drain([work])
            raise failure
        return work

    def _fold_start(self, buf, m: int, red, dop, t, tag, failure):
        """Start the cross-host all-reduce of a one-piece two-level call with the outcome of
        its first in-host step folded in (_begin_overlapped with fold): `buf` holds this
        rank's reduced block (its first `m` elements), then k flags, one per member of the
        cross-host group, that the all-reduce's own op reduces: every member's
        "good" value (0 for SUM and MAX, 1 for MIN), this rank's "bad" where its step failed
        (`failure`, its reason left in the store first). One gloo round trip fewer than a
        second, header-only check. Every member calls it for the same calls in the same
        order (their call checks agreed), so the fold number that names the reasons is the
        same on all of them."""
        self.folded_calls += 1
        me = self.cross_ranks.index(self.rank)
        good, bad = _Folded.flags(red)
        buf[m:].fill_(good)
        if failure is not None:
            self._leave_reason(f"fold{self.folded_calls}", str(failure))
            buf[m + me] = bad
        work = self._gloo_start(buf, dop, t, self.inhost, tag)
        return _Folded(work, buf, m, self.folded_calls, good)

    def _announce(self, what: str, tensor, code: int, root: int) -> None:
        """Name the call in every in-host step's header from here on (ShmComm.set_outer,
        compared with each step's shape): ranks of one host whose steps look alike but whose
        calls differ (counts that pad to the same blocks, AVG and SUM whose steps carry SUM,
        an all_reduce and a reduce_scatter with the same in-host reduce-scatter) fail in the
        step, each check group having agreed, instead of returning different results. Not
        on a CUDA CrossHost: the IPC headers do not carry it (docs/cuda.md)."""
        if self.inhost is not None and self.host_in_step:
            self.inhost.set_outer(_KINDS[what], root if what == "broadcast" else max(code, 0), tensor)

    def reject(self, what: str, why: str, t, tag) -> None:
        """This rank rejected its input to `what` (Communicator._prepare): take part without
        data, so that every peer fails at once naming this rank and `why`: this host's peers
        in the call's first in-host step (a rejected call), every other rank through the call
        check (a FAILED row, `why` in the store)."""
        if self.poison is not None:  # (a CUDA CrossHost: its NCCL steps stop first)
            self.poison(why[:400])
        if self.inhost is not None:  # (every call with a host endpoint starts in-host)
            self.inhost.reject(why[:400], t, tag)
        group, ranks = self._check_group()
        if group is not None:
            self._check(what, None, 0, 0, t, tag, group, ranks, f"rank {self.rank} rejected its input: {why}").wait()

    def _check_group(self):
        """(gloo group, its ranks) of this rank's call check: its cross-host group (the whole
        group on the flat path; the leaders' on uneven hosts: (None, None) for a rank not in
        it, its leader checks for the host)."""
        return (self.checker, self.cross_ranks) if self.checker is not None else (None, None)

    def _host_agree(self, t, tag):
        """A header-only in-host call (no data: every rank of the host at the same call, none
        rejected, and, in its header, the same collective across hosts: _announce); None for a
        rank alone on its host. The first step of a call whose data crosses hosts first, and
        the closing step of a call that has no in-host step after its call check (_close)."""
        if self.inhost is None:
            return None
        return functools.partial(self.inhost.broadcast, torch.empty(0, device=self.device), 0,
                                 policy.ALGO_CODES[policy.RING], t, tag)

    def _close(self, t, tag) -> None:
        """The closing in-host step (header only) of a call with no in-host step after its call
        check: a rank whose check failed rejects its next in-host call (_fail), and its
        host's peers whose check passed (another check group, or no check: a leader's
        non-leaders) must meet that rejection in this call, not in their next one (their
        in-host calls would then pair with the wrong calls). Not on a CUDA CrossHost: a
        failed call there poisons the CUDA endpoint (on_cuda)."""
        agree = self._host_agree(t, tag) if self.host_in_step else None
        if agree is not None:
            agree()

    def _check(self, what: str, tensor, code: int, root: int, t, tag, group, ranks, failure,
               payload=None, header_only=False, piece=0) -> "_Check":
        """Start the call check (module doc): one all-gather of a row per member among `ranks` before
        a cross-host step moves data. gloo kills the process on a size mismatch (its pair
        thread throws and std::terminate runs); ringdp raises a RingError naming each rank's
        call on every rank instead (and, on the uneven all_reduce, tells this host's non-leaders,
        who are in no check). `failure`: this rank's reason
        for a FAILED row (left in the store first). A row is 6 integers (the call, and the payload
        bytes it carries, or minus `piece` where it carries none) and a payload
        slot of policy.check_payload_bytes (one size for every call on the group, so that rows
        never differ in size); `payload`, an all_reduce's data, goes in it when it fits.
        `header_only`: the rows without the slot (the outcome of a call's first in-host step,
        sent by every member of a group whose call check passed: _begin_overlapped).
        `piece`: an all_reduce's first pipeline piece, in elements (_begin)."""
        if failure is None:
            mine = [_KINDS[what], tensor.numel(), zlib.crc32(str(tensor.dtype).encode()), code, root]
            dtype = str(tensor.dtype)
        else:
            self._failures += 1
            self._leave_reason(self._failures, failure)
            mine, dtype = [_FAILED, self._failures, 0, 0, 0], ""
        slot = 0 if header_only else policy.check_payload_bytes(len(ranks))
        nbytes = 0 if payload is None or failure is not None else payload.numel() * payload.element_size()
        fused = 0 < nbytes <= slot
        # the decision is part of the call: members that decided differently (a setting that
        # differs between ranks, e.g. RINGDP_HIER_PIECE_BYTES) disagree here, not in the data
        row = torch.zeros(_HEADER + slot // 8, dtype=torch.int64)
        row[:_HEADER] = torch.tensor(mine + [nbytes if fused else -piece if failure is None else 0], dtype=torch.int64)
        if fused:
            # (typed, not as bytes: a one-element view may have a stride other than 1, which
            # torch calls contiguous but cannot view as bytes)
            row[_HEADER:].view(torch.uint8)[:nbytes].view(payload.dtype).copy_(payload.reshape(-1))
        mine = row
        every = torch.empty(len(ranks) * mine.numel(), dtype=torch.int64)
        # Whom a failed check tells at once (a rejected in-host call): this host's peers, who
        # all took part in the call's first in-host step (the checks of the cross-host
        # groups, which may disagree: a setting that differs between ranks of a host; the
        # uneven path's non-leaders, in no check). Each of them then spends the call after
        # the step alike: rejecting it, or having it rejected. The flat path has no in-host
        # step, and no host endpoint to tell.
        tell = self.inhost
        check = _Check(self, f"{what} (call check)", ranks, mine, every, dtype, t, tag, tell, fused,
                       "in its first in-host step" if header_only else "before any data moved")
        # An all-gather of the rows as gloo's all-to-all of this row to every member: gloo posts
        # every send and receive at once, one network step for any number of hosts, where its
        # all-gather is a ring of 2(H-1) steps of half a row (docs/hierarchy.md "The call check")
        tiled = mine.repeat(len(ranks))
        check.work = self._start(check.what, lambda: group.alltoall_base(every, tiled, [], [],
                                                                         _gloo_opts(AllToAllOptions, t)),
                                 t, tell, tag, ranks, net="gloo")
        return check

    def _leave_reason(self, number: int | str, reason: str) -> None:
        """Leave this rank's reason for its failure `number` in the store (_reason reads it)."""
        try:
            self._store().set(f"{self._reasons}{self.rank}/{number}", reason[:400])
        except Exception:  # noqa: BLE001 -- the peers still fail, without the reason
            pass

    def _reason(self, rank: int, number: int | str) -> str:
        """The reason rank `rank` left for its FAILED row number `number` (a key per failure:
        a rank may fail its next call before a peer reads this one's reason; "fold<n>": its
        failed step in folded call n, _fold_start). Left before its FAILED row went out, so
        there at once, unless leaving it failed (_leave_reason): then a wait of REASON_WAIT_S,
        not the store's own timeout (torchrun's: 30 min)."""
        key = f"{self._reasons}{rank}/{number}"
        try:
            store = self._store()
            store.wait([key], timedelta(seconds=REASON_WAIT_S))
            return store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return "(its reason could not be read from the store)"

    def _members_failed(self, what: str, when: str, failed, tell, t, tag):
        """Raise (and tell, _fail) that the members in `failed`, (rank, failure number) pairs,
        failed `what` `when`, with their reasons from the store (_Check.wait, _Folded.verdict)."""
        why = "; ".join(_said_by(m, self._reason(m, n)) for m, n in failed)
        self._fail(f"rank {self.rank}: {what} across hosts cannot run: "
                   f"{'a rank' if len(failed) == 1 else 'ranks'} failed it {when}: {why}", tell, t, tag)

    def _host_algo(self, tensor, forced: str) -> int:
        """The algorithm code of one collective of `tensor` on this host's endpoint."""
        cap = self.inhost.oneshot_bytes
        threshold = policy.oneshot_threshold(self.host_kind, self.local_size, self.config, cap)
        return policy.ALGO_CODES[policy.choose_algo(tensor.numel() * tensor.element_size(), forced, threshold, cap)]

    # Every gloo step goes through _start and _wait (or both: _across): a failure (a peer host
    # died, a timeout) is a RingError naming the gloo group's ranks (`ranks`, default: the
    # cross-host group's), and this host's peers (`tell`, waiting in the next in-host step)
    # are told at once by a rejected call (_fail). `timeout_s` is the call's; a step waits
    # policy.cross_host_timeout of it, so that it fails (and tells) before a peer's in-host
    # wait for this rank ends.
    def _gloo(self, tensor, dop, timeout_s: float, tell=None, tag: str = "") -> None:
        """All-reduce `tensor` on this rank's gloo group across hosts."""
        self._wait("all-reduce", self._gloo_start(tensor, dop, timeout_s, tell, tag), timeout_s, tell, tag)

    def _gloo_start(self, tensor, dop, timeout_s: float, tell=None, tag: str = ""):
        """Start the gloo all-reduce of `tensor` across hosts (wait: _gloo_wait). MIN and MAX
        of a floating tensor on gloo (_NanAware) follow the kernels' rule, a NaN ignored
        unless every member has one, which gloo's min and max do not."""
        opts = _gloo_opts(dist.AllreduceOptions, timeout_s, reduceOp=dop)
        nan = _NanAware(tensor, dop) if self._nan_rule(dop, tensor) else None  # (its NaNs go as the identity)
        work = self._start("all-reduce", lambda: self.cross.allreduce([tensor], opts), timeout_s, tell, tag)
        if nan is None:
            return work
        every = _gloo_opts(dist.AllreduceOptions, timeout_s, reduceOp=dist.ReduceOp.MIN)
        return nan.then(work, self._start("all-reduce", lambda: self.cross.allreduce([nan.mask], every),
                                          timeout_s, tell, tag))

    def _nan_rule(self, dop, tensor) -> bool:
        """Whether a cross-host step of `dop` on `tensor` needs _NanAware: MIN or MAX of a
        floating tensor on gloo (a CUDA CrossHost's NCCL steps reduce with ringdp's kernels)."""
        return dop in _NanAware.IDENTITY and tensor.is_floating_point() and self.net_name == "gloo"

    def _gloo_wait(self, work, timeout_s: float, tell=None, tag: str = "") -> None:
        self._wait("all-reduce", work, timeout_s, tell, tag)

    def _across(self, what: str, start, timeout_s: float, tell=None, tag: str = "", ranks=None) -> None:
        """Run one gloo collective across hosts: start() issues it through the group's own
        method (module doc) and returns its Work."""
        self._wait(what, self._start(what, start, timeout_s, tell, tag, ranks), timeout_s, tell, tag, ranks)

    def _start(self, what: str, start, timeout_s: float, tell, tag: str, ranks=None, net=None):
        try:
            return start()
        except Exception as e:  # noqa: BLE001
            self._gloo_failed(e, timeout_s, tell, tag, what, ranks, net)

    def _wait(self, what: str, work, timeout_s: float, tell, tag: str, ranks=None, net=None) -> None:
        try:
            self._await(work, policy.cross_host_timeout(timeout_s))
        except Exception as e:  # noqa: BLE001 -- _Aborted, gloo's DistBackendError / RuntimeError
            self._gloo_failed(e, timeout_s, tell, tag, what, ranks, net)

    def _await(self, work, secs: float) -> None:
        """work.wait(), at most `secs`, in slices of ABORT_POLL_S: an abort() ends it (this
        rank's at the slice's end, a peer's once seen in the store, every
        ABORT_STORE_POLL_S), _Aborted then, the work left in flight (close(): inflight). A
        work without is_completed() (a CUDA CrossHost's, which only orders streams) waits
        once. A gloo Work's wait(timeout) that times out leaves the work as it was."""
        if not hasattr(work, "is_completed"):
            work.wait(timeout=timedelta(seconds=secs))
            return
        start = time.monotonic()
        end, looked = start + secs, start
        while True:
            sliced = time.monotonic()
            try:
                work.wait(timeout=timedelta(seconds=max(0.001, min(end - sliced, ABORT_POLL_S))))
                return
            except Exception:  # noqa: BLE001 -- the slice's "timed out", or the work's own failure
                if work.is_completed():
                    work.wait()  # its own outcome (done just after the slice ended, or gloo's error)
                    return
                if time.monotonic() >= end:
                    raise
                if time.monotonic() - sliced < ABORT_POLL_S / 2:  # (raised early, not done: no busy loop)
                    time.sleep(ABORT_POLL_S / 2)
            look = time.monotonic() - looked >= ABORT_STORE_POLL_S
            looked = time.monotonic() if look else looked
            why = self._aborts.why(look)
            if why is not None:
                self._leave([work])
                raise _Aborted(why)

    def _gloo_failed(self, e, timeout_s, tell, tag, what, ranks=None, net=None):
        """`net`: what carried the step (None: the cross-host steps', net_name; the call check: gloo)."""
        first = str(e).splitlines()[0] if str(e) else ""
        ranks = self.cross_ranks if ranks is None else ranks
        net = self.net_name if net is None else net
        # an abort() ended it (_await), or a peer's abort() made a gloo step fail (its group
        # gone: a closed connection): the abort is the cause
        why = str(e) if isinstance(e, _Aborted) else self._aborts.why(look=True, wait_s=ABORT_LOOK_S)
        if why is not None:
            self._fail(f"rank {self.rank}: the {what} across hosts ({net}, ranks {ranks} of the group) was abandoned: "
                       f"{why}" + ("" if isinstance(e, _Aborted) else f" ({type(e).__name__}: {first})"),
                       tell, timeout_s, tag)
        self._fail(f"rank {self.rank}: the {what} across hosts ({net}, ranks {ranks} of the group) "
                   f"failed (its limit {policy.cross_host_timeout(timeout_s):g} s): a rank (or a whole host) died, is stuck or cannot be reached: "
                   f"{type(e).__name__}: {first}", tell, timeout_s, tag)

    def _fail(self, msg: str, tell, timeout_s: float, tag: str):
        """Tell this host's peers (_tell), then raise."""
        self._tell(msg, tell, timeout_s, tag)
        raise RingError(msg) from None

    def _tell(self, msg: str, tell, timeout_s: float, tag: str) -> None:
        """Tell this host's peers that this rank fails the call (`tell`: reject their next
        in-host call). A CUDA CrossHost poisons its CUDA endpoint first (also a rank alone
        on its host, which has no peer to tell): its NCCL steps abort, so that nothing
        queued waits on a dead peer and the rejection, queued behind them, goes out."""
        if self.poison is not None:
            try:
                self.poison(msg[:400])
            except Exception:  # noqa: BLE001
                pass
        if tell is not None:
            try:
                tell.reject(msg[:400], timeout_s, tag)
            except Exception:  # noqa: BLE001 -- the peers' own failure, or they failed too
                pass


class _Aborts:
    """Whether this communicator was aborted (CrossHost.abort): on this rank (`mine`: the
    reason), or on a peer (`seen`: what it left under `key` in the store, once read). The
    store is read on a thread of its own (look), never by a waiting call: across a dead link
    a store call blocks for the store's own timeout. `store`: a function that returns it
    (Communicator._store, which raises once the group is gone: the store is not held)."""

    def __init__(self, store, key: str):
        self.store, self.key, self.mine, self.seen = store, key, None, None
        self._looking: threading.Thread | None = None

    def why(self, look: bool = False, wait_s: float = 0.0) -> str | None:
        """Why a cross-host wait must end (None: it goes on). `look`: start a read of the
        store (unless one is under way), and wait up to `wait_s` for it."""
        if self.mine is not None:
            return f"aborted on this rank ({self.mine})"
        if self.seen is None and look and self.store is not None:
            t = self._looking
            if t is None or not t.is_alive():
                try:
                    store = self.store()
                except Exception:  # noqa: BLE001 -- the group is gone: nothing to look at
                    return None
                t = self._looking = threading.Thread(target=self._read, args=(store,), name="ringdp-abort-look",
                                                     daemon=True)
                t.start()
            if wait_s > 0:
                t.join(wait_s)
        return self.seen

    def _read(self, store) -> None:
        try:
            if store.check([self.key]):
                self.seen = store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001 -- a store that cannot be reached: the wait goes on to its timeout
            pass


class _Aborted(Exception):
    """A cross-host wait ended by an abort() (CrossHost._await)."""


class _NanAware:
    """A gloo MIN or MAX of a floating tensor with the kernels' NaN rule (IEEE fmin/fmax, as
    NCCL: a NaN ignored unless every member has one). gloo's min/max keep a NaN only as their
    first operand, so whether it survives depends on the member order. The tensor's NaNs go
    as the op's identity (+inf for MIN, -inf for MAX), and a uint8 all-reduce (MIN) of where
    they were, beside it, says where every member had one: NaN there after the wait."""
    IDENTITY = {dist.ReduceOp.MIN: float("inf"), dist.ReduceOp.MAX: float("-inf")}

    def __init__(self, tensor, dop):
        nan = tensor.isnan()
        self.tensor, self.mask = tensor, nan.to(torch.uint8)
        tensor.masked_fill_(nan, self.IDENTITY[dop])
        self.works = ()

    def then(self, work, mask_work) -> "_NanAware":
        self.works = (work, mask_work)
        return self

    def wait(self, timeout=None) -> None:
        for w in self.works:
            _wait(w, timeout)
        self.tensor.masked_fill_(self.mask.bool(), float("nan"))

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Folded:
    """The cross-host step of a call whose first in-host step's outcome went with its data
    (CrossHost._fold_start): wait() as a gloo work, then verdict()."""

    def __init__(self, work, buf, m: int, number: int, good: int):
        self.work, self.buf, self.m, self.number, self.good = work, buf, m, number, good  # (buf: block, then flags)

    @staticmethod
    def flags(red: int) -> tuple[int, int]:
        """(good, bad) flag values under op `red`: bad wins the reduction."""
        return (1, 0) if red == _types.MIN else (0, 1)

    def wait(self, timeout=None) -> None:
        _wait(self.work, timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def verdict(self, host: "CrossHost", t, tag) -> None:
        """After wait(): a RingError naming the members whose first in-host step failed (their
        reasons from the store), told to this host's peers; nothing when every flag is good."""
        failed = [(m, f"fold{self.number}") for m, f in zip(host.cross_ranks, self.buf[self.m:].tolist())
                  if f != self.good]
        if failed:
            host._members_failed("all_reduce", "in its first in-host step", failed, host.inhost, t, tag)


class _Check:
    """A started call check (CrossHost._check): wait() once, before the first gloo step."""

    def __init__(self, host: CrossHost, what, ranks, mine, every, dtype: str, t, tag, tell, fused=False,
                 when="before any data moved"):
        self.host, self.what, self.ranks, self.tell, self.when = host, what, ranks, tell, when
        self.fused = fused  # this rank's payload is in its row
        self.mine, self.every, self.dtype, self.t, self.tag = mine, every, dtype.replace("torch.", ""), t, tag
        self.work, self.done = None, False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        h = self.host
        h._wait(self.what, self.work, self.t, self.tell, self.tag, self.ranks, net="gloo")
        rows = self.every.view(len(self.ranks), -1)[:, :_HEADER].tolist()
        if int(self.mine[0]) == _FAILED:
            return  # this rank failed the call itself: it raises its own error (CrossHost._begin)
        failed = [(m, row[1]) for m, row in zip(self.ranks, rows) if row[0] == _FAILED]
        if failed:
            h._members_failed(self.what.split()[0], self.when, failed, self.tell, self.t, self.tag)
        if all(r == rows[0] for r in rows):
            return
        kinds = {v: k for k, v in _KINDS.items()}
        ops = {_types.SUM: "SUM", _types.AVG: "AVG", _types.MIN: "MIN", _types.MAX: "MAX"}
        my_code = int(self.mine[2])

        def call(k, n, d, c, rt, fz):
            dtype = self.dtype if d == my_code else f"not {self.dtype}"
            return (f"{kinds.get(k, k)} of {n} elements, dtype {dtype}" + (f", op {ops[c]}" if c in ops else "")
                    + (f", root {rt}" if k == _KINDS["broadcast"] else "")
                    + (f", its {fz} bytes with the call check" if fz > 0 else "")
                    + (f", in pieces of {-fz} elements" if fz < 0 else ""))

        calls = "; ".join(f"rank {m}: {call(*row)}" for m, row in zip(self.ranks, rows))
        h._fail(f"rank {h.rank}: ranks disagree on a collective across hosts: {calls}", self.tell, self.t, self.tag)

    def payloads(self, payload) -> list | None:
        """After wait(): the members' payloads (each `payload`'s dtype and size, views of the
        gathered rows), in member order, when the data went with the check (every row the
        same call, so every member made the same decision and sent its data); else None."""
        if not self.fused:
            return None
        nbytes = payload.numel() * payload.element_size()
        rows = self.every.view(len(self.ranks), -1)[:, _HEADER:]
        return [rows[k].view(torch.uint8)[:nbytes].view(payload.dtype) for k in range(len(self.ranks))]


def _wait(work, timeout) -> None:
    """A gloo Work's wait() for a wrapper's wait(timeout=None): c10d's Work.wait takes a
    timedelta or nothing, never None (a TypeError that replaced the call's outcome when
    CrossHost._await re-waited a work done just after its slice, 2026-12-07)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=timeout)


def _said_by(rank: int, reason: str) -> str:
    """`reason` (a FAILED row's, from the store) attributed to `rank`, which most reasons
    already name first (a RingError's text starts with its rank): "rank 2: ...", once."""
    return reason if reason.startswith((f"rank {rank}:", f"rank {rank} ")) else f"rank {rank}: {reason}"


def _reduce_rows(out, rows, code: int) -> None:
    """`out` = the reduction of `rows` (op `code`; AVG: SUM, the caller divides), in row
    order, the same on every member."""
    for k, x in enumerate(rows):
        if k == 0:
            out.copy_(x)
        elif code == _types.MIN:
            torch.fmin(out, x, out=out)  # (NaN ignored unless all are: the kernels' rule)
        elif code == _types.MAX:
            torch.fmax(out, x, out=out)
        else:
            out.add_(x)
