"""Multi-process correctness of ringdp.all_reduce on CPU (shared-memory transport).

Values depend on rank and index and are small integers, so every dtype (fp16 and bf16
included) represents the exact closed-form results (tests/_closed_form.py):
    v(r, i) = (i % 13) + 2((r + i) % n)   (no rank's input is the MIN or MAX of all)
    SUM = n(i%13) + n(n-1)   MIN = i%13   MAX = i%13 + 2(n-1)   AVG = i%13 + n - 1
"""
import hashlib
import time

import pytest
import torch

from _closed_form import digest, expected, nan_expected, nan_input, ops_for, same_with_nan, value
from _dist import run_ranks, values
from _torch_features import STORAGE_SWAP

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SIZES = [0, 1, 2, 3, 7, 13, 31, 97, 1000, 4099, 65537]
BIG = 300_007  # prime: several pipeline rounds and an uneven last round

CONFIGS = {
    # default slots and thresholds
    "default": {},
    # tiny slots, two per connection: many rounds, back-pressure on every step; ring only
    "tiny-ring": {"RINGDP_SLOT_BYTES": "4096", "RINGDP_FIFO_SLOTS": "2", "RINGDP_ALGO": "ring"},
    # a slot of 64 mod 128 bytes: float16/bfloat16 partial sums (4 bytes against a 32-element
    # alignment unit) once overflowed it by 64 bytes into the next slot
    "odd-slot-ring": {"RINGDP_SLOT_BYTES": "4160", "RINGDP_FIFO_SLOTS": "2", "RINGDP_ALGO": "ring"},
    # one-shot for everything that fits its buffer
    "oneshot": {"RINGDP_ALGO": "oneshot"},
}


def _matrix(rank, world, sizes, dtypes):
    import torch.distributed as dist

    import ringdp

    failures = []
    checked = 0
    for dtype in dtypes:
        for op in ops_for(dtype):
            for count in sizes:
                for registered in (False, True):
                    exp = expected(op, world, count, dtype)
                    for rep in range(2):  # each collective twice in a row
                        t = ringdp.empty(count, dtype=dtype) if registered else torch.empty(count, dtype=dtype)
                        t.copy_(value(rank, count, dtype, world=world))
                        ringdp.all_reduce(t, op=getattr(dist.ReduceOp, op))
                        checked += 1
                        if not torch.equal(t, exp):
                            bad = (t.to(torch.float64) != exp.to(torch.float64)).nonzero()
                            failures.append((str(dtype), op, count, registered, rep, bad[:5].flatten().tolist()))
    return checked, failures


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matrix(world, config):
    res = values(run_ranks(_matrix, world, SIZES, DTYPES, env=CONFIGS[config], timeout=600))
    for rank, (checked, failures) in enumerate(res):
        assert checked > 0
        assert failures == [], f"rank {rank}: {failures[:10]}"


@pytest.mark.parametrize("world", [2, 3])
def test_big_prime_size(world):
    res = values(run_ranks(_matrix, world, [BIG], [torch.float32, torch.bfloat16]))
    for checked, failures in res:
        assert checked == 2 * 2 * (4 * 2)  # dtypes x registered x ops x reps
        assert failures == []


