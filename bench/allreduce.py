"""Collective bandwidth/latency sweep: ringdp against torch.distributed, nccl-tests style.

Run it
    python bench/allreduce.py                      # starts --world (2) local ranks itself
    python bench/allreduce.py --coll all_reduce,reduce_scatter,all_gather,broadcast
    python bench/allreduce.py --world 4 --plot
    python bench/allreduce.py --algo ring,oneshot  # both forced algorithms, side by side
    torchrun --nproc-per-node 2 bench/allreduce.py # uses the ranks torchrun gives it
    python bench/readme_table.py bench/out/X.json  # tables, speedup summary, targets, crossover

The file is four parts, each with one job:
    Pattern      the values every rank reduces and the exact result (closed form)
    bytes_factor the roofline: bytes each rank must read and write, as a multiple of S
    Caller       what a series calls: torch.distributed on the baseline backend, or
                 ringdp.all_reduce on an ordinary or a registered tensor, per forced algorithm
    measure      one (size, series) point: warm-up, iteration count, one timed batch, #wrong
and a driver (run_rank) that sweeps the sizes, prints the table and writes the JSON/PNG.

Series (each size measures them back to back, in this order):
    gloo / nccl   torch.distributed.all_reduce on the baseline backend (gloo for CPU
                  tensors, nccl for CUDA tensors; --baseline to choose, --no-baseline to skip)
    ringdp        ringdp.all_reduce on an ordinary tensor (staged through the transport)
    ringdp-reg    ringdp.all_reduce on a tensor from ringdp.empty (registered memory)
    ringdp-flat   (--hosts only) ringdp's collective on a communicator made with
                  RINGDP_HIERARCHY=0: the inter-host engine (gloo) on the whole group
    ringdp-pg     (opt-in: --series) torch.distributed's collective on a group of ringdp's
                  backend (dist.new_group(backend="cpu:ringdp"), "cuda:ringdp" on CUDA):
                  what a stock torch.distributed program gets, Work and c10d dispatch included
    part:inhost, part:cross  (opt-in: --series parts; CPU, all_reduce, across hosts of
                  equal size) the two-level all-reduce's steps timed alone in the same run,
                  every host's ranks (every cross-host group) at once as in it: ringdp's
                  reduce_scatter_tensor then all_gather_into_tensor of S on a group of this
                  host's ranks (shared memory); gloo's all_reduce of S / L (L = ranks per
                  host) on a group of the ranks with this local rank, one per host. size is
                  S for both, count the part's elements; each result is checked against the op
                  over the part's group.
                  Their sum beside the ringdp row shows what the pieces' pipeline hides (a
                  "# parts" line per size)
With --algo ring,oneshot the ringdp series are split per forced algorithm (ringdp:ring,
ringdp:oneshot, ringdp-reg:ring, ...), each call passing algo= to ringdp.all_reduce; a
forced series is measured only at the sizes where ringdp really runs that algorithm (a
forced one-shot falls back to the ring above its buffer), as Communicator.algo_for says.

Columns (nccl-tests doc/PERFORMANCE.md): size = S bytes of the tensor, count = elements,
time(us) = mean time of one all_reduce, min(us) = fastest single iteration,
algbw = S / time, busbw = algbw * 2(n-1)/n (GB = 1e9 bytes), #wrong = elements that differ
from the closed-form expectation summed over all ranks, speedup = time of the baseline
measured in the same run at the same size / time. algo = the algorithm ringdp ran
(Communicator.algo_for(S, device, algo): on CUDA the transport's own one-shot threshold;
"direct" where that is the ring and the tensor is registered on CPU, which runs direct
instead: ran_as; path = the engine's own record of it). A forced series keeps the name of
the algo= it passes (ringdp-reg:ring runs direct on CPU).

Timing. Each (size, series) gets `warmup` untimed calls, then one timed batch of `iters`
calls that starts right after a barrier on the gloo process group. Each rank stamps every
iteration with time.perf_counter (CUDA: an event per iteration on the current stream, read
after a synchronize). time = max over ranks of (batch time / iters); min = max over ranks
of each rank's fastest iteration (so min <= time); the JSON also has the median. Without
--iters the count adapts to the size: iters = clamp(target_time / (mean warm-up call after
the first, slowest rank), min_iters, max_iters), agreed on by all ranks.

Correctness (#wrong). After the timed batch the tensor is refilled with a pattern that
depends on rank r and index i and is all-reduced once more:
    b(i) = (i mod (2k+1)) - k,    v(r, i) = n*b(i) + 2*((i + r) mod n) - (n - 1)
The rank term sums to 0 over ranks and spans n*b(i) +- (n-1), so the exact results are
    SUM n^2*b(i)   AVG n*b(i)   MAX n*b(i) + n-1   MIN n*b(i) - (n-1)
All values are small integers; k (<= 3) is chosen so that every partial sum stays exact in
the dtype (|partial| <= n^2 (k+1) <= 256 for bfloat16, 2048 for float16). The timed calls
run on the same pattern (repeated SUMs grow it; that does not change the speed).

Roofline. At start rank 0 alone measures one-thread memcpy bandwidth B with a large
torch copy_ (bytes read + bytes written per second; on CUDA the device copy bandwidth).
For each row, roof(us) = bytes_factor * S * c / B, with c = max(1, ranks on this host /
cores) on CPU (ranks time-share the cores) and c = ranks sharing the GPU on CUDA (they
share its memory bandwidth). %roof = roof / time. B is a DRAM figure: messages that fit
in cache can beat the roofline, and it ignores latency.

bytes_factor: what each rank reads + writes in memory for one all-reduce of S bytes, /S,
n >= 2 ranks (n = 1: nothing moves), read off the transports' code. A partial sum is w
times as wide as an element: w = 2 for float16 and bfloat16, whose partial sums travel as
float32 during the reduce-scatter (csrc/common/types.h acc_size; shm_transports.cpp
StagedTransport, csrc/cuda/protocol.h Planner consume/produce_elem_bytes), else w = 1.
Per chunk of S/n (T = element width, A = partial-sum width, in units of S/n):
    ring step (csrc/ring/ring.cpp)       staged through slots         in place (registered)
    RS send                              read T, write A: 1+w         nothing if w=1, else 1+w
    RS recv_reduce_send (n-2 times)      read A, read T, write A: 2w+1        2w+1 (w=1: 3)
    RS recv_reduce_copy_send             read A, read T, write T, write T: w+3   w+2
    AG recv_copy_send (n-2 times)        read, write T, write slot: 3         read, write: 2
    AG recv                              read, write T: 2                     2
    total staged     ((2w+4)n - 2w - 2)/n    w=1: (6n-4)/n = 4.0 (n=2), 5.0 (n=4)
                                             w=2: (8n-6)/n = 5.0 (n=2), 6.5 (n=4)
    total in place   w=1: 5(n-1)/n = 2.5 (n=2), 3.75 (n=4)
                     w=2: ((2w+3)n - 2w - 1)/n = (7n-5)/n = 4.5 (n=2), 5.75 (n=4)
The in-place ring applies on CUDA IPC for every dtype (read in place,
RINGDP_CUDA_REGISTERED=1, the default), and never on the NCCL transport (staged; NCCL's own
copies are not counted: a lower bound). On CPU a registered all_reduce runs direct instead
(shm_comm.cpp run_direct, any dtype): each rank reads its chunk of all n tensors (S) and
writes the result into all n (S): 2, at any n (the float32 partials of half types stay in L1).
One-shot (shm_comm.cpp, csrc/cuda oneshot_kernel): each rank copies its input into its
one-shot buffer (2), reads all n buffers and writes the result (n+1): n + 3, registered or
not. Baseline rows show the staged-ring figure, the least any staged ring must move.

Other collectives (--coll, a comma list; one sweep and one JSON file each). As nccl-tests:
size S = the larger buffer (reduce_scatter: the input, n x the output; all_gather: the
output, n x the input; broadcast: the tensor), algbw = S / time, busbw = algbw x (n-1)/n
for reduce_scatter and all_gather, x 1 for broadcast (from rank 0). Values and exact
results (small integers, exact in every dtype at n <= 4):
    reduce_scatter   input v(r, j) = (j mod 7) - 3 + 2((j + r) mod n) - (n - 1), j < nk;
                     rank r's output i = the op over ranks at j = rk + i
                     (SUM n((j mod 7) - 3), AVG (j mod 7) - 3, MAX/MIN that +- (n - 1))
    all_gather       input g(r, i) = ((i + 5r) mod 11) - 5; output at qk + i = g(q, i)
    broadcast        rank 0 holds g(0, i), the others 99; afterwards g(0, i) everywhere
ringdp series call ringdp.reduce_scatter_tensor / all_gather_into_tensor / broadcast (the
registered series allocates input and output with ringdp.empty), the baseline
torch.distributed's; no roofline for these (roof "-"). --algo applies to all_reduce only.

Across hosts (--hosts H, every --coll): the ranks are H simulated hosts on this
machine, rank r on host r*H // world (RINGDP_HOST_ID sim0, sim1, ...; world defaults to
2H). The series are then gloo (flat, the whole group over loopback TCP), ringdp (the
hierarchical path policy.cross_host_path chooses: two_level, or leaders on uneven
hosts; column algo), ringdp-reg (the same on tensors from this host's arena: its in-host
steps run in place where they can) and ringdp-flat. No roofline: the "network" is loopback TCP on the same cores. For real hosts run
it under torchrun on each host without --hosts: ringdp finds the hosts itself (ringdp-flat
then needs asking for in --series); bench/netns_hosts.py runs it so on two hosts made of
Linux namespaces of this machine, their link shaped if asked (the JSON's machine.network). With --device
cuda the baseline is nccl, ringdp's collectives take the same hierarchy (CUDA IPC in the
host, ringdp's NCCL between hosts; algo two_level or leaders), ringdp-flat ringdp's flat
NCCL ring (algo ring); on one GPU NCCL needs a host id per rank (sockets
between them: RINGDP_NCCL_HOSTID_PER_RANK=1), so the "network" is sockets on one machine.

Contention (--busy N): N processes that keep a core busy each (a pure-Python loop) run
beside the ranks for the whole sweep, started by the machine's first rank after the
memcpy bandwidth (the roofline) is measured; each ends by itself if that rank dies.
Collectives while something else competes for the cores (a DataLoader worker, another
job), where the ranks' waits for each other decide the time (csrc/transport/shm/wait.h).
The result file name gets _busyN; busy_pids in it lists them.

Output. Rank 0 prints the table as it goes (one group of rows per size; a progress counter
on stderr) and writes <out-dir>/allreduce_<device>_w<world>_<dtype>[_<name>].json
(<coll>_<device>_... for the other collectives, e.g. reduce_scatter_cpu_w2_float32.json; machine
info with the world size of the process group that ran, args, memcpy bandwidth, roofline
factors, every row; rewritten after every size with "complete": false until the end) and,
with --plot, the PNG next to it. Default --out-dir: bench/out/
(ignored by git); the committed results are refreshed with --out-dir bench/results. Without
--name the name is made of the non-default --op and --algo.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import subprocess
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import checkout_fallback, count, positive  # noqa: E402

checkout_fallback()  # last on sys.path: PYTHONPATH's or the installed ringdp wins

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ringdp  # noqa: E402
from _common import OUT_DIR, Console, launch, machine_info, save_json  # noqa: E402

DTYPE_NAMES = {  # CLI name -> nccl-tests style type name
    "float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
    "int32": "int32", "int64": "int64",
}
HALF_TYPES = ("float16", "bfloat16")
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
EXACT_INT_LIMIT = {"float16": 2048, "bfloat16": 256, "float32": 2 ** 24, "float64": 2 ** 53}
MEMCPY_BYTES = {"cpu": 128 << 20, "cuda": 512 << 20}
CHECK_ROWS_PER_CHUNK = 128


# --------------------------------------------------------------------------- sizes, names
def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return str(n)


def sizes_to_sweep(min_bytes: int, max_bytes: int, factor: float, elem: int) -> list[int]:
    """Byte sizes min..max multiplied by factor, rounded down to whole elements."""
    out, s = [], min_bytes
    while s <= max_bytes:
        b = (s // elem) * elem
        if b > 0 and (not out or b != out[-1]):
            out.append(b)
        nxt = int(s * factor)
        s = nxt if nxt > s else s + 1
    return out


def result_name(args, world: int, coll: str = "all_reduce") -> str:
    name = f"{'allreduce' if coll == 'all_reduce' else coll}_{args.device}_w{world}_{args.dtype}"
    extra = args.name
    if extra is None:
        algo = args.algo.replace(",", "+")
        parts = [p for p in (args.op if args.op != "sum" else "", algo if algo != "auto" else "") if p]
        extra = "_".join(parts) if parts else None
    if getattr(args, "hosts", 1) > 1:
        extra = f"{extra}_hosts{args.hosts}" if extra else f"hosts{args.hosts}"
    if getattr(args, "busy", 0) > 0:
        extra = f"{extra}_busy{args.busy}" if extra else f"busy{args.busy}"
    return f"{name}_{extra}" if extra else name


# --------------------------------------------------------------------------- pattern
class Pattern:
    """v(r, i) and its exact all-reduce result (module doc), built as a periodic block and tiled."""

    def __init__(self, dtype_name: str, op: str, n: int, rank: int, device):
        dtype = getattr(torch, dtype_name)
        limit = EXACT_INT_LIMIT.get(dtype_name, 2 ** 62)
        k = min(3, limit // (n * n) - 1)
        self.exact = k >= 0
        self.k = k = max(k, 0)
        period = math.lcm(2 * k + 1, n)
        self.block_len = period * max(1, (1 << 16) // period)
        idx = torch.arange(self.block_len, dtype=torch.int64, device=device)
        b = idx % (2 * k + 1) - k
        value = n * b + 2 * ((idx + rank) % n) - (n - 1)
        expect = {"sum": n * n * b, "avg": n * b, "max": n * b + (n - 1), "min": n * b - (n - 1)}[op]
        self.value = value.to(dtype)
        self.expect = expect.to(dtype)

    def _tiles(self, t):
        rows = t.numel() // self.block_len
        return t[: rows * self.block_len].view(rows, self.block_len), t[rows * self.block_len:]

    def fill(self, t):
        body, tail = self._tiles(t)
        if body.numel():
            body.copy_(self.value.expand_as(body))
        if tail.numel():
            tail.copy_(self.value[: tail.numel()])

    def wrong(self, t) -> int:
        body, tail = self._tiles(t)
        bad = 0
        for r0 in range(0, body.shape[0], CHECK_ROWS_PER_CHUNK):
            bad += int((body[r0: r0 + CHECK_ROWS_PER_CHUNK] != self.expect).sum())
        if tail.numel():
            bad += int((tail != self.expect[: tail.numel()]).sum())
        return bad


class PartPattern(Pattern):
    """v(r, i) on this rank, and the exact result of the op over `members` only (the group
    of a --series parts step)."""

    def __init__(self, dtype_name: str, op: str, n: int, rank: int, device, members: list[int]):
        super().__init__(dtype_name, op, n, rank, device)
        vals = torch.stack([Pattern(dtype_name, op, n, r, device).value.to(torch.float64) for r in members])
        reduce = {"sum": lambda v: v.sum(0), "max": lambda v: v.amax(0), "min": lambda v: v.amin(0)}[op]
        self.expect = reduce(vals).to(self.value.dtype)


class Parts:
    """--series parts (module doc): the groups of the two-level all-reduce's steps on this
    rank, their patterns, and one call of each."""

    KINDS = ("part-inhost", "part-cross")

    def __init__(self, args, rank: int, world: int, hosts: list[str], device):
        by_host = [[r for r, h in enumerate(hosts) if h == k] for k in dict.fromkeys(hosts)]
        if len(by_host) < 2 or len({len(m) for m in by_host}) != 1:
            raise SystemExit(f"rank {rank}: --series parts needs hosts of equal size, at least 2 "
                             f"(ranks per host: {[len(m) for m in by_host]})")
        self.local = len(by_host[0])
        crosses = [[m[lr] for m in by_host] for lr in range(self.local)]
        # every rank makes every group (torch's rule), then uses its own
        self.host_group, _ = dist.new_subgroups_by_enumeration(by_host)
        self.cross_group, _ = dist.new_subgroups_by_enumeration(crosses)
        members = {"part-inhost": next(m for m in by_host if rank in m),
                   "part-cross": next(m for m in crosses if rank in m)}
        self.patterns = {k: PartPattern(args.dtype, args.op, world, rank, device, members[k]) for k in self.KINDS}
        self._blocks: dict = {}

    def count(self, kind: str, count: int) -> int:
        """Elements of a call of `kind` for a size of `count` elements (part-cross: S / L)."""
        return count if kind == "part-inhost" else count // self.local

    def call(self, kind: str, t, op) -> None:
        if kind == "part-cross":
            dist.all_reduce(t, op=op, group=self.cross_group)
            return
        key = (t.numel() // self.local, t.dtype)
        if key not in self._blocks:
            self._blocks = {key: torch.empty(key[0], dtype=t.dtype)}
        block = self._blocks[key]
        ringdp.reduce_scatter_tensor(block, t, op=op, group=self.host_group)
        ringdp.all_gather_into_tensor(t, block, group=self.host_group)


# --------------------------------------------------------------------------- other collectives
COLLS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}
CHUNK = 1 << 22  # elements per step when filling and checking (bounded int64 temporaries)


def _chunked(total: int, start: int = 0):
    for a in range(0, total, CHUNK):
        yield a, min(total, a + CHUNK), torch.arange(start + a, start + min(total, a + CHUNK), dtype=torch.int64)


class Collective:
    """One of reduce_scatter, all_gather, broadcast (module doc): its buffers for a size of
    `count` elements, their values, one call, and the count of wrong elements."""

    def __init__(self, name: str, op: str, n: int, rank: int, device, dtype):
        self.name, self.op, self.n, self.rank, self.device, self.dtype = name, op, n, rank, device, dtype

    def buffers(self, count: int, alloc) -> tuple:
        k = count // self.n
        if self.name == "reduce_scatter":
            return alloc(k * self.n), alloc(k)
        if self.name == "all_gather":
            return alloc(k), alloc(k * self.n)
        return (alloc(count),)

    def _g(self, r: int, idx):
        return ((idx + 5 * r) % 11) - 5

    def _rs_input(self, r: int, j):
        n = self.n
        return (j % 7) - 3 + 2 * ((j + r) % n) - (n - 1)

    def _rs_expect(self, j):
        n, base = self.n, (j % 7) - 3
        return {"sum": n * base, "avg": base, "max": base + (n - 1), "min": base - (n - 1)}[self.op]

    def fill(self, bufs) -> None:
        t = bufs[0]
        for a, b, idx in _chunked(t.numel()):
            if self.name == "reduce_scatter":
                v = self._rs_input(self.rank, idx)
            elif self.name == "all_gather" or self.rank == 0:
                v = self._g(self.rank, idx)
            else:
                v = torch.full_like(idx, 99)
            t[a:b].copy_(v.to(self.dtype))

    def wrong(self, bufs) -> int:
        bad = 0
        if self.name == "reduce_scatter":
            out = bufs[1]
            k = out.numel()
            for a, b, j in _chunked(k, self.rank * k):
                bad += int((out[a:b].cpu() != self._rs_expect(j).to(self.dtype)).sum())
        elif self.name == "all_gather":
            out = bufs[1]
            k = out.numel() // self.n
            for q in range(self.n):
                for a, b, i in _chunked(k):
                    bad += int((out[q * k + a: q * k + b].cpu() != self._g(q, i).to(self.dtype)).sum())
        else:
            t = bufs[0]
            for a, b, i in _chunked(t.numel()):
                bad += int((t[a:b].cpu() != self._g(0, i).to(self.dtype)).sum())
        return bad

    def call(self, bufs, op, torch_api: bool, group=None, comm=None) -> None:
        """One call: torch.distributed's on `group` (the baseline's, or ringdp-pg's), else
        ringdp's on `comm` (a Communicator; None: the module functions, on the default group's)."""
        if torch_api:
            # torch 2.13 names them *_single (the *_tensor names warn as deprecated)
            if self.name == "reduce_scatter":
                getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(bufs[1], bufs[0], op=op, group=group)
            elif self.name == "all_gather":
                getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(bufs[1], bufs[0], group=group)
            else:
                dist.broadcast(bufs[0], src=0, group=group)
            return
        fn = getattr(ringdp if comm is None else comm, {"reduce_scatter": "reduce_scatter_tensor",
                                                        "all_gather": "all_gather_into_tensor",
                                                        "broadcast": "broadcast"}[self.name], None)
        if fn is None:
            raise RuntimeError(f"this ringdp ({ringdp.__file__}) has no {self.name}")
        if self.name == "reduce_scatter":
            fn(bufs[1], bufs[0], op=op)
        elif self.name == "all_gather":
            fn(bufs[1], bufs[0])
        else:
            fn(bufs[0], 0)


# --------------------------------------------------------------------------- roofline
def ran_as(algo: str, registered: bool, device: str = "cpu") -> str:
    """What the engine runs for the algorithm `algo` that ringdp chose (algo_for): on CPU
    the ring of a tensor registered on every rank runs direct instead (shm_comm.cpp
    run_direct; module doc, bytes_factor)."""
    return "direct" if algo == "ring" and registered and device == "cpu" else algo


def bytes_factor(n: int, algo: str = "ring", registered: bool = False, dtype: str = "float32",
                 device: str = "cpu", transport: str = "shm") -> float:
    """Bytes each rank reads + writes for one all-reduce of S bytes, as a multiple of S
    (module doc: derived from the ring steps of each transport)."""
    if n <= 1:
        return 0.0
    if algo == "oneshot":
        return n + 3.0
    w = 2 if dtype in HALF_TYPES else 1
    if ran_as(algo, registered, device) == "direct":
        return 2.0
    in_place = registered and device == "cuda" and transport == "ipc"
    if not in_place:
        return ((2 * w + 4) * n - 2 * w - 2) / n
    if w == 1:
        return 5.0 * (n - 1) / n
    return ((2 * w + 3) * n - 2 * w - 1) / n


def memcpy_bandwidth(device, rank: int) -> dict:
    """One large copy_: rank 0 alone (the roofline's B), then all ranks at once."""
    nbytes = MEMCPY_BYTES[device.type]
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)

    def best_copy(reps: int) -> float:
        dst.copy_(src)
        sync(device)
        best = float("inf")
        for _ in range(reps):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src)
                b.record()
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - t0)
        return best

    dist.barrier()
    alone = best_copy(7) if rank == 0 else 0.0
    dist.barrier()
    together = best_copy(5)
    alone, together = max_over_ranks(alone, together)
    return {"bytes": nbytes, "one_rank_GBps": 2 * nbytes / alone / 1e9,
            "all_ranks_at_once_GBps_per_rank": 2 * nbytes / together / 1e9,
            "counts": "bytes read + bytes written"}


