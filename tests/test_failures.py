"""Failures end in exceptions on every surviving rank, within the timeout, naming the
rank and the problem; nothing is left in /dev/shm."""
import contextlib
import os
import signal
import time

import pytest
import torch

from _dist import run_ranks, values

SLACK_S = 5.0  # detection happens within a few ms; this is slack for a loaded CI machine


def _shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("ringdp-")}


def _mismatch(rank, world, kind):
    import ringdp

    if kind == "size":
        t = torch.ones(1000 + rank)
    elif kind == "dtype":
        t = torch.ones(1000, dtype=torch.float32 if rank == 0 else torch.float64)
    else:  # op
        t = torch.ones(1000)
    op = torch.distributed.ReduceOp.SUM if (kind != "op" or rank == 0) else torch.distributed.ReduceOp.MAX
    t0 = time.monotonic()
    try:
        ringdp.all_reduce(t, op=op, timeout=30)
        err = None
    except ringdp.RingError as e:
        err = str(e)
    took = time.monotonic() - t0
    # The communicator survives a mismatch: the next, matching call works.
    u = torch.full((10,), float(rank))
    ringdp.all_reduce(u)
    return err, took, u.tolist()


@pytest.mark.parametrize("kind", ["size", "dtype", "op"])
def test_mismatch_raises_on_every_rank(kind):
    res = values(run_ranks(_mismatch, 3, kind))
    for rank, (err, took, after) in enumerate(res):
        assert err is not None, f"rank {rank} did not raise"
        assert f"rank {rank}:" in err and "disagree" in err
        assert "rank 0:" in err and "rank 1:" in err and "rank 2:" in err
        assert took < SLACK_S
        assert after == [3.0] * 10


