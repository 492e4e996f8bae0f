"""reduce_scatter_tensor, all_gather_into_tensor and broadcast on CPU (shared-memory transport).

Inputs depend on rank and index (tests/_closed_form.py's v(r, i) = (i % 13) + 2((r + i) % n)), so
every dtype holds the exact results:
    reduce_scatter: rank q's input is v(q, i) for i < n*k; rank r's output is
                    expected(op, n, n*k)[r*k:(r+1)*k] (the all-reduce's block r)
    all_gather:     rank q's input is (i % 13) + 3q; output block q is rank q's input
    broadcast:      rank src's tensor is v(src, i) + 1, the others start at -1
Every collective runs twice in a row (reduce_scatter: the second time in place, into the
input's block), on ordinary and registered tensors (reduce_scatter: the input), with the
default, tiny-slot ring and one-shot configurations.
"""
import hashlib
import os
import signal
import time
from collections import Counter, deque

import pytest
import torch

from _closed_form import expected, ops_for, value
from _dist import cyclic_garbage, run_ranks, values

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 13, 4099]  # elements per rank (reduce_scatter's output, all_gather's input)
BIG = 300_007  # prime, several pipeline rounds

CONFIGS = {
    "default": {},
    # tiny slots, two per connection: many rounds, back-pressure on every step
    "tiny-ring": {"RINGDP_SLOT_BYTES": "4096", "RINGDP_FIFO_SLOTS": "2", "RINGDP_ALGO": "ring"},
    "oneshot": {"RINGDP_ALGO": "oneshot"},  # falls back to the ring above its buffer
}


def _gather_input(rank, count, dtype):
    return (torch.arange(count) % 13 + 3 * rank).to(dtype)


def _matrix(rank, world, sizes, dtypes, kinds=("rs", "ag", "bc"), registered_too=True):
    import torch.distributed as dist

    import ringdp

    bad, checked = [], 0

    def alloc(n, dtype, registered):
        return ringdp.empty(n, dtype=dtype) if registered else torch.empty(n, dtype=dtype)

    for dtype in dtypes:
        for k in sizes:
            for registered in (False, True) if registered_too else (False,):
                if "rs" in kinds:
                    full = value(rank, world * k, dtype, world=world)
                    mine = slice(rank * k, (rank + 1) * k)
                    for op in ops_for(dtype):
                        exp = expected(op, world, world * k, dtype)[mine]
                        for rep in range(2):
                            inp = alloc(world * k, dtype, registered)
                            inp.copy_(full)
                            # rep 1: in place, the output is the input's block `rank` (as the
                            # two-level path across hosts calls it), by torch 2.13's name
                            out = torch.full((k,), -7, dtype=dtype) if rep == 0 else inp[mine]
                            call = ringdp.reduce_scatter_tensor if rep == 0 else ringdp.reduce_scatter_single
                            call(out, inp, op=getattr(dist.ReduceOp, op))
                            checked += 1
                            # the input is not modified (in place: but for the output)
                            want_in = full.clone()
                            if rep == 1:
                                want_in[mine] = exp
                            intact = torch.equal(inp, want_in)
                            if not torch.equal(out, exp) or not intact:
                                bad.append(("rs", str(dtype), op, k, registered, rep, intact))
                if "ag" in kinds:
                    exp = torch.cat([_gather_input(q, k, dtype) for q in range(world)])
                    for rep in range(2):
                        out = alloc(world * k, dtype, registered).fill_(-1)
                        inp = _gather_input(rank, k, dtype)
                        if rep == 1:  # in place: the input is the output's block `rank`
                            inp = out[rank * k:(rank + 1) * k]
                            inp.copy_(_gather_input(rank, k, dtype))
                        (ringdp.all_gather_into_tensor if rep == 0 else ringdp.all_gather_single)(out, inp)
                        checked += 1
                        if not torch.equal(out, exp):
                            bad.append(("ag", str(dtype), k, registered, rep))
                if "bc" in kinds:
                    for rep in range(2):
                        src = (k + rep) % world
                        exp = value(src, k, dtype, world=world) + 1
                        t = alloc(k, dtype, registered)
                        t.copy_(exp if rank == src else torch.full((k,), -1, dtype=dtype))
                        ringdp.broadcast(t, src)
                        checked += 1
                        if not torch.equal(t, exp):
                            bad.append(("bc", str(dtype), k, registered, src))
    return checked, bad