# --------------------------------------------------------------------------- small collectives
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(*xs: float) -> list[float]:
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# --------------------------------------------------------------------------- series
@dataclass(frozen=True)
class Series:
    name: str         # column label: gloo, nccl, ringdp, ringdp-reg, ringdp:ring, ...
    kind: str         # "baseline", "ringdp" (ordinary tensor) or "ringdp-reg" (registered)
    algo: str | None  # the algo= passed to ringdp.all_reduce (None for the baseline)


class Caller:
    """Everything a series calls, for one rank: allocation and one all-reduce."""

    def __init__(self, args, rank: int, world: int, local_rank: int):
        self.args, self.rank, self.world = args, rank, world
        self.dtype = getattr(torch, args.dtype)
        self.elem = torch.empty(0, dtype=self.dtype).element_size()
        self.op = OPS[args.op]
        if args.device == "cuda":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.notes: list[str] = []
        self.local_rank = local_rank
        self.busy_pids: list[int] = []  # --busy: the busy processes this rank started
        # placement: ranks on this host (CPU) or on this GPU (CUDA), from every rank's facts
        me = (socket.gethostname(), self.device.index if self.device.type == "cuda" else -1)
        everyone = [None] * world
        dist.all_gather_object(everyone, me)
        self.hosts = [h for h, _ in everyone]
        self.sharing = sum(1 for x in everyone if tuple(x) == me)
        if self.device.type == "cuda":
            self.contention = float(self.sharing)
        else:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            self.contention = max(1.0, self.hosts.count(me[0]) / cores)
        if self.device.type == "cuda" and self.sharing > 1 and args.hosts > 1:
            # simulated hosts on one GPU: ringdp's NCCL endpoints need a host id per rank
            # (NCCL refuses two ranks of one GPU otherwise), set before ringdp reads its settings
            os.environ.setdefault("RINGDP_NCCL_HOSTID_PER_RANK", "1")
        self.comm = ringdp.init() if {"ringdp", "ringdp-reg", "ringdp-flat"} & set(args.series) else None
        # ringdp-pg: a group of ringdp's torch.distributed backend (its own communicator)
        self.pg = (dist.new_group(backend=f"{self.device.type}:ringdp") if "ringdp-pg" in args.series else None)
        # across hosts: the path the hierarchical all-reduce takes, and ringdp-flat's communicator
        self.cross_path = self.comm.cross_path if self.comm is not None else None
        self.flat_comm = None
        if "ringdp-flat" in args.series:
            if self.cross_path is None:
                raise SystemExit(f"rank {rank}: --series ringdp-flat: this group does not span hosts "
                                 f"(hosts {sorted(set(self.comm.hosts))})")
            from ringdp.comm import Communicator

            self.flat_comm = Communicator(config=self.comm.config.replace(hierarchy=False))
        self.host_keys = self.comm.hosts if self.comm is not None else self.hosts
        self.parts = Parts(args, rank, world, self.host_keys, self.device) if "parts" in args.series else None
        # across hosts: CPU shm + gloo; CUDA IPC + NCCL when the all-reduce takes the
        # hierarchy (policy.cuda_hierarchical), else ringdp's flat NCCL ring
        self.cuda_hier = (self.device.type == "cuda" and self.comm is not None
                          and ringdp.policy.cuda_hierarchical(self.cross_path, self.comm.config))
        self.transport = ("-" if self.comm is None else self.comm.transport(self.device.type)
                          if self.cross_path is None else "shm+gloo" if self.device.type == "cpu"
                          else "ipc+nccl" if self.cuda_hier else "nccl")
        self.baseline, self.group = self._baseline()

    def _baseline(self) -> tuple[str | None, object]:
        if "baseline" not in self.args.series:
            return None, None
        backend = self.args.baseline
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "gloo":
            return "gloo", None  # the default process group
        if self.sharing > 1 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            # NCCL refuses two ranks on one GPU; a host id per rank makes it treat them as
            # separate hosts (it then goes over sockets: slow, but a measured baseline).
            os.environ.setdefault("NCCL_HOSTID", f"ringdp-bench-{self.rank}")
            self.notes.append(f"{self.sharing} ranks share one GPU: the nccl baseline runs with one "
                              "NCCL_HOSTID per rank (over sockets), not a fair NCCL figure")
        return "nccl", dist.new_group(backend="nccl")

    def series(self) -> list[Series]:
        out = [Series(self.baseline, "baseline", None)] if self.baseline else []
        for kind in ("ringdp", "ringdp-reg", "ringdp-flat"):
            if kind in self.args.series:
                out += [Series(kind if len(self.args.algos) == 1 else f"{kind}:{a}", kind, a)
                        for a in self.args.algos]
        if self.pg is not None:  # (torch.distributed's calls take no algo=)
            out.append(Series("ringdp-pg", "ringdp-pg", None))
        if self.parts is not None:
            out += [Series("part:inhost", "part-inhost", None), Series("part:cross", "part-cross", None)]
        return out

    def algo(self, s: Series, nbytes: int) -> str:
        """What runs for this size: "ring"/"oneshot"/"direct" (ran_as) for ringdp, "-" for the
        baseline; across hosts the path (CUDA: the path when the collectives take the
        hierarchy, else ringdp's flat NCCL "ring")."""
        if s.kind == "baseline" or s.kind in Parts.KINDS:
            return "-"
        if self.cross_path is not None and self.device.type == "cuda":
            return self.cross_path if self.cuda_hier and s.kind != "ringdp-flat" else "ring"
        if s.kind == "ringdp-flat":
            return self.flat_comm.cross_path
        comm = ringdp.get_communicator(self.pg) if s.kind == "ringdp-pg" else self.comm
        if comm.cross_path is not None:
            return comm.cross_path
        return self.ran_as(s, comm.algo_for(nbytes, self.device.type, s.algo))

    def ran_as(self, s: Series, algo: str) -> str:
        """What series s runs where ringdp chooses `algo` on one host (ran_as)."""
        return ran_as(algo, s.kind == "ringdp-reg", self.device.type)

    def path(self, s: Series) -> str | None:
        """What the engine ran for this series' last call on this host's shared memory (the
        flight record's path: oneshot, ring_staged, direct); None for
        torch.distributed series, CUDA, across hosts, or a ringdp without the field."""
        if self.torch_api(s) or self.device.type != "cpu" or self.cross_path is not None:
            return None
        recs = (self.flat_comm if s.kind == "ringdp-flat" else self.comm).flight_record()
        return recs[-1].get("path") if recs else None

    def oneshot_max_bytes(self) -> int:
        """Largest size (whole elements, up to 1 GiB) that algo "auto" runs one-shot."""
        lo, hi = 0, (1 << 30) // self.elem
        if self.comm is None or self.cross_path is not None:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.comm.algo_for(mid * self.elem, self.device.type, "auto") == "oneshot":
                lo = mid
            else:
                hi = mid - 1
        return lo * self.elem

    def factor(self, s: Series, algo: str) -> float | None:
        if self.cross_path is not None:  # across hosts: no memory roofline (module doc)
            return None
        return bytes_factor(self.world, "oneshot" if algo == "oneshot" else "ring", s.kind == "ringdp-reg",
                            self.args.dtype, self.device.type, self.transport)

    def alloc(self, s: Series, count: int):
        if s.kind == "ringdp-reg":
            t = ringdp.empty(count, dtype=self.dtype, device=str(self.device))
            alone = self.cross_path is not None and self.comm.local_size == 1  # nothing in-host to register for
            if not ringdp.is_registered(t) and not alone:
                raise RuntimeError("ringdp.empty returned a tensor that is not registered")
            return t
        return torch.empty(count, dtype=self.dtype, device=self.device)

    def torch_api(self, s: Series) -> bool:
        """Whether the series calls torch.distributed (on group_of(s)) rather than ringdp."""
        return s.kind in ("baseline", "ringdp-pg")

    def group_of(self, s: Series):
        """The torch.distributed group a torch_api series calls on (None: the default group)."""
        return self.pg if s.kind == "ringdp-pg" else self.group

    def call(self, s: Series, t):
        if self.torch_api(s):
            dist.all_reduce(t, op=self.op, group=self.group_of(s))
        elif s.kind in Parts.KINDS:
            self.parts.call(s.kind, t, self.op)
        elif s.kind == "ringdp-flat":
            self.flat_comm.all_reduce(t, op=self.op, algo=s.algo)
        else:
            ringdp.all_reduce(t, op=self.op, algo=s.algo)