def _random_sum(rank, world, count, dtype, registered):
    import ringdp

    g = torch.Generator().manual_seed(1234 + rank)
    src = torch.randn(count, generator=g, dtype=torch.float64).to(dtype)
    t = ringdp.empty(count, dtype=dtype) if registered else src.clone()
    t.copy_(src)
    ringdp.all_reduce(t)
    out = [hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()]
    ringdp.all_reduce(t)
    out.append(hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("registered", [False, True])
def test_bitwise_identical_across_ranks(dtype, registered):
    # Random (non-integer) values: rounding differs with summation order, so equal bytes on
    # every rank show each chunk is reduced once, in one order, and copied.
    res = values(run_ranks(_random_sum, 3, 200_003, dtype, registered))
    assert all(r == res[0] for r in res), res


def _paths(rank, world):
    """What the engine ran (the flight record's path) for each kind of tensor, with the values."""
    import torch.distributed as dist

    import ringdp

    comm = ringdp.get_communicator()
    n = 300_007  # above every one-shot threshold: the ring's sizes
    out = {}

    def run(name, t, **kw):
        t.copy_(value(rank, t.numel(), t.dtype, world=world))
        ringdp.all_reduce(t, **kw)
        rec = comm.flight_record()[-1]
        op = kw.get("op", dist.ReduceOp.SUM)
        want = expected({dist.ReduceOp.SUM: "SUM", dist.ReduceOp.MAX: "MAX"}[op], world, t.numel(), t.dtype)
        out[name] = (rec["path"], rec["kind"], torch.equal(t, want))

    run("ordinary", torch.empty(n))
    run("registered", ringdp.empty(n))
    run("registered_bf16", ringdp.empty(n, dtype=torch.bfloat16))  # the in-place ring could not
    run("registered_max_int", ringdp.empty(n, dtype=torch.int64), op=dist.ReduceOp.MAX)
    run("registered_here_only", ringdp.empty(n) if rank == 0 else torch.empty(n))
    run("registered_small", ringdp.empty(5), algo="ring")
    run("oneshot", ringdp.empty(100), algo="oneshot")

    def gather(name, g_out, in_place=False):  # all_gather's registered memory is its output
        g_out.fill_(-1)
        g_in = g_out[rank * n:(rank + 1) * n] if in_place else torch.empty(n, dtype=g_out.dtype)
        g_in.copy_(value(rank, n, g_out.dtype, world=world))
        comm.all_gather_into_tensor(g_out, g_in)
        rec = comm.flight_record()[-1]
        out[name] = (rec["path"], rec["kind"],
                     all(torch.equal(b, value(q, n, g_out.dtype, world=world)) for q, b in enumerate(g_out.chunk(world))))

    gather("all_gather", torch.empty(n * world))
    gather("all_gather_registered", ringdp.empty(n * world))
    gather("all_gather_registered_in_place", ringdp.empty(n * world, dtype=torch.float16), in_place=True)
    gather("all_gather_registered_here_only", ringdp.empty(n * world) if rank == 0 else torch.empty(n * world))
    b = ringdp.empty(n)
    b.copy_(value(0, n, world=world) if rank == 0 else torch.full((n,), -1.0))
    comm.broadcast(b, 0)
    rec = comm.flight_record()[-1]
    out["broadcast_registered"] = (rec["path"], rec["kind"], torch.equal(b, value(0, n, world=world)))

    def scatter(name, inp, in_place=False):  # reduce_scatter's registered memory is its input
        inp.copy_(value(rank, n * world, inp.dtype, world=world))
        mine = inp[rank * n:(rank + 1) * n]
        res = mine if in_place else torch.empty(n, dtype=inp.dtype)
        comm.reduce_scatter_tensor(res, inp)
        rec = comm.flight_record()[-1]
        want = expected("SUM", world, n * world, inp.dtype)[rank * n:(rank + 1) * n]
        out[name] = (rec["path"], rec["kind"], torch.equal(res, want))

    scatter("reduce_scatter", torch.empty(n * world))
    scatter("reduce_scatter_registered", ringdp.empty(n * world))
    scatter("reduce_scatter_registered_in_place", ringdp.empty(n * world, dtype=torch.bfloat16), in_place=True)
    scatter("reduce_scatter_registered_here_only", ringdp.empty(n * world) if rank == 0 else torch.empty(n * world))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_paths(world):
    # A registered all_reduce, reduce_scatter (its input registered) or all_gather (its
    # output) or broadcast runs direct on every rank (any dtype), a mixed one staged on every
    # rank; the flight record says which.
    want = {"ordinary": "ring_staged", "registered": "direct", "registered_bf16": "direct",
            "registered_max_int": "direct", "registered_here_only": "ring_staged", "registered_small": "direct",
            "oneshot": "oneshot", "all_gather": "ring_staged", "all_gather_registered": "direct",
            "all_gather_registered_in_place": "direct", "all_gather_registered_here_only": "ring_staged",
            "broadcast_registered": "direct",
            "reduce_scatter": "ring_staged", "reduce_scatter_registered": "direct",
            "reduce_scatter_registered_in_place": "direct", "reduce_scatter_registered_here_only": "ring_staged"}
    for rank, out in enumerate(values(run_ranks(_paths, world))):
        assert {k: v[0] for k, v in out.items()} == want, (rank, out)
        assert all(v[2] for v in out.values()), (rank, out)


def _direct_back_to_back(rank, world, count, calls, kind):
    """Many direct all-reduces (reduce-scatters, all-gathers) on the same registered tensor, the ranks
    out of step (a rank sleeps before some calls, another overwrites its tensor the moment a
    call returns): a peer still reading or writing my tensor after I return would show in
    the values."""
    import random

    import ringdp

    in_place = kind.endswith("_in_place")  # the output is the input's block (reduce_scatter) or the reverse
    scatter, gather = kind.startswith("reduce_scatter"), kind.startswith("all_gather")
    if kind == "broadcast":  # the source rotates; it overwrites its tensor as the call returns
        t = ringdp.empty(count)
        g = torch.arange(count, dtype=torch.float64) % 101
        bad = []
        for k in range(calls):
            if random.Random(rank * 1000 + k).random() < 0.2:
                time.sleep(0.002 * random.Random(k).random())
            src = k % world
            t.copy_(g * (src + 1) + k if rank == src else torch.full((count,), -5.0, dtype=torch.float64))
            ringdp.broadcast(t, src, algo="ring")
            if not torch.equal(t.to(torch.float64), g * (src + 1) + k):
                bad.append(k)
            t.fill_(-1e9)  # a peer still reading the source's tensor would copy this
        return bad, ringdp.get_communicator().flight_record()[-1]["path"]
    t = ringdp.empty(count * world if scatter or gather else count)
    res = torch.empty(count)
    i = torch.arange(t.numel(), dtype=torch.float64)
    mine = slice(rank * count, (rank + 1) * count) if scatter else slice(None)
    g = torch.arange(count, dtype=torch.float64) % 101
    rng = random.Random(rank)
    bad = []
    for k in range(calls):
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.002)
        if gather:  # block q of my output: rank q's input (q + 1)(i % 101) + k
            src = t[rank * count:(rank + 1) * count] if in_place else torch.empty(count)
            src.copy_(g * (rank + 1) + k)
            ringdp.all_gather_into_tensor(t, src, algo="ring")
            want = torch.cat([g * (q + 1) + k for q in range(world)])
            if not torch.equal(t.to(torch.float64), want):
                bad.append(k)
            t.fill_(-1e9)  # a peer still reading my output would copy this
            continue
        t.copy_((i % 101) * (rank + 1) + k)  # exact in float32
        if scatter:
            if in_place:  # into my block of the input
                res = t[mine]
            ringdp.reduce_scatter_tensor(res, t, algo="ring")
        else:
            ringdp.all_reduce(t, algo="ring")  # (one-shot's threshold aside, whatever it is)
            res = t
        want = ((i % 101) * (world * (world + 1) // 2) + world * k)[mine]
        if not torch.equal(res.to(torch.float64), want):
            bad.append(k)
        t.fill_(-1e9)  # a peer still reading my input would fold this in
    return bad, ringdp.get_communicator().flight_record()[-1]["path"]


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "reduce_scatter_in_place", "all_gather",
                                  "all_gather_in_place", "broadcast"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_direct_back_to_back(world, kind):
    for rank, (bad, path) in enumerate(values(run_ranks(_direct_back_to_back, world, 40_009, 60, kind))):
        assert path == "direct"
        assert bad == [], f"rank {rank}: wrong results at calls {bad[:10]}"


def _async(rank, world):
    import ringdp

    n = 100_003
    ts = [ringdp.empty(n) for _ in range(3)] + [torch.empty(n)]
    for k, t in enumerate(ts):
        t.copy_(value(rank, n, torch.float32, world=world) + k)
    works = [ringdp.all_reduce(t, async_op=True) for t in ts]
    done_flags = []
    results = []
    for w, t in zip(works, ts):
        assert w.wait() is True
        done_flags.append(w.is_completed())
        results.append(t.clone())
        t.fill_(-1e9)  # overwritten at once: a peer still reading this buffer would see it
    # a second, synchronous collective after the async ones, on the same buffers
    ts[0].copy_(torch.full((n,), float(rank)))
    ringdp.all_reduce(ts[0])
    ok = [torch.equal(r, expected("SUM", world, n, torch.float32) + world * k) for k, r in enumerate(results)]
    return done_flags, ok, float(ts[0][0]), float(ts[0][-1])


@pytest.mark.parametrize("world", [2, 4])
def test_async_then_overwrite(world):
    res = values(run_ranks(_async, world))
    want = float(sum(range(world)))
    for done, ok, first, last in res:
        assert done == [True] * 4
        assert ok == [True] * 4
        assert first == want and last == want


def _registered_views(rank, world):
    import ringdp

    base = ringdp.zeros(3, 1001)
    assert ringdp.is_registered(base) and ringdp.is_registered(base[1])
    assert not ringdp.is_registered(torch.zeros(10))
    base[1] = rank + 1.0
    ringdp.all_reduce(base[1])  # a contiguous view in registered memory
    assert ringdp.get_communicator().shm.arena_in_use > 0
    return float(base[1].sum()), float(base[0].sum()), float(base[2].sum())


def test_registered_views():
    res = values(run_ranks(_registered_views, 2))
    for row_sum, other0, other2 in res:
        assert row_sum == 1001 * 3.0
        assert other0 == 0 and other2 == 0


def _register_in_place(rank, world):
    """Communicator.register_in_place (in a 10 MiB arena) on what may move and what may not; a
    moved tensor's views follow it, its values stay, it all-reduces in place (closed form,
    twice), and freeing it gives the arena back. A move asked for while an async all-reduce
    of the tensor is still queued waits for it (queued: None)."""
    import ringdp

    comm = ringdp.get_communicator()
    t = torch.arange(4099, dtype=torch.float64) * (rank + 1)  # a prime count: no even split
    view = t[10:20]
    before, in_use = t.clone(), comm.shm.arena_in_use
    moved = comm.register_in_place(t)
    same = torch.equal(t, before) and torch.equal(view, before[10:20])
    reg = comm.is_registered(t) and comm.is_registered(view)
    grew = comm.shm.arena_in_use - in_use
    for _ in range(2):
        t.copy_(before)
        ringdp.all_reduce(t)
    summed = torch.equal(t, torch.arange(4099, dtype=torch.float64) * sum(range(1, world + 1)))
    view.fill_(-1.0)  # the view writes into the moved memory
    view_writes = float(t[10:20].sum())
    del t, view
    freed = comm.shm.arena_in_use == in_use
    # in flight: the move queued behind the first all-reduce, before the second
    u = torch.arange(1000003, dtype=torch.float64) * (rank + 1)  # 8 MB: the ring takes a while
    w1 = ringdp.all_reduce(u, async_op=True)
    queued = comm.register_in_place(u)
    w2 = ringdp.all_reduce(u, async_op=True)
    w1.wait()
    w2.wait()
    s = sum(range(1, world + 1))
    in_flight = {"queued": queued, "registered": comm.is_registered(u),
                 "exact": torch.equal(u, torch.arange(1000003, dtype=torch.float64) * s * world)}
    # a bfloat16 tensor moves too (a registered all_reduce of any dtype runs direct)
    h = (torch.arange(3001) % 13 + rank).to(torch.bfloat16)
    half = {"moved": comm.register_in_place(h)}
    ringdp.all_reduce(h, algo="ring")
    half["path"] = comm.flight_record()[-1]["path"]
    half["exact"] = torch.equal(h, ((torch.arange(3001) % 13) * world + sum(range(world))).to(torch.bfloat16))
    refused = {
        "again": comm.register_in_place(u),  # already registered
        "slice": comm.register_in_place(torch.zeros(8)[2:6]),  # not at the storage's start
        "prefix": comm.register_in_place(torch.zeros(8)[:4]),  # not the whole storage
        "strided": comm.register_in_place(torch.zeros(4, 4).t()),
        "empty": comm.register_in_place(torch.zeros(0)),
        "shared": comm.register_in_place(torch.zeros(8).share_memory_()),
        "bool": comm.register_in_place(torch.zeros(8, dtype=torch.bool)),
        "arena_full": comm.register_in_place(torch.zeros(1 << 22)),  # 16 MiB
    }
    return {"moved": moved, "same": same, "registered": reg, "grew": grew, "summed": summed,
            "view_writes": view_writes, "freed": freed, "in_flight": in_flight, "refused": refused,
            "half": half}


def test_register_in_place():
    for r, out in enumerate(values(run_ranks(_register_in_place, 3, env={"RINGDP_ARENA_GB": "0.01"}))):
        assert out["summed"] and out["same"] and out["view_writes"] == -10.0 and out["in_flight"]["exact"], (r, out)
        if not STORAGE_SWAP:  # (torch 2.11) it declines every tensor, and each stays where it was
            assert out["moved"] is False and out["in_flight"]["queued"] is False and out["half"]["moved"] is False
            assert not out["registered"] and out["grew"] == 0 and not out["in_flight"]["registered"], (r, out)
            continue
        assert out["moved"] is True and out["registered"], (r, out)
        assert out["grew"] >= 4099 * 8, (r, out)
        assert out["summed"], (r, out)
        assert out["view_writes"] == -10.0, (r, out)
        assert out["freed"], (r, out)
        assert out["in_flight"]["queued"] in (None, True), (r, out)
        assert out["in_flight"]["registered"] and out["in_flight"]["exact"], (r, out)
        assert not any(out["refused"].values()), (r, out["refused"])
        assert out["half"] == {"moved": True, "path": "direct", "exact": True}, (r, out["half"])


def _forced_algo(rank, world):
    import ringdp

    comm = ringdp.get_communicator()
    out = {}
    for algo in ("ring", "oneshot", "auto"):
        for count in (1, 1000, 70_001):  # 70_001 float32 > the 256 KiB one-shot buffer
            t = value(rank, count, torch.float32, world=world)
            paths = []
            for _ in range(2):
                t.copy_(value(rank, count, torch.float32, world=world))
                ringdp.all_reduce(t, algo=algo)
                rec = comm.flight_record()[-1]  # what the engine ran for this call
                paths.append((rec["kind"], rec["count"], rec["path"]))
            out[(algo, count)] = (comm.algo_for(4 * count, "cpu", algo),
                                  torch.equal(t, expected("SUM", world, count, torch.float32)), paths)
    try:
        ringdp.all_reduce(torch.ones(3), algo="fastest")
    except ValueError as e:
        out["bad"] = str(e)
    return out


@pytest.mark.parametrize("configured", [None, "ring", "oneshot"])
@pytest.mark.parametrize("world", [2, 3])
def test_algo_keyword(world, configured):
    """algo= forces the algorithm per call (what the benchmark uses instead of RINGDP_ALGO),
    whatever RINGDP_ALGO says; a forced one-shot falls back to the ring above its buffer
    (policy.choose_algo), and algo_for says so. The flight record shows what ran: an
    ordinary tensor's ring is ring_staged, one-shot is oneshot."""
    env = {"RINGDP_ALGO": configured} if configured else {}
    ran = {"ring": "ring_staged", "oneshot": "oneshot"}
    for out in values(run_ranks(_forced_algo, world, env=env)):
        assert all(v[1] for key, v in out.items() if key != "bad"), out
        assert out[("ring", 1)][0] == "ring" and out[("oneshot", 1)][0] == "oneshot"
        assert out[("oneshot", 70_001)][0] == "ring"
        assert out[("auto", 1)][0] == ("ring" if world == 2 else "oneshot")
        for count in (1, 1000, 70_001):
            assert out[("ring", count)][2] == [("all_reduce", count, "ring_staged")] * 2, (count, out)
        for count in (1, 1000):
            assert out[("oneshot", count)][2] == [("all_reduce", count, "oneshot")] * 2, (count, out)
        assert out[("oneshot", 70_001)][2] == [("all_reduce", 70_001, "ring_staged")] * 2, out
        for key, (decided, _, paths) in ((k, v) for k, v in out.items() if k != "bad"):
            assert [p[2] for p in paths] == [ran[decided]] * 2, (key, out)  # auto: as algo_for decided
        assert "fastest" in out["bad"]


def _future_releases_outputs(rank, world):
    import gc
    import time
    import weakref

    import ringdp

    gc.disable()  # only reference counting: a reference cycle would keep the tensor alive
    try:
        out = []
        for _ in range(2):
            t = torch.ones(1000)
            ref = weakref.ref(t)
            fut = ringdp.all_reduce(t, async_op=True).get_future()
            v = fut.wait()[0]
            out.append((v is t, torch.equal(v, torch.full((1000,), float(world)))))
            del t, v, fut
            deadline = time.monotonic() + 2.0  # the worker thread lets go of its last item
            while ref() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            out.append(ref() is None)
    finally:
        gc.enable()
    return out


def test_work_future_value_and_no_lingering_tensors():
    """Work.get_future() completes with the output tensors, and once the caller drops it the
    tensors go (RingDDP reduces a whole step's .grad this way: a reference cycle kept them
    alive until the next garbage collection, and every step paid fresh page faults)."""
    for out in values(run_ranks(_future_releases_outputs, 2)):
        assert out == [(True, True), True, (True, True), True], out


NAN_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _nan_min_max(rank, world):
    """MIN and MAX with NaNs on some ranks: ring, one-shot and direct (registered), all_reduce
    and reduce_scatter, each against fmin/fmax over every rank's input (a NaN ignored unless
    every rank has one), and bitwise identical across ranks."""
    import torch.distributed as dist

    import ringdp

    comm = ringdp.get_communicator()
    out = []
    for op in ("MIN", "MAX"):
        rop = getattr(dist.ReduceOp, op)
        for dtype in NAN_DTYPES:
            for n in (1, 7, 4099, BIG):
                want = nan_expected(op, world, n, dtype)
                for how in ("ring", "oneshot", "registered"):
                    if how == "oneshot" and n * 4 > comm.shm.oneshot_bytes:
                        continue
                    t = ringdp.empty(n, dtype=dtype) if how == "registered" else torch.empty(n, dtype=dtype)
                    t.copy_(nan_input(rank, world, n, dtype))
                    ringdp.all_reduce(t, op=rop, algo="oneshot" if how == "oneshot" else "ring")
                    path = comm.flight_record()[-1]["path"]
                    out.append(("all_reduce", op, str(dtype), n, how, path, same_with_nan(t, want), digest(t)))
                res = torch.empty(n, dtype=dtype)
                comm.reduce_scatter_tensor(res, torch.cat([nan_input(rank, world, n, dtype)] * world), op=rop)
                out.append(("reduce_scatter", op, str(dtype), n, "-", "-", same_with_nan(res, want), None))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_min_max_ignore_nan_like_nccl(world):
    """A NaN is ignored unless every rank has one there (IEEE fmin/fmax, NCCL's rule). Before,
    a NaN survived only where its rank's value was the partial the kernel started from, so
    whether it showed depended on the index and on the rank's place in the ring."""
    res = values(run_ranks(_nan_min_max, world))
    paths = {how: {row[5] for row in res[0] if row[4] == how} for how in ("ring", "oneshot", "registered")}
    assert paths == {"ring": {"ring_staged"}, "oneshot": {"oneshot"}, "registered": {"direct"}}, paths
    for rank, rows in enumerate(res):
        bad = [row[:6] for row in rows if not row[6]]
        assert not bad, (rank, bad)
    for k, row in enumerate(res[0]):  # bitwise identical on every rank
        assert all(rows[k][7] == row[7] for rows in res), row[:6]
