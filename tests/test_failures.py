"""Failures end in exceptions on every surviving rank, within the timeout, naming the
rank and the problem; nothing is left in /dev/shm."""
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


def _bad_input(rank, world):
    import ringdp

    t = torch.ones(8, 8)
    try:
        if rank == 1:
            ringdp.all_reduce(t.t(), timeout=30)  # not contiguous
        else:
            ringdp.all_reduce(t, timeout=30)
        return None
    except (ValueError, ringdp.RingError) as e:
        return type(e).__name__, str(e)


def test_bad_input_on_one_rank_fails_all_ranks_fast():
    res = values(run_ranks(_bad_input, 2))
    assert res[1][0] == "ValueError" and "contiguous" in res[1][1]
    assert res[0][0] == "RingError" and "rank 1 rejected its input" in res[0][1]


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


def _peer_killed(rank, world, count, when):
    import threading

    import ringdp

    comm = ringdp.init(timeout=60)
    names = [f"{comm.shm.name}"]
    t = ringdp.empty(count) if rank == 0 else torch.ones(count)
    t.fill_(1.0)
    ringdp.all_reduce(t)  # one good call first
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
        return str(e), time.monotonic() - t0, names


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("world", [2, 3])
def test_sigkilled_peer(world, when):
    dead = world - 1
    res = run_ranks(_peer_killed, world, 4_000_000, when, allow_missing=(dead,), timeout=120)
    for rank in range(world - 1):
        status, value = res[rank]
        assert status == "ok", value
        assert value is not None, "the survivor never noticed"
        msg, took, names = value
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