# --------------------------------------------------------------------------- measure
def timed_batch(c: Caller, run, iters: int) -> tuple[float, list[float]]:
    """One batch of run() right after a barrier: (batch seconds, per-iteration seconds), this rank."""
    sync(c.device)
    dist.barrier()
    if c.device.type == "cuda":
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        evs[0].record()
        for k in range(iters):
            run()
            evs[k + 1].record()
        torch.cuda.synchronize()
        return evs[0].elapsed_time(evs[-1]) / 1e3, [evs[k].elapsed_time(evs[k + 1]) / 1e3 for k in range(iters)]
    stamps = [time.perf_counter()]
    for _ in range(iters):
        run()
        stamps.append(time.perf_counter())
    return stamps[-1] - stamps[0], [b - a for a, b in zip(stamps, stamps[1:])]


def measure(c: Caller, pattern, s: Series, nbytes: int, memcpy_Bps: float) -> dict:
    """One (size, series) point, collective over all ranks; returns the row (rank 0's view).
    `pattern`: the all-reduce Pattern, or a Collective for the others."""
    args, n = c.args, c.world
    count = nbytes // c.elem
    coll = pattern if isinstance(pattern, Collective) else None
    if coll is None:
        if s.kind in Parts.KINDS:  # (its own size and closed form: module doc)
            pattern, count = c.parts.patterns[s.kind], c.parts.count(s.kind, count)
        t = c.alloc(s, count)

        def fill():
            pattern.fill(t)

        def run():
            c.call(s, t)

        def check() -> int:
            return pattern.wrong(t)
    else:
        t = coll.buffers(count, lambda m: c.alloc(s, m))

        def fill():
            coll.fill(t)

        def run():
            coll.call(t, c.op, c.torch_api(s), c.group_of(s), c.flat_comm if s.kind == "ringdp-flat" else None)

        def check() -> int:
            return coll.wrong(t)
    fill()
    sync(c.device)

    warmup = args.warmup if args.warmup is not None else (5 if nbytes < (16 << 20) else 2)
    stamps = []
    dist.barrier()
    for _ in range(warmup):
        t0 = time.perf_counter()
        run()
        sync(c.device)
        stamps.append(time.perf_counter() - t0)
    if args.iters is not None:
        iters = args.iters
    else:
        steady = stamps[1:] or stamps or [1e-3]
        (est,) = max_over_ranks(statistics.fmean(steady))
        iters = int(min(args.max_iters, max(args.min_iters, math.ceil(args.target_time / max(est, 1e-7)))))

    batch, per = timed_batch(c, run, iters)
    batch, fastest, median = max_over_ranks(batch, min(per), statistics.median(per))

    fill()  # correctness: refill, one more call, compare with the closed form
    run()
    sync(c.device)
    path = c.path(s)
    wrong = torch.tensor([check()], dtype=torch.int64)
    dist.all_reduce(wrong)
    t = None  # noqa: F841 -- frees the buffers before the next point

    mean = batch / iters
    algbw = nbytes / mean / 1e9
    if coll is None:
        algo = c.algo(s, nbytes)
        factor = c.factor(s, algo)
        roof = factor * nbytes * c.contention / memcpy_Bps if factor is not None else None
    else:  # what runs for what one-shot would stage: all_gather its input, the others the whole
        # buffer (across hosts: the path, as for all_reduce); no roofline
        staged = nbytes // n if coll.name == "all_gather" else nbytes
        algo, factor, roof = c.algo(s, staged), None, None
    return {
        "size": nbytes, "count": count, "type": DTYPE_NAMES[args.dtype], "redop": args.op,
        "collective": coll.name if coll else "all_reduce",
        "series": s.name, "kind": s.kind, "algo": algo, "path": path, "iters": iters, "warmup": warmup,
        "time_us": mean * 1e6, "min_us": fastest * 1e6, "median_us": median * 1e6,
        "algbw_GBps": algbw, "busbw_GBps": algbw * BUSBW_FACTOR[coll.name if coll else "all_reduce"](n),
        "wrong": int(wrong[0]),
        "bytes_per_rank": factor * nbytes if factor is not None else None,
        "roof_us": roof * 1e6 if roof is not None else None,
        "pct_roof": (100.0 * roof / mean) if roof else None, "speedup": None,
    }


