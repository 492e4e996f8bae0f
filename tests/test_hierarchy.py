"""The CPU all-reduce across hosts (issue 12): hosts simulated on one machine with
RINGDP_HOST_ID per rank (set inside each rank before ringdp.init), against the closed forms
of tests/_closed_form.py, each call twice, bitwise identical on every rank; the even path
(a,a,b,b: two-level), the uneven one (a,a,a,b: leaders), RINGDP_HIERARCHY=0 (gloo on the
whole group), RingDDP across two simulated hosts, and a whole host SIGKILLed; also
reduce_scatter_tensor, all_gather_into_tensor and broadcast across hosts (tests/test_collectives.py's
closed forms) and a host dying under them."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _closed_form import all_reduce_matrix, expected, host_calls, nan_expected, nan_input, same_with_nan, value
from _dist import run_ranks, values

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "bench")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
SIZES = [0, 1, 7, 4099, 300007]


def _as_host(rank, hosts, hierarchy=None, timeout=60):
    os.environ["RINGDP_HOST_ID"] = hosts[rank]
    if hierarchy is not None:
        os.environ["RINGDP_HIERARCHY"] = hierarchy
    import ringdp

    return ringdp.init(timeout=timeout)


def case_matrix(rank, world, hosts, hierarchy=None, piece_bytes=None, max_pieces=None):
    import ringdp

    if piece_bytes is not None:
        os.environ["RINGDP_HIER_PIECE_BYTES"] = str(piece_bytes)
    if max_pieces is not None:  # this process only (run_ranks: fresh processes)
        ringdp.policy.HIER_MAX_PIECES = max_pieces

    c = _as_host(rank, hosts, hierarchy)
    from ringdp import policy
    bad, digests = all_reduce_matrix(rank, world, lambda t, op, a: ringdp.all_reduce(t, op=op, async_op=a), DTYPES,
                                     SIZES)
    t = value(rank, 21, torch.float32, world=world).reshape(7, 3)  # a 2-d tensor, not a multiple of the local size
    ringdp.all_reduce(t)
    if not torch.equal(t, expected("SUM", world, 21, torch.float32).reshape(7, 3)):
        bad.append(("2-d", "SUM", 21))
    # registered memory: this host's arena on the hierarchical paths (the all-reduce of it
    # then runs its in-host steps in place), a clear error on the flat one
    # (4099: its blocks go with the call check; 100003: through gloo, in one piece by default,
    # the first step's outcome with the data out of place: CrossHost._fold_start)
    registered = None
    try:
        ringdp.empty(1)
    except ValueError as e:
        registered = str(e)
    else:
        ok = True
        for n in (4099, 100003):
            t = ringdp.empty(n)
            alone = c.local_size == 1  # (uneven hosts: a rank alone on its host gets ordinary memory)
            ok = ok and ringdp.is_registered(t) != alone and not ringdp.is_registered(torch.empty(n))
            for _ in range(2):
                t.copy_(value(rank, n, world=world))
                ringdp.all_reduce(t)
                ok = ok and torch.equal(t, expected("SUM", world, n, torch.float32))
        registered = ok
    # in-host calls of one SUM all-reduce of a known size (_host_calls_want): how many pieces it went in
    pieces = {}
    for dtype, n in PIECE_CASES:
        t = value(rank, n, dtype, world=world)
        before = host_calls(c)
        ringdp.all_reduce(t)
        pieces[(str(dtype), n)] = (host_calls(c) - before, torch.equal(t, expected("SUM", world, n, dtype)))
    return {"path": c.cross_path, "local": (c.local_rank, c.local_size), "bad": bad, "digests": digests,
            "registered": registered, "machine_ranks": c.machine_ranks,
            "fused": (c.across.fused_calls, policy.check_payload_bytes(len(c.across.cross_ranks) or 1)),
            "folded": c.across.folded_calls, "host_calls": pieces}


PIECE_CASES = [(torch.float32, 300_007), (torch.bfloat16, 4099)]


def _host_calls_want(path, local_size, n, esz, piece_bytes, max_pieces) -> int:
    """In-host calls of one SUM all-reduce of n elements of esz bytes (ringdp/hosts.py, policy.py):
    at most max_pieces pieces (default 2), each at least piece_bytes (default 16 MiB), i.e.
    pieces of max(piece_bytes, ceil(bytes / max_pieces)), rounded up to whole elements, on
    two_level to whole rows of local_size elements of the tensor padded to a multiple of
    local_size; two in-host calls a piece (two_level: reduce_scatter + all_gather; leaders:
    all_reduce + broadcast), none for a rank alone on its host. (The whole call's count and
    op go in the steps' headers: CrossHost._announce, no call of their own.)"""
    if local_size == 1:
        return 0
    piece_bytes = piece_bytes or (16 << 20)
    max_pieces = max_pieces or 2
    if path == "two_level":
        rows = -(-n // local_size)
        per = -(-max(piece_bytes, -(-rows * local_size * esz // max_pieces)) // (local_size * esz))
        return 2 * -(-rows // per)
    per = -(-max(piece_bytes, -(-n * esz // max_pieces)) // esz)
    return 2 * -(-n // per)


def _check_pieces(res, piece_bytes, max_pieces):
    for r, out in enumerate(res):
        path, (_, local_size) = out["path"], out["local"]
        want = {(str(dtype), n): (_host_calls_want(path, local_size, n, dtype.itemsize, piece_bytes, max_pieces), True)
                for dtype, n in PIECE_CASES}
        assert out["host_calls"] == want, (r, path, out["host_calls"], want)


def _check_matrix(res, path, locals_):
    for r, out in enumerate(res):
        assert out["path"] == path, (r, out["path"])
        assert out["local"] == locals_[r]
        # simulated hosts share this machine: the spin policy counts all the group's ranks here
        assert out["machine_ranks"] == len(res), (r, out["machine_ranks"])
        # the small all-reduces went with the call check (its payload slot: 1-7 elements, and
        # 4099 float32 on two hosts), the others by gloo; a non-leader has no cross-host step
        fused, slot = out["fused"]
        assert (fused > 0) == (path != "leaders" or locals_[r][0] == 0), (r, path, out["fused"])
        assert path == "two_level" or out["folded"] == 0, (r, path, out["folded"])  # (the two-level path's alone)
        assert out["bad"] == [], f"rank {r}: results differ from the closed forms: {out['bad'][:5]}"
        if path == "flat":
            assert isinstance(out["registered"], str) and "spans 2 hosts" in out["registered"], out["registered"]
        else:
            assert out["registered"] is True, f"rank {r}: registered memory across hosts: {out['registered']}"
        assert out["digests"] == res[0]["digests"], f"rank {r}'s results are not bitwise equal to rank 0's"
    return res[0]["digests"]


# default: one piece; 8 KiB minimum: 2 pieces (policy.HIER_MAX_PIECES) from 8 KiB, of whole
# elements (4099 bfloat16 padded to 2 x 2050: pieces of 2 x 2048 and 2 x 2); no cap: 3 to 300
@pytest.mark.parametrize("piece_bytes,max_pieces", [(None, None), (8192, None), (8192, 10 ** 6)])
def test_even_hosts_two_level(piece_bytes, max_pieces):
    res = values(run_ranks(case_matrix, 4, ["a", "a", "b", "b"], None, piece_bytes, max_pieces, timeout=200))
    _check_matrix(res, "two_level", [(0, 2), (1, 2), (0, 2), (1, 2)])
    _check_pieces(res, piece_bytes, max_pieces)
    # one piece too big for the call check's slot (300007 float32 and more, registered 100003):
    # the first step's outcome went with the data (_fold_start); in pieces it never does
    for r, out in enumerate(res):
        assert (out["folded"] > 0) == (piece_bytes is None), (r, out["folded"])


@pytest.mark.parametrize("piece_bytes,max_pieces", [(None, None), (8192, None), (8192, 10 ** 6)])  # one; two; many
def test_uneven_hosts_leaders(piece_bytes, max_pieces):
    res = values(run_ranks(case_matrix, 4, ["a", "a", "a", "b"], None, piece_bytes, max_pieces, timeout=200))
    _check_matrix(res, "leaders", [(0, 3), (1, 3), (2, 3), (0, 1)])
    _check_pieces(res, piece_bytes, max_pieces)


def test_interleaved_hosts_and_hierarchy_off_same_results():
    # hosts a,b,a,b: local ranks follow rank order on each host; RINGDP_HIERARCHY=0: gloo on
    # the whole group, the same (exact) results
    two = _check_matrix(values(run_ranks(case_matrix, 4, ["a", "b", "a", "b"], timeout=200)), "two_level",
                        [(0, 2), (0, 2), (1, 2), (1, 2)])
    flat = _check_matrix(values(run_ranks(case_matrix, 4, ["a", "a", "b", "b"], "0", timeout=200)), "flat",
                         [(0, 2), (1, 2), (0, 2), (1, 2)])
    assert two == flat


def test_one_rank_per_host_is_gloo():
    res = values(run_ranks(case_matrix, 2, ["a", "b"], timeout=120))
    _check_matrix(res, "flat", [(0, 1), (0, 1)])


def case_nan_min_max(rank, world, hosts, hierarchy=None, piece_bytes="8192"):
    """MIN and MAX (all_reduce, reduce_scatter_tensor) with NaNs on some ranks
    (tests/_closed_form.py nan_input) across hosts: a
    NaN ignored unless every rank has one, as on one host (gloo's own min/max keep a NaN only
    as their first operand); small sizes go with the call check's rows, larger ones through
    gloo (RINGDP_HIER_PIECE_BYTES 8192: several pieces; None: one piece, the first step's
    outcome with the data, CrossHost._fold_start). Host a's ranks (0 and 1) also have
    NaN where the other host has none, so that the cross-host step sees NaN on one side."""
    import torch.distributed as dist

    if piece_bytes is not None:
        os.environ["RINGDP_HIER_PIECE_BYTES"] = piece_bytes
    comm = _as_host(rank, hosts, hierarchy)
    bad = []
    for op in ("MIN", "MAX"):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            for n in (7, 4099, 300007):
                want = nan_expected(op, world, n, dtype, also=(0, 1))
                for reg in (False, True):
                    if reg and comm.cross_path != "two_level":
                        continue
                    t = comm.empty((n,), dtype) if reg else torch.empty(n, dtype=dtype)
                    t.copy_(nan_input(rank, world, n, dtype, also=(0, 1)))
                    comm.all_reduce(t, op=getattr(dist.ReduceOp, op))
                    if not same_with_nan(t, want):
                        bad.append((op, str(dtype), n, reg))
                res = torch.empty(n, dtype=dtype)
                comm.reduce_scatter_tensor(res, torch.cat([nan_input(rank, world, n, dtype, also=(0, 1))] * world),
                                           op=getattr(dist.ReduceOp, op))
                if not same_with_nan(res, want):
                    bad.append(("reduce_scatter", op, str(dtype), n))
    return comm.cross_path, bad


@pytest.mark.parametrize("hosts,hierarchy,path,piece_bytes", [
    ("aabb", None, "two_level", "8192"), ("aabb", None, "two_level", None), ("aaab", None, "leaders", "8192"),
    ("aabb", "0", "flat", "8192")])
def test_min_max_ignore_nan_across_hosts(hosts, hierarchy, path, piece_bytes):
    for r, (got, bad) in enumerate(values(run_ranks(case_nan_min_max, 4, list(hosts), hierarchy, piece_bytes,
                                                    timeout=200))):
        assert got == path and not bad, (r, got, bad)


def case_later_groups(rank, world, hosts):
    """After ringdp set up across hosts: a second communicator on the same group (its own
    gloo groups) and a group the user makes with local synchronization both work (torch
    names such a group after the number of groups the rank already knows)."""
    from datetime import timedelta

    import ringdp
    from ringdp.comm import Communicator

    c = _as_host(rank, hosts, timeout=20)
    flat = Communicator(timeout=20, config=c.config.replace(hierarchy=False))
    t = value(rank, 1001, world=world)
    flat.all_reduce(t)
    ok = [c.cross_path, flat.cross_path, torch.equal(t, expected("SUM", world, 1001, torch.float32))]
    g = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=20),
                       use_local_synchronization=True)
    t = value(rank, 33, world=world)
    dist.all_reduce(t, group=g)
    t2 = value(rank, 33, world=world)
    ringdp.all_reduce(t2)
    flat.close()
    return ok + [torch.equal(t, t2)]


@pytest.mark.parametrize("hosts,path", [("aaab", "leaders"), ("aabb", "two_level")])
def test_later_groups_after_set_up(hosts, path):
    for r, (p, flat, ok, same) in enumerate(values(run_ranks(case_later_groups, len(hosts), list(hosts), timeout=120))):
        assert (p, flat) == (path, "flat") and ok and same, (r, p, flat, ok, same)


def case_groups_known_differ(rank, world, hosts):
    """The user's own groups first, [1, 2, 3] and [0, 3]: ranks 1 and 3 are members of
    different numbers of them (torch then names a group made with local synchronization
    differently on the two). ringdp then sets up across hosts on the default group; its
    cross-host groups must not depend on that count (they did: ranks 1 and 3 waited for
    each other under two names until the timeout). Then the default group is destroyed:
    rank 0's store port is free (ringdp's gloo groups hold no store)."""
    import socket
    from datetime import timedelta

    import ringdp

    os.environ["RINGDP_HOST_ID"] = hosts[rank]
    store = dist.distributed_c10d._get_default_store()
    while not hasattr(store, "port"):  # PrefixStores over run_ranks' TCPStore
        store = store.underlying_store
    port = store.port
    del store
    for members in ([1, 2, 3], [0, 3]):
        dist.new_group(members, backend="gloo", timeout=timedelta(seconds=20))
    t0 = time.monotonic()
    c = ringdp.init(timeout=20)
    t = value(rank, 1001, world=world)
    ringdp.all_reduce(t)
    took = time.monotonic() - t0
    ok = torch.equal(t, expected("SUM", world, 1001, torch.float32))
    path = c.cross_path
    del c
    dist.barrier()
    dist.destroy_process_group()
    listened = None
    if rank == 0:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                listened = False
            except OSError:
                listened = True
    return path, ok, took, listened


@pytest.mark.parametrize("hosts,path", [("aabb", "two_level"), ("aaab", "leaders")])
def test_cross_host_groups_whatever_groups_a_rank_knows(hosts, path):
    for r, (p, ok, took, listened) in enumerate(values(run_ranks(case_groups_known_differ, 4, list(hosts),
                                                                 timeout=120))):
        assert (p, ok) == (path, True), (r, p, ok)
        assert took < 15, f"rank {r}: set-up and one all-reduce took {took:.1f} s (waited for a peer?)"
        assert listened in ((False,) if r == 0 else (None,)), f"rank {r}: the store port still listened: {listened}"


def case_one_element_views(rank, world, hosts):
    """One-element views at stride 2 (torch calls them contiguous, but cannot view them as
    bytes): their data goes with the call check (a fused payload). It raised "self.stride(-1)
    must be 1 to view Float as Byte" on every rank (found by tests/_fuzz.py)."""
    import ringdp

    _as_host(rank, hosts, timeout=20)
    base = torch.full((1, 2), -1.0)
    t = base[:, 1]
    t.fill_(rank + 1.0)
    ringdp.all_reduce(t)
    out = {"all_reduce": (base.clone(), torch.tensor([[-1.0, world * (world + 1) / 2]]))}
    src = torch.full((1, 2), -1.0)
    x = src[:, 1]
    x.fill_(10.0 + rank)
    o = torch.zeros(world)
    ringdp.all_gather_into_tensor(o, x)
    out["all_gather_into_tensor"] = (o, 10.0 + torch.arange(world, dtype=torch.float32))
    return out


def _assert_each_exact(case, hosts):
    """Run `case` on simulated `hosts`; every rank's {name: (got, want)} bitwise equal."""
    for r, out in enumerate(values(run_ranks(case, len(hosts), list(hosts), timeout=120))):
        for name, (got, want) in out.items():
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"rank {r} {name}: {m}")


@pytest.mark.parametrize("hosts", ["aabb", "ab"])
def test_one_element_views_across_hosts(hosts):
    _assert_each_exact(case_one_element_views, hosts)


def case_tensors_autograd_guards(rank, world, hosts):
    """Parameters (leaves that require grad) and inference tensors, which one host's C++
    transports write below autograd, across hosts too, where the steps are torch ops: every
    collective, AVG's division included, at a size that goes with the call check and one
    whose data goes through gloo's steps, twice (each raised "a view of a leaf Variable that
    requires grad is being used in an in-place operation" or "Inplace update to inference
    tensor outside InferenceMode", 2026-12-07). Their versions count the writes; a Parameter
    still trains."""
    import ringdp

    _as_host(rank, hosts, timeout=20)
    out = {}

    def inference(t):
        with torch.inference_mode():
            return t.clone()

    for n in (4099, 300_007):
        for k in range(2):
            key = lambda name: f"{name} n={n} #{k}"  # noqa: E731
            p = torch.nn.Parameter(value(rank, n, world=world))
            v0 = p._version
            ringdp.all_reduce(p, op=dist.ReduceOp.AVG)
            out[key("all_reduce AVG Parameter")] = (p.detach().clone(), expected("AVG", world, n, torch.float32))
            out[key("version counts the write")] = (torch.tensor(p._version > v0), torch.tensor(True))
            t = inference(value(rank, n, world=world))
            ringdp.all_reduce(t)
            out[key("all_reduce inference tensor")] = (t, expected("SUM", world, n, torch.float32))
            m = n // world + 1
            want = expected("SUM", world, m * world, torch.float32)[rank * m:(rank + 1) * m]
            for kind, o in (("Parameter", torch.nn.Parameter(torch.zeros(m))), ("inference", inference(torch.zeros(m)))):
                ringdp.reduce_scatter_tensor(o, value(rank, m * world, world=world))
                out[key(f"reduce_scatter into {kind}")] = (o.detach().clone(), want)
            gathered = torch.cat([value(q, m, world=world) for q in range(world)])
            for kind, o in (("Parameter", torch.nn.Parameter(torch.zeros(m * world))),
                            ("inference", inference(torch.zeros(m * world)))):
                ringdp.all_gather_into_tensor(o, value(rank, m, world=world))
                out[key(f"all_gather into {kind}")] = (o.detach().clone(), gathered)
            for kind, b in (("Parameter", torch.nn.Parameter(value(rank, n, world=world))),
                            ("inference", inference(value(rank, n, world=world)))):
                ringdp.broadcast(b, world - 1)
                out[key(f"broadcast {kind}")] = (b.detach().clone(), value(world - 1, n, world=world))
    p = torch.nn.Parameter(value(rank, 7, world=world))
    ringdp.broadcast(p, world - 1)
    (p * p).sum().backward()  # (still a leaf that trains)
    out["grad"] = (p.grad, 2 * value(world - 1, 7, world=world))
    return out


def _assert_each_exact(case, hosts):
    """Run `case` on simulated `hosts`; every rank's {name: (got, want)} bitwise equal."""
    for r, out in enumerate(values(run_ranks(case, len(hosts), list(hosts), timeout=120))):
        for name, (got, want) in out.items():
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"rank {r} {name}: {m}")


@pytest.mark.parametrize("hosts", ["aabb", "ab"])
def test_one_element_views_across_hosts(hosts):
    _assert_each_exact(case_one_element_views, hosts)


def case_tensors_autograd_guards(rank, world, hosts):
    """Parameters (leaves that require grad) and inference tensors, which one host's C++
    transports write below autograd, across hosts too, where the steps are torch ops: every
    collective, AVG's division included, twice (each raised "a view of a leaf Variable that
    requires grad is being used in an in-place operation" or "Inplace update to inference
    tensor outside InferenceMode", 2026-12-07). Their versions count the writes; a Parameter
    still trains."""
    import ringdp

    _as_host(rank, hosts, timeout=20)
    n = 4099
    out = {}
    for _ in range(2):
        p = torch.nn.Parameter(value(rank, n, world=world))
        v0 = p._version
        ringdp.all_reduce(p, op=dist.ReduceOp.AVG)
        out["all_reduce AVG Parameter"] = (p.detach().clone(), expected("AVG", world, n, torch.float32))
        out["version counts the write"] = (torch.tensor(p._version > v0), torch.tensor(True))
        with torch.inference_mode():
            t = value(rank, n, world=world)
        ringdp.all_reduce(t)
        out["all_reduce inference tensor"] = (t, expected("SUM", world, n, torch.float32))
        o = torch.nn.Parameter(torch.zeros(7))
        ringdp.reduce_scatter_tensor(o, value(rank, 7 * world, world=world))
        out["reduce_scatter Parameter"] = (o.detach().clone(), expected("SUM", world, 7 * world, torch.float32)[rank * 7:(rank + 1) * 7])
        g = torch.nn.Parameter(torch.zeros(5 * world))
        ringdp.all_gather_into_tensor(g, value(rank, 5, world=world))
        out["all_gather Parameter"] = (g.detach().clone(), torch.cat([value(q, 5, world=world) for q in range(world)]))
        b = torch.nn.Parameter(value(rank, n, world=world))
        ringdp.broadcast(b, world - 1)
        out["broadcast Parameter"] = (b.detach().clone(), value(world - 1, n, world=world))
    (b * b).sum().backward()  # (still a leaf that trains)
    out["grad"] = (b.grad, 2 * value(world - 1, n, world=world))
    return out


@pytest.mark.parametrize("hosts", ["aabb", "aab"])
def test_parameters_and_inference_tensors_across_hosts(hosts):
    _assert_each_exact(case_tensors_autograd_guards, hosts)


def case_collectives(rank, world, hosts, hierarchy=None):
    """reduce_scatter_tensor, all_gather_into_tensor and broadcast across hosts: the closed
    forms of tests/test_collectives.py (every rank's values depend on rank and index, every
    call twice, broadcast from every rank in turn), then the same asynchronously."""
    import test_collectives

    import ringdp

    c = _as_host(rank, hosts, hierarchy)
    checked, bad = test_collectives._matrix(rank, world, [0, 1, 7, 4099], [torch.float32, torch.bfloat16, torch.int64],
                                            registered_too=False)
    k = 1001  # async, a 2-d output
    out = torch.empty(7, 143)
    ringdp.reduce_scatter_tensor(out, value(rank, world * k, world=world), async_op=True).wait()
    if not torch.equal(out.view(-1), expected("SUM", world, world * k, torch.float32)[rank * k:(rank + 1) * k]):
        bad.append(("rs async, 2-d output",))
    gathered = torch.empty(world * k)
    ringdp.all_gather_into_tensor(gathered, value(rank, k, world=world), async_op=True).wait()
    if not torch.equal(gathered, torch.cat([value(q, k, world=world) for q in range(world)])):
        bad.append(("ag async",))
    return c.cross_path, checked, bad, (c.across.fused_calls, c.across.cross is not None)


@pytest.mark.parametrize("hosts,path", [("aabb", "two_level"), ("abab", "two_level"), ("aaab", "leaders"),
                                        ("ab", "flat")])
def test_collectives_across_hosts(hosts, path):
    # sizes 0, 1, 7 go with the call check (fused), 4099 in some dtypes too, in others not
    res = values(run_ranks(case_collectives, len(hosts), list(hosts), timeout=200))
    for r, (p, checked, bad, (fused, checks)) in enumerate(res):
        assert p == path and checked > 0
        assert bad == [], f"rank {r}: {bad[:10]}"
        assert (fused > 0) == checks, (r, fused, checks)


def case_mismatch_across_hosts(rank, world, hosts):
    """Ranks of different hosts at different calls: a RingError on every rank that names the
    calls (gloo alone kills the process on a size mismatch), then the communicator works."""
    import ringdp

    _as_host(rank, hosts, timeout=20)
    b = hosts[rank] == "b"
    calls = [  # (what host a's ranks call, what host b's call)
        lambda: ringdp.all_reduce(torch.ones(2000 if b else 1000)),  # count
        lambda: ringdp.all_reduce(torch.ones(1000), op=dist.ReduceOp.MAX if b else dist.ReduceOp.SUM),  # op
        lambda: ringdp.all_gather_into_tensor(torch.empty(world * (9 if b else 5)), torch.ones(9 if b else 5)),
        lambda: ringdp.broadcast(torch.ones(3 if b else 4), 0),
    ]
    errors = []
    for call in calls:
        t0 = time.monotonic()
        try:
            call()
            errors.append(None)
        except ringdp.RingError as e:
            errors.append((str(e), time.monotonic() - t0))
    t = value(rank, 4099, world=world)
    ringdp.all_reduce(t)
    return errors, torch.equal(t, expected("SUM", world, 4099, torch.float32))


@pytest.mark.parametrize("hosts", ["aabb", "aaab", "ab"])
def test_mismatch_across_hosts_is_a_ring_error(hosts):
    for r, (errors, ok_after) in enumerate(values(run_ranks(case_mismatch_across_hosts, len(hosts), list(hosts),
                                                            timeout=150))):
        assert all(e is not None for e in errors), (r, errors)
        for msg, took in errors:
            assert took < 15 and "disagree" in msg and "rank" in msg, (r, msg, took)
        assert "1000 elements" in errors[0][0] and "2000 elements" in errors[0][0], errors[0][0]
        assert ok_after, f"rank {r}: the communicator does not work after the mismatches"


def case_one_rank_fails(rank, world, hosts, bad):
    """One rank (`bad`) rejects its input, or calls with another count, while the others
    call normally: that rank gets its own error, every other rank a RingError naming it
    within seconds (not the timeout: 20 s here), and the communicator works after."""
    os.environ["RINGDP_HIER_PIECE_BYTES"] = str(64 << 10)  # (160 KiB: two pieces; the other calls: one)
    import ringdp

    _as_host(rank, hosts, timeout=20)
    me = rank == bad
    x = value(rank, 60, world=world).reshape(6, 10)
    calls = [  # (name, call, what the other ranks' error must say)
        ("all_reduce, bad input", lambda: ringdp.all_reduce(x.t() if me else x), "contiguous"),
        ("reduce_scatter, bad input", lambda: ringdp.reduce_scatter_tensor(
            torch.empty(5 if me else 7), value(rank, world * 7, world=world)), "reduce_scatter_tensor"),
        ("all_gather, bad input", lambda: ringdp.all_gather_into_tensor(
            torch.empty(world * 5 + (1 if me else 0)), value(rank, 5, world=world)), "all_gather_into_tensor"),
        ("broadcast, bad input", lambda: ringdp.broadcast(value(rank, 9, world=world), world if me else 0), "src="),
        ("all_reduce, another count", lambda: ringdp.all_reduce(value(rank, 2000 if me else 1000, world=world)), "rank"),
        ("all_reduce, count 0 on one rank", lambda: ringdp.all_reduce(value(rank, 0 if me else 5, world=world)), "rank"),
        # a call in pieces (its check before its first in-host step: CrossHost._overlaps)
        # against one whose data goes with the check (after the step)
        ("all_reduce, a count in pieces on one rank", lambda: ringdp.all_reduce(
            value(rank, 40001 if me else 1000, world=world)), "rank"),
        # the other ranks at count 0, which returns with no cross-host data: its ranks whose
        # check passed still learn in this call that a peer's failed (a closing in-host step)
        ("all_reduce, count 0 but on one rank", lambda: ringdp.all_reduce(value(rank, 5 if me else 0, world=world)), "rank"),
        ("all_gather, count 0 but on one rank", lambda: ringdp.all_gather_into_tensor(
            torch.empty(world * (5 if me else 0)), value(rank, 5 if me else 0, world=world)), "rank"),
        ("reduce_scatter, AVG on one rank", lambda: ringdp.reduce_scatter_tensor(
            torch.empty(7), value(rank, world * 7, world=world), op=dist.ReduceOp.AVG if me else dist.ReduceOp.SUM), "rank"),
        ("broadcast, another src on one rank", lambda: ringdp.broadcast(value(rank, 9, world=world), 1 if me else 0), "rank"),
        # in two pieces: ranks whose check passed have started piece 0 across hosts when piece
        # 1's in-host step fails (a peer's rejection); the call waits for it before it raises
        ("all_reduce in pieces, AVG on one rank", lambda: ringdp.all_reduce(
            value(rank, 40001, world=world), op=dist.ReduceOp.AVG if me else dist.ReduceOp.SUM), "rank"),
        # one element more: piece 0 is the same on every rank (20001), piece 1 is not; on the
        # uneven path a non-leader is in no call check, and its host's ranks must fail the
        # call in its first in-host step (they used to fail in piece 1's, with the other
        # hosts' leaders in piece 1's gloo step, waiting for the timeout)
        ("all_reduce in pieces, one element more on one rank", lambda: ringdp.all_reduce(
            value(rank, 40002 if me else 40001, world=world)), "rank"),
    ]
    out = []
    for name, call, needle in calls:
        t0 = time.monotonic()
        try:
            call()
            out.append((name, None, "no error", 0.0, needle))
        except Exception as e:  # noqa: BLE001
            out.append((name, type(e).__name__, str(e), time.monotonic() - t0, needle))
    t = value(rank, 4099, world=world)
    ringdp.all_reduce(t)
    ok = torch.equal(t, expected("SUM", world, 4099, torch.float32))
    g = torch.empty(world * 3)
    ringdp.all_gather_into_tensor(g, torch.full((3,), float(rank)))
    return out, ok and torch.equal(g, torch.arange(world, dtype=torch.float32).repeat_interleave(3))


# bad rank: on a host of two (its peer learns in the first in-host step, the other host
# through the call check; on the second host too, where local and group ranks differ), a
# non-leader and the rank alone on its host of the uneven path, one rank per host (flat)
@pytest.mark.parametrize("hosts,bad", [("aabb", 1), ("aabb", 3), ("aaab", 1), ("aaab", 3), ("ab", 0)])
def test_one_rank_fails_is_a_ring_error_everywhere(hosts, bad):
    res = values(run_ranks(case_one_rank_fails, len(hosts), list(hosts), bad, timeout=300))
    for r, (calls, ok_after) in enumerate(res):
        for name, kind, msg, took, needle in calls:
            assert kind is not None, f"rank {r}, {name}: no error"
            assert took < 10, f"rank {r}, {name}: the error took {took:.1f} s (the timeout is 20 s): {msg}"
            if r == bad and "bad input" in name:
                assert kind in ("ValueError", "TypeError"), (r, name, kind, msg)
                continue
            assert kind == "RingError", (r, name, kind, msg)
            # every message names the group's ranks, the in-host endpoint's too (not its local ones)
            assert msg.startswith(f"rank {r}:"), (r, name, msg)
            # a failed rank's reason names it once, not "rank 1: rank 1: ..."
            assert not re.search(r"rank (\d+): rank \1[: ]", msg), (r, name, msg)
            if "bad input" in name:
                assert f"rank {bad}" in msg and needle in msg, (r, name, msg)
        assert ok_after, f"rank {r}: the communicator does not work after the failed calls"


def case_folded_call_fails(rank, world, hosts, bad):
    """Calls of one piece too big for the call check's slot (the default piece size; 40001
    float32: blocks of 80 KB on two hosts of two), whose first in-host step's outcome goes
    with their cross-host data (CrossHost._fold_start): one rank (`bad`) rejects its input,
    calls AVG where the others call SUM, or another count that pads to the same blocks; ranks
    of one host disagree on the count (odd local ranks 40002), on both hosts. A RingError on
    every rank but the rejecting one within seconds (the timeout: 20 s), its message saying
    `needle`, and the communicator works after, in the same kind of call (folded)."""
    import ringdp

    c = _as_host(rank, hosts, timeout=20)
    me, odd = rank == bad, hosts[:rank].count(hosts[rank]) % 2 == 1
    x = value(rank, 40000, world=world).reshape(200, 200)
    avg, sum_ = dist.ReduceOp.AVG, dist.ReduceOp.SUM
    calls = [
        ("bad input", lambda: ringdp.all_reduce(x.t() if me else x), "contiguous"),
        ("AVG on one rank", lambda: ringdp.all_reduce(value(rank, 40001, world=world), op=avg if me else sum_), "AVG"),
        ("one element more on one rank", lambda: ringdp.all_reduce(value(rank, 40002 if me else 40001, world=world)),
         "40002"),
        ("a host's ranks disagree", lambda: ringdp.all_reduce(value(rank, 40002 if odd else 40001, world=world)),
         "40002"),
    ]
    out = []
    for name, call, needle in calls:
        before = c.across.folded_calls
        t0 = time.monotonic()
        try:
            call()
            out.append((name, None, "no error", 0.0, needle, c.across.folded_calls - before))
        except Exception as e:  # noqa: BLE001
            out.append((name, type(e).__name__, str(e), time.monotonic() - t0, needle, c.across.folded_calls - before))
    before = c.across.folded_calls
    ok = True
    for _ in range(2):
        t = value(rank, 40001, world=world)
        ringdp.all_reduce(t)
        ok = ok and torch.equal(t, expected("SUM", world, 40001, torch.float32))
    # policy.FOLD_MAX_BLOCK_BYTES: a block of the cap is folded, one element more is not
    cap = ringdp.policy.FOLD_MAX_BLOCK_BYTES // 4
    for n, folds in ((2 * cap, 1), (2 * cap + 2, 0)):
        t, was = value(rank, n, world=world), c.across.folded_calls
        ringdp.all_reduce(t)
        ok = ok and torch.equal(t, expected("SUM", world, n, torch.float32)) and c.across.folded_calls - was == folds
    return out, ok, c.across.folded_calls - before


@pytest.mark.parametrize("bad", [1, 2])
def test_folded_call_fails_is_a_ring_error_everywhere(bad):
    res = values(run_ranks(case_folded_call_fails, 4, list("aabb"), bad, timeout=300))
    peer = bad ^ 1  # the bad rank's host peer: its check group agreed, its first in-host step failed
    for r, (calls, ok_after, folded_after) in enumerate(res):
        for name, kind, msg, took, needle, folded in calls:
            assert kind is not None, f"rank {r}, {name}: no error"
            assert took < 10, f"rank {r}, {name}: the error took {took:.1f} s (the timeout is 20 s): {msg}"
            if r == bad and name == "bad input":
                assert kind == "ValueError", (r, name, kind, msg)
                continue
            assert kind == "RingError" and msg.startswith(f"rank {r}:"), (r, name, kind, msg)
            assert not re.search(r"rank (\d+): rank \1[: ]", msg), (r, name, msg)
            if name != "a host's ranks disagree":
                assert f"rank {bad}" in msg or f"rank {peer}" in msg, (r, name, msg)
            if name == "a host's ranks disagree" or r in (bad, peer) or "disagree" not in msg:
                assert needle in msg, (r, name, msg)
            # the ranks of the other cross-host group than the bad rank's (its peer's) passed
            # the call check and learnt of the failure from the folded flags
            if r not in (bad, peer) and r % 2 == peer % 2 and name != "a host's ranks disagree":
                assert folded == 1 and "in its first in-host step" in msg, (r, name, folded, msg)
        assert ok_after and folded_after == 3, f"rank {r}: the communicator does not work after the failed calls"


def case_host_ranks_disagree(rank, world, hosts):
    """Ranks of one host disagree on what their first in-host step does not carry by itself,
    in a way each cross-host check group agrees on (aabb: local rank 0 says one thing on both
    hosts, local rank 1 another; aaabb: the odd local ranks another thing, and for the
    broadcast the rank of the host without the source names another source): all_gather's
    count, broadcast's src; an all_reduce's count where both pad to the same blocks (4001 and
    4002 elements: 2001 each on two ranks), AVG and SUM (the steps carry SUM), a
    reduce_scatter's AVG and SUM, an all_reduce and a reduce_scatter whose in-host steps
    look alike (two_level: 4000 elements, and 1000 per rank of 4); and an uneven
    all_reduce in pieces whose counts differ by one, so that its first pieces agree. A
    RingError on every rank naming both calls (CrossHost._announce), then the communicator
    works. (Those after the broadcast returned on every rank before: different results.)"""
    import ringdp

    os.environ["RINGDP_HIER_PIECE_BYTES"] = str(16 << 10)  # (4096 float32: 4097 and 4098 go in two pieces)
    _as_host(rank, hosts, timeout=20)
    lr = hosts[:rank].count(hosts[rank])  # local rank
    odd = lr % 2 == 1
    avg, sum_ = dist.ReduceOp.AVG, dist.ReduceOp.SUM

    def pieces():  # the first pieces agree (4096 elements), the second do not
        ringdp.all_reduce(value(rank, 4098 if odd else 4097, world=world))

    calls = [
        ("all_gather", lambda: ringdp.all_gather_into_tensor(torch.empty(world * (5 if odd else 3)),
                                                             value(rank, 5 if odd else 3, world=world)),
         ("5 x float32 per rank", "3 x float32 per rank")),
        ("broadcast", lambda: ringdp.broadcast(value(rank, 9, world=world), (1 if rank == world - 1 else 0) if world == 5
                                               else (2 if odd else 0)), None),
        ("all_reduce count", lambda: ringdp.all_reduce(value(rank, 4002 if odd else 4001, world=world)),
         ("of 4002 x float32 SUM", "of 4001 x float32 SUM")),
        ("all_reduce op", lambda: ringdp.all_reduce(value(rank, 4001, world=world), op=avg if odd else sum_),
         ("4001 x float32 AVG", "4001 x float32 SUM")),
        ("reduce_scatter op", lambda: ringdp.reduce_scatter_tensor(torch.empty(3), value(rank, 3 * world, world=world),
                                                                   op=avg if odd else sum_),
         ("3 x float32 per rank AVG", "3 x float32 per rank SUM")),
        ("all_reduce or reduce_scatter", lambda: (ringdp.reduce_scatter_tensor(torch.empty(1000), value(
            rank, 1000 * world, world=world)) if odd else ringdp.all_reduce(value(rank, 4000, world=world))),
         ("reduce_scatter across hosts of 1000", "all_reduce across hosts of 4000")),
        ("all_reduce in pieces", pieces, ("of 4098 x float32", "of 4097 x float32")),
    ]
    out = []
    for name, call, said in calls:
        t0 = time.monotonic()
        try:
            call()
            out.append((name, None, time.monotonic() - t0, said))
        except ringdp.RingError as e:
            out.append((name, str(e), time.monotonic() - t0, said))
    t = value(rank, 4099, world=world)
    ringdp.all_reduce(t)
    return out, torch.equal(t, expected("SUM", world, 4099, torch.float32))


def case_leader_fails_after_its_step(rank, world, hosts, n):
    """Uneven hosts: the leader of the first host (rank 0) fails its reduce_scatter_tensor
    after the call's first in-host step, while making what its cross-host step sends (an
    error injected there): (error type, message, seconds) per rank, then whether the same
    call right after gives the closed form."""
    import ringdp
    from ringdp import hosts as hosts_mod

    _as_host(rank, hosts, timeout=20)
    real = hosts_mod.CrossHost._host_segments
    if rank == 0:
        def broken(self, *args):
            raise MemoryError("injected: no memory for the host segments")
        hosts_mod.CrossHost._host_segments = broken
    t0 = time.monotonic()
    try:
        ringdp.reduce_scatter_tensor(torch.empty(n), value(rank, world * n, world=world))
        got = (None, "no error", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        got = (type(e).__name__, str(e), time.monotonic() - t0)
    hosts_mod.CrossHost._host_segments = real
    out = torch.empty(n)
    ringdp.reduce_scatter_tensor(out, value(rank, world * n, world=world))
    return got, torch.equal(out, expected("SUM", world, world * n, torch.float32)[rank * n:(rank + 1) * n])


@pytest.mark.parametrize("n", [3, 50000], ids=["with-the-check", "own-step"])
def test_a_leader_that_fails_after_its_first_step_fails_everywhere(n):
    """The leader's own error becomes a RingError with it as the cause; its host's peers
    (who passed the step and are in no check) and the other host (through the check) fail
    within seconds, not the 20 s timeout, naming rank 0; the communicator works after. (It
    raised the bare error without taking part in the call check: every other rank waited
    for its timeout.)"""
    res = values(run_ranks(case_leader_fails_after_its_step, 4, list("aaab"), n, timeout=180))
    for r, ((kind, msg, took), ok_after) in enumerate(res):
        assert kind == "RingError" and "rank 0" in msg, (r, kind, msg)
        assert took < 10, (r, took, msg)
        assert ok_after, f"rank {r}: the next reduce_scatter_tensor is wrong"
    assert "injected" in res[0][0][1] and "MemoryError" in res[0][0][1], res[0]


@pytest.mark.parametrize("hosts", ["aabb", "aaabb"])
def test_ranks_of_a_host_that_disagree_fail_everywhere(hosts):
    res = values(run_ranks(case_host_ranks_disagree, len(hosts), list(hosts), timeout=150))
    for r, (calls, ok_after) in enumerate(res):
        for name, msg, took, said in calls:
            assert msg is not None, f"rank {r}, {name}: no error"
            assert msg.startswith(f"rank {r}:") and took < 10, (r, name, msg, took)
            # a rank whose host peers all agree fails through the call check, or a rejected
            # step: the others name both calls
            if said is not None and "disagree on the call" in msg:
                assert all(x in msg for x in said), (r, name, msg)
        assert ok_after, f"rank {r}: the communicator does not work after the failed calls"


def case_setting_differs(rank, world, hosts, who):
    """The ranks in `who` set a smaller RINGDP_HIER_PIECE_BYTES: their 16 KiB all-reduce goes
    in two pieces by gloo, the other ranks' in one with the call check. Within a host the
    first in-host step already disagrees (its piece); between hosts only the check can tell:
    its rows carry the decision. A RingError on every rank, never a wrong result (the data
    slot of a rank that sent none read as zeros) nor a wait for the timeout."""
    if rank in who:
        os.environ["RINGDP_HIER_PIECE_BYTES"] = "8192"
    import ringdp

    _as_host(rank, hosts, timeout=20)
    out = []
    for n in (4099, 300007):  # (300007: the others' in one piece, its outcome folded into the data)
        t0 = time.monotonic()
        try:
            ringdp.all_reduce(value(rank, n, world=world))
            out.append((None, time.monotonic() - t0))
        except ringdp.RingError as e:
            out.append((str(e), time.monotonic() - t0))
    return out


# one rank of host a; all of host a; on uneven hosts the leaders' path, the rank alone on its host
@pytest.mark.parametrize("hosts,who", [("aabb", (0,)), ("aabb", (0, 1)), ("aaab", (3,))])
def test_setting_that_differs_between_ranks_is_a_ring_error(hosts, who):
    res = values(run_ranks(case_setting_differs, 4, list(hosts), who, timeout=120))
    for r, calls in enumerate(res):
        for n, (msg, took) in zip((4099, 300007), calls):
            assert msg is not None, f"rank {r}, {n} elements: no error (ranks {who} in pieces, the others not)"
            assert took < 10, (r, n, took, msg)
    if len(who) > 1 or hosts == "aaab":  # only the check saw it: it names both decisions
        small, large = res[who[0] ^ 2][0][0], res[who[0] ^ 2][1][0]  # (a rank of the other host)
        assert "disagree" in small and "with the call check" in small, small
        assert "disagree" in large and "in pieces of" in large, large


def case_hierarchy_differs(rank, world, hosts, who):
    """The ranks in `who` set RINGDP_HIERARCHY=0: they would make the flat path's groups
    while the others make the two-level ones, each waiting for the other's. The set-up
    compares the setting first: a RingError on every rank naming it and the ranks' values."""
    import ringdp

    t0 = time.monotonic()
    try:
        _as_host(rank, hosts, hierarchy="0" if rank in who else "1", timeout=20)
        return None, time.monotonic() - t0
    except ringdp.RingError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.parametrize("who", [(3,), (0, 1)])
def test_hierarchy_that_differs_between_ranks_is_a_ring_error(who):
    res = values(run_ranks(case_hierarchy_differs, 4, list("aabb"), who, timeout=120))
    for r, (msg, took) in enumerate(res):
        assert msg is not None, f"rank {r}: no error although ranks {who} set RINGDP_HIERARCHY=0"
        assert msg.startswith(f"rank {r}: the group's ranks disagree on RINGDP_HIERARCHY"), msg
        assert all(f"rank {v}: {v not in who}" in msg for v in range(4)), msg
        assert took < 10, (r, took, msg)


def case_one_host(rank, world):
    c = _as_host(rank, ["a"] * world)
    import ringdp

    t = value(rank, 1000, world=world)
    ringdp.all_reduce(t)
    return c.cross_path, c.shm is not None, torch.equal(t, expected("SUM", world, 1000, torch.float32))


def test_one_host_is_todays_path():
    for path, has_shm, ok in values(run_ranks(case_one_host, 2)):
        assert path is None and has_shm and ok


def case_ddp(rank, world, hosts):
    _as_host(rank, hosts)
    import test_ddp

    return test_ddp.case_train(rank, world, model="mlp")


def test_ringddp_on_two_hosts():
    import test_ddp

    res = values(run_ranks(case_ddp, 4, ["a", "a", "b", "b"], timeout=200))
    test_ddp._check_train(res, 1e-5)


# ---- the CUDA two-level all-reduce's Python on the CPU: CUDA faked (tests/_fake_cuda.py) ----
def case_cuda_two_level_faked(rank, world, hosts, piece_bytes, bad_rank=None):
    """CrossHost.on_cuda's all-reduce (what a CUDA tensor across hosts runs: ringdp/cuda_comm.py)
    with the CUDA transports faked over CPU ones: its in-host endpoint (cuda_comm._InHost) over
    a native whose calls run on this host's real shared-memory endpoint, its cross-host one
    (cuda_comm._Across) over a native whose all-reduce runs on the real gloo group of its
    cross-host step (two-level: this local rank's; uneven hosts: the leaders'), and
    torch.cuda's streams and events logging. So the algorithm, the adapters'
    arguments (blocks, counts, op codes, streams) and the stream order run for real; the
    GPU transports themselves are tests/test_cuda.py's."""
    os.environ["RINGDP_HIER_PIECE_BYTES"] = str(piece_bytes)
    c = _as_host(rank, hosts)
    from _closed_form import all_reduce_matrix, expected, value
    from _fake_cuda import install

    from ringdp import _types, cuda_comm
    from ringdp._native import RingError

    log, current = [], ["caller"]
    install(torch, log, current)
    shm, gloo = c.across.inhost, c.across.cross
    ops = {_types.SUM: dist.ReduceOp.SUM, _types.MIN: dist.ReduceOp.MIN, _types.MAX: dist.ReduceOp.MAX}

    class Ipc:  # this host's CUDA IPC endpoint: the shared-memory one does the work
        oneshot_bytes = shm.oneshot_bytes if shm is not None else 0

        def reduce_scatter_tensor(self, out, inp, op, stream, algo, timeout_s):
            log.append(("ipc reduce_scatter", stream, out.numel(), inp.numel()))
            shm.reduce_scatter(out, inp, op, algo, timeout_s, "")

        def all_gather_tensor(self, out, inp, stream, algo, timeout_s):
            log.append(("ipc all_gather", stream, out.numel(), inp.numel()))
            shm.all_gather(out, inp, algo, timeout_s, "")

        def all_reduce_tensor(self, t, op, stream, algo, timeout_s):
            log.append(("ipc all_reduce", stream, t.numel()))
            shm.all_reduce(t, op, algo, timeout_s, "")

        def broadcast_tensor(self, t, root, stream, algo, timeout_s):
            log.append(("ipc broadcast", stream, t.numel(), root))
            shm.broadcast(t, root, algo, timeout_s, "")

        def reject(self, why):
            log.append(("ipc reject",))
            shm.reject(why, 60, "")

    class Nccl:  # the NCCL endpoint of the cross-host group: gloo does the work
        def all_reduce_tensor(self, t, op, stream, algo, timeout_s):
            log.append(("nccl all_reduce", stream, t.numel(), timeout_s))
            o = dist.AllreduceOptions()
            o.reduceOp = ops[op]
            gloo.allreduce([t], o).wait()

        def reduce_scatter_tensor(self, out, inp, op, stream, algo, timeout_s):
            log.append(("nccl reduce_scatter", stream, out.numel(), inp.numel()))
            o = dist.ReduceScatterOptions()
            o.reduceOp = ops[op]
            gloo._reduce_scatter_base(out, inp, o).wait()

        def all_gather_tensor(self, out, inp, stream, algo, timeout_s):
            log.append(("nccl all_gather", stream, out.numel(), inp.numel()))
            from torch._C._distributed_c10d import AllgatherOptions

            gloo._allgather_base(out, inp, AllgatherOptions()).wait()

        def broadcast_tensor(self, t, root, stream, algo, timeout_s):
            log.append(("nccl broadcast", stream, t.numel(), root))
            o = dist.BroadcastOptions()
            o.rootRank = root
            gloo.broadcast([t], o).wait()

    def ep(native):
        return type("Ep", (), {"native": native, "device": "cuda:0"})()

    hier = c.across.on_cuda(None if shm is None else cuda_comm._InHost(ep(Ipc())),  # (none: alone on its host)
                            None if gloo is None else cuda_comm._Across(ep(Nccl()), torch.cuda.Stream("side")),
                            torch.device("cpu"),  # (none: a non-leader on uneven hosts)
                            poison=lambda why: log.append(("poison",)))
    done = type("Done", (), {"wait": lambda self: True})()

    def all_reduce(t, op, async_op=False):
        hier.on_stream("caller-handle", 30.0, lambda: hier.all_reduce(t, _types.op_code(op), "auto", 30.0, ""))
        return done

    out = {"stream": hier.stream.name, "fused": hier.fused_calls, "path": hier.path}
    if bad_rank is not None:  # one rank calls with another count: a RingError everywhere, naming it
        n = 4099 + (rank == bad_rank)
        try:
            all_reduce(value(rank, n, world=world), dist.ReduceOp.SUM)
            out["error"] = None
        except RingError as e:
            out["error"] = str(e)
        out["rejected"] = ("ipc reject",) in log
        out["poisoned first"] = out["rejected"] and ("poison",) in log and (
            log.index(("poison",)) < log.index(("ipc reject",)))
        tail = [("wait_stream", hier.stream.name, "side")] if hier.cross is not None else []  # (a non-leader: none)
        out["joined"] = log[-len(tail) - 1:] == tail + [("wait_stream", "caller", hier.stream.name)]
        out["poisoned"] = ("poison",) in log
        return out
    out["bad"], _ = all_reduce_matrix(rank, world, all_reduce, DTYPES, SIZES)
    # the halves and broadcast through the same binding: tests/test_collectives.py's closed forms
    import ringdp
    import test_collectives

    def on(call):
        return hier.on_stream("caller-handle", 30.0, call)

    ringdp.reduce_scatter_tensor = lambda o, i, op=dist.ReduceOp.SUM, **_: on(
        lambda: hier.reduce_scatter(o, i, _types.op_code(op), "auto", 30.0, ""))
    ringdp.all_gather_into_tensor = lambda o, i, **_: on(lambda: hier.all_gather(o, i, "auto", 30.0, ""))
    ringdp.broadcast = lambda x, src, **_: on(lambda: hier.broadcast(x, src, "auto", 30.0, ""))
    out["halves_checked"], halves_bad = test_collectives._matrix(
        rank, world, [0, 1, 7, 4099], [torch.float32, torch.bfloat16, torch.int64], registered_too=False)
    out["bad"] += halves_bad
    out["fused"] = hier.fused_calls  # (never: the check's rows are host memory)
    log.clear()
    t = value(rank, 40000, world=world)  # 160 KB float32: two pieces of at least piece_bytes
    all_reduce(t, dist.ReduceOp.SUM)
    out["two_pieces_ok"] = torch.equal(t, expected("SUM", world, 40000, torch.float32))
    out["log"] = [e[:3] if e[0] in ("wait", "record") else e for e in log]
    return out


def test_cuda_two_level_python_on_faked_cuda():
    """The CUDA two-level collectives' Python (ringdp/hosts.py on_cuda, on_stream;
    ringdp/cuda_comm.py _InHost, _Across) with CUDA faked over the CPU transports: closed
    forms for every dtype, op and size of the all-reduce, and of reduce_scatter_tensor,
    all_gather_into_tensor and broadcast (tests/test_collectives.py's), no data with the call
    check (host-memory rows), and
    the stream order of a two-piece call: the call's stream H waits for the caller; each
    piece reduce-scattered in-host on H; its cross-host all-reduce on the side stream after
    H (side waits for H), an event after it; the next piece's reduce-scatter on H before H
    waits for that event (the two overlap); each all-gather on H after its piece's event;
    H waits for the side stream and the caller for H at the end, failed or not."""
    res = values(run_ranks(case_cuda_two_level_faked, 4, ["a", "a", "b", "b"], 8192, timeout=300))
    for r, out in enumerate(res):
        assert out["path"] == "two_level" and out["halves_checked"] > 100, (out["path"], out["halves_checked"])
        assert out["bad"] == [], f"rank {r}: results differ from the closed forms: {out['bad'][:5]}"
        assert out["fused"] == 0, (r, out["fused"])
        assert out["two_pieces_ok"], r
        H = out["stream"]
        q = 40000 // 2 // 2  # a piece: half the tensor; a rank's block of it: half the piece (2 ranks a host)
        tx = 27.0  # the cross-host step's timeout: the call's (30 s) less a tenth (policy.cross_host_timeout)
        want = [("wait_stream", H, "caller"),
                ("ipc reduce_scatter", f"{H}-handle", q, 2 * q),
                ("wait_stream", "side", H), ("nccl all_reduce", "side-handle", q, tx), ("record", "e1", "side"),
                ("ipc reduce_scatter", f"{H}-handle", q, 2 * q),
                ("wait_stream", "side", H), ("nccl all_reduce", "side-handle", q, tx), ("record", "e2", "side"),
                ("wait", H, "e1"), ("ipc all_gather", f"{H}-handle", 2 * q, q),
                ("wait", H, "e2"), ("ipc all_gather", f"{H}-handle", 2 * q, q),
                ("wait_stream", H, "side"), ("wait_stream", "caller", H)]  # (also after a failure)
        names = {}  # events named by order of recording: ("record", event, stream), ("wait", stream, event)
        got = [("record", names.setdefault(e[1], f"e{len(names) + 1}"), e[2]) if e[0] == "record"
               else ("wait", e[1], names.get(e[2], e[2])) if e[0] == "wait" else e for e in out["log"]]
        assert got == want, f"rank {r}: {got}"


def test_cuda_leaders_python_on_faked_cuda():
    """The same on uneven hosts a,a,a,b (the leaders' path on CUDA): closed forms for every
    dtype, op and size, the halves and broadcast too; per piece the in-host all-reduce (IPC), the leaders' cross-host
    all-reduce on the side stream (rank 0 and rank 3, who is alone on its host and has no
    in-host step), then the in-host broadcast; a non-leader has no cross-host step."""
    res = values(run_ranks(case_cuda_two_level_faked, 4, ["a", "a", "a", "b"], 8192, timeout=300))
    for r, out in enumerate(res):
        assert out["path"] == "leaders" and out["halves_checked"] > 100, (out["path"], out["halves_checked"])
        assert out["bad"] == [], f"rank {r}: results differ from the closed forms: {out['bad'][:5]}"
        assert out["fused"] == 0 and out["two_pieces_ok"], (r, out["fused"])
        kinds = [e[0] for e in out["log"] if e[0].startswith(("ipc", "nccl"))]
        want = {0: ["ipc all_reduce", "nccl all_reduce"] * 2 + ["ipc broadcast"] * 2,
                3: ["nccl all_reduce"] * 2}.get(r, ["ipc all_reduce"] * 2 + ["ipc broadcast"] * 2)
        if r == 0:  # the second piece's in-host all-reduce before the first one's broadcast
            want = ["ipc all_reduce", "nccl all_reduce", "ipc all_reduce", "nccl all_reduce", "ipc broadcast",
                    "ipc broadcast"]
        assert kinds == want, (r, kinds)


def test_cuda_two_level_mismatch_faked():
    """Rank 3 calls the CUDA two-level all-reduce with 4100 elements, the others with 4099 (the
    same padded block: the in-host steps agree): the call check of local rank 1's group
    (ranks 1, 3) fails, both reject their next in-host call (on CUDA: IPC's reject), and
    ranks 0 and 2, whose check passed, fail in the all-gather that follows: a RingError
    on every rank naming rank 3's call, no hang. (Here the in-host endpoint is the CPU one,
    which fails in the call; on a GPU ranks 0 and 2 learn it from the device by their next
    check or synchronize(): tests/test_cuda.py test_cuda_two_hosts_mismatch_raises.)"""
    res = values(run_ranks(case_cuda_two_level_faked, 4, ["a", "a", "b", "b"], 8192, 3, timeout=120))
    for r, out in enumerate(res):
        assert out["error"] is not None and "rank 3: all_reduce of 4100 elements" in out["error"], (r, out["error"])
    assert [out["rejected"] for out in res] == [False, True, False, True], [o["error"] for o in res]
    assert res[1]["poisoned first"] and res[3]["poisoned first"]  # (NCCL aborted before IPC's rejection)
    # the failed call's steps already queued still use the tensor: the caller's stream waits for them
    assert all(out["joined"] for out in res), res


def test_cuda_leaders_mismatch_faked():
    """The same on uneven hosts a,a,a,b, rank 3 (alone on host b) calling with 4100 elements:
    the leaders' check (ranks 0, 3) fails; rank 0 poisons its CUDA endpoint and rejects its
    in-host call, so ranks 1 and 2 fail in the in-host broadcast; rank 3, with no host peer
    to tell, still poisons its endpoint (its NCCL steps must not wait on anyone)."""
    res = values(run_ranks(case_cuda_two_level_faked, 4, ["a", "a", "a", "b"], 8192, 3, timeout=120))
    for r, out in enumerate(res):
        assert out["error"] is not None and "rank 3: all_reduce of 4100 elements" in out["error"], (r, out["error"])
    assert [out["rejected"] for out in res] == [True, False, False, False], [o["error"] for o in res]
    assert [out["poisoned"] for out in res] == [True, False, False, True], [o["error"] for o in res]
    assert all(out["joined"] for out in res), res


def case_cuda_endpoints_follow(rank, world, hosts):
    """CudaEndpoint._hierarchy (ringdp/cuda_comm.py) with its transports faked: which native
    endpoints it makes ((kind, rank among its peers, their number, the group's ranks its
    messages name them by)) and which of them it chains (cuda_api.h follow: the IPC endpoint
    follows the NCCL one on a rank that has both, so that an aborted cross-host step halts
    the in-host steps behind it)."""
    c = _as_host(rank, hosts)
    from _fake_cuda import install

    from ringdp import cuda_comm

    install(torch, [], ["caller"])

    class Native:
        def __init__(self, kind):
            self.kind, self.followed = kind, []

        def follow(self, leader):
            self.followed.append(leader.kind)

    def connect(cls, comm, kind, r, w, rendezvous, device, names=None):
        ep = cuda_comm.CudaEndpoint.__new__(cuda_comm.CudaEndpoint)
        ep.kind, ep.native, ep.device, ep.hier, ep._parts = kind, Native(kind), device, None, []
        ep.made = (kind, r, w, names)
        return ep

    cuda_comm.CudaEndpoint._connect = classmethod(connect)
    ep = connect(None, c, "nccl", rank, world, None, torch.device("cpu"))
    ep._hierarchy(c)
    return sorted((part.made, part.native.followed) for part, _ in ep._parts)


@pytest.mark.parametrize("hosts", ["aabb", "aaab"])
def test_cuda_hierarchy_ipc_follows_nccl(hosts):
    """A rank with both an in-host IPC endpoint and a cross-host NCCL one chains them (IPC
    follows NCCL); a rank with one of them chains nothing. Each endpoint's messages name
    ranks as the group does (Options::rank_names: the host's ranks, the cross-host group's).
    The halt itself is the GPU's to show:
    tests/test_cuda.py::test_cuda_two_hosts_aborted_cross_step_fails_host_peers."""
    res = values(run_ranks(case_cuda_endpoints_follow, 4, list(hosts), timeout=120))
    ipc = lambda r, n, names, f: (("ipc", r, n, names), f)  # noqa: E731
    nccl = lambda r, n, names: (("nccl", r, n, names), [])  # noqa: E731
    if hosts == "aabb":  # two-level: every rank has both; NCCL among the ranks of one local rank
        want = [[ipc(0, 2, [0, 1], ["nccl"]), nccl(0, 2, [0, 2])], [ipc(1, 2, [0, 1], ["nccl"]), nccl(0, 2, [1, 3])],
                [ipc(0, 2, [2, 3], ["nccl"]), nccl(1, 2, [0, 2])], [ipc(1, 2, [2, 3], ["nccl"]), nccl(1, 2, [1, 3])]]
    else:  # leaders: rank 0 (host a's leader) both; ranks 1, 2 IPC only; rank 3 (alone on b) NCCL only
        want = [[ipc(0, 3, [0, 1, 2], ["nccl"]), nccl(0, 2, [0, 3])], [ipc(1, 3, [0, 1, 2], [])],
                [ipc(2, 3, [0, 1, 2], [])], [nccl(1, 2, [0, 3])]]
    assert res == want, res


def case_host_dies(rank, world, hosts, victims, kind="all_reduce"):
    import ringdp

    _as_host(rank, hosts, timeout=20)
    calls = {  # rank 3 (host b, local rank 1) is the broadcast's source: rank 1 waits across
        "all_reduce": lambda: ringdp.all_reduce(value(rank, 4099, world=world)),  # hosts, rank 0 inside its host
        "broadcast": lambda: ringdp.broadcast(value(rank, 4099, world=world), 3),
        "all_gather": lambda: ringdp.all_gather_into_tensor(torch.empty(world * 4099), value(rank, 4099, world=world)),
        "reduce_scatter": lambda: ringdp.reduce_scatter_tensor(torch.empty(4099), value(rank, world * 4099, world=world)),
    }
    t = value(rank, 4099, world=world)
    ringdp.all_reduce(t)  # works once
    if rank in victims:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    start = time.monotonic()
    try:
        calls[kind]()
    except ringdp.RingError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("hosts,kind", [("aabb", "all_reduce"), ("aaab", "all_reduce"), ("aabb", "broadcast"),
                                        ("aabb", "all_gather"), ("aaab", "broadcast"), ("aaab", "all_gather"),
                                        ("aaab", "reduce_scatter")])
def test_whole_host_dies_is_a_ring_error(hosts, kind):
    hosts = list(hosts)
    victims = [r for r, h in enumerate(hosts) if h == "b"]
    res = run_ranks(case_host_dies, 4, hosts, victims, kind, timeout=120, allow_missing=victims)
    for r, out in enumerate(res):
        if r in victims:
            continue
        assert out is not None and out[0] == "ok", (r, out)
        msg, took = out[1]
        assert msg is not None, f"rank {r}: no error after host b died"
        assert took < 25, (r, took)
        assert _names_cross_host_cause(msg, victims), (r, msg)


def _names_cross_host_cause(msg: str, dead) -> bool:
    """`msg` (a RingError) names a failed cross-host step, this rank's own or (a rejection)
    that of a peer of its host, whose gloo group holds one of the ranks in `dead`."""
    import re

    groups = [{int(x) for x in m.split(",")} for m in re.findall(r"ranks \[([\d, ]+)\] of the group", msg)]
    return ("across hosts" in msg and "cannot be reached" in msg
            and any(g & set(dead) for g in groups))


def _netns_hosts():
    """bench/netns_hosts.py (two hosts in Linux namespaces, torchrun launchers across them)."""
    import sys

    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import netns_hosts

    return netns_hosts


def _two_launchers(tmp_path, hosts, env=None, nproc=(2, 2)):
    """tests/_two_hosts_job.py under a torchrun launcher on each of two hosts
    (bench/netns_hosts.py launch: --nnodes 2, `nproc` ranks per host, c10d store on host
    0), then every rank's results checked: every call right, bitwise identical everywhere,
    local ranks 0..n-1 of local size n on each host, the two-level path on hosts of one
    size, the leaders' on hosts of different sizes. Returns each rank's record."""
    from _dist import free_port

    job = [os.path.join(HERE, "_two_hosts_job.py")]
    results = _netns_hosts().launch(hosts, job, free_port(), nproc=list(nproc), timeout=150,
                                    rdzv_id=f"hier{os.getpid()}",
                                    env={"RINGDP_TEST_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", **(env or {})})
    assert all(rc == 0 for rc, _ in results), "\n".join(log[-3000:] for _, log in results)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(sum(nproc))]
    path = "two_level" if nproc[0] == nproc[1] else "leaders"
    by_host = {}
    for r, o in enumerate(outs):
        assert o["path"] == path, (r, o["path"])
        assert all(o["ok"]) and len(o["ok"]) == 28, (r, o["ok"])
        assert all(torch.equal(a, b) for a, b in zip(o["results"], outs[0]["results"])), r
        by_host.setdefault(o["host"], []).append(o["local"])
    assert sorted(sorted(v) for v in by_host.values()) == sorted([(i, n) for i in range(n)] for n in nproc), by_host
    return outs


def test_torchrun_two_nodes(tmp_path):
    # Two torchrun launchers side by side (--nnodes 2, c10d rendezvous on 127.0.0.1), each
    # its own simulated host: the two-level path on what torchrun sets up.
    loopback = {"prefix": [[], []], "addr": ["127.0.0.1"] * 2, "env": [{"RINGDP_HOST_ID": "a"}, {"RINGDP_HOST_ID": "b"}]}
    outs = _two_launchers(tmp_path, loopback)
    assert sorted(o["host"] for o in outs) == ["a", "a", "b", "b"]  # (torchrun orders the nodes)


@pytest.mark.parametrize("nproc", [(2, 2), (3, 1)], ids=["even", "uneven"])
def test_two_hosts_in_namespaces(tmp_path, nproc):
    # Two hosts as near to real ones as one machine gets (bench/netns_hosts.py): each
    # launcher in its own network namespace (the store's and gloo's traffic crosses a veth
    # link between them, not loopback), hostname (ringdp finds the hosts from hostname and
    # boot id: no RINGDP_HOST_ID) and /dev/shm (one host's shared memory unseen by the
    # other). The two-level path (hosts of 2 and 2 ranks; the leaders' on 3 and 1: torchrun
    # with a different --nproc-per-node per node), ringdp's backend across hosts (its own
    # cross-host gloo groups on the store), closed forms, bitwise identical.
    # RINGDP_SPIN_US=2: the four ranks share two cores, which ringdp, counting ranks per
    # hostname, does not know.
    nh = _netns_hosts()
    try:
        with nh.two_hosts(str(tmp_path)) as hosts:
            outs = _two_launchers(tmp_path, hosts, {"RINGDP_SPIN_US": "2"}, nproc)
    except nh.Unavailable as e:
        pytest.skip(f"this machine does not allow network namespaces: {e}")
    assert sorted(o["host"] for o in outs) == sorted([hosts["name"][0]] * nproc[0] + [hosts["name"][1]] * nproc[1])


@pytest.mark.parametrize("backend", [False, True], ids=["ringdp", "backend"])
def test_link_down_between_hosts(tmp_path, backend):
    # The link between two namespace hosts goes down while they all-reduce (a pulled cable:
    # every process stays alive, no connection is reset, nothing arrives), through
    # ringdp.all_reduce or dist.all_reduce(async_op=True).wait() on a cpu:ringdp group:
    # every rank raises a RingError naming itself and the cross-host step within ringdp's
    # timeout of its last good call (8 s here; the cross-host steps' 7.2 s), and ringdp.destroy() then returns at
    # once. (torchrun's own agents wait on their store across the dead link: the launchers
    # are ended here.)
    import json

    from _dist import free_port

    nh = _netns_hosts()
    job = [os.path.join(HERE, "_link_down_job.py")]
    state = {"down_at": None}

    def progress(r):
        try:
            return int((tmp_path / f"prog{r}").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def watch():
        if state["down_at"] is None:
            if min(progress(r) for r in range(4)) >= 20:  # every rank well into the loop
                nh.set_link(hosts, 0, False)
                state["down_at"] = time.monotonic()
            return False
        return all((tmp_path / f"rank{r}.json").exists() for r in range(4))

    try:
        with nh.two_hosts(str(tmp_path)) as hosts:
            results = nh.launch(hosts, job, free_port(), env={"RINGDP_TEST_OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
                                                              "RINGDP_SPIN_US": "2", "JOB_BACKEND": str(int(backend))},
                                timeout=150, rdzv_id=f"down{os.getpid()}", watch=watch, stop_on_failure=False)
    except nh.Unavailable as e:
        pytest.skip(f"this machine does not allow network namespaces: {e}")
    logs = "\n".join(log[-2000:] for _, log in results)
    assert state["down_at"] is not None, f"the ranks never got going:\n{logs}"
    for r in range(4):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} left no record within the launchers' time:\n{logs}"
        rec = json.loads(path.read_text())
        assert rec["error"].startswith(f"RingError: rank {r}:"), rec
        # the cause, the cross-host step: its own, or a peer of its host's that rejected the
        # in-host call it waited in (the cross-host steps' timeout is shorter than the in-host
        # waits', policy.cross_host_timeout: that peer fails and tells it first)
        assert _names_cross_host_cause(rec["error"], {0, 1, 2, 3}), rec
        assert rec["after_s"] < rec["timeout"] + 2, rec  # within the timeout of its last good call (7.2 s seen)
        assert rec["calls"] >= 20 and rec["destroy"] == "ok" and rec["destroy_s"] < 5, rec


# ------------------------------------------------------------------ a cross-host wait (one process)
class _FakeWork:
    """A gloo Work's wait/is_completed: done at `done_at` (monotonic), failing with `error`
    then; `early`: wait(timeout) raises at once while not done (no slice passes)."""

    def __init__(self, done_at, error=None, early=False):
        self.done_at, self.error, self.early, self.waits = done_at, error, early, 0

    def is_completed(self):
        return time.monotonic() >= self.done_at

    def wait(self, timeout=None):
        self.waits += 1
        if not self.is_completed():
            if not self.early:
                time.sleep(min(timeout.total_seconds(), max(0.0, self.done_at - time.monotonic())))
            if not self.is_completed():
                raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


class _FakeStore:
    def __init__(self, note=None):
        self.note, self.checks = note, 0

    def check(self, keys):
        self.checks += 1
        return self.note is not None

    def get(self, key):
        return self.note.encode()


def _waiter(store):
    from ringdp import hosts

    h = hosts.CrossHost.__new__(hosts.CrossHost)
    h._aborts, h._abandoned = hosts._Aborts(lambda: store, "k"), []
    return h


def test_close_holds_the_gloo_works_left_in_flight(monkeypatch):
    """CrossHost.close(): the gloo works an abort or a failed call left in flight are held,
    with the groups, in ringdp/inflight.py until a while after they end (their groups'
    destructors would wait for them; gloo's thread must not drop them as Python finalizes),
    the ones that ended a moment ago too."""
    from ringdp import hosts, inflight
    from ringdp.policy import GLOO_LET_GO_S

    held = inflight.GlooInFlight()
    monkeypatch.setattr(hosts.inflight, "GLOO", held)
    h = _waiter(_FakeStore())
    group = object()
    h.inhost, h.cross, h.checker, h.whole, h._lookup, h._buffers = None, group, None, None, None, {}
    done, stuck = _FakeWork(0.0), _FakeWork(time.monotonic() + 60)
    h._abandoned = [done, stuck]
    h.close()  # (the ended one too: gloo's thread may not have let it go yet)
    assert held.held() == ["a step across hosts"] * 2 and h._abandoned == [] and h.cross is None
    assert held._works[id(stuck)][1] == (group, None, None, None)  # (the groups, held with it)
    stuck.done_at = time.monotonic()
    t0 = time.monotonic()
    while held.held() and time.monotonic() - t0 < 5 * GLOO_LET_GO_S:
        time.sleep(0.01)
    assert held.held() == []


def test_cross_host_wait_in_slices():
    """CrossHost._await: a work done after several slices returns (and its error is raised as
    its own); this rank's abort() ends a wait within a slice, a peer's note in the store within
    ABORT_STORE_POLL_S plus a slice, the work then kept (close: inflight); the deadline holds;
    a wait that raises at once without the work done does not spin."""
    from ringdp import hosts

    poll, look = hosts.ABORT_POLL_S, hosts.ABORT_STORE_POLL_S
    h = _waiter(_FakeStore())
    w = _FakeWork(time.monotonic() + 3.5 * poll)
    h._await(w, 10.0)
    assert w.is_completed() and w.waits >= 4 and h._abandoned == []
    w = _FakeWork(time.monotonic() + 1.5 * poll, error="Connection reset by peer")
    with pytest.raises(RuntimeError, match="Connection reset"):
        h._await(w, 10.0)
    # this rank's abort, from another thread
    w = _FakeWork(time.monotonic() + 60)
    threading.Timer(0.3, lambda: setattr(h._aborts, "mine", "ProcessGroup.abort() was called")).start()
    t0 = time.monotonic()
    with pytest.raises(hosts._Aborted, match="aborted on this rank"):
        h._await(w, 10.0)
    assert 0.3 <= time.monotonic() - t0 < 0.3 + 5 * poll  # (a slice, and room for a loaded machine)
    assert h._abandoned == [w]
    # a peer's note in the store
    store = _FakeStore("rank 3 aborted the group (ProcessGroup.abort() was called)")
    h = _waiter(store)
    t0 = time.monotonic()
    with pytest.raises(hosts._Aborted, match="rank 3 aborted the group"):
        h._await(_FakeWork(time.monotonic() + 60), 10.0)
    assert look <= time.monotonic() - t0 < look + 5 * poll and store.checks >= 1
    # no abort: the deadline, the work's own "timed out"
    h = _waiter(_FakeStore())
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        h._await(_FakeWork(time.monotonic() + 60), 0.45)
    assert 0.45 <= time.monotonic() - t0 < 0.45 + 3 * poll
    # a wait that raises at once (not done): no busy loop
    w = _FakeWork(time.monotonic() + 60, early=True)
    with pytest.raises(RuntimeError):
        h._await(w, 0.5)
    assert w.waits <= 0.5 / (poll / 2) + 2, w.waits


def test_wrapped_gloo_works_wait_without_timeout():
    """_Folded and _NanAware wrap gloo Works; their wait() without a timeout waits as a gloo
    Work's does: it passed timeout=None, which c10d's Work.wait refuses (a TypeError), and
    CrossHost._await re-waits a work done just after its slice exactly so, so a good call
    failed with that TypeError now and then and a gloo failure came out as one (a helper's
    review, 2026-12-07). Also through _await, a work whose slice ended a moment before it
    was done."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    from ringdp import hosts

    pg = ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    t = torch.ones(4)
    w = pg.allreduce([t])
    w.wait()
    for wrapped in (hosts._Folded(w, t, 2, 1, 0), hosts._NanAware(t, dist.ReduceOp.MIN).then(w, w)):
        wrapped.wait()
        wrapped.wait(timedelta(seconds=1))

    class Late:  # done, but its first (sliced) wait raised "timed out"
        def __init__(self, inner):
            self.inner, self.n = inner, 0

        def wait(self, timeout=None):
            self.n += 1
            if self.n == 1:
                raise RuntimeError("Operation timed out!")
            return self.inner.wait(timeout=timeout)

        def is_completed(self):
            return True

    late = Late(hosts._Folded(w, t, 2, 1, 0))
    _waiter(_FakeStore())._await(late, 5.0)
    assert late.n == 2


def case_call_timeout_longer(rank, world, hosts, late):
    """A call's timeout= above the communicator's, one rank `late` s late (more than the
    communicator's timeout, less than the call's): every rank's call ends well."""
    import ringdp

    _as_host(rank, hosts, timeout=3)
    got = []
    # (every collective through gloo's steps; the all-reduce with the call check too)
    for n, call in [(4096, "all_reduce")] + [(300_000, c) for c in ("all_reduce", "broadcast", "reduce_scatter",
                                                                     "all_gather")]:
        t = value(rank, n, world=world)
        ringdp.all_reduce(t.clone())  # (everyone set up)
        if rank == world - 1:
            time.sleep(late)
        t0 = time.monotonic()
        m = n // world
        if call == "all_reduce":
            ringdp.all_reduce(t, timeout=30)
            want = expected("SUM", world, n, torch.float32)
        elif call == "broadcast":
            ringdp.broadcast(t, 0, timeout=30)
            want = value(0, n, world=world)
        elif call == "reduce_scatter":
            src, t = t, torch.empty(m)
            ringdp.reduce_scatter_tensor(t, src, timeout=30)
            want = expected("SUM", world, n, torch.float32)[rank * m:(rank + 1) * m]
        else:
            src, t = value(rank, m, world=world), torch.empty(n)
            ringdp.all_gather_into_tensor(t, src, timeout=30)
            want = torch.cat([value(q, m, world=world) for q in range(world)])
        got.append((f"{call} n={n}", torch.equal(t, want), time.monotonic() - t0))
    return got


def test_call_timeout_longer_than_the_communicators_across_hosts():
    """Every collective through gloo's steps (the all-reduce with the call check too): the gloo steps
    across hosts take the call's timeout (policy.cross_host_timeout of it):
    they took the communicator's, so a call with a longer timeout= failed across hosts at
    0.9 x the communicator's ("its limit 27 s" after 2.7 s) where on one host it waited (a
    helper's review, 2026-12-07)."""
    late = 3.5  # (the communicator's 3 s; its gloo steps': 2.7 s)
    for r, got in enumerate(values(run_ranks(case_call_timeout_longer, 4, list("aabb"), late, timeout=200))):
        for call, ok, took in got:
            assert ok, (r, call)
            if r != 3:  # (the late rank's own call did not wait)
                assert took >= late - 1.0, (r, call, took)


def case_own_step_failure(rank, world, hosts, stuck_s):
    """Rank 1 (host a) alive but stuck past the timeout in its second call: rank 0, its host
    peer, fails its in-host step naming rank 1; its call check then fails too (host b's
    ranks gave up on it meanwhile). The error rank 0 raises is its own step's."""
    import ringdp

    _as_host(rank, hosts, timeout=3)
    ringdp.all_reduce(torch.ones(1000))
    if rank == 1:
        time.sleep(stuck_s)
        return None
    try:
        ringdp.all_reduce(torch.ones(1000))
    except ringdp.RingError as e:
        time.sleep(2)  # (rank 1 may still be asleep; leave together)
        return str(e)
    return "no error"


def test_own_step_failure_is_the_error_raised():
    """_begin: a rank whose first in-host step failed raises that error even when its call
    check fails after it (it raised the check's instead, "Connection closed by peer", and no
    rank's error named the stuck rank: a helper's review, 2026-12-07), as _begin_overlapped
    does."""
    res = values(run_ranks(case_own_step_failure, 4, list("aabb"), 8.0, timeout=120))
    assert res[1] is None
    assert res[0].startswith("rank 0: reduce_scatter") and "waiting for rank 1" in res[0], res[0]
    assert all(isinstance(m, str) and m != "no error" for m in (res[0], res[2], res[3])), res


def case_cross_group_set_up_fails(rank, world, hosts):
    """Rank 3's gloo group across hosts cannot be made (its constructor raises here):
    rank 3 and its group's peer, rank 1 (left waiting for it in the store), raise a
    RingError naming the group's ranks, not torch's bare errors."""
    from ringdp import hosts as hosts_mod

    if rank == 3:
        def refuse(*args, **kwargs):
            raise RuntimeError("no route to the other host (injected)")

        hosts_mod.ProcessGroupGloo = refuse
    try:
        _as_host(rank, hosts, timeout=3)
    except Exception as e:  # noqa: BLE001 -- its type is the point
        return f"{type(e).__name__}: {e}"
    return "set up"


def test_cross_group_set_up_failure_is_a_ring_error():
    res = values(run_ranks(case_cross_group_set_up_fails, 4, list("aabb"), timeout=120))
    for r in (1, 3):
        assert res[r].startswith(f"RingError: rank {r}: setting up the gloo group across hosts (ranks [1, 3]"), res[r]
    assert "injected" in res[3], res[3]


def test_a_missing_reason_is_not_waited_for_at_the_stores_timeout(monkeypatch):
    """A failed member's reason is read from the store with a bounded wait (REASON_WAIT_S):
    a reason whose leaving failed was waited for at the store's own timeout (torchrun's
    30 minutes) before the call's RingError came out."""
    from ringdp import hosts

    monkeypatch.setattr(hosts, "REASON_WAIT_S", 0.3)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    h = hosts.CrossHost.__new__(hosts.CrossHost)
    h._store, h._reasons, h.rank = (lambda: store), "reasons/", 0
    h._leave_reason(4, "rank 0: its in-host step failed")
    assert h._reason(0, 4) == "rank 0: its in-host step failed"
    t0 = time.monotonic()
    assert "could not be read" in h._reason(1, 4)
    assert time.monotonic() - t0 < 5
