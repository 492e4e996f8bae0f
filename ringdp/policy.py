"""Policy: which path and which size, decided in Python where it is easy to test.

The constants are the defaults (ringdp/config.py reads the RINGDP_* overrides once); the
functions are the decisions, each made in one place for every transport:

* choose_algo: ring or one-shot for one all-reduce (shared memory, CUDA IPC, NCCL alike);
* oneshot_threshold: up to which size `auto` picks one-shot, per transport and world size;
* transport_for: which CUDA transport (IPC inside a host, NCCL across hosts);
* spin_ns, timeout_s: how long to spin before sleeping, how long to wait for peers;
* inline_async: which asynchronous collectives run on the calling thread;
* cross_host_path, two_level_piece_bytes: the CPU all-reduce across hosts and its pieces;
* cross_host_timeout: how long a cross-host step waits, within the call's timeout;
* the limits of the RINGDP_* values (MAX_TIMEOUT_S, MAX_BUFFER_BYTES, ...), which config.py
  applies.

ONESHOT_MAX_BYTES comes from `python bench/allreduce.py --algo ring,oneshot` on the 2-core CI
machine (world 2 and 4, float32); see README.md "Choosing the algorithm".
"""
from __future__ import annotations

import os

RING = "ring"
ONESHOT = "oneshot"
ALGO_CODES = {RING: 0, ONESHOT: 1}  # csrc/transport/shm/shm_comm.h Algo, csrc/cuda/cuda_api.h

# Shared memory: messages up to this size use the one-shot path (every rank reduces all
# peers' copies) for world sizes of 3 and more; ONESHOT_MAX_BYTES_BY_WORLD overrides per
# world size (world 2: the ring is as fast at every size).
ONESHOT_MAX_BYTES = 128 << 10
ONESHOT_MAX_BYTES_BY_WORLD = {1: 0, 2: 0}
# The one-shot buffer each rank keeps (twice, alternating by call parity).
ONESHOT_BYTES = 256 << 10
# Ring pipeline: bytes per FIFO slot and slots per connection.
SLOT_BYTES = 256 << 10
FIFO_SLOTS = 8
# Virtual size of each rank's registered-memory arena (pages are reserved on allocation).
ARENA_GB = 16
DEFAULT_TIMEOUT_S = 300.0
# A collective that has waited this long for a peer logs a stall report, once (as Horovod's
# stall inspector; 0: never). The timeout's RingError carries the same report.
DEFAULT_STALL_WARN_S = 60.0
# Collectives kept per communicator in the flight record (dumped beside RINGDP_TRACE).
FLIGHT_RECORD_CALLS = 256
# Registered CUDA memory per rank (IPC arena), MiB.
CUDA_ARENA_MB = 256
# RingDDP: a gradient of at least this many bytes is reduced in its own .grad, in a bucket
# of its own, when .grad are not bucket views and no comm hook is set (ringdp stages it
# through the transport on its worker, instead of the backward copying it into a bucket
# and the end of backward copying it back). Measured on the 2-core CI machine, world 2,
# 4 x Linear(2560, 2560): ~90 ms per step with it vs ~100-110 ms through the buckets.
IN_GRAD_MIN_BYTES = 1 << 20
# RINGDP_INLINE_ASYNC_MAX_BYTES (off by default): an asynchronous collective on shared
# memory (async_op=True; the torch.distributed backend's calls from C++ and its dist.* calls
# with async_op=True) of at most this many bytes runs on the calling thread when nothing is queued,
# and a completed Work comes back. It saves the handoff to ringdp's worker thread and back:
# measured on the 2-core CI machine, world 2, float32 all-reduce waited for at once, inline
# vs through the worker (which spins as inline calls do while its caller waits: spin_ns):
# 4 KiB 7 vs 35 us, 64 KiB 21 vs 47, 256 KiB 25 vs 52, 1 MiB 59 vs 92, 4 MiB 220 vs 252.
# Off by default because the call then blocks until every peer has entered the collective:
# a program that issues an async collective and then does something its peer needs first
# (a send the peer receives before its own all-reduce; async calls on two groups issued in
# different orders on different ranks) waits until the timeout, where gloo and NCCL return
# at once. Safe when every rank issues the same collectives in the same order with nothing
# in between that a peer waits for (DDP, FSDP, most data-parallel loops).
INLINE_ASYNC_MAX_BYTES = 0
# Busy-wait before sleeping on the futex: long when every rank has a core, short when
# ranks outnumber cores (the spinning rank would take the core its peer needs).
SPIN_NS = 50_000
SPIN_NS_OVERSUBSCRIBED = 2_000