# --------------------------------------------------------------------------- driver
HEADER = (f"{'size':>12} {'count':>11} {'type':>8} {'redop':>5} {'series':>18} {'algo':>7} "
          f"{'iters':>6} {'time(us)':>11} {'min(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
          f"{'roof(us)':>10} {'%roof':>6} {'speedup':>7}")


def format_row(r: dict) -> str:
    pct = f"{r['pct_roof']:5.1f}%" if r["pct_roof"] is not None else "     -"
    sp = f"{r['speedup']:6.2f}x" if r["speedup"] is not None else "      -"
    roof = f"{r['roof_us']:10.2f}" if r["roof_us"] is not None else f"{'-':>10}"
    return (f"{r['size']:>12} {r['count']:>11} {r['type']:>8} {r['redop']:>5} {r['series']:>18} "
            f"{r['algo']:>7} {r['iters']:>6} {r['time_us']:11.2f} {r['min_us']:10.2f} "
            f"{r['algbw_GBps']:7.3f} {r['busbw_GBps']:7.3f} {r['wrong']:>6} {roof} {pct} {sp}")


def run_rank(rank: int, world: int, args):
    """One rank: join the gloo group, sweep, write the results (rank 0), leave cleanly."""
    torch.set_num_threads(1)
    if args.hosts > 1:  # simulated hosts (module doc): before ringdp reads its configuration
        os.environ["RINGDP_HOST_ID"] = f"sim{rank * args.hosts // world}"
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        sweep(rank, args)
    finally:
        ringdp.destroy()
        dist.destroy_process_group()