def _bad_input(rank, world, what):
    import ringdp

    t = torch.ones(8, 8)
    t0 = time.monotonic()
    try:
        if rank == 1 and what == "layout":
            ringdp.all_reduce(t.t(), timeout=30)  # not contiguous
        elif rank == 1:
            ringdp.all_reduce(t, timeout=0)  # a bad timeout is bad input too
        else:
            ringdp.all_reduce(t, timeout=30)
        return None
    except (ValueError, ringdp.RingError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0


@pytest.mark.parametrize("what,why", [("layout", "contiguous"), ("timeout", "timeout must be positive")])
def test_bad_input_on_one_rank_fails_all_ranks_fast(what, why):
    res = values(run_ranks(_bad_input, 2, what))
    assert res[1][0] == "ValueError" and why in res[1][1]
    assert res[0][0] == "RingError" and "rank 1 rejected its input" in res[0][1] and why in res[0][1], res[0]
    assert res[0][2] < SLACK_S, res[0]  # at once, not after its 30 s


def _bad_args(rank, world):
    import ringdp

    errors = []
    for call in (
        lambda: ringdp.all_reduce(torch.ones(4, dtype=torch.uint8)),
        lambda: ringdp.all_reduce(torch.ones(4, dtype=torch.int32), op=torch.distributed.ReduceOp.AVG),
        lambda: ringdp.all_reduce(torch.ones(4), op=torch.distributed.ReduceOp.PRODUCT),
        lambda: ringdp.all_reduce([1, 2, 3]),
    ):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(type(e).__name__)
    t = torch.ones(5)
    ringdp.all_reduce(t)  # still in step after four rejected calls
    return errors, t.tolist()


def test_bad_arguments_are_clear_errors():
    for errors, t in values(run_ranks(_bad_args, 2)):
        assert errors == ["TypeError", "TypeError", "ValueError", "TypeError"]
        assert t == [2.0] * 5


def _peer_killed(rank, world, count, when, tensors):
    import threading

    import ringdp

    comm = ringdp.init(timeout=60)
    names = [f"{comm.shm.name}"]
    # "mixed": rank 0 registered, the others not (the staged ring); "registered": every rank
    # (the direct all-reduce)
    t = ringdp.empty(count) if rank == 0 or tensors == "registered" else torch.ones(count)
    t.fill_(1.0)
    ringdp.all_reduce(t)  # one good call first
    path = comm.flight_record()[-1]["path"]
    if rank == world - 1:
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.005, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            ringdp.all_reduce(t)
    t0 = time.monotonic()
    try:
        while True:
            ringdp.all_reduce(t)
            if time.monotonic() - t0 > 60:
                return None
    except ringdp.RingError as e:
        return str(e), time.monotonic() - t0, names, path


@pytest.mark.parametrize("tensors", ["mixed", "registered"])
@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("world", [2, 3])
def test_sigkilled_peer(world, when, tensors):
    dead = world - 1
    res = run_ranks(_peer_killed, world, 4_000_000, when, tensors, allow_missing=(dead,), timeout=120)
    for rank in range(world - 1):
        status, value = res[rank]
        assert status == "ok", value
        assert value is not None, "the survivor never noticed"
        msg, took, names, path = value
        assert path == {"mixed": "ring_staged", "registered": "direct"}[tensors]
        assert f"rank {rank}:" in msg
        assert "died" in msg or "aborted" in msg
        assert took < SLACK_S
    leftovers = [n for n in _shm_names() if any(n == nm.lstrip("/") for nm in res[0][1][2])]
    assert leftovers == []


def _never_arrives(rank, world):
    import ringdp

    ringdp.init()
    if rank == 1:
        time.sleep(4)  # alive, but never joins the collective
        return None
    t0 = time.monotonic()
    try:
        ringdp.all_reduce(torch.ones(10), timeout=1.5)
    except ringdp.RingError as e:
        return str(e), time.monotonic() - t0
    return None


def test_peer_that_never_arrives_times_out():
    res = values(run_ranks(_never_arrives, 2))
    msg, took = res[0]
    assert "timed out after 1.5 s" in msg and "rank 1" in msg and "rank 0:" in msg
    assert 1.5 <= took < 1.5 + SLACK_S


def test_timeout_env(monkeypatch):
    from datetime import timedelta

    from ringdp import policy
    from ringdp.config import Config

    monkeypatch.setenv("RINGDP_TIMEOUT_S", "12")
    default = Config.from_env().timeout_s
    assert policy.timeout_s(None, default) == 12.0
    assert policy.timeout_s(3, default) == 3.0
    assert policy.timeout_s(timedelta(seconds=4), default) == 4.0
    with pytest.raises(ValueError):
        policy.timeout_s(0, default)


def _names_then(rank, world, how):
    import ringdp

    comm = ringdp.init()
    name = comm.shm.name.lstrip("/")
    t = ringdp.empty(1000)
    t.fill_(1)
    ringdp.all_reduce(t)
    present = os.path.exists(f"/dev/shm/{name}")
    if how == "raise":
        raise RuntimeError(f"boom {name}")
    return name, present


@pytest.mark.parametrize("how", ["normal", "raise"])
def test_no_shm_left_behind(how):
    res = run_ranks(_names_then, 2, how)
    if how == "normal":
        names = [v[0] for v in values(res)]
        assert all(not present for _, present in values(res))  # unlinked right after set-up
    else:
        names = [v[1].split("boom ")[1].split()[0] for v in res]
    assert names and not (set(names) & _shm_names())


def _reduce_or_error(rank, world):
    import ringdp

    t = torch.full((1000,), float(rank + 1))
    try:
        ringdp.all_reduce(t)
    except ringdp.RingError as e:
        return str(e)
    return t.tolist()


def test_small_dev_shm_is_a_clear_error():
    """/dev/shm smaller than a rank's segment (a container's default is 64 MiB; here 1 MiB,
    a tmpfs mounted over it in a mount namespace of the test's own): every rank raises a
    RingError naming itself, the room /dev/shm has and the settings that size the segment,
    and leaves nothing there. Skipped where this user may not make a mount namespace."""
    import json
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = (f"import json, sys; sys.path.insert(0, {tests!r}); import test_failures as t; "
              "print(json.dumps(t.run_ranks(t._reduce_or_error, 2, timeout=120))); "
              "import os; print(json.dumps(sorted(os.listdir('/dev/shm'))))")
    try:
        run = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                              f"mount -t tmpfs -o size=1M tmpfs /dev/shm && exec {sys.executable} -c \"$0\"", script],
                             capture_output=True, text=True, timeout=180)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if run.returncode != 0 and ("unshare" in run.stderr or "mount" in run.stderr) and "Traceback" not in run.stderr:
        pytest.skip(f"no mount namespace here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    res, left = json.loads(lines[-2]), json.loads(lines[-1])
    for r, (status, msg) in enumerate(res):
        assert status == "ok" and isinstance(msg, str), (r, status, msg)
        assert msg.startswith(f"rank {r}: cannot reserve") and "MiB free of 1 MiB" in msg, msg
        assert "--shm-size" in msg and "RINGDP_SLOT_BYTES" in msg and "RINGDP_FIFO_SLOTS" in msg, msg
    assert not [n for n in left if n.startswith("ringdp-")], left


def test_different_hosts_collectives_work_and_registered_memory_is_a_clear_error():
    # Ranks on two hosts (hostnames differ), one rank each (the flat path: gloo on the whole
    # group; tests/test_hierarchy.py has the rest): the CPU collectives run; registered
    # memory, which needs ranks sharing a host, says so clearly.
    for ok, msg in values(run_ranks(_fake_host, 2)):
        assert ok == [True] * 4, ok
        assert msg is not None and "spans 2 hosts" in msg and "RINGDP_HIERARCHY" in msg, msg


def _fake_host(rank, world):
    import socket

    import ringdp

    socket.gethostname = lambda: f"host{rank}"
    ringdp.init(timeout=20)
    t = torch.arange(5.0) + rank
    ringdp.all_reduce(t)
    ok = [torch.equal(t, 2 * torch.arange(5.0) + 1)]
    out = torch.empty(2)
    ringdp.reduce_scatter_tensor(out, torch.arange(4.0) + rank)
    ok.append(torch.equal(out, 2 * torch.arange(2.0 * rank, 2.0 * rank + 2) + 1))
    g = torch.empty(4)
    ringdp.all_gather_into_tensor(g, torch.full((2,), float(rank)))
    ok.append(torch.equal(g, torch.tensor([0.0, 0.0, 1.0, 1.0])))
    b = torch.full((3,), float(rank))
    ringdp.broadcast(b, 1)
    ok.append(torch.equal(b, torch.ones(3)))
    try:
        ringdp.empty(4)
        msg = None
    except ValueError as e:
        msg = str(e)
    return ok, msg


# ---- the worker thread: a stuck callback, close() and start-up racing other threads ----------
def _stuck_callback(rank, world, api):
    """A callback on ringdp's worker waits for a lock that the main thread holds across its
    next synchronous call, which waits behind that callback: a RingError on the main thread
    after the timeout (it waited forever), the call dropped on every rank alike, and the
    communicator goes on once the callback returns. `api`: ringdp's calls, or torch.distributed's
    on a group of ringdp's backend (its timeout: the group's)."""
    import functools
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    import ringdp

    g = dist.new_group(backend="cpu:ringdp", timeout=timedelta(seconds=3)) if api == "backend" else None
    all_reduce = functools.partial(dist.all_reduce if api == "backend" else ringdp.all_reduce, group=g)
    all_reduce(torch.ones(1))  # (set up first)
    lock, in_callback, where = threading.Lock(), threading.Event(), []
    # the worker waits at a gate until the callback is in place, so that it runs there on
    # every rank (on a call already finished, then() runs it at once, on this thread)
    gate = threading.Event()
    ringdp.get_communicator(g)._submit(lambda: gate.wait(30), async_op=True)

    def callback(f):
        where.append(threading.current_thread().name)
        in_callback.set()
        with lock:
            return True

    with lock:
        w = all_reduce(torch.ones(1 << 18), async_op=True)
        chained = w.get_future().then(callback)
        gate.set()
        assert in_callback.wait(30)
        t0 = time.monotonic()
        try:
            all_reduce(torch.ones(4))
            err = None
        except ringdp.RingError as e:
            err = str(e)
        took = time.monotonic() - t0
        w2 = all_reduce(torch.ones(1 << 18), async_op=True)  # (queued: an async call alike)
        f2 = w2.get_future()
        # its callbacks run on the worker once it gets there, never on this thread, which
        # holds the lock (it would wait for itself)
        f2_then = f2.then(lambda f: (lock.acquire(), lock.release(), threading.current_thread().name)[-1])
        try:
            w2.wait()
            err2 = None
        except ringdp.RingError as e:
            err2 = str(e)
    chained.wait()  # (the callback returns: the worker then fails the dropped calls, on its thread)
    try:
        f2.wait()
        future = None
    except RuntimeError as e:
        future = str(e)
    dropped = (err2, w2.is_success(), repr(w2.exception()), future, f2_then.wait())
    after = torch.full((3,), float(rank))
    all_reduce(after)
    return err, took, where, after.tolist(), dropped


@pytest.mark.parametrize("api", ["ringdp", "backend"])
def test_stuck_callback_is_an_error_not_a_hang(api):
    res = values(run_ranks(_stuck_callback, 2, api, env={"RINGDP_TIMEOUT_S": "3"}, timeout=120))
    for rank, (err, took, where, after, dropped) in enumerate(res):
        assert err is not None and f"rank {rank}:" in err and "callback" in err and "dropped" in err, err
        assert 3 <= took < 3 + 1 + SLACK_S, took
        assert where[0].startswith("ringdp-worker"), where
        assert after == [1.0, 1.0, 1.0]
        err2, success, exception, future, then_on = dropped
        assert then_on.startswith("ringdp-worker"), then_on
        assert err2 is not None and f"rank {rank}:" in err2 and "dropped" in err2, dropped
        assert success is False and "RingError" in exception and "dropped" in exception, dropped
        assert future is not None and "dropped" in future, dropped


def _dropped_on_one_rank(rank, world):
    """Rank 0 alone drops a call (its callback stuck on the worker, as in _stuck_callback)
    that every other rank runs. The drop takes part in the call as a rejected one: the other
    ranks fail it at once, naming rank 0, instead of pairing it with rank 0's next call
    (whose data they would silently reduce); then every rank's next call is the same call."""
    import threading

    import ringdp

    ringdp.init(timeout=3)
    ringdp.all_reduce(torch.ones(1))  # (set up first)
    big, small = torch.ones(1 << 16), torch.ones(4)
    err, took = None, 0.0
    if rank == 0:
        lock, in_callback, gate = threading.Lock(), threading.Event(), threading.Event()
        ringdp.get_communicator()._submit(lambda: gate.wait(30), async_op=True)  # (not a collective)

        def callback(f):
            in_callback.set()
            with lock:
                return True

        with lock:
            chained = ringdp.all_reduce(big, async_op=True).get_future().then(callback)
            gate.set()
            assert in_callback.wait(30)
            t0 = time.monotonic()
            try:
                ringdp.all_reduce(small, timeout=30)  # dropped after the communicator's 3 s
            except ringdp.RingError as e:
                err = str(e)
            took = time.monotonic() - t0
        chained.wait()  # (the callback returns: the worker then takes part in the dropped call)
    else:
        ringdp.all_reduce(big)
        t0 = time.monotonic()
        try:
            ringdp.all_reduce(small, timeout=30)  # rank 0's dropped call
        except ringdp.RingError as e:
            err = str(e)
        took = time.monotonic() - t0
    nxt = torch.full((4,), 10.0 * (rank + 1))
    ringdp.all_reduce(nxt, timeout=30)  # the same next call on every rank
    return err, took, small.tolist(), nxt.tolist()


def test_call_dropped_on_one_rank_fails_on_every_rank():
    # (one host: across hosts the peers' gloo steps, whose timeout is the communicator's less
    # a margin, end before the drop does, which comes after the communicator's timeout)
    world = 2
    res = values(run_ranks(_dropped_on_one_rank, world, env={"RINGDP_TIMEOUT_S": "3"}, timeout=120))
    for rank, (err, took, small, nxt) in enumerate(res):
        assert err is not None, f"rank {rank}: the call rank 0 dropped returned {small}"
        assert err.startswith(f"rank {rank}:") and "dropped" in err, err
        if rank > 0:
            assert "rank 0" in err, err
        assert took < 3 + 1 + SLACK_S, (rank, took)  # the drop after 3 s; the peers at once then
        assert nxt == [10.0 * world * (world + 1) / 2] * 4, (rank, nxt)


def _busy_callback(rank, world):
    """A callback on the worker that makes collectives for longer than the timeout, each
    within it (rank 1 arrives 0.8 s late at each): not stuck; the call queued behind it
    waits, then runs."""
    import threading

    import ringdp

    ringdp.all_reduce(torch.ones(1))
    gate, xs = threading.Event(), [torch.full((7,), float(rank + i)) for i in range(5)]
    ringdp.get_communicator()._submit(lambda: gate.wait(30), async_op=True)  # (the callback runs on the worker)

    def callback(f):
        for x in xs:
            if rank == 1:
                time.sleep(0.8)
            ringdp.all_reduce(x)
        return threading.current_thread().name

    chained = ringdp.all_reduce(torch.ones(1 << 18), async_op=True).get_future().then(callback)
    gate.set()
    t0 = time.monotonic()
    y = torch.full((3,), float(rank))
    ringdp.all_reduce(y)  # (queued behind the callback's 4 s)
    return chained.wait(), time.monotonic() - t0, y.tolist(), [x[0].item() for x in xs]


def test_busy_callback_is_not_stuck():
    res = values(run_ranks(_busy_callback, 2, env={"RINGDP_TIMEOUT_S": "3"}, timeout=120))
    for where, took, y, xs in res:
        assert where.startswith("ringdp-worker"), where
        assert took > 3.0, took  # (longer than the timeout: it waited behind the callback, and was not dropped)
        assert y == [1.0, 1.0, 1.0] and xs == [1.0 + 2 * i for i in range(5)], (y, xs)


def _destroy_in_a_callback(rank, world):
    """ringdp.destroy() in a callback on the worker while a call is queued behind it: the
    call fails with a RingError saying so (it ran on released endpoints)."""
    import threading

    import ringdp

    ringdp.all_reduce(torch.ones(1))
    gate = threading.Event()
    ringdp.get_communicator()._submit(lambda: gate.wait(30), async_op=True)  # (the callback runs on the worker)
    chained = ringdp.all_reduce(torch.ones(1 << 18), async_op=True).get_future().then(lambda f: ringdp.destroy())
    w2 = ringdp.all_reduce(torch.ones(4), async_op=True)
    gate.set()
    chained.wait()
    try:
        w2.wait()
        return None
    except ringdp.RingError as e:
        return str(e)


def test_destroy_in_a_callback_fails_the_queued_calls():
    for rank, err in enumerate(values(run_ranks(_destroy_in_a_callback, 2, timeout=120))):
        assert err is not None and f"rank {rank}:" in err and "destroyed" in err, err


def _no_deadline(rank, world):
    """timeout=inf (or one past what the clock can add) is policy.MAX_TIMEOUT_S, no practical
    limit: a late peer is met (before, the deadline's conversion overflowed into the past:
    'timed out after inf s' as soon as a wait slept, and the communicator was poisoned; the
    shared-memory transport still takes such a value as no deadline)."""
    import ringdp

    ringdp.all_reduce(torch.ones(1))
    out = []
    for timeout in (float("inf"), 1e300):
        if rank == 1:
            time.sleep(0.3)
        t = torch.full((1000,), float(rank + 1))
        ringdp.all_reduce(t, timeout=timeout)
        out.append(float(t[0]))
    return out


def test_infinite_timeout_waits_without_a_deadline():
    for out in values(run_ranks(_no_deadline, 2, timeout=60)):
        assert out == [3.0, 3.0]


def _work_wait_timeout(rank, world, as_timedelta):
    """Work.wait(timeout) on a call whose peer is late: a RingError after `timeout` (seconds,
    or a timedelta as torch's Work.wait takes); the call goes on, and a second wait returns it."""
    from datetime import timedelta

    import ringdp

    ringdp.all_reduce(torch.ones(1))
    if rank == 1:
        time.sleep(2.0)
    t = torch.full((1 << 18,), float(rank + 1))
    w = ringdp.all_reduce(t, async_op=True)
    t0 = time.monotonic()
    try:
        w.wait(timeout=timedelta(seconds=0.5) if as_timedelta else 0.5)
        err = None
    except ringdp.RingError as e:
        err = str(e)
    took = time.monotonic() - t0
    w.wait(timedelta(0) if as_timedelta else None)  # (no limit, as torch's default)
    return err, took, float(t[0]), float(t[-1])


@pytest.mark.parametrize("as_timedelta", [False, True])
def test_work_wait_timeout_is_a_ring_error(as_timedelta):
    res = values(run_ranks(_work_wait_timeout, 2, as_timedelta, timeout=120))
    err, took, first, last = res[0]
    assert err is not None and "rank 0:" in err and "within 0.5 s" in err, err
    assert 0.5 <= took < 0.5 + SLACK_S, took
    for _, _, first, last in res:
        assert first == last == 3.0


def _work_wait_timeout_in_a_callback(rank, world):
    """Work.wait(timeout) in a callback on ringdp's worker, on a call queued behind a slow
    one (2 s, on this rank only): the callback runs the queue itself (_run_queued_until) and
    gives up with a RingError once the timeout passed, before the next queued call; the
    calls still run, on the worker, with the right values."""
    import threading

    import ringdp

    comm = ringdp.init(timeout=20)
    ringdp.all_reduce(torch.ones(1))
    gate = threading.Event()
    comm._submit(lambda: gate.wait(30), async_op=True)  # (the worker waits until all is queued)
    a = torch.full((4,), float(rank + 1))
    w1 = ringdp.all_reduce(a, async_op=True)
    comm._submit(lambda: time.sleep(2.0 if rank == 0 else 0.0), async_op=True)
    b = torch.full((1 << 16,), float(rank + 1))
    w3 = ringdp.all_reduce(b, async_op=True)
    out = {}

    def callback(_f):
        out["thread"] = threading.current_thread().name
        t0 = time.monotonic()
        try:
            w3.wait(timeout=0.5)
            out["err"] = None
        except ringdp.RingError as e:
            out["err"] = str(e)
        out["took"] = time.monotonic() - t0

    done = w1.get_future().then(callback)
    gate.set()
    done.wait()
    w3.wait()
    out["values"] = (float(a[0]), float(b[0]), float(b[-1]))
    return out


def test_work_wait_timeout_in_a_callback():
    res = values(run_ranks(_work_wait_timeout_in_a_callback, 2, timeout=120))
    for out in res:
        assert out["thread"].startswith("ringdp-worker"), out
        assert out["values"] == (3.0, 3.0, 3.0), out
    first = res[0]
    assert first["err"] is not None and "within 0.5 s" in first["err"], first
    assert 1.9 <= first["took"] < 2 + SLACK_S, first  # (the slow call ran to its end first)


def _queued_while_closing(rank, world):
    """Another thread queues a call while the main thread destroys ringdp (the window made
    wide by a sleep before _enqueue): the call is refused with a RingError, not queued behind
    the worker's stop, where it waited forever."""
    import threading

    import ringdp
    import ringdp.comm as C

    orig = C.Communicator._enqueue

    def slow(self, *a, **k):
        if threading.current_thread().name == "late":
            time.sleep(1.0)
        return orig(self, *a, **k)

    C.Communicator._enqueue = slow
    ringdp.all_reduce(torch.ones(1 << 18), async_op=True).wait()  # (the worker runs)
    out = {}

    def late():
        try:
            ringdp.all_reduce(torch.ones(4), async_op=True).wait()
            out["late"] = None
        except ringdp.RingError as e:
            out["late"] = str(e)

    th = threading.Thread(target=late, name="late", daemon=True)
    th.start()
    time.sleep(0.3)
    ringdp.destroy()
    th.join(30)
    out["alive"] = th.is_alive()
    return out


def test_call_racing_destroy_is_refused():
    for out in values(run_ranks(_queued_while_closing, 2, timeout=120)):
        assert out["alive"] is False, out
        assert out["late"] is not None and "destroyed" in out["late"], out


def _inline_while_closing(rank, world, hosts):
    """destroy() on the main thread while another thread's synchronous call runs inline. A
    call in flight (its peer comes 1.5 s late) finishes, with the right values, before the
    endpoints go; a call that passed the liveness check just before the destroy (a sleep
    widens the window) then fails with the communicator's RingError. Before, the teardown
    ran beside both: the first lost its endpoint mid-call, the second an AttributeError
    on None. hosts: one (shared memory) or two (rank r on host r: the cross-host path)."""
    import socket
    import threading

    import ringdp
    import ringdp.comm as C

    if hosts == 2:
        socket.gethostname = lambda: f"host{rank}"
    orig = C.Communicator._take_inline

    def slow(self, *a, **k):
        inline = orig(self, *a, **k)
        if threading.current_thread().name == "late":
            time.sleep(1.0)
        return inline

    C.Communicator._take_inline = slow
    out = {}

    def call(key, t):
        try:
            ringdp.all_reduce(t)
            out[key] = t.tolist()
        except Exception as e:  # noqa: BLE001 -- the kind and message are the result
            out[key] = f"{type(e).__name__}: {e}"

    n = 1 << 16
    ringdp.init(timeout=20)
    ringdp.all_reduce(torch.ones(4))  # (set up on both ranks)
    t = torch.arange(n, dtype=torch.float32) * (rank + 1)
    if rank == 0:
        th = threading.Thread(target=call, args=("in_flight", t), name="in_flight", daemon=True)
        th.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        ringdp.destroy()
        out["destroy_s"] = time.monotonic() - t0
        th.join(30)
    else:
        time.sleep(1.5)
        call("in_flight", t)
        ringdp.destroy()
    out["in_flight_ok"] = out.get("in_flight") == (torch.arange(n, dtype=torch.float32) * 3).tolist()
    out.pop("in_flight", None)
    ringdp.init(timeout=20)  # (a new communicator, on both ranks)
    if rank == 0:
        th = threading.Thread(target=call, args=("late", torch.ones(4)), name="late", daemon=True)
        th.start()
        time.sleep(0.3)
        ringdp.destroy()
        th.join(30)
    else:
        ringdp.destroy()
    return out


@pytest.mark.parametrize("hosts", [1, 2])
def test_inline_call_racing_destroy(hosts):
    res = values(run_ranks(_inline_while_closing, 2, hosts, timeout=120))
    for out in res:
        assert out["in_flight_ok"] is True, out
    first = res[0]
    assert 1.0 <= first["destroy_s"] < 1.2 + SLACK_S, first  # it waited for the call in flight
    assert first["late"].startswith("RingError") and "destroyed" in first["late"], first


def _close_inside_a_call(rank, world):
    """destroy() made on the thread that runs a call, inside it (as a signal handler would,
    between taking the call lock and the collective): it does not wait for the call, which
    then fails with the communicator's RingError. (It waited the whole timeout for itself.)"""
    import ringdp
    import ringdp.comm as C

    ringdp.init(timeout=20)
    ringdp.all_reduce(torch.ones(4))
    orig = C.Communicator._set_spin
    took = []

    def handler_inside(self, on_worker):
        if rank == 0 and not took:
            t0 = time.monotonic()
            ringdp.destroy()
            took.append(time.monotonic() - t0)
        return orig(self, on_worker)

    C.Communicator._set_spin = handler_inside
    try:
        ringdp.all_reduce(torch.ones(4)) if rank == 0 else None
        err = None
    except ringdp.RingError as e:
        err = str(e)
    C.Communicator._set_spin = orig
    ringdp.destroy()
    return took, err


def test_destroy_inside_a_call_does_not_wait_for_it():
    res = values(run_ranks(_close_inside_a_call, 2, timeout=120))
    took, err = res[0]
    assert took and took[0] < SLACK_S, took
    assert err is not None and "destroyed" in err, err


def _call_outlives_close(rank, world, hosts):
    """A call whose own timeout (30 s) is longer than the communicator's (2 s), in flight
    (its peer 4 s late) while destroy() runs on another thread: destroy() returns after the
    communicator's timeout, the call keeps its endpoints and ends with the right values, and
    the endpoints are released as it ends."""
    import socket
    import threading

    import ringdp

    if hosts == 2:
        socket.gethostname = lambda: f"host{rank}"
    comm = ringdp.init(timeout=2)
    ringdp.all_reduce(torch.ones(4))
    n = 1 << 16
    t = torch.arange(n, dtype=torch.float32) * (rank + 1)
    out = {}

    def call():
        try:
            ringdp.all_reduce(t, timeout=30)
            out["ok"] = torch.equal(t, torch.arange(n, dtype=torch.float32) * 3)
        except Exception as e:  # noqa: BLE001 -- the result
            out["ok"] = f"{type(e).__name__}: {e}"

    if rank == 0:
        th = threading.Thread(target=call, daemon=True)
        th.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        ringdp.destroy()
        out["destroy_s"] = time.monotonic() - t0
        out["kept_while_running"] = comm._shm is not None and th.is_alive()
        th.join(30)
    else:
        time.sleep(4.0)
        call()
        ringdp.destroy()
    out["released"] = comm._shm is None and comm.across is None
    return out


def test_call_outliving_destroy_keeps_its_endpoints():
    # (one host: across hosts a call's gloo step keeps the group's timeout, whatever the call's)
    res = values(run_ranks(_call_outlives_close, 2, 1, timeout=120))
    for out in res:
        assert out["ok"] is True and out["released"] is True, out
    assert 1.5 <= res[0]["destroy_s"] < 2 + SLACK_S, res[0]
    assert res[0]["kept_while_running"] is True, res[0]


def _first_calls_from_two_threads(rank, world):
    """Two threads make the communicator's first queued calls at once (a slow Queue() and a
    late worker widen the window): one worker, both calls run."""
    import queue as Q
    import threading
    import types

    import ringdp
    import ringdp.comm as C

    class SlowQueue(Q.Queue):
        def __init__(self):
            time.sleep(0.2)
            super().__init__()

    C.queue = types.SimpleNamespace(Queue=SlowQueue, Empty=Q.Empty)
    orig = C.Communicator._run_worker

    def late_start(self, *a):
        time.sleep(0.5)
        return orig(self, *a)

    C.Communicator._run_worker = late_start
    ringdp.all_reduce(torch.ones(1))  # (set up, inline: no worker yet)
    # the same call from both threads: whichever order each rank takes, the sums agree
    ts = [torch.full((1 << 16,), float(rank + 1)) for i in range(2)]
    done = []

    def user(i):
        time.sleep(0.05 * i)
        ringdp.all_reduce(ts[i], async_op=True).wait()
        done.append(i)

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    workers = sum(th.name.startswith("ringdp-worker") for th in threading.enumerate())
    return sorted(done), workers, [x.tolist() for x in ts]


def test_first_calls_from_two_threads_start_one_worker():
    for done, workers, ts in values(run_ranks(_first_calls_from_two_threads, 2, env={"RINGDP_TIMEOUT_S": "20"},
                                              timeout=120)):
        assert done == [0, 1] and workers == 1, (done, workers)
        assert all(x == [3.0] * (1 << 16) for x in ts)


# ---- values past what the consumers hold: huge timeouts, sizes that overflow ------------------
def _huge_timeout(rank, world, how):
    """A timeout past what threading, timedelta or gloo take (RINGDP_TIMEOUT_S set by the
    caller, init's or a call's timeout=): the collectives work and destroy() is clean (before:
    an OverflowError in set-up, or from destroy() with the shared-memory endpoint kept)."""
    import ringdp

    if how == "hosts":  # one rank per simulated host: the cross-host step (gloo) gets the timeout too
        os.environ["RINGDP_HOST_ID"] = f"host{rank}"
    c = ringdp.init(timeout=float("inf") if how == "init" else None)
    t = torch.full((1000,), float(rank + 1))
    ringdp.all_reduce(t, timeout=float("inf") if how in ("call", "hosts") else None)
    u = torch.ones(10)
    ringdp.all_reduce(u, async_op=True, timeout=1e15 if how != "env" else None).wait()
    shm = c._shm if how != "hosts" else True
    ringdp.destroy()
    return float(t[0]), float(u[0]), c.timeout, shm is not None, c._shm is None


@pytest.mark.parametrize("how,env", [("env", "inf"), ("env", "1e15"), ("env", "1e10"), ("init", "30"),
                                     ("call", "30"), ("hosts", "30")])
def test_huge_timeouts_work_and_destroy_cleanly(how, env):
    from ringdp import policy

    for rank, (t, u, timeout, had_shm, released) in enumerate(
            values(run_ranks(_huge_timeout, 2, how, env={"RINGDP_TIMEOUT_S": env}, timeout=120))):
        assert (t, u) == (3.0, 2.0), (rank, t, u)
        assert timeout == (30.0 if how in ("call", "hosts") else policy.MAX_TIMEOUT_S), timeout
        assert had_shm and released, rank


def _shm_comm_errors(settings):
    """What constructing a one-rank ShmComm says for each dict of ShmConfig fields in
    `settings`: the RingError's text, or None when it was made."""
    import uuid

    from ringdp import _C

    errs = []
    for fields in settings:
        c = _C.ShmConfig()
        c.rank, c.world, c.name, c.host = 0, 1, _C.shm_segment_name(uuid.uuid4().hex[:12], 0), "h"
        for field, value in fields.items():
            setattr(c, field, value)
        try:
            _C.ShmComm(c)
            errs.append(None)
        except _C.RingError as e:
            errs.append(str(e))
    return errs


def _shm_geometry_overflow(rank, world):
    """The shared-memory layout checks its own arithmetic (behind the parser's limits): a
    configuration whose segment size wraps in 64 bits is a RingError, not a small segment
    that the ring then writes past (SIGSEGV)."""
    return _shm_comm_errors([{"slot_bytes": 1 << 61}, {"fifo_slots": 1 << 62}, {"oneshot_bytes": 1 << 63},
                             {"oneshot_bytes": (1 << 64) - 1}, {"arena_bytes": (1 << 64) - 1}])


def test_shm_geometry_overflow_is_a_ring_error():
    before = _shm_names()
    errs = values(run_ranks(_shm_geometry_overflow, 1, timeout=120))[0]
    for e in errs:
        assert e is not None and "does not fit" in e, errs
    assert not (_shm_names() - before)


def _shm_config_names(rank, world):
    """ShmConfig.rank_names (an in-host endpoint of a hierarchy names its group's ranks): a
    list that does not cover the world is refused, and a refusal names the rank by its name;
    a rank outside the world is refused as the CUDA transports refuse it."""
    return _shm_comm_errors([{"rank_names": [3, 7]}, {"rank_names": [7], "slot_bytes": 100}, {"rank": 1}])


def test_shm_config_names_ranks():
    before = _shm_names()
    errs = values(run_ranks(_shm_config_names, 1, timeout=120))[0]
    assert errs[0] == "ringdp shm rank 0: rank_names has 2 entries for world size 1", errs
    assert errs[1] is not None and errs[1].startswith("rank 7: slot_bytes 100"), errs
    assert errs[2] == "ringdp shm: invalid rank 1 for world size 1", errs
    assert not (_shm_names() - before)


def _empty_too_large(rank, world):
    """ringdp.empty of a size whose byte count does not fit: a ValueError naming the shape and
    the dtype (before: 2^62 float32 elements wrapped to 0 bytes, a tensor claiming 2^62
    elements on a 4 KiB block, written through by zero_())."""
    import ringdp

    ringdp.init()
    out = []
    for size, dtype in [((2 ** 62,), torch.float32), ((2 ** 33, 2 ** 31), torch.float32),
                        ((2 ** 61, 2), torch.float64), ((-1, 4), torch.float32)]:
        try:
            t = ringdp.empty(*size, dtype=dtype)
            out.append(("made", tuple(t.shape)))
        except ValueError as e:
            out.append(("ValueError", str(e)))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
    ok = ringdp.zeros(4)  # the arena still works
    ok += 1
    return out, ok.tolist()


def test_empty_of_a_size_that_overflows_is_a_value_error():
    out, ok = values(run_ranks(_empty_too_large, 1, timeout=120))[0]
    assert ok == [1.0] * 4
    for (kind, msg), shape, dtype in zip(out, ["(4611686018427387904,)", "(8589934592, 2147483648)",
                                                "(2305843009213693952, 2)", "(-1, 4)"],
                                         ["torch.float32", "torch.float32", "torch.float64", "torch.float32"]):
        assert kind == "ValueError" and shape in msg and dtype in msg, (kind, msg)


def _peer_dies_in_training(rank, world, kind, when, hosts):
    """Training on ringdp (kind "ring": RingDDP on the gloo default group; "stock": torch's
    DDP on a cpu:ringdp group; "hook": the same with torch's fp16 compression hook, whose
    futures are the hook's own; "fsdp": FSDP2, fully_shard per layer and at the root, on
    that group: its all-gathers and reduce-scatters), small buckets; the last rank SIGKILLs
    itself in step 2, before its forward or in the middle of its backward (a gradient hook,
    after buckets reduced later in the order, or FSDP2's later layers' reduce-scatters,
    have started). The others: (exception type, message, seconds from step 2 to the error,
    ringdp's shared-memory names)."""
    import threading

    from torch import nn

    if hosts:
        os.environ["RINGDP_HOST_ID"] = hosts[rank]
    import torch.distributed as dist

    import ringdp

    torch.set_num_threads(1)
    group = dist.new_group(backend="cpu:ringdp") if kind != "ring" else None
    torch.manual_seed(0)
    # (BatchNorm: buffers, which both DDPs broadcast before each forward)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 4))
    if kind == "ring":
        ddp = ringdp.RingDDP(model, bucket_cap_mb=0.05)
    elif kind == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
        if kind == "hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    names = sorted(_shm_names())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    victim = rank == world - 1
    state = {"step": 0}
    if victim and when == "backward":
        # the gradient of the first Tanh's output: after the last layers' gradients (their
        # buckets, FSDP2's reduce-scatters) and before layer 0's (a hook on a parameter would
        # not do for FSDP2: its gradients reach the unsharded parameters)
        def arm(module, inputs, out):
            if state["step"] == 2:
                out.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        model[2].register_forward_hook(arm)

    def step(s):
        state["step"] = s
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(s * world + rank))
        if victim and when == "forward" and s == 2:  # (the others then fail in their forward's broadcast)
            os.kill(os.getpid(), signal.SIGKILL)
        out = ddp(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for s in range(2):
        step(s)
    t0 = time.monotonic()
    try:
        for s in range(2, 6):
            step(s)
    except Exception as e:  # noqa: BLE001 -- what the survivor sees
        took = time.monotonic() - t0
        alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        return type(e).__name__, str(e), took, names, alive
    return None, None, time.monotonic() - t0, names, []


@pytest.mark.parametrize("hosts", [None, "aabb"], ids=["onehost", "aabb"])
@pytest.mark.parametrize("when", ["forward", "backward"])
@pytest.mark.parametrize("kind", ["ring", "stock", "hook", "fsdp"])
def test_peer_dies_in_training(kind, when, hosts):
    """A peer SIGKILLed in the middle of training: every survivor's step raises within the
    timeout (5 s), naming the dead rank (on two hosts: the cross-host step that cannot reach
    it, or the peer of its host that died), its process exits with 0, and nothing of
    ringdp's is left in /dev/shm."""
    world = 4 if hosts else 3
    dead = world - 1
    codes = []
    res = run_ranks(_peer_dies_in_training, world, kind, when, hosts and list(hosts),
                    env={"RINGDP_TIMEOUT_S": "5"}, allow_missing=(dead,), timeout=120, exitcodes=codes)
    for r in range(dead):
        status, value = res[r]
        assert status == "ok", value
        etype, msg, took, names, alive = value
        assert msg is not None, f"rank {r}: trained on after rank {dead} died"
        assert f"rank {dead}" in msg or "across hosts" in msg, (r, etype, msg)
        assert took < 5 + 2 * SLACK_S, (r, took, msg)
        assert codes[r] == 0, (r, codes)
    left = _shm_names() & set(res[0][1][3])
    assert not left, left


LATE_S = 3.0  # how late _interrupted's peers come to the collective (rank 0's SIGINT: at 0.5 s)
IN_FLIGHT_S = 5.0  # how late _interrupted's rank 2 starts its part of a cross-host step (in_flight)


def _interrupted(rank, world, mode, hosts, numel=1000, in_flight=False):
    """Rank 0 sends itself a SIGINT 0.5 s into a collective of `numel` elements that the
    others enter LATE_S late ("inline": a synchronous ringdp.all_reduce, run on the calling
    thread; "wait": async_op and Work.wait(), the call on ringdp's worker; "backend":
    dist.all_reduce on a cpu:ringdp group; "handler": a SIGINT handler of the program's,
    which returns). Across hosts with more than 1000 elements (pipeline pieces) only the
    other host is late: the interrupt comes in a cross-host wait. `in_flight` (across
    hosts, pipeline pieces): every rank comes at once and rank 0's peer across hosts (rank 2)
    starts its first piece's cross-host all-reduce IN_FLIGHT_S late, so that rank 0's
    interrupt comes while both of its pieces' cross-host works are in flight. Returns
    (what the call raised or its values, seconds from the call to that, what the next call
    raised or its values, seconds from the start to when a handler ran)."""
    import threading

    if hosts:
        os.environ["RINGDP_HOST_ID"] = hosts[rank]
    import torch.distributed as dist

    import ringdp

    # (a parent that ignores SIGINT, as a shell's background job does, passes that on)
    ran = []
    handler = (lambda sig, frame: ran.append(time.monotonic())) if mode == "handler" else signal.default_int_handler
    signal.signal(signal.SIGINT, handler)
    group = dist.new_group(backend="cpu:ringdp") if mode == "backend" else None

    def reduce(async_op=False):
        t = torch.full((numel,), float(rank + 1))
        if mode == "backend":
            dist.all_reduce(t, group=group)
        elif async_op:
            ringdp.all_reduce(t, async_op=True).wait()
        else:
            ringdp.all_reduce(t)
        return sorted(set(t.tolist()))

    def outcome(fn):
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 -- KeyboardInterrupt included: what the caller sees
            return f"{type(e).__name__}: {e}"

    reduce()
    if in_flight and rank == 2:
        from ringdp.hosts import CrossHost

        start, late = CrossHost._gloo_start, [IN_FLIGHT_S]

        def gloo_start(self, *args, **kwargs):
            if late:
                time.sleep(late.pop())
            return start(self, *args, **kwargs)
        CrossHost._gloo_start = gloo_start
    t0 = time.monotonic()
    if rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    elif not (hosts and numel > 1000 and (in_flight or hosts[rank] == hosts[0])):
        time.sleep(LATE_S)
    first = outcome(lambda: reduce(async_op=mode == "wait"))
    took = time.monotonic() - t0
    return first, took, outcome(reduce), [t - t0 for t in ran]


@pytest.mark.parametrize("mode,hosts,numel,in_flight",
                         [("inline", None, 1000, False), ("wait", None, 1000, False), ("backend", None, 1000, False),
                          ("handler", None, 1000, False), ("inline", "aabb", 1000, False),
                          ("inline", "aabb", 1 << 16, False), ("inline", "aabb", 1 << 16, True)],
                         ids=["inline", "wait", "backend", "handler", "inline-aabb", "pipelined-aabb-late-host",
                              "pipelined-aabb-in-flight"])
def test_ctrl_c_ends_a_collective(mode, hosts, numel, in_flight):
    """Ctrl-C (SIGINT) while a collective waits for a late peer: a KeyboardInterrupt at once
    (it waited out the timeout, 300 s by default, as the transport waited in C++), the peers'
    call a RingError naming rank 0 and the interrupt, the next call on rank 0 a RingError
    saying so, and the process exits with 0. A SIGINT handler of the program's runs as it
    did, once the call returns, never inside it: every rank gets the sum, twice. Across hosts
    in two pipeline pieces with the other host late, the interrupt comes in the call check
    across hosts, where Python waits; the ranks that saw the abort run no gloo operation
    after it (rank 1's next call once sent a check row where rank 3, late, waited for the
    abandoned call's: gloo terminated rank 3's process). With the cross-host steps of both
    pieces in flight (in_flight: rank 2 starts its part IN_FLIGHT_S late), the interrupted call
    waits for neither (CrossHost._drain(wait=False)): it once waited GLOO_DRAIN_S for each."""
    world = 4 if hosts else 2
    codes = []
    env = {"RINGDP_TIMEOUT_S": "30", "RINGDP_HIER_PIECE_BYTES": "4096"}  # (64 Ki floats: two pieces)
    res = values(run_ranks(_interrupted, world, mode, hosts and list(hosts), numel, in_flight, env=env, timeout=120,
                           exitcodes=codes))
    total = [world * (world + 1) / 2]
    if mode == "handler":
        for r, (first, took, after, ran) in enumerate(res):
            assert first == after == total, (r, first, after)
        (first, took, after, ran) = res[0]
        # (sent at 0.5 s; the call ends once rank 1 came, at LATE_S)
        assert len(ran) == 1 and LATE_S - 0.5 < ran[0] < took + 0.5, f"the handler ran at {ran} s, the call ended at {took} s"
    else:
        first, took, after, _ = res[0]
        assert str(first).startswith("KeyboardInterrupt"), first
        assert took < 0.5 + (2.0 if numel > 1000 else SLACK_S), took  # (the peers came at LATE_S)
        assert str(after).startswith("RingError") and "interrupted" in str(after), after
        for r in range(1, world):
            first, took, _, _ = res[r]
            if in_flight and hosts[r] != hosts[0] and first == total:
                continue  # (rank 0 had given its shards to both cross-host works: the other host's sums)
            assert str(first).startswith("RingError"), (r, first)
            # the other host hears the reason through the store, which lives on rank 0 here:
            # once rank 0 has exited, its gloo step fails (a rank died, is stuck or unreachable)
            if not hosts or hosts[r] == hosts[0]:
                assert "rank 0" in str(first) and "interrupted" in str(first), (r, first)
            assert took < (IN_FLIGHT_S if in_flight else LATE_S) + SLACK_S, (r, took)
    assert codes == [0] * world, codes



EXIT_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exit_job.py")


@contextlib.contextmanager
def _exit_job(tmp_path, mode, **settings):
    """tests/_exit_job.py's two ranks in `mode` (stderr in tmp_path/stderr-R, CI's RINGDP_*
    settings dropped, RINGDP_TIMEOUT_S 60 and `settings` set): (the processes, rank 0's
    stderr so far). Whatever still runs at the end is killed."""
    import subprocess
    import sys

    from _dist import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGDP_")}
    env.update({"RINGDP_TIMEOUT_S": "60", **settings})
    logs = [open(tmp_path / f"stderr-{r}", "w+") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, EXIT_JOB, str(r), str(port), str(tmp_path), mode], env=env,
                              stdout=subprocess.DEVNULL, stderr=logs[r]) for r in range(2)]
    try:
        yield procs, lambda: (tmp_path / "stderr-0").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def _wait_for(pred, limit_s, what):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < limit_s, f"waited {limit_s} s for {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.parametrize("mode,how", [("ringdp", "peer-comes"), ("ringdp", "ctrl-c"), ("backend", "ctrl-c"),
                                      ("two-groups", "ctrl-c")])