# ---- limits of the RINGDP_* values ----------------------------------------------------------
# config.py refuses a value outside them, with a ValueError naming the variable (none is
# finite-only by accident: inf and 1e30 were accepted and broke later, as a raw OverflowError,
# a pybind TypeError or a SIGSEGV); the C++ side checks its own arithmetic as well
# (csrc/transport/shm/layout.h Geometry::make, csrc/bindings.cpp registered_bytes).
#
# Timeouts (RINGDP_TIMEOUT_S, init's and a call's timeout=; RINGDP_STALL_WARN_S): above
# this they are this, infinity included: "no practical limit" (115.7 days). Every consumer
# takes it with room to spare, where 1e10 s did not: threading waits (destroy() joins the
# worker and takes the lock for the timeout) stop at threading.TIMEOUT_MAX, 9.2e9 s on Linux
# (OverflowError past it); datetime.timedelta (the store's waits, the gloo groups across
# hosts) at 999999999 days, 8.6e13 s ("int too large to convert to C int" at 1e15, inf not
# convertible at all); gloo and c10d turn their timedelta into milliseconds and their waits
# add it in nanoseconds to the steady clock (int64: 9.2e9 s, less the uptime). The C++
# transports take any value (infinity: no deadline; csrc/transport/shm/shm_comm.cpp
# begin_call, csrc/cuda/protocol.h timeout_ns). 1e7 s stays ~900x under the tightest limit,
# so sums and shares of it (deadlines, cross_host_timeout) stay in range.
MAX_TIMEOUT_S = 1e7
# At interpreter exit a communicator still open (a backend group never destroyed) waits this
# long for its worker's queued calls (comm._close_at_exit); the call's timeouts bound them too
EXIT_WAIT_S = 10.0
# close() (destroy(), the exit) that has waited this long for the worker's unfinished calls, or
# for the CUDA work queued on ringdp's streams, says so
CLOSE_NOTE_S = 1.0
# Closing's wait for the CUDA work on ringdp's streams polls their events this often, in Python,
# so that Ctrl-C ends it (cuda_comm.CudaEndpoint.wait_queued)
DEVICE_POLL_S = 0.001
# Ctrl-C in that wait aborts the calls (Communicator._abandon); the worker then gets this long
# to leave the aborted one (milliseconds on shared memory, ABORT_POLL_S across hosts) and refuse
# the rest: a daemon thread still in C++ when Python finalizes ends the process in std::terminate
ABANDON_WAIT_S = 2.0
# A call that fails with gloo collectives of its own still in flight (a cross-host step of
# an earlier piece, torch's Join all-reduce, the gloo part of a backend Work) waits this long
# for them before it raises: a gloo collective left running completes its future on gloo's
# thread, at the latest at exit, and one that does so after the interpreter finalised (a
# Python callback on it) aborts the process ("terminate called ...", exit -6). One stuck on a
# dead peer is left to its own timeout. The exit waits as long for the gloo calls ringdp holds
# still in flight (ringdp/inflight.py): long enough for peers that make them too, short where
# they never will (ranks that stopped at a failure, each waiting on the others)
GLOO_DRAIN_S = 2.0
# The gloo calls ringdp holds (ringdp/inflight.py: the backend's inner ones, those left by a
# group across hosts, RingDDP's Join notice on a gloo group) are held until this long after they are
# seen to end: gloo's thread marks a call ended before it drops its own references (a lock and
# a return: microseconds, longer on a loaded machine); the exit keeps for good what is held
GLOO_LET_GO_S = 0.5
# RINGDP_SLOT_BYTES: csrc/transport/shm/shm_comm.cpp's rule (a slot holds whole cache lines
# and at least a page).
SLOT_MIN_BYTES = 4096
SLOT_ALIGN_BYTES = 64
# One buffer ringdp sizes from a variable: a FIFO slot or a one-shot buffer (RINGDP_SLOT_BYTES,
# RINGDP_ONESHOT_BYTES; RINGDP_CUDA_SLOT_BYTES, RINGDP_CUDA_ONESHOT_BYTES), 1 GiB: 4096x the
# shared-memory defaults, 64x the largest CUDA one. Each rank reserves and touches its FIFO
# (slots x slot bytes) and two one-shot buffers when it sets up (in /dev/shm; on the GPU).
MAX_BUFFER_BYTES = 1 << 30
# Slots per connection (RINGDP_FIFO_SLOTS, RINGDP_CUDA_SLOTS) and RINGDP_CUDA_CHANNELS (C
# ints there; the transport clamps channels to 64 anyway): 1024, 128x the defaults.
MAX_SLOTS = 1 << 10
# RINGDP_ARENA_GB (and RINGDP_CUDA_ARENA_MB, the same bound in MiB): 64 TiB, half of the
# x86-64 user address space (128 TiB): the arena is reserved address space, and every rank
# maps every peer's segment, so a larger one can never be mapped. With the bounds above the
# whole segment (4 KiB + slots x slot bytes + 2 x one-shot bytes + arena) stays under 2^47
# bytes: its size cannot wrap in 64 bits.
MAX_ARENA_GB = 1 << 16
# RINGDP_SPIN_US: 1 s. The spin is a busy core before a futex sleep that wakes within
# microseconds; past a second it buys nothing (C++ holds it as int64 nanoseconds added to the
# clock: it must stay far below 9.2e18 ns).
MAX_SPIN_US = 1e6


