"""ringdp's torch.distributed backend on a group that spans hosts (issue 12 point 3): its
all-reduce runs ringdp's hierarchical path (ringdp/hosts.py CrossHost.all_reduce), not its inner
gloo group. Hosts simulated on one machine with RINGDP_HOST_ID per rank, set before
init_process_group("cpu:ringdp") (each rank leaves run_ranks' gloo group for a ringdp default
group on the same store: the backend's communicator sets up inside init_process_group).

Checked: dist.all_reduce of every dtype, op and size against tests/_closed_form.py, each
call twice, bitwise identical on every rank (sha256 through all_gather_object), a,a,b,b
(two_level) and a,a,a,b (leaders), RINGDP_HIERARCHY=0 (flat); that the hierarchical path ran
(the host-local shared-memory endpoint counted exactly its calls, and the cross-host gloo
group is the communicator's, not the backend's inner one); stock DDP across two simulated
hosts against one process; a whole host SIGKILLed; reduce_scatter_tensor,
all_gather_into_tensor and broadcast: the communicator's (two levels on even hosts, its gloo
group of every rank on uneven ones), never the inner gloo group."""
from __future__ import annotations

import hashlib
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _closed_form import all_reduce_matrix, expected, host_calls, value
from _dist import run_ranks, values

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32]
SIZES = [0, 1, 7, 4099, 300007]