def test_exit_with_an_unfinished_collective(tmp_path, mode, how):
    """A script whose rank 0 ends with all-reduces it started with async_op and never
    waited for (tests/_exit_job.py MODE: ringdp's on a gloo group, torch's on a cpu:ringdp
    group never destroyed, or ringdp's on two groups): its exit waits in ringdp's close for
    the peer to make them too, and says so on stderr within policy.CLOSE_NOTE_S (it sat
    silent for up to the timeout, 60 s here). "peer-comes": rank 1 makes the call; both get
    the sum and exit with 0. "ctrl-c": a SIGINT in that wait leaves every call (rank 1's
    then fail naming rank 0 and the interrupt), rank 0 exits with 0 at once, saying so in a
    line (no "Exception ignored in atexit" traceback), and never in std::terminate: CPython
    3.11 marks a thread whose join Ctrl-C interrupted as stopped while it still runs, and
    the worker, still in C++, was killed as Python finalized (exit -6, 3 of 8 scratch runs
    before close() waited on an event of its own)."""
    import json

    before = _shm_names()
    with _exit_job(tmp_path, mode) as (procs, err0):
        _wait_for(lambda: (tmp_path / "left").exists(), 120, "rank 0 to start its all-reduces")
        took = _wait_for(lambda: "closing waits for" in err0(), 1.0 + SLACK_S, "rank 0's note")
        assert "closing waits for 1 unfinished call on ringdp's worker (all_reduce #2 running: it waits for its " \
               "peers" in err0(), err0()
        assert procs[0].poll() is None, (took, err0())
        if how == "ctrl-c":
            procs[0].send_signal(signal.SIGINT)
            t0 = time.monotonic()
            procs[0].wait(timeout=60)
            assert time.monotonic() - t0 < 2.0 + SLACK_S, err0()
        (tmp_path / "go").write_text("")
        for p in procs:
            p.wait(timeout=60)
    outcome = json.loads((tmp_path / "outcome").read_text())
    assert [p.returncode for p in procs] == [0, 0], ([p.returncode for p in procs], err0())
    for bad in ("Traceback", "Exception ignored", "terminate called", "still runs after"):
        assert bad not in err0(), err0()
    if how == "ctrl-c":
        assert err0().count("interrupted while closing") == 1, err0()
        assert len(outcome) == (2 if mode == "two-groups" else 1), outcome
        for o in outcome:
            error = o.get("error", "")
            assert "rank 0" in error and "interrupted" in error, outcome
    else:
        assert outcome == [{"values": [2.0, 6.0, 10.0, 14.0]}], outcome
    assert not (_shm_names() - before), _shm_names() - before