def choose_algo(nbytes: int, forced: str, threshold: int, capacity: int) -> str:
    """The algorithm of one all-reduce of `nbytes`: `forced` (auto, ring, oneshot) as the
    caller asked; `threshold`: the largest message `auto` sends one-shot; `capacity`: the
    largest message the transport can send one-shot (0: none). A forced one-shot falls back
    to the ring above the capacity."""
    if forced == RING or nbytes > capacity:
        return RING
    if forced == ONESHOT:
        return ONESHOT
    return ONESHOT if nbytes <= threshold else RING


def inline_async(nbytes: int, cfg) -> bool:
    """Whether an asynchronous shared-memory collective of `nbytes` runs on the calling
    thread when nothing is queued (INLINE_ASYNC_MAX_BYTES; 0: none does)."""
    return 0 < cfg.inline_async_max_bytes and nbytes <= cfg.inline_async_max_bytes


def oneshot_threshold(transport: str, world: int, cfg, capacity: int) -> int:
    """Up to which size `auto` picks one-shot on `transport` ("shm", "ipc", "nccl")."""
    if transport == "shm":
        default = ONESHOT_MAX_BYTES_BY_WORLD.get(world, ONESHOT_MAX_BYTES)
        limit = default if cfg.oneshot_max_bytes is None else cfg.oneshot_max_bytes
    else:  # CUDA: the whole one-shot buffer unless RINGDP_CUDA_ONESHOT_MAX_BYTES says less
        limit = cfg.cuda_oneshot_max_bytes or capacity
    return min(limit, capacity)