def _check(res):
    for rank, (checked, bad) in enumerate(values(res)):
        assert checked > 0
        assert bad == [], f"rank {rank}: {bad[:10]}"


@pytest.mark.parametrize("world,config", [(1, "default")] + [(w, c) for w in (2, 3, 4) for c in CONFIGS])
def test_matrix(world, config):
    # (world 1 moves no data: one configuration is enough)
    if world == 4 and config != "default":
        dtypes = [torch.float32, torch.bfloat16, torch.int64]  # (keep the time modest on 2 cores)
    else:
        dtypes = DTYPES
    _check(run_ranks(_matrix, world, SIZES, dtypes, env=CONFIGS[config], timeout=300))


@pytest.mark.parametrize("world", [3])
def test_big_prime_size(world):
    # rs: 300_007 per rank (world x that in), ag likewise, bc 300_007
    _check(run_ranks(_matrix, world, [BIG], [torch.float32, torch.bfloat16], timeout=300))


def _random(rank, world, count, dtype, registered):
    """Random values: rounding depends on the order of the reduction, so equal bytes on every
    rank show one rank reduced each block once and the others copied it."""
    import ringdp

    g = torch.Generator().manual_seed(99 + rank)
    inp = torch.randn(world * count, generator=g, dtype=torch.float64).to(dtype)
    out = torch.empty(count, dtype=dtype)
    ringdp.reduce_scatter_tensor(out, ringdp.empty(world * count, dtype=dtype).copy_(inp) if registered else inp)
    full = ringdp.empty(world * count, dtype=dtype) if registered else torch.empty(world * count, dtype=dtype)
    ringdp.all_gather_into_tensor(full, out)
    ref = inp.clone()
    ringdp.all_reduce(ref)  # a different order of additions: close, maybe not equal
    close = torch.allclose(full.double(), ref.double(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
    mine = torch.equal(full[rank * count:(rank + 1) * count], out)
    bc = ringdp.empty(count, dtype=dtype) if registered else torch.empty(count, dtype=dtype)
    bc.copy_(inp[:count])
    ringdp.broadcast(bc, world - 1)
    digest = lambda t: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()  # noqa: E731
    return digest(full), digest(bc), close, mine


@pytest.mark.parametrize("dtype,registered", [(torch.float32, True), (torch.bfloat16, False)])
def test_bitwise_identical_across_ranks(dtype, registered):
    res = values(run_ranks(_random, 3, 100_003, dtype, registered))
    assert all(r[0] == res[0][0] and r[1] == res[0][1] for r in res), res
    assert all(r[2] and r[3] for r in res), res


def _async(rank, world):
    import ringdp

    k = 50_001
    outs = [torch.empty(k) for _ in range(2)] + [ringdp.empty(world * k)]
    ins = ([value(rank, world * k, torch.float32, world=world) + j for j in range(2)]
           + [value(rank, k, torch.float32, world=world)])
    bc = ringdp.empty(k)
    bc.fill_(float(rank))
    works = [ringdp.reduce_scatter_tensor(outs[j], ins[j], async_op=True) for j in range(2)]
    works.append(ringdp.all_gather_into_tensor(outs[2], ins[2], async_op=True))
    works.append(ringdp.broadcast(bc, 1, async_op=True))
    ar = torch.full((k,), 1.0)
    works.append(ringdp.all_reduce(ar, async_op=True))
    fut = works[0].get_future()
    ok = []
    for w in works:
        assert w.wait() is True
        ok.append(w.is_completed() and w.is_success())
    exp_rs = expected("SUM", world, world * k, torch.float32)[rank * k:(rank + 1) * k]
    ok.append(torch.equal(outs[0], exp_rs))
    ok.append(torch.equal(outs[1], exp_rs + world))
    ok.append(torch.equal(outs[2], torch.cat([value(q, k, torch.float32, world=world) for q in range(world)])))
    ok.append(torch.equal(bc, torch.full((k,), 1.0)))
    ok.append(torch.equal(ar, torch.full((k,), float(world))))
    ok.append(fut.wait()[0] is outs[0])

    big = torch.ones(1 << 18)  # (queued on the worker: its future is made before it completes)

    def calls():  # each kind of call again: none leaves a reference cycle behind
        ringdp.all_reduce(big, async_op=True).get_future().wait()
        ringdp.reduce_scatter_tensor(outs[0], ins[0])
        ringdp.all_gather_into_tensor(outs[2], ins[2], async_op=True).wait()
        ringdp.broadcast(bc, 0, async_op=True).get_future().wait()
        ringdp.all_reduce(ar, async_op=True).wait()
        ringdp.all_reduce(ar)

    ok.append(cyclic_garbage(calls) == [])
    # overwrite at once; a second round on the same buffers must not see stale reads
    for t in outs + [bc]:
        t.fill_(-1e9)
    bc.fill_(rank + 7.0)  # a different value on every rank: only rank 0's may be left
    ringdp.broadcast(bc, 0)
    ok.append(torch.equal(bc, torch.full((k,), 7.0)))
    return ok


@pytest.mark.parametrize("world", [3])
def test_async_op(world):
    for ok in values(run_ranks(_async, world)):
        assert all(ok), ok


def _small_async(rank, world):
    """Small asynchronous collectives (policy.inline_async): run on the calling thread when
    nothing is queued (a completed Work comes back, no worker thread exists yet), behind
    the queue otherwise, with the same values; a failure is raised by wait(), not the call."""
    import threading

    import ringdp

    def worker_started():
        return any(t.name.startswith("ringdp-worker") for t in threading.enumerate())

    out = {}
    k = 1001  # elements per rank: 4 KiB, and prime-ish
    for rep in range(2):  # each twice in a row
        ar = value(rank, world * k, torch.float32, world=world)
        rs_out, ag_out, bc = torch.empty(k), torch.empty(world * k), torch.full((k,), -1.0)
        if rank == world - 1:
            bc.copy_(value(rank, k, torch.float32, world=world) + 1)
        works = [ringdp.all_reduce(ar, async_op=True),
                 ringdp.reduce_scatter_tensor(rs_out, value(rank, world * k, torch.float32, world=world), async_op=True),
                 ringdp.all_gather_into_tensor(ag_out, _gather_input(rank, k, torch.float32), async_op=True),
                 ringdp.broadcast(bc, world - 1, async_op=True)]
        out[f"completed at return {rep}"] = [w.is_completed() for w in works]
        assert all(w.wait() for w in works)
        out[f"values {rep}"] = [
            torch.equal(ar, expected("SUM", world, world * k, torch.float32)),
            torch.equal(rs_out, expected("SUM", world, world * k, torch.float32)[rank * k:(rank + 1) * k]),
            torch.equal(ag_out, torch.cat([_gather_input(q, k, torch.float32) for q in range(world)])),
            torch.equal(bc, value(world - 1, k, torch.float32, world=world) + 1)]
    out["worker after small calls"] = worker_started()
    # a small call behind a large one queued on the worker: it waits its turn, in order
    big, small = torch.full((1 << 20,), float(rank)), torch.full((k,), float(rank))
    w_big = ringdp.all_reduce(big, async_op=True)
    w_small = ringdp.all_reduce(small, async_op=True)
    w_small.wait()
    out["in order"] = [w_big.is_completed(), torch.equal(small, torch.full((k,), float(sum(range(world))))),
                       torch.equal(big, torch.full((1 << 20,), float(sum(range(world)))))]
    w_big.wait()
    # ranks disagree on the count: the call returns, wait() raises, the communicator goes on
    w = ringdp.all_reduce(torch.ones(k + rank), async_op=True)
    try:
        w.wait()
        out["mismatch"] = "no error"
    except ringdp.RingError as e:
        out["mismatch"] = str(e)
    t = torch.full((k,), 1.0)
    ringdp.all_reduce(t)
    out["after"] = torch.equal(t, torch.full((k,), float(world)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_small_async_runs_inline(world):
    """RINGDP_INLINE_ASYNC_MAX_BYTES (off by default)."""
    for r, out in enumerate(values(run_ranks(_small_async, world, env={"RINGDP_INLINE_ASYNC_MAX_BYTES": "262144"}))):
        for rep in range(2):
            assert out[f"completed at return {rep}"] == [True] * 4, (r, out)
            assert out[f"values {rep}"] == [True] * 4, (r, out)
        assert not out["worker after small calls"], f"rank {r}: a small call went through the worker"
        assert out["in order"] == [True, True, True], (r, out)
        assert "ranks disagree on the call" in out["mismatch"] and f"{1001 + r} x float32" in out["mismatch"], (r, out)
        assert out["after"], (r, out)


def _async_then_send(rank, world):
    """Rank 0 issues an async all-reduce, then sends to rank 1, which receives before its
    own all-reduce: legal with torch.distributed (an async call returns at once), and so
    with ringdp by default (the call goes to the worker); with RINGDP_INLINE_ASYNC_MAX_BYTES
    the small call would wait for rank 1, which waits for the send."""
    import threading

    import torch.distributed as dist

    import ringdp

    ringdp.init()  # (set-up is collective)
    t = torch.full((5,), float(rank))
    x = torch.zeros(3)
    if rank == 0:
        w = ringdp.all_reduce(t, async_op=True)
        dist.send(torch.tensor([1.0, 2.0, 3.0]), 1)
        w.wait()
    else:
        dist.recv(x, 0)
        ringdp.all_reduce(t)
    worker = any(th.name.startswith("ringdp-worker") for th in threading.enumerate())
    return torch.equal(t, torch.full((5,), 1.0)), x.tolist(), worker


def _collective_in_a_callback(rank, world):
    """A collective made in a future's callback that ringdp's worker runs (torch's PowerSGD
    hook does this) runs there at once; a synchronous call that another thread makes
    meanwhile waits for it. Rank 0's main thread calls while its callback runs, rank 1's
    after: without the wait the two ranks would run the two calls in opposite orders."""
    import threading

    import ringdp

    in_callback, where = threading.Event(), []
    nested, plain = torch.full((5,), float(rank)), torch.full((7,), float(rank))
    ringdp.all_reduce(torch.ones(1))  # (set up first: the set-up waits for every rank)
    if rank == 1:
        time.sleep(0.3)  # (rank 0's callback is in place before its call ends: on its worker)

    def callback(f):
        where.append(threading.current_thread().name)
        in_callback.set()
        time.sleep(0.3)
        return ringdp.all_reduce(nested, async_op=True).get_future().wait()[0]

    chained = ringdp.all_reduce(torch.ones(1 << 18), async_op=True).get_future().then(callback)
    if rank == 0:
        assert in_callback.wait(30)
    else:
        chained.wait()
    ringdp.all_reduce(plain)
    total = float(sum(range(world)))
    return where, torch.equal(chained.wait(), torch.full((5,), total)), torch.equal(plain, torch.full((7,), total))


def test_collective_in_a_callback():
    res = values(run_ranks(_collective_in_a_callback, 2, timeout=120))
    assert res[0][0][0].startswith("ringdp-worker"), res[0]
    assert all(ok_nested and ok_plain for _, ok_nested, ok_plain in res), res


def _wait_in_a_callback(rank, world):
    """A callback on ringdp's worker that waits for calls queued after the one it follows
    (Work.wait() and a Work's torch future): the worker runs them there, in queue order,
    instead of waiting for itself (it hung). Rank 1 arrives late, so that rank 0's callback
    is in place before its call ends and runs on its worker."""
    import threading

    import ringdp

    ringdp.all_reduce(torch.ones(1))  # (set up first: the set-up waits for every rank)
    later, where = [torch.full((11 + i,), float(rank * (i + 1))) for i in range(3)], []
    if rank == 1:
        time.sleep(0.3)
    head = ringdp.all_reduce(torch.ones(1 << 18), async_op=True)
    tail = [ringdp.all_reduce(x, async_op=True) for x in later]

    def callback(f):
        where.append(threading.current_thread().name)
        tail[1].wait()  # (two queued calls run here)
        return tail[2].get_future().wait()[0][:11] + later[0]

    chained = head.get_future().then(callback)
    value = chained.wait()
    after = torch.full((3,), float(rank))
    ringdp.all_reduce(after)  # (the communicator goes on)
    return where, value, later, after


def test_wait_in_a_callback():
    res = values(run_ranks(_wait_in_a_callback, 2, timeout=120))
    n = 1.0  # sum of the ranks
    assert res[0][0][0].startswith("ringdp-worker"), res[0][0]
    for where, value, later, after in res:
        assert torch.equal(value, torch.full((11,), 3 * n + n)), value
        for i, x in enumerate(later):
            assert torch.equal(x, torch.full((11 + i,), n * (i + 1))), (i, x)
        assert torch.equal(after, torch.full((3,), n))


def test_async_returns_before_peers_arrive():
    res = values(run_ranks(_async_then_send, 2, env={"RINGDP_TIMEOUT_S": "30"}, timeout=90))
    assert res[0][0] and res[1][0], res
    assert res[1][1] == [1.0, 2.0, 3.0], res
    assert res[0][2], "rank 0's async call did not go through the worker"


def _kind_mismatch(rank, world):
    import ringdp

    out = []
    try:
        if rank == 0:
            ringdp.reduce_scatter_tensor(torch.empty(10), torch.ones(10 * world))
        else:
            ringdp.all_gather_into_tensor(torch.empty(10 * world), torch.ones(10))
        out.append("no error")
    except ringdp.RingError as e:
        out.append(str(e))
    try:  # broadcast from different sources
        ringdp.broadcast(torch.ones(5), src=rank % 2)
        out.append("no error")
    except ringdp.RingError as e:
        out.append(str(e))
    # the communicator is still usable: both ranks agree now
    t = torch.ones(10)
    ringdp.broadcast(t.fill_(rank + 5.0), src=1)
    out.append(float(t.sum()))
    return out


def test_kind_mismatch_raises_on_every_rank(pool):
    for rank, (mismatch, roots, after) in enumerate(pool.run(_kind_mismatch)):
        assert f"rank {rank}:" in mismatch and "different collectives" in mismatch, mismatch
        assert "reduce_scatter #" in mismatch and "all_gather #" in mismatch, mismatch
        assert "disagree" in roots and "from rank 0" in roots and "from rank 1" in roots, roots
        assert after == 60.0


def _bad_args(rank, world):
    import ringdp

    errors = []
    base = torch.zeros(3 * world + 1)
    shared = base[:3 * world]
    calls = [
        lambda: ringdp.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world + 1)),  # size
        lambda: ringdp.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world, dtype=torch.float64)),  # dtype
        lambda: ringdp.reduce_scatter_tensor(torch.empty(3, dtype=torch.int32), torch.empty(3 * world, dtype=torch.int32),
                                             op="avg"),  # AVG of ints
        lambda: ringdp.all_gather_into_tensor(torch.empty(3 * world + 2), torch.empty(3)),  # size
        lambda: ringdp.all_gather_into_tensor(torch.empty(6 * world)[::2], torch.empty(3)),  # non-contiguous
        lambda: ringdp.all_gather_into_tensor(torch.empty(3 * world), [1, 2, 3]),  # not a tensor
        lambda: ringdp.broadcast(torch.empty(3), world),  # src out of range
        lambda: ringdp.broadcast(torch.empty(3), -1),
        lambda: ringdp.broadcast(torch.empty(3), "0"),
        lambda: ringdp.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world), op=torch.distributed.ReduceOp.PRODUCT),
        lambda: ringdp.reduce_scatter_tensor(shared[1:4], shared),  # the output overlaps the input, not as its block
        lambda: ringdp.all_gather_into_tensor(shared, base[3 * rank + 1:3 * rank + 4]),  # likewise the input
    ]
    for c in calls:
        try:
            c()
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append((type(e).__name__, str(e)))
    out = torch.empty(4)
    ringdp.reduce_scatter_tensor(out, torch.full((4 * world,), float(rank)))  # still usable
    return errors, out.tolist()