@pytest.mark.parametrize("how", ["peer-comes", "ctrl-c", "peer-leaves"])
def test_exit_with_a_gloo_call_in_flight(tmp_path, how):
    """Rank 0 ends its script with a cpu:ringdp all-reduce that the backend hands to its inner
    gloo group (BXOR), started with async_op and never waited for (tests/_exit_job.py
    gloo-call). Its exit waits for it at most policy.GLOO_DRAIN_S (3 s here), saying so on
    stderr within policy.CLOSE_NOTE_S, then keeps it from gloo's thread (ringdp/inflight.py).
    "peer-comes": rank 1 makes the call in that wait; both get the result and exit with 0.
    "ctrl-c": a SIGINT in the wait: rank 0 exits with 0 at once, naming the call it left.
    "peer-leaves": rank 0 exits with 0 once the wait is over. In both, rank 1 leaves as rank 0
    finalizes (which then takes 1.5 s more), so that the call ends (fails) on gloo's thread
    while Python finalizes. Before: the exit waited for the call in the gloo group's
    destructor as Python finalized (up to gloo's timeout), and a call that ended while Python
    finalized ended the process in std::terminate (exit -6; found by tests/_fuzz.py
    --interrupt)."""
    import json

    with _exit_job(tmp_path, "gloo-call", GLOO_DRAIN_S="3", FINAL_S="1.5") as (procs, err0):
        _wait_for(lambda: (tmp_path / "left").exists(), 120, "rank 0 to start its all-reduce")
        t0 = time.monotonic()
        _wait_for(lambda: "the exit waits for" in err0(), 1.0 + SLACK_S, "rank 0's note")
        assert "the exit waits for 1 gloo collective still in flight (allreduce: they wait for their peers" \
               in err0(), err0()
        if how == "peer-comes":
            (tmp_path / "go").write_text("")
        elif how == "ctrl-c":
            procs[0].send_signal(signal.SIGINT)
            t0 = time.monotonic()
        procs[0].wait(timeout=60)
        took = time.monotonic() - t0
        procs[1].wait(timeout=60)
    outcome = json.loads((tmp_path / "outcome").read_text())
    assert [p.returncode for p in procs] == [0, 0], ([p.returncode for p in procs], err0())
    for bad in ("Traceback", "Exception ignored", "terminate called"):
        assert bad not in err0(), err0()
    if how == "peer-comes":
        assert outcome == [{"values": [1, 3, 1, 7]}], outcome  # (i ^ (i + 1))
        assert "still in flight at exit" not in err0(), err0()
        return
    assert err0().count("1 gloo collective still in flight at exit") == 1, err0()
    assert "(allreduce): left to gloo's thread" in err0(), err0()
    assert outcome == [{"left": True}], outcome  # (rank 1 left as rank 0 finalized)
    if how == "ctrl-c":
        assert took < 1.5 + SLACK_S, (took, err0())
    else:
        assert 3.0 - 1.0 < took < 3.0 + 1.5 + SLACK_S, (took, err0())
        assert "after 3." in err0(), err0()