def transport_for(hosts: list[str], cfg) -> str:
    """The CUDA transport: RINGDP_TRANSPORT if forced, else IPC when every rank is on one
    host, else NCCL."""
    if cfg.transport in ("ipc", "nccl"):
        return cfg.transport
    return "ipc" if len(set(hosts)) == 1 else "nccl"


def cuda_hierarchical(cross_path: str | None, cfg) -> bool:
    """Whether CUDA collectives across hosts take the CPU collectives' hierarchical path
    (ringdp/hosts.py with CUDA IPC inside each host and ringdp's NCCL transport across hosts):
    TWO_LEVEL (hosts of one size: NCCL between the ranks of one local rank) or LEADERS
    (uneven hosts: NCCL between the hosts' first ranks), unless RINGDP_TRANSPORT forces a
    transport. Otherwise (one rank per host, RINGDP_HIERARCHY=0): the flat NCCL ring."""
    return cross_path in (TWO_LEVEL, LEADERS) and cfg.transport == "auto"


def timeout_s(timeout, default: float) -> float:
    """Seconds to wait for peers: `timeout` (seconds or a timedelta), else `default`, at
    most MAX_TIMEOUT_S (a longer one, infinity included, is that bound: no practical limit).
    The one rule of every timeout a user gives: RINGDP_TIMEOUT_S (config.py), init's and
    each call's timeout= (comm.py). NaN, zero and negative values are a ValueError."""
    if timeout is None:
        timeout = default
    if hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()
    timeout = float(timeout)
    if not timeout > 0:  # (NaN too)
        raise ValueError(f"timeout must be positive, got {timeout}")
    return min(timeout, MAX_TIMEOUT_S)


def spin_ns(machine_ranks: int, cfg, compute_threads: int = 0) -> int:
    """Busy-wait before sleeping: RINGDP_SPIN_US, else long when every rank of the group on
    this machine has a core and short when they outnumber the cores. Hosts simulated with
    RINGDP_HOST_ID share one machine, so the machine's ranks count, not the host's (2
    simulated hosts x 2 ranks on 2 cores counted as 2 per host and spun 50 us per wait; an
    A/B of the two spins on the quiet box showed no difference beyond its noise).

    compute_threads: for the collectives that run on ringdp's worker thread while the
    caller goes on (async_op, RingDDP's and torch DDP's buckets during backward), the
    caller's intra-op threads (torch.get_num_threads()) keep computing beside the worker, so
    each rank needs compute_threads + 1 cores; a worker that spins 50 us per wait then takes
    cores from the backward. Measured on the 2-core box, world 2, 26M-parameter MLP, 7 paired
    runs: stock DDP on cpu:ringdp 134 ms per step on average with this rule vs 142 ms with
    50 us spins everywhere (faster in 5 of 7 pairs; RingDDP 122 vs 125 ms, within noise),
    while a synchronous 64 KiB all-reduce takes 20 us with 50 us spins and 80 us with 2 us
    ones: so the short spin only where the caller computes meanwhile. A caller blocked in
    Work.wait() computes nothing: while one waits, the worker spins as inline calls do
    (Communicator._caller_waits; a 8 MiB dist.all_reduce on a ringdp group took 1.3-1.4 ms
    with the short spin, 0.64-0.70 ms so).

    This is the most a wait spins: the ring's waits inside a call spin less while spinning
    does not pay (csrc/transport/shm/wait.h SpinLearner: half after a wait that had to
    sleep, twice after one the spin caught, and while below it the whole spin on a probe
    every 16th wait).
    Beside one busy process (bench/allreduce.py --busy 1), world 2, a 16 MiB all-reduce took
    5.0-6.6 ms with a fixed 50 us spin and 3.4-4.3 ms so."""
    if cfg.spin_us is not None:
        return int(cfg.spin_us * 1000)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    need = machine_ranks * (compute_threads + 1 if compute_threads > 0 else 1)
    return SPIN_NS if need <= cores else SPIN_NS_OVERSUBSCRIBED