def test_bad_arguments_are_clear_errors(pool):
    for errors, out in pool.run(_bad_args):
        kinds = [e[0] if e else None for e in errors]
        assert kinds == ["ValueError", "TypeError", "TypeError", "ValueError", "ValueError", "TypeError",
                         "ValueError", "ValueError", "TypeError", "ValueError", "ValueError", "ValueError"], errors
        assert "expected output.numel() x world size" in errors[0][1]
        assert "differs from input dtype" in errors[1][1]
        assert "contiguous" in errors[4][1]
        assert "src=2 is not a rank" in errors[6][1]
        assert "the output overlaps the input other than as its block" in errors[10][1], errors[10]
        assert "the input overlaps the output other than as its block" in errors[11][1], errors[11]
        assert out == [1.0] * 4


def _bad_on_one_rank(rank, world):
    import ringdp

    t0 = time.monotonic()
    try:
        if rank == 0:
            ringdp.reduce_scatter_tensor(torch.empty(3), torch.empty(5))
        else:
            ringdp.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world))
    except (ValueError, ringdp.RingError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None


def test_bad_input_on_one_rank_fails_the_peer_fast(pool):
    (k0, m0, _), (k1, m1, t1) = pool.run(_bad_on_one_rank)
    assert k0 == "ValueError"
    assert k1 == "RingError" and "rank 0 rejected its input" in m1 and t1 < 10, m1


def _peer_killed(rank, world, kind):
    import threading

    import ringdp

    ringdp.init(timeout=60)
    k = 1_000_000
    inp, out = torch.ones(world * k), torch.empty(k)
    big = torch.empty(world * k)

    def call():
        if kind == "rs":
            ringdp.reduce_scatter_tensor(out, inp)
        elif kind == "ag":
            ringdp.all_gather_into_tensor(big, out)
        else:
            ringdp.broadcast(big, 0)

    call()  # one good call first
    if rank == world - 1:
        threading.Timer(0.005, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            call()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:
            call()
        return None
    except ringdp.RingError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.parametrize("kind", ["rs", "ag", "bc"])
def test_sigkilled_peer(kind):
    world = 3
    res = run_ranks(_peer_killed, world, kind, allow_missing=(world - 1,), timeout=120)
    name = {"rs": "reduce_scatter", "ag": "all_gather", "bc": "broadcast"}[kind]
    for rank in range(world - 1):
        status, v = res[rank]
        assert status == "ok", v
        assert v is not None, "the survivor never noticed"
        msg, took = v
        assert f"rank {rank}:" in msg and ("died" in msg or "aborted" in msg), msg
        assert name in msg, msg
        assert took < 30


def _torch_arguments(rank, world):
    """ringdp's collectives called with torch.distributed's argument names (world 3; a group
    of ranks 1 and 2, whose group ranks are 0 and 1)."""
    import torch.distributed as dist

    import ringdp

    out = {}
    o = torch.empty(3 * world)
    ringdp.all_gather_into_tensor(output_tensor=o, input_tensor=torch.full((3,), rank + 0.5))
    o2 = torch.empty(2 * world)
    ringdp.all_gather_single(output_tensor=o2, input_tensor=torch.full((2,), rank + 0.25), async_op=True).wait()
    out["gathered"] = (o.tolist(), o2.tolist())
    t = torch.full((4,), float(rank))
    ringdp.broadcast(t, group_src=world - 1)  # the default group: group rank = global rank
    out["default group_src"] = t.tolist()
    sub = dist.new_group([1, 2])  # (every rank makes it)
    if rank in (1, 2):
        results = []
        for kwargs in ({"src": 2}, {"group_src": 0}, {"group_src": 1}, {"src": 1}):
            t = torch.full((5,), rank * 10.0)
            ringdp.broadcast(t, group=sub, async_op=True, **kwargs).wait()
            results.append(t.tolist())
        errors = []
        for kwargs in ({"src": 2, "group_src": 1}, {}, {"src": 0}):  # both, neither, a global rank not in it
            try:
                ringdp.broadcast(torch.ones(3), group=sub, **kwargs)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        t = torch.full((2,), rank * 1.0)
        ringdp.broadcast(t, 2, sub)  # still usable; positional as torch's
        out["group"] = (results, errors, t.tolist())
    return out


def test_torch_argument_names():
    """all_gather_into_tensor/all_gather_single(output_tensor=, input_tensor=) and
    broadcast(src= a global rank | group_src= a rank of the group), as torch.distributed
    takes them: results against closed forms; both roots, none, or a src outside the group
    are ValueErrors naming the rank (the group's), and the group stays usable."""
    world = 3
    res = values(run_ranks(_torch_arguments, world, timeout=120))
    for rank, out in enumerate(res):
        gathered, gathered2 = out["gathered"]
        assert gathered == [q + 0.5 for q in range(world) for _ in range(3)], gathered
        assert gathered2 == [q + 0.25 for q in range(world) for _ in range(2)], gathered2
        assert out["default group_src"] == [world - 1.0] * 4
        if rank == 0:
            assert "group" not in out
            continue
        results, errors, last = out["group"]
        assert results == [[20.0] * 5, [10.0] * 5, [20.0] * 5, [10.0] * 5], results
        me = f"on rank {rank - 1}:"  # (the group's rank, as ringdp's messages about a group name them)
        assert errors[0] is not None and me in errors[0] and "not both" in errors[0], errors
        assert errors[1] is not None and me in errors[1] and "root is missing" in errors[1], errors
        assert errors[2] is not None and "src=0 is a global rank outside the group (its global ranks: [1, 2])" \
            in errors[2], errors
        assert last == [2.0, 2.0]


def _flight(rank, world):
    import ringdp

    ringdp.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world), tag="rs")
    ringdp.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2), tag="ag")
    ringdp.broadcast(torch.ones(2), 0, tag="bc")
    return [(r["kind"], r["tag"], r["status"]) for r in ringdp.get_communicator().flight_record()[-3:]]