def test_join_notice_left_in_flight_at_destroy(tmp_path):
    """RingDDP's join() on a gloo default group: rank 0's forward starts torch's Join notice (an
    async gloo all-reduce) and raises a RingError naming rank 1, which is alive but makes no
    call (tests/_exit_job.py join). Its script then calls destroy_process_group(), as README
    asks, and ends. Before: destroy_process_group() waited for the notice in the gloo group's
    destructor until rank 1 left (55 s in a scratch run; gloo's timeout, 30 minutes by
    default, for a peer that stays). Now the notice is held in ringdp/inflight.py: the destroy
    is immediate, and the exit waits policy.GLOO_DRAIN_S (1 s here) and leaves it, naming it."""
    import json

    with _exit_job(tmp_path, "join", RINGDP_TIMEOUT_S="3", GLOO_DRAIN_S="1", FINAL_S="1.5") as (procs, err0):
        procs[0].wait(timeout=60)
        procs[1].wait(timeout=60)
    assert [p.returncode for p in procs] == [0, 0], ([p.returncode for p in procs], err0())
    raised = (tmp_path / "raised").read_text()
    assert "rank 0: all_reduce #2 timed out after 3 s waiting for rank 1" in raised, raised
    assert float((tmp_path / "destroyed").read_text()) < 1.0, err0()
    for bad in ("Traceback", "Exception ignored", "terminate called"):
        assert bad not in err0(), err0()
    assert "ringdp rank 0: 1 gloo collective still in flight at exit after 1." in err0(), err0()
    assert "(RingDDP's Join notice (allreduce)): left to gloo's thread" in err0(), err0()
    assert json.loads((tmp_path / "outcome").read_text()) == [{"left": True}]  # (rank 1 left as rank 0 finalized)