# ---- across hosts (CPU tensors) ------------------------------------------------------------
LOCAL = "local"  # one host: the shared-memory engine alone (today's path)
FLAT = "flat"  # gloo all_reduce on the whole group (RINGDP_HIERARCHY=0, or one rank per host)
TWO_LEVEL = "two_level"  # even hosts: in-host reduce_scatter, cross-host all_reduce per shard, in-host all_gather
# Two-level path: the tensor goes in at most HIER_MAX_PIECES pieces of at least
# HIER_PIECE_BYTES (RINGDP_HIER_PIECE_BYTES, the *minimum* piece), the inter-host all-reduce
# of one piece overlapping the in-host reduce-scatter of the next (two_level_piece_bytes).
# Each piece pays fixed synchronisation: a gloo call and two in-host calls on the box; on real
# hosts 3 launches and 2(H-1) network latencies (~300 us at 16 hosts). The count comes from
# the cost model (bench/cost_model.py, docs/hierarchy.md "Piece size"): over H = 2..16 hosts
# of 8 H100, one NIC per GPU and one per host, 1 MiB-1 GiB (330 cells), the time with
# max(16 MiB, S/k) pieces against the model's best piece (1 MiB..256 MiB or one piece) is,
# geometric mean / worst: k=1 1.064 / 1.59, k=2 1.022 / 1.31, k=3 1.023 / 1.37,
# k=4 1.035 / 1.64, k=8 1.070 / 1.93, fixed 16 MiB pieces 1.177 / 3.08. Two pieces fit best
# and stay best (or within 0.01 of S/3) with alpha_net 5 or 20 us, launch 25 us, in-host
# 250 GB/s or a 23 GB/s NIC. Where two pieces lose, the best is one piece (32-64 MiB at 8-16
# hosts: up to 1.31x slower) or S/4-S/16 (256 MiB-1 GiB: up to 1.16x); S/4 loses up to 1.64x at
# 64 MiB on 16 hosts (4 x 16 MiB pieces, each paying the network latency). The 2-core box,
# where the simulated hosts share the cores and nothing overlaps, agrees: 2x2 hosts, 16 / 64 /
# 256 MiB: 4 MiB pieces 25-28 / 87-88 / 321 ms, 16 MiB pieces 17.5-22 / 81-87 / 297 ms, one
# piece 19-20 / 65-76 / 293 ms.
HIER_PIECE_BYTES = 16 << 20
HIER_MAX_PIECES = 2
LEADERS = "leaders"  # uneven hosts: in-host all_reduce, leaders' all_reduce across hosts, in-host broadcast


def cross_host_path(local_sizes: list[int], hierarchy: bool) -> str:
    """The CPU all-reduce path for a group whose ranks sit on hosts with `local_sizes` ranks
    each; `hierarchy`: RINGDP_HIERARCHY."""
    if len(local_sizes) == 1:
        return LOCAL
    if not hierarchy or max(local_sizes) == 1:
        return FLAT
    return TWO_LEVEL if len(set(local_sizes)) == 1 else LEADERS


# A cross-host step (gloo or NCCL between hosts, the call check) waits this much less than
# the call's timeout (a tenth of it, at most this many seconds): a rank stuck in it (a dead
# host, a pulled cable) then fails and tells its host's peers (a rejected call) before their
# in-host wait for it ends, so that every rank's RingError names the cross-host step, the
# cause, rather than the peer of its own host that it waited for. With one timeout at both
# levels which ended first was a race (CI met it: a rank reported its in-host wait).
CROSS_HOST_MARGIN_S = 5.0


def cross_host_timeout(timeout_s: float) -> float:
    """Seconds a cross-host step of a call whose timeout is `timeout_s` waits: `timeout_s`
    less a tenth of it, the margin at most CROSS_HOST_MARGIN_S (never longer than ringdp's
    timeout: issue 12)."""
    return timeout_s - min(0.1 * timeout_s, CROSS_HOST_MARGIN_S)