def test_flight_record_names_the_kinds(pool):
    for rec in pool.run(_flight):
        assert rec == [("reduce_scatter", "rs", "ok"), ("all_gather", "ag", "ok"), ("broadcast", "bc", "ok")]


# ---- the schedule, without processes: replay the engine's traces -------------------------
def _replay(kind, count, n, slice_elems, root=0):
    """Run every rank's trace of `kind` against FIFOs between neighbours; returns, per rank,
    what each element of its result holds: how many times each rank was reduced into it (a
    Counter, reduce_scatter: a rank reduced twice, or never, shows), or the rank whose data
    it is (all_gather, broadcast)."""
    from ringdp._native import _C

    traces = [deque(_C.collective_trace(kind, count, n, r, slice_elems, 1, root)) for r in range(n)]
    fifo = [deque() for _ in range(n)]  # fifo[r]: slices r received from r-1, oldest first
    size = count * n if kind in ("reduce_scatter", "all_gather") else count
    if kind == "reduce_scatter":
        data = [[Counter({r: 1})] * size for r in range(n)]  # (never changed in place: + makes a new one)
        result = [[None] * count for _ in range(n)]
    elif kind == "all_gather":
        data = [[i // count if i // count == r else None for i in range(size)] for r in range(n)]
    else:
        data = [[root if r == root else None] * size for r in range(n)]
    progress = True
    while progress:
        progress = False
        for r in range(n):
            while traces[r]:
                prim, off, cnt = traces[r][0]
                if prim == "finish":
                    traces[r].popleft()
                    continue
                nxt = fifo[(r + 1) % n]
                if prim.startswith("recv"):
                    if not fifo[r]:
                        break
                    o2, c2, vals = fifo[r].popleft()
                    assert (o2, c2) == (off, cnt), (kind, r, prim, off, cnt, o2, c2)
                traces[r].popleft()
                progress = True
                seg = range(off, off + cnt)
                if prim in ("send", "copy_send"):
                    nxt.append((off, cnt, [data[r][i] for i in seg]))
                elif prim == "recv_reduce_send":
                    nxt.append((off, cnt, [v + data[r][i] for v, i in zip(vals, seg)]))
                elif prim == "recv_reduce_copy":
                    for v, i in zip(vals, seg):
                        result[r][i - r * count] = v + data[r][i]
                elif prim in ("recv_copy_send", "recv"):
                    for v, i in zip(vals, seg):
                        data[r][i] = v
                    if prim == "recv_copy_send":
                        nxt.append((off, cnt, vals))
    assert all(not t for t in traces), "deadlock in the schedule"
    assert all(not f for f in fifo), "slices sent and never received"
    return result if kind == "reduce_scatter" else data


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("count,slice_elems", [(0, 4), (1, 4), (7, 2), (13, 4), (10, 100)])
def test_schedule_replay(n, count, slice_elems):
    everyone = Counter(range(n))  # every rank reduced in exactly once
    if n > 1:
        rs = _replay("reduce_scatter", count, n, slice_elems)
        assert all(v == everyone for r in range(n) for v in rs[r]), rs
    ag = _replay("all_gather", count, n, slice_elems)
    assert all(ag[r] == [i // count for i in range(n * count)] for r in range(n)), ag
    for root in range(n):
        bc = _replay("broadcast", count, n, slice_elems, root)
        assert all(bc[r] == [root] * count for r in range(n)), bc