BUSY_S = 2.5  # how long _cuda_work_at_close's stand-in device takes to end its queued work ("device-ends")
SIGINT_S = 1.5  # when its SIGINT comes (the other cases)


def _cuda_work_at_close(rank, world, how):
    """A communicator whose CUDA endpoint (cuda_comm.CudaEndpoint over a stand-in transport,
    on _fake_cuda's streams and events) still has device work queued: `how` "device-ends"
    (it ends BUSY_S after the call), or never until the transport is halted, with a SIGINT at SIGINT_S
    in destroy()'s wait ("ctrl-c"; "ctrl-c-twice": a second one 0.5 s later, while the
    transport's halt takes 1 s, as an NCCL abort may), or the backend's abort()
    (close(wait=False): "abort").
    Returns what the call raised, how long it took, the transport's calls in order, ringdp's
    log lines (with their times) and what a CPU all-reduce raises after."""
    import logging
    import threading

    import _fake_cuda
    import ringdp
    from ringdp import cuda_comm

    signal.signal(signal.SIGINT, signal.default_int_handler)
    calls, busy_until = [], [float("inf")]

    class Transport:  # (csrc/cuda's Comm, as CudaEndpoint calls it)
        stream = "ringdp-handle"

        def halt(self, why):
            calls.append(("halt", why))
            if how == "ctrl-c-twice":
                time.sleep(1.0)
            busy_until[0] = 0.0  # its kernels give up

        def check(self):
            calls.append(("check",))

        def quiesce(self):
            calls.append(("quiesce",))

        def destroy(self):
            calls.append(("destroy",))

    _fake_cuda.install(torch, [], ["default"], idle=lambda: time.monotonic() >= busy_until[0])
    comm = ringdp.get_communicator()
    ringdp.all_reduce(torch.ones(4))
    comm._cuda = cuda_comm.CudaEndpoint("ipc", Transport(), torch.device("cuda", 0))
    lines, t0 = [], time.monotonic()

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append((time.monotonic() - t0, record.getMessage()))

    logging.getLogger("ringdp").addHandler(Lines())
    if how == "device-ends":
        busy_until[0] = t0 + BUSY_S
    for at in [SIGINT_S, SIGINT_S + 0.5][:{"ctrl-c": 1, "ctrl-c-twice": 2}.get(how, 0)]:
        threading.Timer(at, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        if how == "abort":
            comm.close(wait=False)
        else:
            ringdp.destroy()
        raised = None
    except BaseException as e:  # noqa: BLE001 -- KeyboardInterrupt included
        raised = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    try:
        comm.all_reduce(torch.ones(4))
        after = None
    except ringdp.RingError as e:
        after = str(e)
    ringdp.destroy()
    return raised, took, calls, lines, after


@pytest.mark.parametrize("how", ["device-ends", "ctrl-c", "ctrl-c-twice", "abort"])
def test_cuda_work_at_close(how):
    """Closing with CUDA work still queued on ringdp's streams (a collective whose peers
    never came, left in flight at exit) waits for it where Ctrl-C reaches the wait: the
    transports' teardown synchronised their streams in C++, which held the signal until the
    device gave up (the timeout, 300 s by default), silently. After CLOSE_NOTE_S it says so
    on stderr; Ctrl-C there halts the transports (their kernels give up and tell the peers
    this rank's reason: close() has check() tell those of a transport no kernel was left
    on), tears down locally and raises; a second Ctrl-C meanwhile (an NCCL halt is its
    abort, which may take seconds) skips none of it; the backend's abort() halts them too,
    as torch's NCCL abort does. A stand-in transport on fake streams: what the device
    does with a halt is tests/test_cuda.py's (bench/gpu_check.sh)."""
    (raised, took, calls, lines, after), = values(run_ranks(_cuda_work_at_close, 1, how, timeout=120))
    notes = [(t, m) for t, m in lines if "closing waits for the CUDA collectives" in m]
    halts = [c for c in calls if c[0] == "halt"]
    if how == "device-ends":
        assert raised is None and BUSY_S - 0.1 < took < BUSY_S + SLACK_S, (raised, took)
        assert len(notes) == 1 and 0.9 < notes[0][0] < BUSY_S, lines  # (CLOSE_NOTE_S: 1 s)
        assert "ringdp rank 0: closing waits for the CUDA collectives queued on cuda:0" in notes[0][1], notes
        assert "Ctrl-C leaves them" in notes[0][1], notes
        assert calls == [("quiesce",), ("destroy",)], calls
        assert after is not None and "destroyed" in after, after
        return
    if how == "abort":
        assert raised is None and took < SLACK_S, (raised, took)
        assert halts == [("halt", "rank 0: ProcessGroup.abort() was called")], calls
    else:
        assert str(raised).startswith("KeyboardInterrupt"), raised
        assert took < SIGINT_S + SLACK_S, took  # (it waited for the device, which gives up only when halted)
        assert halts == [("halt", "rank 0: interrupted (KeyboardInterrupt: Ctrl-C) while closing, in the wait "
                                  "for its CUDA collectives")], calls
    assert after is not None and "rank 0" in after and "destroyed" in after, after
    # the halt, check() telling the peers of a transport no kernel was left on, the local teardown
    assert calls == [calls[0], ("check",), ("quiesce",), ("destroy",)], calls
    if how.startswith("ctrl-c"):
        assert len(notes) == 1, lines
        assert [m for _, m in lines if "interrupted while closing" in m] == [
            "ringdp rank 0: interrupted while closing: its CUDA collectives were left "
            "(their peers fail, naming this rank over CUDA IPC)"], lines


def _peer_dies_at_the_bucket_rebuild(rank, world):
    """RingDDP on the gloo default group: the last rank SIGKILLs itself where every rank
    adopts the authoritative rank's gradient order (Reducer.rebuild, at the end of the first
    synchronised backward). The others: (exception type, message, seconds to the error)."""
    import ringdp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = ringdp.RingDDP(model, bucket_cap_mb=0.001)
    if rank == world - 1:
        ddp.reducer.rebuild = lambda src: os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for s in range(3):
            ddp(torch.full((4, 16), float(rank + s))).pow(2).mean().backward()
    except Exception as e:  # noqa: BLE001 -- what the survivor sees
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, None, time.monotonic() - t0


def test_peer_dies_at_the_bucket_rebuild():
    """The gradient order goes through ringdp's communicator, not the process group (on
    gloo, its error named no rank): every survivor raises a RingError naming the dead rank
    within the timeout (5 s)."""
    world = 3
    res = run_ranks(_peer_dies_at_the_bucket_rebuild, world, env={"RINGDP_TIMEOUT_S": "5"},
                    allow_missing=(world - 1,), timeout=120)
    for r in range(world - 1):
        assert res[r][0] == "ok", res[r]
        etype, msg, took = res[r][1]
        assert etype == "RingError" and f"rank {world - 1}" in (msg or ""), (r, etype, msg)
        assert took < 5 + 2 * SLACK_S, (r, took, msg)