def _ringdp_world(rank, world, hosts, timeout=60, hierarchy=None):
    """This rank as host hosts[rank], in a default group of ringdp's backend (made on the store
    of run_ranks' gloo group, which is destroyed first); returns the backend's communicator."""
    os.environ["RINGDP_HOST_ID"] = hosts[rank]
    if hierarchy is not None:
        os.environ["RINGDP_HIERARCHY"] = hierarchy
    import ringdp

    store = dist.distributed_c10d._get_default_store()  # rank 0 serves it while we hold it
    dist.destroy_process_group()
    dist.init_process_group("cpu:ringdp", store=dist.PrefixStore("backend-hosts/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, ringdp.ProcessGroupRingdp), type(pg)
    comm = ringdp.get_communicator()
    assert comm is pg.communicator
    return pg, comm, store


def _calls_per_all_reduce(comm, n: int, op: str) -> int:
    """In-host calls one all-reduce of n elements makes on this rank, in one piece (case_matrix):
    two_level: reduce_scatter + all_gather; leaders: all_reduce + broadcast (ranks of a host
    with several); n = 0: the first step (no data) and the closing header-only step after the
    call check (ringdp/hosts.py _close); AVG as many (the op goes in the steps' headers:
    CrossHost._announce); flat or alone on a host: none."""
    if comm.across is None or comm.across.inhost is None:
        return 0
    return 2


def case_matrix(rank, world, hosts, hierarchy=None, sizes=SIZES):
    os.environ["RINGDP_HIER_PIECE_BYTES"] = str(64 << 20)  # every call one piece: 2 in-host calls
    pg, comm, _store = _ringdp_world(rank, world, hosts, hierarchy=hierarchy)
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    calls0, want = host_calls(comm), []
    bad, digests = all_reduce_matrix(rank, world, lambda t, op, a: dist.all_reduce(t, op=op, async_op=a), DTYPES,
                                     sizes, lambda count, op: want.append(_calls_per_all_reduce(comm, count, op)))
    want_calls = sum(want)
    matrix_calls = host_calls(comm) - calls0

    # the other all-reduce forms the backend runs hierarchically: coalesced, PREMUL_SUM, 2-d
    ts = [value(rank, 5, world=world), value(rank, 4099, torch.float64, world=world)]
    pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
    for t, (n, dt) in zip(ts, [(5, torch.float32), (4099, torch.float64)]):
        if not torch.equal(t, expected("SUM", world, n, dt)):
            bad.append(("coalesced", n))
    t = value(rank, 4099, world=world)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    if not torch.equal(t, expected("SUM", world, 4099, torch.float32) * 0.5):
        bad.append(("premul", 4099))
    t = value(rank, 21, world=world).reshape(7, 3)  # not a multiple of the local size
    dist.all_reduce(t)
    if not torch.equal(t, expected("SUM", world, 21, torch.float32).reshape(7, 3)):
        bad.append(("2-d", 21))
    dist.barrier()  # its all-reduce runs on the communicator too (it raised across hosts before)
    extra_calls = host_calls(comm) - calls0 - matrix_calls

    # every rank's digests, compared on every rank (all_gather_object: the inner gloo group)
    mine = hashlib.sha256(repr(sorted(digests.items())).encode()).hexdigest()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    cross = comm.across.cross if comm.across is not None else None
    out = {"path": comm.cross_path, "local": (comm.local_rank, comm.local_size), "bad": bad,
           "digests": digests, "same_everywhere": all(d == mine for d in everyone),
           "host_shm": comm.across is not None and comm.across.inhost is not None,
           "matrix_calls": matrix_calls, "want_calls": want_calls,
           "extra_calls": extra_calls, "shm": comm.shm is not None,
           "cross": None if cross is None else (type(cross).__name__, comm.across.cross_ranks,
                                                cross is not pg._gloo and isinstance(cross, ProcessGroupGloo))}
    dist.destroy_process_group()
    return out


def _check_matrix(res, path, locals_, cross):
    for r, out in enumerate(res):
        assert out["path"] == path, (r, out["path"])
        assert out["local"] == locals_[r]
        assert not out["shm"]  # a group across hosts has no whole-group shared-memory endpoint
        assert out["bad"] == [], f"rank {r}: results differ from the closed forms: {out['bad'][:5]}"
        assert out["same_everywhere"], f"rank {r}: some rank's results are not bitwise equal to this one's"
        assert out["digests"] == res[0]["digests"], f"rank {r}'s results are not bitwise equal to rank 0's"
        # the hierarchical path ran: the in-host steps of every call on the host-local endpoint
        # (the inner gloo group would have made none), across hosts the communicator's own gloo group
        assert out["host_shm"] == (path != "flat" and locals_[r][1] > 1), (r, out["host_shm"])
        assert out["matrix_calls"] == out["want_calls"], (r, out["matrix_calls"], out["want_calls"])
        if out["host_shm"]:
            assert out["matrix_calls"] > 0 and out["extra_calls"] >= 8, (r, out["extra_calls"])
        assert out["cross"] == cross[r], (r, out["cross"])


def test_even_hosts_two_level():
    res = values(run_ranks(case_matrix, 4, ["a", "a", "b", "b"], timeout=240))
    g = "ProcessGroupGloo"
    _check_matrix(res, "two_level", [(0, 2), (1, 2), (0, 2), (1, 2)],
                  [(g, [0, 2], True), (g, [1, 3], True), (g, [0, 2], True), (g, [1, 3], True)])


def test_uneven_hosts_leaders():
    res = values(run_ranks(case_matrix, 4, ["a", "a", "a", "b"], timeout=240))
    g = "ProcessGroupGloo"
    _check_matrix(res, "leaders", [(0, 3), (1, 3), (2, 3), (0, 1)], [(g, [0, 3], True), None, None,
                                                                     (g, [0, 3], True)])


def test_hierarchy_off_is_flat_gloo_of_the_communicator():
    res = values(run_ranks(case_matrix, 4, ["a", "a", "b", "b"], "0", [0, 7, 4099], timeout=240))
    flat = ("ProcessGroupGloo", [0, 1, 2, 3], True)
    _check_matrix(res, "flat", [(0, 2), (1, 2), (0, 2), (1, 2)], [flat] * 4)


# ------------------------------------------------------------------ stock DDP
def case_ddp(rank, world, hosts, steps):
    import test_backend

    pg, comm, _store = _ringdp_world(rank, world, hosts)
    before = host_calls(comm)
    params = test_backend.train_ddp(rank, world, dist.group.WORLD, "plain", steps=steps)
    out = {"params": params, "host_calls": host_calls(comm) - before, "path": comm.cross_path,
           "ref": test_backend.reference(world, "plain", steps=steps)}
    dist.destroy_process_group()
    return out


def test_stock_ddp_on_two_hosts():
    import test_backend

    steps = 3
    res = values(run_ranks(case_ddp, 4, ["a", "a", "b", "b"], steps, timeout=240))
    for r, out in enumerate(res):
        assert out["path"] == "two_level"
        assert out["host_calls"] >= 2 * steps, f"rank {r}: DDP's buckets did not run on the hierarchical path"
        for a, b in zip(out["params"], out["ref"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {r} vs one process: {m}")
        for a, b in zip(out["params"], res[0]["params"]):
            assert torch.equal(a, b), f"rank {r}'s parameters differ from rank 0's"
    init = test_backend.params(test_backend.build(test_backend.MLP, 0))
    assert max((a - b).abs().max().item() for a, b in zip(res[0]["params"], init)) > 1e-3  # it trained


# ------------------------------------------------------------------ a host dies
def case_host_dies(rank, world, hosts, victims):
    import ringdp

    _pg, comm, _store = _ringdp_world(rank, world, hosts, timeout=20)
    t = value(rank, 4099, world=world)
    dist.all_reduce(t)  # works once
    ok = torch.equal(t, expected("SUM", world, 4099, torch.float32))
    if rank in victims:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    start = time.monotonic()
    try:
        dist.all_reduce(value(rank, 4099, world=world))
    except ringdp.RingError as e:
        return ok, comm.cross_path, str(e), time.monotonic() - start
    except Exception as e:  # noqa: BLE001 -- e.g. gloo's own error: not ringdp's guarantee
        return ok, comm.cross_path, f"not a RingError: {type(e).__name__}: {e}", time.monotonic() - start
    return ok, comm.cross_path, None, time.monotonic() - start


@pytest.mark.parametrize("hosts,path", [(["a", "a", "b", "b"], "two_level"), (["a", "a", "a", "b"], "leaders")])
def test_whole_host_dies_is_a_ring_error(hosts, path):
    victims = [r for r, h in enumerate(hosts) if h == "b"]
    res = run_ranks(case_host_dies, 4, hosts, victims, timeout=120, allow_missing=victims)
    for r, out in enumerate(res):
        if r in victims:
            continue
        assert out is not None and out[0] == "ok", (r, out)
        ok, got_path, msg, took = out[1]
        assert ok and got_path == path, (r, ok, got_path)
        assert msg is not None, f"rank {r}: no error after host b died"
        assert not msg.startswith("not a RingError"), (r, msg)
        assert took < 25, (r, took)
        # it names the ranks of the failed cross-host step, a rank of the dead host among them
        assert "across hosts" in msg and "ranks [" in msg, (r, msg)
        named = msg.split("ranks [", 1)[1].split("]", 1)[0]
        assert any(str(v) in named.split(", ") for v in victims), (r, msg)


def _abort_in_flight(g, rank, world):
    """An async all-reduce on `g`, then torch's _abort_process_group 0.5 s later: (the RingError
    its wait() raised, seconds from the abort), or None when it raised none."""
    import ringdp

    work = dist.all_reduce(value(rank, 1 << 16, world=world), async_op=True)
    time.sleep(0.5)
    start = time.monotonic()
    dist.distributed_c10d._abort_process_group(g)
    try:
        work.wait()
    except ringdp.RingError as e:
        return str(e), time.monotonic() - start
    return None


def case_abort(rank, world, hosts):
    """torch's _abort_process_group on rank 0 while its all-reduce waits in its first in-host
    step for rank 1 (host a), which has not called yet: the call fails at once naming the
    abort, with no call check (the in-host endpoint of a group across hosts is aborted too,
    and the check would wait for the other host). The others call after the abort: rank 1's
    in-host step fails at once naming rank 0, and its FAILED row tells rank 3, its peer
    across hosts; rank 2, waiting for rank 0's row, fails when rank 0's cross-host gloo group
    goes with its endpoints (at the latest at its cross-host timeout)."""
    import ringdp

    _pg, comm, _store = _ringdp_world(rank, world, hosts, timeout=10)
    t = value(rank, 4099, world=world)
    dist.all_reduce(t)  # works once
    ok = torch.equal(t, expected("SUM", world, 4099, torch.float32))
    g, path = dist.distributed_c10d._get_default_group(), comm.cross_path  # (None once released)
    out = None
    if rank == 0:
        out = _abort_in_flight(g, rank, world)
        time.sleep(12)  # (its store serves the others until they are done)
        return ok, path, out
    time.sleep(3)
    start = time.monotonic()
    try:
        dist.all_reduce(value(rank, 1 << 16, world=world))
    except ringdp.RingError as e:
        out = (str(e), time.monotonic() - start)
    dist.destroy_process_group()
    return ok, path, out


def test_abort_across_hosts_fails_the_in_host_step_at_once():
    res = run_ranks(case_abort, 4, ["a", "a", "b", "b"], timeout=120)
    for r, out in enumerate(res):
        assert out is not None and out[0] == "ok", (r, out)
        ok, path, got = out[1]
        assert ok and path == "two_level", (r, ok, path)
        assert got is not None, f"rank {r}: no error"
    (m0, s0), (m1, s1), (m2, s2), (m3, s3) = (out[1][2] for out in res)
    assert "aborted on this rank" in m0 and "ProcessGroup.abort()" in m0 and s0 < 2.0, (m0, s0)
    assert "rank 0 aborted" in m1 and "ProcessGroup.abort()" in m1 and s1 < 5.0, (m1, s1)
    assert "rank 1" in m3 and "rank 0 aborted" in m3 and s3 < 5.0, (m3, s3)
    assert "across hosts" in m2 and s2 < 12.0, (m2, s2)  # (rank 0 posts no row: the timeout)


def case_abort_across(rank, world, hosts, late):
    """torch's _abort_process_group on rank 0 while its all-reduce waits across hosts: host a
    (ranks 0, 1) calls at once, host b (2, 3) `late` seconds later, so rank 0 waits in its
    call check for rank 2 (a gloo step) when it aborts. gloo cannot end a collective in
    flight: the wait does (in slices, hosts.py CrossHost._await). Rank 0's call fails at once
    naming the abort; every other rank's within about a second of its own wait across hosts,
    naming rank 0's abort (the note it left in the store), never at its cross-host timeout
    (27 s here). Then the process goes on: a new group of the same ranks works."""
    import ringdp

    _pg, comm, store = _ringdp_world(rank, world, hosts, timeout=30)
    t = value(rank, 4099, world=world)
    dist.all_reduce(t)  # works once
    ok = torch.equal(t, expected("SUM", world, 4099, torch.float32))
    g, path = dist.distributed_c10d._get_default_group(), comm.cross_path
    out = None
    if hosts[rank] != "a":
        time.sleep(late)
    start = time.monotonic()
    if rank == 0:
        out = _abort_in_flight(g, rank, world)
    else:
        try:
            dist.all_reduce(value(rank, 1 << 16, world=world))
        except ringdp.RingError as e:
            out = (str(e), time.monotonic() - start)
        dist.destroy_process_group()
    # a new group of the same ranks (as a fault-tolerant trainer would make) on a fresh prefix
    dist.init_process_group("cpu:ringdp", store=dist.PrefixStore("after-abort/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    t = value(rank, 4099, world=world)
    dist.all_reduce(t)
    after = torch.equal(t, expected("SUM", world, 4099, torch.float32))
    dist.destroy_process_group()
    return ok, path, out, after


@pytest.mark.parametrize("hosts, path", [(["a", "a", "b", "b"], "two_level"), (["a", "a", "a", "b"], "leaders")])
def test_abort_across_hosts_ends_the_cross_host_wait(hosts, path):
    late, codes = 3.0, []
    res = run_ranks(case_abort_across, 4, hosts, late, timeout=120, exitcodes=codes)
    # the gloo works left in flight end, and the processes exit cleanly (a daemon thread
    # holding their gloo group at exit ended it in std::terminate: ringdp/inflight.py)
    assert codes == [0, 0, 0, 0], codes
    for r, out in enumerate(res):
        assert out is not None and out[0] == "ok", (r, out)
        ok, got_path, got, after = out[1]
        assert ok and got_path == path, (r, ok, got_path)
        assert got is not None, f"rank {r}: no error"
        assert after, f"rank {r}: the group made after the abort gave a wrong sum"
    msgs = [out[1][2] for out in res]
    # rank 0: its call check across hosts (with host b's rank, who has not called) ends at once
    m0, s0 = msgs[0]
    assert "aborted on this rank" in m0 and "ProcessGroup.abort()" in m0 and s0 < 1.0, (m0, s0)
    # two_level: rank 1 waits in its call check for rank 3 (host b, late), and the note in the
    # store ends it; leaders: ranks 1 and 2 (in no check) wait in the in-host broadcast from
    # rank 0, whose aborted endpoint ends it. Host b calls later: its cross-host waits (rank
    # 0's abandoned check may even complete with its row) end when they read the note, or
    # when a host peer rejects the call. Each names rank 0 and its abort.
    for r, (m, s) in enumerate(msgs[1:], 1):
        assert ("rank 0 aborted" in m or "rank 0 rejected" in m and "aborted on this rank" in m) and s < 3.0, (r, m, s)
    assert any("rank 0 aborted the group" in m for m, _ in msgs[1:]), msgs  # (the note reached host b)


# ------------------------------------------------------------------ the other collectives
def case_other_collectives(rank, world, hosts):
    import ringdp

    pg, comm, _store = _ringdp_world(rank, world, hosts)
    out = {}
    calls0 = host_calls(comm)

    class NoInnerGloo:  # the backend must not hand these to its inner gloo group
        def __getattr__(self, name):
            raise AssertionError(f"the inner gloo group was used ({name})")

    inner, pg._gloo = pg._gloo, NoInnerGloo()
    for dtype in (torch.float32, torch.int32):
        n = 4099
        inp = torch.cat([value(rank, n, dtype, world=world) + q for q in range(world)])  # block q: v(rank, i) + q
        o = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(o, inp)
        out[f"reduce_scatter_tensor {dtype}"] = (o, expected("SUM", world, n, dtype) + world * rank)
        g = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(g, value(rank, n, dtype, world=world))
        out[f"all_gather_into_tensor {dtype}"] = (g, torch.cat([value(q, n, dtype, world=world) for q in range(world)]))
        for src in (0, world - 1):
            b = value(rank, n, dtype, world=world)
            dist.broadcast(b, src=src)
            out[f"broadcast {dtype} from {src}"] = (b, value(src, n, dtype, world=world))
    pg._gloo = inner
    steps = host_calls(comm) - calls0
    # ringdp's own call on the same communicator
    try:
        o = torch.empty(2)
        ringdp.reduce_scatter_tensor(o, torch.ones(2 * world))
        refused = None if torch.equal(o, torch.full((2,), float(world))) else f"wrong result {o}"
    except ringdp.RingError as e:
        refused = str(e)
    t = value(rank, 7, world=world)
    dist.all_reduce(t)  # the hierarchical all-reduce after them: still in step
    out["all_reduce after"] = (t, expected("SUM", world, 7, torch.float32))
    dist.destroy_process_group()
    released = comm.across is None and comm.cross_path is None  # shutdown() closed the communicator
    return {"results": out, "refused": refused, "released": released, "host_calls": steps}


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "a", "a", "b"]])
def test_other_collectives(hosts):
    """reduce_scatter_tensor, all_gather_into_tensor and broadcast on a backend group across
    hosts run on its communicator, never the inner gloo group (replaced by one that raises):
    on two levels on even hosts, through the leaders on uneven ones (the in-host endpoint
    makes calls for them; a rank alone on its host has none); exact."""
    for r, res in enumerate(values(run_ranks(case_other_collectives, 4, hosts, timeout=180))):
        for name, (got, want) in res["results"].items():
            assert torch.equal(got, want), f"rank {r} {name}: {got[:8]} != {want[:8]}"
        if hosts.count(hosts[r]) > 1:
            assert res["host_calls"] >= 2 * 4, (r, res["host_calls"])  # 2 dtypes x (rs, ag, 2 broadcasts)
        else:
            assert res["host_calls"] == 0, (r, res["host_calls"])
        assert res["refused"] is None, res["refused"]
        assert res["released"], f"rank {r}: the destroyed group's communicator kept its cross-host gloo group"