# Across hosts every call check all-gathers one fixed-size row per member of its gloo group:
# the call (6 int64) and a payload slot of check_payload_bytes(members). A collective whose
# cross-host step's data fits the slot travels in it, and its members make the step's result
# from the rows themselves (all_reduce: reduce them; reduce_scatter: reduce their blocks;
# all_gather: place them; broadcast: take the root's): one gloo round trip per call instead
# of two (the check, then the data). The size is a
# constant, never configured: rows of different sizes on two ranks would kill gloo (its pair
# thread throws, std::terminate), the very failure the check exists to prevent.
CHECK_PAYLOAD_TOTAL_BYTES = 64 << 10


def check_payload_bytes(members: int) -> int:
    """The payload slot of one member's check row (bytes, a multiple of 64): at most
    CHECK_PAYLOAD_TOTAL_BYTES for the whole group, so that a check costs the same few KiB
    whatever the number of hosts."""
    return CHECK_PAYLOAD_TOTAL_BYTES // max(1, members) // 64 * 64


# A two-level all_reduce in one piece whose block is too big for the check's slot overlaps
# its call check with the first in-host step, and the step's outcome then needs a second
# round trip: a small all-gather beside the data's all-reduce, or a flag per member folded
# into the data's all-reduce itself (ringdp/hosts.py CrossHost._fold_start), which costs a
# copy of the block instead (the in-host steps run out of place, in a scratch buffer). Folded
# up to FOLD_MAX_BLOCK_BYTES of block. On the 2-core box (2 hosts x 2 ranks, interleaved runs
# against the code without it, medians of six each;
# bench/results/compare_folded_outcome_allreduce_cpu_w4_hosts2.json, every size folded) it
# took 256 KiB and 1 MiB calls (128 and 512 KiB blocks) to 0.87x and 0.94x their time, 4 MiB
# (2 MiB blocks) to 0.94x, 16 MiB (8 MiB) to 1.02x; a second set folding up to 2 MiB blocks
# (..._cap2m_...) gave 0.87x, 0.96x, 1.06x and, unfolded, 0.99x. So up to 1 MiB: at 2 MiB
# the copy costs what the round trip saves. On real hosts a round trip is shorter and a copy
# faster; the cap is what this box measured.
FOLD_MAX_BLOCK_BYTES = 1 << 20


def folds_outcome(block_bytes: int) -> bool:
    """Whether a one-piece two-level all_reduce whose cross-host block (one rank's part of
    the cross-host step) is `block_bytes` carries its first in-host step's outcome in that
    step's data instead of a second check (FOLD_MAX_BLOCK_BYTES). Every member of a check
    group decides alike: the block is the same on all of them when their calls agree."""
    return block_bytes <= FOLD_MAX_BLOCK_BYTES


def two_level_piece_bytes(nbytes: int, min_piece_bytes: int, max_pieces: int | None = None) -> int:
    """Bytes per piece of a two-level all-reduce of `nbytes`: at most `max_pieces` pieces
    (None: HIER_MAX_PIECES, read at each call), each at least `min_piece_bytes`
    (RINGDP_HIER_PIECE_BYTES), i.e. max(min_piece_bytes, ceil(nbytes / max_pieces)), so
    that a tensor up to the minimum goes in one piece. Rounding to whole elements (and to
    the local size) is the caller's business.
    No torch here: bench/cost_model.py imports it."""
    if max_pieces is None:
        max_pieces = HIER_MAX_PIECES
    if nbytes < 0 or min_piece_bytes < 1 or max_pieces < 1:
        raise ValueError(f"two_level_piece_bytes: nbytes {nbytes} must be >= 0, min_piece_bytes "
                         f"{min_piece_bytes} and max_pieces {max_pieces} >= 1")
    return max(min_piece_bytes, -(-nbytes // max_pieces))