# --busy: a core's worth of pure-Python work that ends by itself once its parent (the rank that
# started it) is gone, however that rank ended (mp.spawn and torchrun stop ranks with SIGTERM,
# which skips `finally`)
# (argv[1]: the parent's pid, as the parent saw it: one that dies before the loop starts ends it at once)
BUSY_LOOP = ("import os, sys\np = int(sys.argv[1])\nwhile os.getppid() == p:\n"
             "    for _ in range(100000):\n        pass\n")


def busy_processes(count: int) -> list:
    """`count` processes that keep a core busy each (--busy) until killed or orphaned."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]


def sweep(rank: int, args):
    n = dist.get_world_size()
    out = Console(rank)
    c = Caller(args, rank, n, int(os.environ.get("LOCAL_RANK", rank)))
    hogs = []
    try:
        memcpy = memcpy_bandwidth(c.device, rank)  # (the roofline: the machine without --busy)
        if args.busy > 0:  # started by the machine's first rank once every rank measured that, stopped at the end
            dist.barrier()
            if c.local_rank == 0:
                hogs = busy_processes(args.busy)
                c.busy_pids = [h.pid for h in hogs]
            dist.barrier()
        for coll in args.colls:
            sweep_one(rank, args, c, coll, memcpy, out)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        if c.flat_comm is not None:
            c.flat_comm.close()


def sweep_one(rank: int, args, c: Caller, coll_name: str, memcpy: dict, out: Console):
    """One collective's sweep: rows, table, JSON (rank 0)."""
    n = c.world
    if coll_name == "all_reduce":
        pattern = Pattern(args.dtype, args.op, n, rank, c.device)
        if not pattern.exact:
            c.notes.append(f"world {n} is too large for exact {args.dtype} integers; #wrong may be nonzero")
        series = c.series()
        sizes = sizes_to_sweep(args.min_bytes, args.max_bytes, args.factor, c.elem)
    else:
        pattern = Collective(coll_name, args.op, n, rank, c.device, c.dtype)
        series = [Series(s.kind, s.kind, None) if s.kind != "baseline" else s for s in c.series()
                  if s.kind not in Parts.KINDS]  # (--series parts: all_reduce's)
        series = list(dict.fromkeys(series))  # one series per kind (--algo is all_reduce's)
        # whole chunks: the larger buffer is n x the smaller one
        sizes = sorted({(z // (c.elem * n)) * c.elem * n
                        for z in sizes_to_sweep(args.min_bytes, args.max_bytes, args.factor, c.elem)} - {0})
    memcpy_Bps = memcpy["one_rank_GBps"] * 1e9
    # a forced algorithm compared with another is measured only where ringdp runs it
    plan = [(z, s) for z in sizes for s in series if len(args.algos) == 1 or s.algo in ("auto", None)
            or s.kind == "baseline" or c.algo(s, z) == c.ran_as(s, s.algo)]
    factors = {f"{ran_as(algo, kind == 'registered', c.device.type)}_{kind}":
               bytes_factor(n, algo, kind == "registered", args.dtype, c.device.type, c.transport)
               for algo in ("ring", "oneshot") for kind in ("ordinary", "registered")}
    threshold = c.oneshot_max_bytes()
    info = machine_info(n, args.device)

    out.line(f"# ringdp {coll_name} benchmark: world {n}, device {args.device} ({c.transport}), {args.dtype}, "
             f"op {args.op}, algo {args.algo}, series {', '.join(s.name for s in series)}")
    out.line(f"# machine: {info['cpu_model']} ({info['cpu_cores']} cores), torch {info['torch']}, "
             f"{info.get('gpu', 'no gpu') if args.device == 'cuda' else 'cpu'}, ringdp: {info['ringdp']}")
    out.line(f"# memcpy (read+write): {memcpy['one_rank_GBps']:.1f} GB/s one rank alone, "
             f"{memcpy['all_ranks_at_once_GBps_per_rank']:.1f} GB/s per rank with all {n} at once; "
             f"roofline: first figure, times {c.contention:g} for ranks sharing a core/GPU")
    out.line("# bytes per rank / S: " + ", ".join(f"{k} {v:.2f}" for k, v in factors.items()))
    if c.cross_path is not None:
        out.line(f"# hosts: {', '.join(f'rank {r} on {h}' for r, h in enumerate(c.host_keys))}; ringdp runs "
                 f"{c.cross_path} (at most {ringdp.policy.HIER_MAX_PIECES} pieces of at least RINGDP_HIER_PIECE_BYTES "
                 f"{c.comm.config.hier_piece_bytes})"
                 + (f" with {c.transport}" if args.device == "cuda" else "")
                 + (("; ringdp-flat " + ("ringdp's NCCL ring" if args.device == "cuda" else "gloo") + " on the whole group")
                    if c.flat_comm is not None else "") + "; no roofline")
    elif c.comm is not None:
        out.line(f"# one-shot up to {threshold} bytes (algo auto)")
    for note in c.notes:
        out.line(f"# note: {note}")
    out.line(f"# GB/s = 1e9 bytes/s; busbw = algbw x {BUSBW_FACTOR[coll_name](n):g}; time = mean per call, max over "
             "ranks; speedup = baseline time / time")
    out.line("#")
    out.line(HEADER)

    def payload(complete: bool) -> dict:
        return {
            "benchmark": "allreduce" if coll_name == "all_reduce" else coll_name,
            "collective": coll_name,
            "complete": complete,
            "machine": info,
            "args": {k: v for k, v in vars(args).items()},
            "env": {k: v for k, v in os.environ.items() if k.startswith(("RINGDP_", "NCCL_"))},
            "transport": c.transport,
            "hosts": c.host_keys,
            "cross_path": c.cross_path,
            # the two-level pieces (policy.two_level_piece_bytes): bench/cost_model.py validates with them
            "hier_pieces": ({"min_piece_bytes": c.comm.config.hier_piece_bytes,
                             "max_pieces": ringdp.policy.HIER_MAX_PIECES} if c.cross_path == "two_level" else None),
            "memcpy": memcpy,
            "busy_pids": c.busy_pids,  # --busy: the busy processes rank 0 started
            "roofline": {"contention": c.contention, "bytes_per_rank_over_S": factors},
            "oneshot_max_bytes": threshold,
            "pattern_k": getattr(pattern, "k", None),
            "notes": c.notes,
            "total_wrong": sum(r["wrong"] for r in rows),
            "elapsed_s": time.perf_counter() - out.t0,
            "rows": rows,
        }

    name = result_name(args, n, coll_name)
    rows, done = [], 0
    for nbytes in sizes:
        group = []
        for s in [s for z, s in plan if z == nbytes]:
            out.progress(done, len(plan), f"{human_bytes(nbytes)} {s.name}")
            group.append(measure(c, pattern, s, nbytes, memcpy_Bps))
            done += 1
        base = next((r for r in group if r["kind"] == "baseline"), None)
        for r in group:
            if base is not None and r["kind"] not in Parts.KINDS:  # (a part is not an all-reduce)
                r["speedup"] = base["time_us"] / r["time_us"]
            out.line(format_row(r))
        parts = {r["kind"]: r["time_us"] for r in group if r["kind"] in Parts.KINDS}
        whole = next((r["time_us"] for r in group if r["series"] == "ringdp"), None)
        if len(parts) == len(Parts.KINDS) and whole is not None:
            total = sum(parts.values())
            out.line(f"# parts at {human_bytes(nbytes)}: in-host {parts['part-inhost'] / 1e3:.2f} ms + "
                     f"cross {parts['part-cross'] / 1e3:.2f} ms = {total / 1e3:.2f} ms; ringdp two-level "
                     f"{whole / 1e3:.2f} ms ({whole / total:.2f} of the sum)")
        rows.extend(group)
        if rank == 0 and nbytes != sizes[-1]:  # what is measured survives a killed run
            save_json(name, payload(False), args.out_dir)
        out.progress(done, len(plan), f"done {human_bytes(nbytes)}")

    if rank != 0:
        return
    result = payload(True)
    out.line("#")
    out.line(f"# total #wrong: {result['total_wrong']}")
    path = save_json(name, result, args.out_dir)
    out.line(f"# wrote {path}  (summary: python bench/readme_table.py {path})")
    if args.plot:
        try:
            from plot_allreduce import plot_runs

            out.line(f"# wrote {plot_runs([('', result)], path.with_suffix('.png'))}")
        except Exception as e:  # noqa: BLE001 -- a plot must not lose the numbers
            out.line(f"# plot failed: {type(e).__name__}: {e}")


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Sizes accept K/M/G suffixes (powers of 1024).")
    ap.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("4K"))
    ap.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("256M"))
    ap.add_argument("-f", "--factor", type=float, default=4.0, help="size multiplier per step (default 4)")
    ap.add_argument("-n", "--iters", type=count(1), default=None,
                    help="timed calls per size and series (default: adapt to --target-time)")
    ap.add_argument("-w", "--warmup", type=count(0), default=None,
                    help="untimed calls first (default 5, 2 from 16 MiB)")
    ap.add_argument("--target-time", type=positive, default=0.25,
                    help="seconds per timed batch when --iters is not given (default 0.25)")
    ap.add_argument("--min-iters", type=count(1), default=3)
    ap.add_argument("--max-iters", type=count(1), default=2000)
    ap.add_argument("-d", "--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    ap.add_argument("-o", "--op", choices=list(OPS), default="sum")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--algo", default=None,
                    help="ringdp algorithm auto|ring|oneshot, passed as all_reduce(algo=...) (default: "
                         "$RINGDP_ALGO or auto), or a comma list such as ring,oneshot: one ringdp series "
                         "per algorithm")
    ap.add_argument("--coll", default="all_reduce",
                    help=f"comma list of {', '.join(COLLS)} (default all_reduce): one sweep and one JSON each")
    ap.add_argument("--world", type=count(1), default=None,
                    help="local ranks to start when not under torchrun (default 2, with --hosts H: 2H)")
    ap.add_argument("--hosts", type=count(1), default=1,
                    help="simulate H hosts on this machine (module doc 'Across hosts'): rank r on host r*H // world")
    ap.add_argument("--busy", type=count(0), default=0,
                    help="start N busy processes (a pure-Python loop each) beside the ranks for the whole "
                         "sweep: collectives while other work competes for the cores (module doc 'Contention')")
    ap.add_argument("--baseline", choices=("auto", "gloo", "nccl"), default="auto",
                    help="torch.distributed backend to compare with (auto: gloo on cpu, nccl on cuda)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--series", default=None,
                    help="comma list of baseline, ringdp, ringdp-reg, ringdp-flat, ringdp-pg, parts (default: "
                         "baseline,ringdp,ringdp-reg; with --hosts: and ringdp-flat)")
    ap.add_argument("--out-dir", default=str(OUT_DIR),
                    help="where the JSON/PNG go (default bench/out, ignored by git; "
                         "bench/results holds the committed ones)")
    ap.add_argument("--plot", action="store_true", help="also write a PNG of busbw and time against size")
    ap.add_argument("--name", default=None, help="suffix of the result file name")
    ap.add_argument("--timeout", type=positive, default=900.0, help="process group timeout, seconds")
    return ap


