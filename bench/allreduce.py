"""All-reduce bandwidth/latency sweep: ringdp against torch.distributed, nccl-tests style.

Run it
    python bench/allreduce.py                      # starts --world (2) local ranks itself
    python bench/allreduce.py --world 4 --plot
    python bench/allreduce.py --algo ring,oneshot  # both forced algorithms, side by side
    torchrun --nproc-per-node 2 bench/allreduce.py # uses the ranks torchrun gives it

Series (each size measures them back to back, in this order):
    gloo / nccl   torch.distributed.all_reduce on the baseline backend (gloo for CPU
                  tensors, nccl for CUDA tensors; --baseline to choose, --no-baseline to skip)
    ringdp        ringdp.all_reduce on an ordinary tensor (staged through the transport)
    ringdp-reg    ringdp.all_reduce on a tensor from ringdp.empty (registered memory)
With --algo ring,oneshot the ringdp series are split per forced algorithm (ringdp:ring,
ringdp:oneshot, ringdp-reg:ring, ...): RINGDP_ALGO is set before each series (ringdp reads
it on every call) and a forced series is measured only at the sizes where ringdp really
runs that algorithm (a forced one-shot falls back to the ring above its buffer). The
summary then prints the size at which the faster algorithm changes: the one-shot threshold.

Columns (nccl-tests doc/PERFORMANCE.md): size = S bytes of the tensor, count = elements,
time(us) = mean time of one all_reduce, min(us) = fastest single iteration,
algbw = S / time, busbw = algbw * 2(n-1)/n (GB = 1e9 bytes), #wrong = elements that differ
from the closed-form expectation summed over all ranks, speedup = baseline time / time.

Timing. Each (size, series) gets `warmup` untimed calls, then one timed batch of `iters`
calls that starts right after a barrier on the gloo process group. Each rank stamps every
iteration with time.perf_counter (CUDA: an event per iteration on the current stream, read
after a synchronize). time = max over ranks of (batch time / iters); min = max over ranks
of each rank's fastest iteration (so min <= time); the JSON also has the median. Without --iters the count adapts to
the size: iters = clamp(target_time / (fastest warmup call, slowest rank), min_iters,
max_iters), agreed on by all ranks.

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
For each row, roof(us) = (bytes each rank must read and write) * c / B, with
c = max(1, ranks on this host / cores) on CPU (ranks time-share the cores) and
c = ranks sharing the GPU on CUDA (they share its memory bandwidth). %roof = roof / time.
Bytes each rank reads+writes, as multiples of S, world n >= 2 (n = 1: nothing to do):
  ring, ordinary tensor (staged through the transport's slots), per chunk of S/n:
      reduce-scatter: first send 2/n (read tensor, write slot), each of the n-2 middle
      steps 3/n (read peer slot, read tensor, write own slot), final reduce 4/n (read
      peer slot, read tensor, write tensor, write slot for the all-gather);
      all-gather: each of the n-2 middle steps 3/n (read slot, write tensor, write slot),
      last receive 2/n (read slot, write tensor)
      total (2 + 3(n-2) + 4 + 3(n-2) + 2)/n = (6n - 4)/n          (n=2: 4.0, n=4: 5.0)
  ring, registered tensor (in place, peers read each other's tensors):
      reduce-scatter n-1 steps of 3/n (read peer, read own, write own),
      all-gather n-1 steps of 2/n (read peer, write own): total 5(n-1)/n  (n=2: 2.5)
  one-shot (every rank reduces all n inputs itself):
      ordinary: copy in 2, read n inputs, write 1: n + 3;  registered: n + 1
  baseline rows show the ordinary-tensor ring figure, the least any staged ring must move.
B is a DRAM figure: messages that fit in cache can beat the roofline, and it ignores latency.
The algo column of a ringdp row is what ringdp.policy.choose_algo picks for that size under
the RINGDP_ALGO in force (auto: one-shot up to ringdp.policy.ONESHOT_MAX_BYTES, or
RINGDP_ONESHOT_MAX_BYTES).

Output. Rank 0 prints the table as it goes (one group of rows per size; a progress counter
on stderr), then a summary, and writes bench/results/allreduce_<device>_w<world>_<dtype>
[_<name>].json (machine info, args, memcpy bandwidth, every row) and, with --plot, the PNG
next to it. Without --name the name is made of the non-default --op and --algo.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # an uninstalled, in-place built checkout (installed wins)

from _common import free_port, machine_info, save_json, under_torchrun  # noqa: E402

DTYPE_NAMES = {  # CLI name -> (torch attribute, nccl-tests style type name)
    "float32": ("float32", "float"),
    "float64": ("float64", "double"),
    "float16": ("float16", "half"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "int32": ("int32", "int32"),
    "int64": ("int64", "int64"),
}
OPS = ("sum", "avg", "min", "max")
EXACT_INT_LIMIT = {"float16": 2048, "bfloat16": 256, "float32": 2 ** 24, "float64": 2 ** 53}
MEMCPY_BYTES_CPU = 128 << 20
MEMCPY_BYTES_CUDA = 512 << 20
CHECK_ROWS_PER_CHUNK = 128


# --------------------------------------------------------------------------- small helpers
def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return str(n)


def sizes_to_sweep(args, elem: int) -> list[int]:
    """Byte sizes min..max multiplied by factor, rounded down to whole elements."""
    out, s = [], args.min_bytes
    while s <= args.max_bytes:
        b = (s // elem) * elem
        if b > 0 and (not out or b != out[-1]):
            out.append(b)
        nxt = int(s * args.factor)
        s = nxt if nxt > s else s + 1
    return out


def bytes_factor(kind: str, algo: str, n: int) -> float:
    """Bytes each rank reads+writes for one all-reduce, as a multiple of S (module doc)."""
    if n <= 1:
        return 0.0
    if algo == "oneshot":
        return n + 1.0 if kind == "registered" else n + 3.0
    if kind == "registered":
        return 5.0 * (n - 1) / n
    return (6.0 * n - 4.0) / n


# --------------------------------------------------------------------------- pattern
class Pattern:
    """v(r, i) and its exact all-reduce result, built as a periodic block and tiled."""

    def __init__(self, torch, dtype_name: str, dtype, op: str, n: int, rank: int, device):
        limit = EXACT_INT_LIMIT.get(dtype_name, 2 ** 62)
        k = min(3, limit // (n * n) - 1)
        self.exact = k >= 0
        k = max(k, 0)
        period = math.lcm(2 * k + 1, n)
        self.block_len = period * max(1, (1 << 16) // period)
        idx = torch.arange(self.block_len, dtype=torch.int64, device=device)
        b = idx % (2 * k + 1) - k
        value = n * b + 2 * ((idx + rank) % n) - (n - 1)
        expect = {"sum": n * n * b, "avg": n * b, "max": n * b + (n - 1), "min": n * b - (n - 1)}[op]
        self.value = value.to(dtype)
        self.expect = expect.to(dtype)
        self.k = k

    def _tiles(self, t):
        count = t.numel()
        rows = count // self.block_len
        body = t[: rows * self.block_len].view(rows, self.block_len)
        tail = t[rows * self.block_len:]
        return body, tail

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


# --------------------------------------------------------------------------- the worker
class Series:
    """One curve: kind is baseline, ringdp (ordinary tensor) or ringdp-reg (registered);
    algo is the RINGDP_ALGO it runs under (None for the baseline)."""

    def __init__(self, name: str, kind: str, algo: str | None):
        self.name, self.kind, self.algo = name, kind, algo

    def __repr__(self):
        return self.name


class Bench:
    def __init__(self, args, rank: int, world: int, local_rank: int):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.args, self.rank, self.world = args, rank, world
        self.dtype = getattr(torch, DTYPE_NAMES[args.dtype][0])
        self.elem = torch.empty(0, dtype=self.dtype).element_size()
        self.op_name = args.op
        self.op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG,
                   "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[args.op]
        self.cuda = args.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.notes: list[str] = []
        self._progress_shown = False
        self.rows: list[dict] = []
        self.pattern = Pattern(torch, args.dtype, self.dtype, args.op, world, rank, self.device)
        if not self.pattern.exact:
            self.note(f"world {world} is too large for exact {args.dtype} integers; #wrong may be nonzero")
        self._t_start = time.perf_counter()

    # -- plumbing -----------------------------------------------------------------------
    def log(self, *parts, err=False):
        if self.rank == 0:
            if self._progress_shown:  # wipe the live counter before the line lands
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
                self._progress_shown = False
            print(*parts, file=sys.stderr if err else sys.stdout, flush=True)

    def note(self, text: str):
        self.notes.append(text)
        self.log(f"# note: {text}")

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def reduce_scalar(self, x: float, op) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=op)
        return float(t[0])

    def agree(self, ok: bool) -> bool:
        """True only if every rank says True (MIN over ranks)."""
        return self.reduce_scalar(1.0 if ok else 0.0, self.dist.ReduceOp.MIN) > 0.5

    # -- set-up -------------------------------------------------------------------------
    def placement(self):
        """Ranks on this host (CPU) or sharing this GPU (CUDA), from all ranks' facts."""
        me = (socket.gethostname(), self.device.index if self.cuda else -1)
        everyone = [None] * self.world
        self.dist.all_gather_object(everyone, me)
        host_ranks = sum(1 for h, _ in everyone if h == me[0])
        sharing = sum(1 for x in everyone if x == me)
        return host_ranks, sharing

    def measure_memcpy(self) -> dict:
        torch, dist = self.torch, self.dist
        nbytes = MEMCPY_BYTES_CUDA if self.cuda else MEMCPY_BYTES_CPU
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=self.device)
        dst = torch.zeros_like(src)

        def best_copy(reps: int) -> float:
            dst.copy_(src)
            self.sync()
            best = float("inf")
            for _ in range(reps):
                if self.cuda:
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
        alone = best_copy(7) if self.rank == 0 else 0.0
        dist.barrier()
        together = self.reduce_scalar(best_copy(5), dist.ReduceOp.MAX)
        alone = self.reduce_scalar(alone, dist.ReduceOp.MAX)
        del src, dst
        return {"bytes": nbytes,
                "one_rank_GBps": 2 * nbytes / alone / 1e9,
                "all_ranks_at_once_GBps_per_rank": 2 * nbytes / together / 1e9,
                "counts": "bytes read + bytes written"}

    def setup_ringdp(self):
        self.ringdp = None
        self.threshold = None
        want = {"ringdp", "ringdp-reg"} & set(self.args.series)
        if not want:
            return
        try:
            import ringdp  # noqa: F401
            import ringdp._C  # noqa: F401
            ok = True
        except Exception as e:  # noqa: BLE001
            ok, err = False, e
        if not self.agree(ok):
            self.note(f"ringdp is not importable ({err if not ok else 'on another rank'}); "
                      "running the baseline only")
            return
        import ringdp

        self.ringdp = ringdp
        if hasattr(ringdp, "init"):
            ringdp.init()
        try:
            from ringdp import policy

            self.threshold = int(policy.oneshot_max_bytes(self.world) if hasattr(policy, "oneshot_max_bytes")
                                 else os.environ.get("RINGDP_ONESHOT_MAX_BYTES", policy.ONESHOT_MAX_BYTES))
        except Exception:  # noqa: BLE001
            self.threshold = None

    def setup_baseline(self, sharing: int):
        self.bgroup, self.bname = None, None
        if "baseline" not in self.args.series:
            return
        backend = self.args.baseline
        if backend == "auto":
            backend = "nccl" if self.cuda else "gloo"
        if backend == "gloo":
            self.bgroup, self.bname = None, "gloo"  # the default (gloo) group
            return
        if sharing > 1:
            # NCCL refuses two ranks on one GPU; a host id per rank makes it treat them as
            # separate hosts (it then goes over sockets: slow, but a measured baseline).
            os.environ.setdefault("NCCL_HOSTID", f"ringdp-bench-{self.rank}")
            self.note(f"{sharing} ranks share one GPU: nccl baseline runs with one NCCL_HOSTID "
                      "per rank (over sockets), not a fair NCCL figure")
        self.bgroup = self.dist.new_group(backend="nccl")
        self.bname = "nccl"

    def use(self, series: Series):
        """Put the series' forced algorithm in force (ringdp reads RINGDP_ALGO per call)."""
        if series.algo is not None:
            os.environ["RINGDP_ALGO"] = series.algo

    def probe(self, series: Series) -> bool:
        """Every rank tries a small call; the series runs only if all succeed."""
        ok, err = True, None
        self.use(series)
        try:
            t = self.alloc(series, max(self.world, 1))
            self.pattern.fill(t)
            self.call(series, t)
            self.sync()
            ok = self.pattern.wrong(t) == 0
            err = None if ok else "wrong result on a 1-element probe"
        except Exception as e:  # noqa: BLE001
            ok, err = False, f"{type(e).__name__}: {e}"
        if not self.agree(ok):
            self.note(f"series {series} skipped: {err or 'failed on another rank'}")
            return False
        return True

    # -- the calls ------------------------------------------------------------------------
    def alloc(self, series: Series, count: int):
        if series.kind == "ringdp-reg":
            t = self.ringdp.empty(count, dtype=self.dtype, device=str(self.device))
            if hasattr(self.ringdp, "is_registered") and not self.ringdp.is_registered(t):
                raise RuntimeError("ringdp.empty returned a tensor that is not registered")
            return t
        return self.torch.empty(count, dtype=self.dtype, device=self.device)

    def call(self, series: Series, t):
        if series.kind == "baseline":
            if self.op_name == "avg" and not self.dtype.is_floating_point and self.bname == "gloo":
                self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, group=self.bgroup)
                t.div_(self.world, rounding_mode="trunc")  # gloo has no integer AVG
            else:
                self.dist.all_reduce(t, op=self.op, group=self.bgroup)
        else:
            self.ringdp.all_reduce(t, op=self.op)

    def algo_for(self, series: Series, nbytes: int) -> str:
        """The algorithm ringdp runs for this size under the series' RINGDP_ALGO."""
        if series.kind == "baseline":
            return "-"
        policy = getattr(self.ringdp, "policy", None)
        if policy is not None and hasattr(policy, "choose_algo"):
            saved = os.environ.get("RINGDP_ALGO")
            self.use(series)
            try:
                code = policy.choose_algo(nbytes, self.world)
            finally:
                if saved is None:
                    os.environ.pop("RINGDP_ALGO", None)
                else:
                    os.environ["RINGDP_ALGO"] = saved
            return "oneshot" if code == getattr(policy, "ALGO_ONESHOT", 1) else "ring"
        if series.algo in ("ring", "oneshot"):
            return series.algo
        return "oneshot" if self.threshold is not None and nbytes <= self.threshold else "ring"

    def timed(self, series: Series, t, iters: int) -> tuple[float, list[float]]:
        """One batch after a barrier: (batch seconds, per-iteration seconds), this rank."""
        torch = self.torch
        self.sync()
        self.dist.barrier()
        if self.cuda:
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
            evs[0].record()
            for k in range(iters):
                self.call(series, t)
                evs[k + 1].record()
            torch.cuda.synchronize()
            per = [evs[k].elapsed_time(evs[k + 1]) / 1e3 for k in range(iters)]
            return evs[0].elapsed_time(evs[-1]) / 1e3, per
        stamps = [0.0] * (iters + 1)
        stamps[0] = time.perf_counter()
        for k in range(iters):
            self.call(series, t)
            stamps[k + 1] = time.perf_counter()
        return stamps[-1] - stamps[0], [stamps[k + 1] - stamps[k] for k in range(iters)]

    def measure(self, series: Series, nbytes: int) -> dict:
        torch, dist, args = self.torch, self.dist, self.args
        count = nbytes // self.elem
        self.use(series)
        t = self.alloc(series, count)
        self.pattern.fill(t)
        self.sync()

        # warm-up, each call stamped: the calls after the first size the timed batch
        warmup = args.warmup if args.warmup is not None else (5 if nbytes < (16 << 20) else 2)
        stamps = []
        dist.barrier()
        for _ in range(warmup):
            t0 = time.perf_counter()
            self.call(series, t)
            self.sync()
            stamps.append(time.perf_counter() - t0)
        if args.iters is not None:
            iters = args.iters
        else:
            steady = stamps[1:] or stamps or [1e-3]
            est = self.reduce_scalar(sum(steady) / len(steady), dist.ReduceOp.MAX)
            iters = int(min(args.max_iters, max(args.min_iters, math.ceil(args.target_time / max(est, 1e-7)))))

        batch, per = self.timed(series, t, iters)
        batch = self.reduce_scalar(batch, dist.ReduceOp.MAX)
        per.sort()
        fastest_iter = self.reduce_scalar(per[0], dist.ReduceOp.MAX)
        median_iter = self.reduce_scalar(per[len(per) // 2], dist.ReduceOp.MAX)

        # correctness: refill, one more call, compare with the closed form
        self.pattern.fill(t)
        self.call(series, t)
        self.sync()
        wrong_t = torch.tensor([self.pattern.wrong(t)], dtype=torch.int64)
        dist.all_reduce(wrong_t)
        del t

        n = self.world
        mean = batch / iters
        algbw = nbytes / mean / 1e9
        busbw = algbw * (2 * (n - 1) / n if n > 1 else 0.0)
        kind = "registered" if series.kind == "ringdp-reg" else "ordinary"
        algo = self.algo_for(series, nbytes)
        factor = bytes_factor(kind, "oneshot" if algo == "oneshot" else "ring", n)
        roof = factor * nbytes * self.contention / self.memcpy_bw if factor else 0.0
        return {
            "size": nbytes, "count": count, "type": DTYPE_NAMES[args.dtype][1], "redop": self.op_name,
            "series": series.name, "kind": series.kind, "algo": algo,
            "iters": iters, "warmup": warmup,
            "time_us": mean * 1e6, "min_us": fastest_iter * 1e6, "median_us": median_iter * 1e6,
            "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": int(wrong_t[0]),
            "bytes_per_rank": factor * nbytes, "roof_us": roof * 1e6,
            "pct_roof": (100.0 * roof / mean) if roof else None,
            "speedup": None,
        }

    # -- output ---------------------------------------------------------------------------
    HEADER = (f"{'size':>12} {'count':>11} {'type':>8} {'redop':>5} {'series':>10} {'algo':>7} "
              f"{'iters':>6} {'time(us)':>11} {'min(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
              f"{'roof(us)':>10} {'%roof':>6} {'speedup':>7}")

    def print_row(self, r: dict):
        pct = f"{r['pct_roof']:5.1f}%" if r["pct_roof"] is not None else "     -"
        sp = f"{r['speedup']:6.2f}x" if r["speedup"] is not None else "      -"
        self.log(f"{r['size']:>12} {r['count']:>11} {r['type']:>8} {r['redop']:>5} {r['series']:>10} "
                 f"{r['algo']:>7} {r['iters']:>6} {r['time_us']:11.2f} {r['min_us']:10.2f} "
                 f"{r['algbw_GBps']:7.3f} {r['busbw_GBps']:7.3f} {r['wrong']:>6} "
                 f"{r['roof_us']:10.2f} {pct} {sp}")

    def progress(self, done: int, total: int, what: str):
        if self.rank != 0:
            return
        el = time.perf_counter() - self._t_start
        if sys.stderr.isatty():
            sys.stderr.write(f"\r\033[K[{done}/{total}] {el:.1f}s {what}")
            self._progress_shown = True
        elif what.startswith("done"):
            sys.stderr.write(f"[{done}/{total}] {el:.1f}s {what}\n")
        sys.stderr.flush()

    # -- the run --------------------------------------------------------------------------
    def run(self) -> dict | None:
        args, n = self.args, self.world
        host_ranks, sharing = self.placement()
        if self.cuda:
            self.contention = float(sharing)
        else:
            try:
                cores = len(os.sched_getaffinity(0))
            except AttributeError:
                cores = os.cpu_count() or 1
            self.contention = max(1.0, host_ranks / cores)
        memcpy = self.measure_memcpy()
        self.memcpy_bw = memcpy["one_rank_GBps"] * 1e9
        self.setup_ringdp()
        self.setup_baseline(sharing)

        series = []
        if self.bname:
            series.append(Series(self.bname, "baseline", None))
        for kind in ("ringdp", "ringdp-reg"):
            if kind not in args.series or self.ringdp is None:
                continue
            for algo in args.algos:
                name = kind if len(args.algos) == 1 else f"{kind}:{algo}"
                s = Series(name, kind, algo)
                if self.probe(s):
                    series.append(s)
        sizes = sizes_to_sweep(args, self.elem)
        # a forced algorithm compared with another is measured only where ringdp runs it
        plan = [(z, s) for z in sizes for s in series
                if len(args.algos) == 1 or s.algo == "auto" or s.kind == "baseline"
                or self.algo_for(s, z) == s.algo]

        self.log(f"# ringdp all_reduce benchmark: world {n}, device {args.device}, {args.dtype}, "
                 f"op {args.op}, algo {args.algo}, series {', '.join(s.name for s in series)}")
        info = machine_info(n, args.device)
        self.log(f"# machine: {info['cpu_model']} ({info['cpu_cores']} cores), torch {info['torch']}, "
                 f"{info.get('gpu', 'no gpu') if self.cuda else 'cpu'}, ringdp: {info['ringdp']}")
        self.log(f"# memcpy (read+write): {memcpy['one_rank_GBps']:.1f} GB/s one rank alone, "
                 f"{memcpy['all_ranks_at_once_GBps_per_rank']:.1f} GB/s per rank with all {n} at once; "
                 f"roofline: first figure, times {self.contention:g} for ranks sharing a core/GPU")
        self.log(f"# bytes per rank / S: ring ordinary {bytes_factor('ordinary', 'ring', n):.2f}, "
                 f"ring registered {bytes_factor('registered', 'ring', n):.2f}, one-shot ordinary "
                 f"{bytes_factor('ordinary', 'oneshot', n):.2f}, registered {bytes_factor('registered', 'oneshot', n):.2f}")
        if self.ringdp is not None:
            self.log(f"# one-shot threshold (auto): {self.threshold if self.threshold is not None else 'unknown'} bytes")
        self.log("# GB/s = 1e9 bytes/s; time = mean per call, max over ranks; speedup = baseline time / time")
        self.log("#")
        self.log(self.HEADER)

        total = len(plan)
        done = 0
        for nbytes in sizes:
            group = []
            for z, s in plan:
                if z != nbytes:
                    continue
                self.progress(done, total, f"{human_bytes(nbytes)} {s.name}")
                group.append(self.measure(s, nbytes))
                done += 1
            base = next((r for r in group if r["series"] == self.bname), None)
            for r in group:
                if base is not None:
                    r["speedup"] = base["time_us"] / r["time_us"]
                self.print_row(r)
            self.rows.extend(group)
            self.progress(done, total, f"done {human_bytes(nbytes)}")

        summary = self.summarize()
        if self.rank != 0:
            return None
        wrong = sum(r["wrong"] for r in self.rows)
        self.log("#")
        self.log(f"# total #wrong: {wrong}")
        for line in summary["lines"]:
            self.log(f"# {line}")
        payload = {
            "benchmark": "allreduce",
            "machine": info,
            "args": {k: v for k, v in vars(args).items()},
            "env": {k: v for k, v in os.environ.items() if k.startswith("RINGDP_") or k.startswith("NCCL_")},
            "memcpy": memcpy,
            "roofline": {"contention": self.contention,
                         "bytes_per_rank_over_S": {
                             "ring_ordinary": bytes_factor("ordinary", "ring", n),
                             "ring_registered": bytes_factor("registered", "ring", n),
                             "oneshot_ordinary": bytes_factor("ordinary", "oneshot", n),
                             "oneshot_registered": bytes_factor("registered", "oneshot", n)}},
            "oneshot_max_bytes": self.threshold,
            "pattern_k": self.pattern.k,
            "notes": self.notes,
            "summary": summary,
            "total_wrong": wrong,
            "elapsed_s": time.perf_counter() - self._t_start,
            "rows": self.rows,
        }
        path = save_json(result_name(args, n), payload, args.out_dir)
        self.log(f"# wrote {path}")
        if args.plot:
            try:
                from plot_allreduce import plot_runs

                self.log(f"# wrote {plot_runs([('', payload)], path.with_suffix('.png'))}")
            except Exception as e:  # noqa: BLE001 -- a plot must not lose the numbers
                self.log(f"# plot failed: {type(e).__name__}: {e}")
        return payload

    def summarize(self) -> dict:
        """Speedups by size range and, on CPU float32, the issue's performance targets."""
        out: dict = {"lines": [], "targets": {}}
        if len(self.args.algos) > 1:
            from plot_allreduce import crossovers

            out["crossovers"] = crossovers([("", {"rows": self.rows})])
            out["lines"].extend(out["crossovers"])
            if {"ring", "oneshot"} <= set(self.args.algos):
                up_to, capped = {}, False
                for kind in ("ringdp", "ringdp-reg"):
                    ring = {r["size"]: r["time_us"] for r in self.rows if r["series"] == f"{kind}:ring"}
                    one = {r["size"]: r["time_us"] for r in self.rows if r["series"] == f"{kind}:oneshot"}
                    best, common = 0, sorted(set(ring) & set(one))
                    for z in common:
                        if one[z] >= ring[z]:
                            break
                        best = z
                    if common:
                        up_to[kind] = best
                        capped = capped or best == common[-1]
                if up_to:
                    out["oneshot_faster_up_to"] = up_to
                    out["suggested_oneshot_max_bytes"] = min(up_to.values())
                    out["lines"].append(
                        "one-shot beats the ring at every size up to " +
                        ", ".join(f"{human_bytes(v)} ({k})" for k, v in up_to.items()) +
                        f"; suggested ONESHOT_MAX_BYTES = {min(up_to.values())}" +
                        (" (capped by the largest size measured one-shot)" if capped else ""))
        if not self.bname:
            return out
        base = {r["size"]: r for r in self.rows if r["series"] == self.bname}
        small = min(base) if base else None
        names = list(dict.fromkeys(r["series"] for r in self.rows if r["kind"] != "baseline"))
        for s in names:
            rs = {r["size"]: r for r in self.rows if r["series"] == s}
            big = [rs[z]["speedup"] for z in rs if z >= (16 << 20) and z <= (256 << 20)]
            allsp = [r["speedup"] for r in rs.values()]
            entry = {"min_speedup": min(allsp), "max_speedup": max(allsp)}
            line = f"{s}: speedup over {self.bname} {min(allsp):.2f}x..{max(allsp):.2f}x"
            if big:
                entry["busbw_speedup_16M_256M_min"] = min(big)
                line += f"; at 16-256 MiB busbw >= {min(big):.2f}x"
            if small in rs:
                entry["latency_smallest"] = {"size": small, "us": rs[small]["time_us"],
                                             "baseline_us": base[small]["time_us"]}
                line += (f"; at {human_bytes(small)} {rs[small]['time_us']:.1f} us vs "
                         f"{base[small]['time_us']:.1f} us ({base[small]['time_us'] / rs[small]['time_us']:.1f}x)")
            out[s] = entry
            out["lines"].append(line)
        # the issue's targets (2-core CPU, float32); informative, not a test
        if (self.args.device == "cpu" and self.args.dtype == "float32" and self.bname == "gloo"
                and len(self.args.algos) == 1):
            t = out["targets"]
            if self.world == 2:
                if "ringdp" in out and "busbw_speedup_16M_256M_min" in out["ringdp"]:
                    t["ordinary_16M_256M_ge_3.5x"] = out["ringdp"]["busbw_speedup_16M_256M_min"] >= 3.5
                if "ringdp-reg" in out and "busbw_speedup_16M_256M_min" in out["ringdp-reg"]:
                    t["registered_16M_256M_ge_6x"] = out["ringdp-reg"]["busbw_speedup_16M_256M_min"] >= 6.0
                four_k = [r for r in self.rows if r["size"] == 4096 and r["series"].startswith("ringdp")]
                if 4096 in base and four_k:
                    t["latency_4KiB_le_1/8"] = all(r["time_us"] * 8 <= base[4096]["time_us"] for r in four_k)
            elif self.world == 4:
                rd = [r for r in self.rows if r["series"].startswith("ringdp")]
                if rd:
                    t["faster_than_gloo_every_size"] = all(r["speedup"] > 1.0 for r in rd)
            for k, v in t.items():
                out["lines"].append(f"target {k}: {'met' if v else 'NOT met'}")
        return out


def result_name(args, world: int) -> str:
    name = f"allreduce_{args.device}_w{world}_{args.dtype}"
    extra = args.name
    if extra is None:
        algo = args.algo.replace(",", "+")
        parts = [p for p in (args.op if args.op != "sum" else "", algo if algo != "auto" else "") if p]
        extra = "_".join(parts) if parts else None
    return f"{name}_{extra}" if extra else name


# --------------------------------------------------------------------------- processes
def worker(local_rank: int, world: int, args, port: int | None):
    """One rank: join (or create) the gloo group, run the sweep, leave cleanly."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    if port is None:  # torchrun: env:// with the ranks it gave us
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        dist.init_process_group("gloo", timeout=timeout)
    else:
        rank = local_rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=timeout)
    bench = Bench(args, dist.get_rank(), dist.get_world_size(), local_rank)
    try:
        bench.run()
    finally:
        ringdp = getattr(bench, "ringdp", None)
        if ringdp is not None and hasattr(ringdp, "destroy"):
            try:
                ringdp.destroy()
            except Exception:  # noqa: BLE001
                pass
        dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Sizes accept K/M/G suffixes (powers of 1024).")
    ap.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("4K"))
    ap.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("256M"))
    ap.add_argument("-f", "--factor", type=float, default=4.0, help="size multiplier per step (default 4)")
    ap.add_argument("-n", "--iters", type=int, default=None,
                    help="timed calls per size and series (default: adapt to --target-time)")
    ap.add_argument("-w", "--warmup", type=int, default=None,
                    help="untimed calls first (default 5, 2 from 16 MiB)")
    ap.add_argument("--target-time", type=float, default=0.25,
                    help="seconds per timed batch when --iters is not given (default 0.25)")
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=2000)
    ap.add_argument("-d", "--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    ap.add_argument("-o", "--op", choices=OPS, default="sum")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--algo", default=None,
                    help="ringdp algorithm auto|ring|oneshot (sets RINGDP_ALGO; default: $RINGDP_ALGO "
                         "or auto), or a comma list such as ring,oneshot: one ringdp series per algorithm")
    ap.add_argument("--world", type=int, default=2, help="local ranks to start when not under torchrun")
    ap.add_argument("--baseline", choices=("auto", "gloo", "nccl"), default="auto",
                    help="torch.distributed backend to compare with (auto: gloo on cpu, nccl on cuda)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--series", default="baseline,ringdp,ringdp-reg",
                    help="comma list of baseline, ringdp, ringdp-reg (default: all)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--plot", action="store_true", help="also write a PNG of busbw and time against size")
    ap.add_argument("--name", default=None, help="suffix of the result file name")
    ap.add_argument("--timeout", type=float, default=900.0, help="process group timeout, seconds")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.series = [s.strip() for s in args.series.split(",") if s.strip()]
    bad = set(args.series) - {"baseline", "ringdp", "ringdp-reg"}
    if bad:
        raise SystemExit(f"unknown --series {sorted(bad)}")
    if args.no_baseline and "baseline" in args.series:
        args.series.remove("baseline")
    if args.algo is None:
        args.algo = os.environ.get("RINGDP_ALGO", "auto") or "auto"
    args.algos = list(dict.fromkeys(a.strip().lower() for a in args.algo.split(",") if a.strip()))
    if not args.algos or set(args.algos) - {"auto", "ring", "oneshot"}:
        raise SystemExit("--algo takes auto, ring, oneshot or a comma list of them")
    args.algo = ",".join(args.algos)
    if args.factor <= 1.0:
        raise SystemExit("--factor must be > 1")
    if args.min_bytes > args.max_bytes:
        raise SystemExit("--min-bytes is larger than --max-bytes")

    if under_torchrun():
        worker(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args.world, args, free_port()), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