def parse_args(argv: list[str] | None = None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.min_iters > args.max_iters:
        ap.error(f"--min-iters {args.min_iters} is above --max-iters {args.max_iters}")
    if args.world is None:
        args.world = 2 * args.hosts
    if args.series is None:
        args.series = "baseline,ringdp,ringdp-reg,ringdp-flat" if args.hosts > 1 else "baseline,ringdp,ringdp-reg"
    args.series = [s.strip() for s in args.series.split(",") if s.strip()]
    bad = set(args.series) - {"baseline", "ringdp", "ringdp-reg", "ringdp-flat", "ringdp-pg", "parts"}
    if bad:
        ap.error(f"unknown --series {sorted(bad)}")
    if "parts" in args.series and (args.device != "cpu" or args.op == "avg"
                                   or (args.hosts == 1 and "TORCHELASTIC_RUN_ID" not in os.environ)):
        ap.error("--series parts: CPU tensors across hosts (--hosts, or torchrun across hosts), --op sum, min or max")
    if "ringdp-flat" in args.series and args.hosts == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        ap.error("--series ringdp-flat needs --hosts, or torchrun across hosts (it is the inter-host engine)")
    if "ringdp-flat" in args.series and "ringdp" not in args.series:
        ap.error("--series ringdp-flat needs ringdp too (its communicator is made from ringdp's)")
    if args.no_baseline and "baseline" in args.series:
        args.series.remove("baseline")
    if args.algo is None:
        args.algo = os.environ.get("RINGDP_ALGO", "auto") or "auto"
    args.algos = list(dict.fromkeys(a.strip().lower() for a in args.algo.split(",") if a.strip()))
    if not args.algos or set(args.algos) - {"auto", "ring", "oneshot"}:
        ap.error("--algo takes auto, ring, oneshot or a comma list of them")
    args.algo = ",".join(args.algos)
    args.colls = list(dict.fromkeys(x.strip() for x in args.coll.split(",") if x.strip()))
    if not args.colls or set(args.colls) - set(COLLS):
        ap.error(f"--coll takes a comma list of {', '.join(COLLS)}")
    if args.hosts > args.world:
        ap.error(f"--hosts {args.hosts} needs at least as many ranks (--world {args.world})")
    if args.factor <= 1.0:
        ap.error("--factor must be > 1")
    if args.min_bytes > args.max_bytes:
        ap.error("--min-bytes is larger than --max-bytes")
    if args.op == "avg" and args.dtype.startswith("int"):
        ap.error("--op avg needs a floating-point --dtype (ringdp's AVG is floating-point only)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launch(run_rank, args, args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
