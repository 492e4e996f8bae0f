"""ringdp follows the process group's lifetime: torch.distributed.destroy_process_group()
then init_process_group() again works (on the same store port, as torchrun's env:// does)
and ringdp then runs on the new group; a call on a destroyed group is a clear RingError,
never a run on the old communicator. A failed RingDDP model check ends in the same
RingError on every rank, and the processes exit cleanly."""
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch

from _dist import free_port, run_ranks, values

ROUNDS = 4  # destroy / re-init cycles per rank in one run


def _port_listened(port: int) -> bool:
    """Whether a socket listens on `port` (SO_REUSEADDR: closed connections of the port in
    TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def _use_ringdp(rank, world, round_):
    """An all_reduce with values depending on rank, index and round, and a RingDDP step;
    returns what failed to match (empty: all good)."""
    import ringdp

    bad = []
    t = torch.arange(1000, dtype=torch.float64) * (rank + 1) + round_
    ringdp.all_reduce(t)
    want = torch.arange(1000, dtype=torch.float64) * (world * (world + 1) / 2) + world * round_
    if not torch.equal(t, want):
        bad.append(f"round {round_}: all_reduce gave {t[:3].tolist()}..., want {want[:3].tolist()}...")
    torch.manual_seed(rank)  # rank 0's parameters are broadcast
    net = torch.nn.Linear(4, 3)
    model = ringdp.RingDDP(net)
    x = torch.full((2, 4), float(rank + 1))
    model(x).sum().backward()
    # d(sum(W x + b))/dW[i, j] = sum over the batch of x[:, j] = 2 (rank + 1); averaged
    want_grad = 2.0 * sum(r + 1 for r in range(world)) / world
    if not torch.allclose(net.weight.grad, torch.full((3, 4), want_grad)):
        bad.append(f"round {round_}: RingDDP gradient {net.weight.grad[0].tolist()}, want {want_grad}")
    return bad


def _reinit(rank, world, barrier):
    """ROUNDS times: use ringdp, destroy the default group, check that nothing of it is left
    (rank 0's store port is free) and that ringdp refuses the destroyed group, re-initialise
    on the same port, check that ringdp runs on a new communicator and the old one refuses."""
    import torch.distributed as dist

    import ringdp

    store = dist.distributed_c10d._get_default_store()
    while not hasattr(store, "port"):  # PrefixStores over run_ranks' TCPStore
        store = store.underlying_store
    port = store.port
    del store
    problems = []
    for round_ in range(ROUNDS):
        problems += _use_ringdp(rank, world, round_)
        old = ringdp.get_communicator()
        dist.destroy_process_group()
        if rank == 0 and _port_listened(port):
            problems.append(f"round {round_}: the store server still listens on {port} after destroy_process_group")
        try:
            ringdp.all_reduce(torch.ones(4))
            problems.append(f"round {round_}: ringdp.all_reduce ran after destroy_process_group")
        except Exception as e:  # noqa: BLE001 -- checked here
            if not isinstance(e, ringdp.RingError) or "destroyed" not in str(e) or f"rank {rank}" not in str(e):
                problems.append(f"round {round_}: unclear error after destroy: {type(e).__name__}: {e}")
        for what, fn in [("get_communicator", ringdp.get_communicator), ("empty", lambda: ringdp.empty(4))]:
            try:  # (not the communicator get_communicator() found last: its group is gone)
                fn()
                problems.append(f"round {round_}: ringdp.{what}() answered after destroy_process_group")
            except ringdp.RingError as e:
                if "destroyed" not in str(e):
                    problems.append(f"round {round_}: unclear error from ringdp.{what}(): {e}")
        # torch's own race, not ringdp's: a rank that re-connects before rank 0 closed its
        # store server reaches the old server. Everyone destroyed before anyone re-connects.
        barrier.wait(timeout=60)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))  # the old code hung here, in gloo's connect
        if ringdp.get_communicator() is old:
            problems.append(f"round {round_}: the new group got the old communicator")
        try:
            old.all_reduce(torch.ones(4))
            problems.append(f"round {round_}: the old communicator ran after its group was destroyed")
        except Exception as e:  # noqa: BLE001 -- checked here
            if not isinstance(e, ringdp.RingError) or "destroyed" not in str(e):
                problems.append(f"round {round_}: unclear error from the old communicator: {type(e).__name__}: {e}")
    problems += _use_ringdp(rank, world, ROUNDS)
    return problems


def test_reinit_on_the_same_port():
    import multiprocessing as mp

    barrier = mp.get_context("spawn").Barrier(2)
    for rank, problems in enumerate(values(run_ranks(_reinit, 2, barrier, timeout=120))):
        assert problems == [], f"rank {rank}: {problems}"


def _subgroup(rank, world):
    import torch.distributed as dist

    import ringdp

    g = dist.new_group([0, 1])
    t = torch.full((8,), float(rank + 1))
    ringdp.all_reduce(t, group=g)
    first = t.tolist()
    dist.destroy_process_group(g)
    try:
        ringdp.all_reduce(torch.ones(8), group=g)
        after = None
    except Exception as e:  # noqa: BLE001 -- the test checks its type and text
        after = (type(e).__name__, str(e))
    # the default group and a new group of the same ranks still work
    g2 = dist.new_group([0, 1])
    u = torch.full((8,), float(10 * (rank + 1)))
    ringdp.all_reduce(u, group=g2)
    v = torch.full((8,), float(rank))
    ringdp.all_reduce(v)
    held = sum(not c._closed for c in ringdp.comm._comms.values())
    return first, after, u.tolist(), v.tolist(), held


def test_destroyed_subgroup_is_a_clear_error():
    for rank, (first, after, u, v, held) in enumerate(values(run_ranks(_subgroup, 2))):
        assert held == 2, f"rank {rank}: {held} communicators held (the world's and the new group's; the destroyed one's released)"
        assert first == [3.0] * 8
        assert after is not None, f"rank {rank}: ringdp ran on a destroyed group"
        name, msg = after
        assert name == "RingError" and "destroyed" in msg and f"rank {rank}" in msg, after
        assert u == [30.0] * 8 and v == [1.0] * 8


def _groups_of_the_same_ranks(rank, world):
    """Two groups of the same ranks are two groups: each its own communicator, their
    collectives never paired with each other's (rank 0 starts A's then B's, rank 1 B's then
    A's, as torch allows: each group's own order agrees), and destroying one leaves the
    other working. The ranks' group names, once each group is set up, say the same."""
    import torch.distributed as dist

    import ringdp

    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    ca, cb = ringdp.init(a), ringdp.init(b)
    out = {"distinct": ca is not cb}
    for call in range(2):
        xa = torch.arange(5, dtype=torch.float64) + rank + 10 * call  # A: 2i + 1 + 20 call
        xb = torch.arange(5, dtype=torch.float64) * 100 + rank  # B: 200i + 1
        order = [(xa, a), (xb, b)] if rank == 0 else [(xb, b), (xa, a)]
        for w in [ringdp.all_reduce(t, group=g, async_op=True) for t, g in order]:
            w.wait()
        out[f"call{call}"] = (xa.tolist(), xb.tolist())
    ringdp.destroy(b)
    xa = torch.ones(3)
    ringdp.all_reduce(xa, group=a)
    out["a after b destroyed"] = xa.tolist()
    return out


def test_groups_of_the_same_ranks_are_apart():
    for rank, out in enumerate(values(run_ranks(_groups_of_the_same_ranks, 2))):
        assert out["distinct"], f"rank {rank}: two groups of the same ranks share a communicator"
        for call in range(2):
            xa, xb = out[f"call{call}"]
            assert xa == [2.0 * i + 1 + 20 * call for i in range(5)], (rank, call, xa)
            assert xb == [200.0 * i + 1 for i in range(5)], (rank, call, xb)
        assert out["a after b destroyed"] == [2.0] * 3, out


def _groups_set_up_on_two_threads(rank, world):
    """Two threads per rank set up two groups (the default one and a subgroup) in opposite
    orders on the two ranks: each set-up waits only for its own group's peers, never for
    the other thread's (one table lock held across both would wait for the timeout)."""
    import threading

    import torch.distributed as dist

    import ringdp

    g = dist.new_group([0, 1])
    res = {}

    def use(name, group, delay):
        time.sleep(delay)
        t0 = time.monotonic()
        try:  # a value of each group's own: a call paired with the other group's would show
            x = torch.full((4,), float(rank + 1) * (10 if name == "sub" else 1))
            ringdp.all_reduce(x, group=group)
            res[name] = (x.tolist(), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 -- the test reports it
            res[name] = (f"{type(e).__name__}: {e}", time.monotonic() - t0)

    threads = [threading.Thread(target=use, args=("world", None, 0.0 if rank == 0 else 0.5)),
               threading.Thread(target=use, args=("sub", g, 0.5 if rank == 0 else 0.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return res


def test_groups_set_up_on_two_threads_in_opposite_orders():
    res = values(run_ranks(_groups_set_up_on_two_threads, 2, env={"RINGDP_TIMEOUT_S": "20"}, timeout=120))
    for rank, r in enumerate(res):
        for name, want in (("world", 1.0 + 2.0), ("sub", 10.0 + 20.0)):
            got, took = r[name]
            assert got == [want] * 4, (rank, name, got)
            assert took < 10, (rank, name, took)


def _init_timeout_after_set_up(rank, world):
    """ringdp.init(timeout=) once the group's communicator exists: the same timeout is
    fine, another one a clear error (it would be ignored)."""
    import ringdp

    ringdp.all_reduce(torch.ones(2))  # sets the default group up, default timeout
    c = ringdp.get_communicator()
    same = ringdp.init(timeout=c.timeout) is c
    try:
        ringdp.init(timeout=5)
        other = None
    except ValueError as e:
        other = str(e)
    return same, other, c.timeout


def test_init_timeout_on_an_existing_communicator():
    for rank, (same, other, timeout) in enumerate(values(run_ranks(_init_timeout_after_set_up, 2))):
        assert same
        assert other is not None, f"rank {rank}: init(timeout=5) silently ignored (timeout stays {timeout} s)"
        assert other.startswith(f"rank {rank}: ringdp.init(timeout=5)") and f"{timeout:g} s" in other, other


def _closed_cuda(rank, world):
    """A communicator kept past ringdp.destroy(): its CUDA calls say it was destroyed, and
    set nothing up (before: the CUDA endpoint was made anew, collectively, on a closed
    communicator, and never freed)."""
    import ringdp

    comm = ringdp.get_communicator()
    ringdp.all_reduce(torch.ones(4))
    ringdp.destroy()
    out = []
    for call in (lambda: comm.empty((4,), device="cuda"), lambda: comm.algo_for(1024, device="cuda")):
        try:
            call()
            out.append(None)
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
    return out, comm._cuda is None


def test_closed_communicator_sets_no_cuda_endpoint_up():
    for rank, (out, no_endpoint) in enumerate(values(run_ranks(_closed_cuda, 2))):
        assert no_endpoint
        (e1, m1), (e2, m2) = out
        assert e1 == "ValueError" and e2 == "RingError", out
        for m in (m1, m2):
            assert "destroyed" in m and f"rank {rank}" in m, m


def _cuda_setup_racing_close(rank, world):
    """close() on another thread lands just after a CUDA call's first set-up checked that
    the communicator is usable (here: inside that check, after it answered): the set-up
    raises the communicator's closed RingError and makes no endpoint (before: it set one up,
    collectively, on the closed communicator, which nothing would free)."""
    import threading

    import ringdp
    from ringdp import comm as comm_mod

    comm = ringdp.get_communicator()
    ringdp.all_reduce(torch.ones(4))
    made = []
    real = comm._unusable

    def unusable_then_closed():
        reason = real()
        if not made:  # (once: the first check of the set-up)
            made.append("checked")
            closer = threading.Thread(target=comm.close)
            closer.start()
            closer.join()
        return reason

    comm._unusable = unusable_then_closed
    orig = comm_mod.cuda_comm.CudaEndpoint.create
    comm_mod.cuda_comm.CudaEndpoint.create = classmethod(lambda cls, c, device: made.append("created") or object())
    try:
        comm._cuda_endpoint("cuda:0")
        err = None
    except ringdp.RingError as e:
        err = str(e)
    finally:
        comm_mod.cuda_comm.CudaEndpoint.create = orig
    return err, made, comm._cuda is None


def test_cuda_setup_racing_close_makes_no_endpoint():
    for rank, (err, made, none) in enumerate(values(run_ranks(_cuda_setup_racing_close, 2))):
        assert made == ["checked"] and none, (rank, made)
        assert err is not None and f"rank {rank}" in err and "destroyed" in err, err


def _failed_teardown(rank, world):
    """destroy() when one communicator's CUDA teardown fails (its barrier's peer died: a
    stand-in endpoint whose close() raises): that communicator still lets its shared memory
    go, every other communicator is closed too, and destroy() raises the failure after."""
    import torch.distributed as dist

    import ringdp

    c1 = ringdp.init()
    c2 = ringdp.init(dist.new_group([0, 1]))
    for c in (c1, c2):
        c.all_reduce(torch.ones(4))

    class FailingCudaEndpoint:
        def wait_queued(self, lasting=None):  # (nothing queued)
            pass

        def close(self, rendezvous):
            raise ringdp.RingError(f"rank {rank}: the CUDA endpoint's teardown failed (a stand-in)")

    c1._cuda = FailingCudaEndpoint()
    try:
        ringdp.destroy()
        err = None
    except ringdp.RingError as e:
        err = str(e)
    left = [(c._closed, c._shm is None, c._cuda is None, c.across is None) for c in (c1, c2)]
    try:
        c1.all_reduce(torch.ones(4))
        after = None
    except ringdp.RingError as e:
        after = str(e)
    return err, left, after, len(ringdp.comm._comms)


def test_failed_teardown_still_releases_everything():
    for rank, (err, left, after, n) in enumerate(values(run_ranks(_failed_teardown, 2))):
        assert err is not None and "stand-in" in err, err
        assert left == [(True, True, True, True)] * 2, left
        assert after is not None and f"rank {rank}" in after and "destroyed" in after, after
        assert n == 0


def _destroy_in_a_signal_handler_during_init(rank, world):
    """A signal handler that calls ringdp.destroy() (a graceful-shutdown handler) runs while
    init() on the same thread waits for a late peer: destroy() returns (before: it waited
    forever for the table lock that init() held, on its own thread), and the set-up goes on."""
    import signal
    import threading

    import ringdp

    ringdp.all_reduce(torch.ones(1))  # (one communicator to destroy)
    import torch.distributed as dist

    g = dist.new_group([0, 1])
    handled = []
    if rank == 0:
        def handler(signum, frame):
            t0 = time.monotonic()
            ringdp.destroy()
            handled.append(time.monotonic() - t0)

        signal.signal(signal.SIGUSR1, handler)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    else:
        time.sleep(3.0)
    ringdp.init(g, timeout=20)  # rank 0 waits for rank 1 here when the signal comes
    t = torch.full((4,), float(rank + 1))
    ringdp.all_reduce(t, group=g)
    return handled, t.tolist()


def test_destroy_in_a_signal_handler_during_init():
    res = values(run_ranks(_destroy_in_a_signal_handler_during_init, 2, timeout=60))
    handled, t = res[0]
    assert len(handled) == 1 and handled[0] < 5, handled
    assert all(r[1] == [3.0] * 4 for r in res), res


# ---------------------------------------------------------------------- shutdown
_RANK_PROGRAM = """
import os, sys
sys.path.insert(0, {tests!r})
import test_lifecycle
test_lifecycle._mismatch_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
"""


def _starve_gloo_threads(rank):
    """Make a lost race at exit likely: torch's gloo threads get the lowest priority, on the
    CPU of the main thread. (A gloo work still holding tensors made in Python when the
    interpreter finalises aborts the process; without this, 3-10% of runs lose that race.)"""
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if "gloo" not in f.read():
                continue
        try:
            os.sched_setaffinity(int(tid), {cpu})
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)
        except OSError:
            pass


def _mismatch_main(rank, world, port):
    """A user's script: rank 1 built a wider model; RingDDP's check fails; the script
    prints the error and ends (no destroy_process_group)."""
    import torch.distributed as dist

    import ringdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _starve_gloo_threads(rank)
    width = 12 if rank == 1 else 16
    net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    pg = dist.distributed_c10d._get_default_group()
    seq = pg._get_sequence_number_for_group()
    try:
        ringdp.RingDDP(net)
        print("NO ERROR")
    except ringdp.RingError as e:
        print(f"ERROR {e}")
    # No flush: stdout (a pipe) is written at exit. Writing now would release the GIL and
    # let the gloo threads finish in time, hiding the race this test is about.
    print(f"GLOO COLLECTIVES {pg._get_sequence_number_for_group() - seq}")


def _run_script(world, timeout=120):
    port = free_port()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in [os.path.dirname(tests), os.environ.get("PYTHONPATH")] if p))
    code = _RANK_PROGRAM.format(tests=tests)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(world), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text.decode(errors="replace")))
    return out


RUNS = 2  # runs of 3 fresh ranks; the old check aborted in most of them (see _starve_gloo_threads)


def test_model_mismatch_same_error_everywhere_and_clean_exit():
    for run in range(RUNS):
        out = _run_script(3)
        exits = [rc for rc, _ in out]
        assert exits == [0, 0, 0], f"run {run}: exit codes {exits} (-6: SIGABRT):\n" + "\n".join(t for _, t in out)
        errors = []
        for rank, (_, text) in enumerate(out):
            lines = text.splitlines()
            err = [ln for ln in lines if ln.startswith("ERROR ")]
            assert err, f"run {run}: rank {rank} did not raise:\n{text}"
            assert f"(seen from rank {rank})" in err[0]
            errors.append(err[0].replace(f"(seen from rank {rank})", ""))
            # the check issues no gloo collective: nothing of it is left in gloo's threads
            assert "GLOO COLLECTIVES 0" in lines, f"run {run}: rank {rank}:\n{text}"
        assert len(set(errors)) == 1, errors
        assert "rank 1 differs from rank 0's at entry #0" in errors[0]
        assert "(16, 8)" in errors[0] and "(12, 8)" in errors[0]


def _incarnations(store, world, delays, timeout=20.0):
    """Rendezvous.incarnation on `world` threads sharing `store`, rank r starting after
    delays[r] seconds (None: never): each rank's number (or the exception it raised)."""
    import threading

    from ringdp.rendezvous import Rendezvous

    out = [None] * world

    def one(r):
        if delays[r] is None:  # this rank never comes
            return
        time.sleep(delays[r])
        try:
            out[r] = Rendezvous("ringdp/g/", r, world, timeout, store=store).incarnation()
        except Exception as e:  # noqa: BLE001 -- reported to the test
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_incarnation_is_fresh_over_a_dead_attempts_keys():
    """The keys of earlier set-ups stay in the store (torchrun's agent store across
    --max-restarts attempts): a complete one (its member list), and one whose rank 0 drew a
    number that no other rank ever joined (it died half-way), and a rank that joined a number
    and died. The next set-up's ranks, whichever comes first, agree on a number that no
    earlier set-up drew; a set-up after that draws another. (The end to end case, under
    torchrun: tests/test_leftovers.py::test_elastic_restart.)"""
    import torch.distributed as dist

    from ringdp import RingError

    store = dist.HashStore()
    world = 3
    first = _incarnations(store, world, [0.0, 0.0, 0.0])
    assert first == [1, 1, 1], first
    # a half-way attempt: rank 0 drew 2 and died; rank 2 joined it and died
    old = dist.PrefixStore("ringdp/g/", store)
    assert old.add("incarnation/drawn", 1) == 2
    old.set("incarnation/2/join/2", "dead")
    for delays in ([0.3, 0.0, 0.0], [0.0, 0.3, 0.0], [0.0, 0.0, 0.0], [0.2, 0.1, 0.0]):
        drawn = int(old.add("incarnation/drawn", 0))
        got = _incarnations(store, world, delays)
        assert got == [drawn + 1] * world, (delays, drawn, got)  # rank 0's fresh draw, on every rank
    assert _incarnations(dist.HashStore(), 1, [0.0]) == [1]  # world 1
    # the same prefix again with more ranks (torchrun's --nnodes a:b grows the world; a group
    # name reused after destroy_process_group): the earlier, shorter member lists are not
    # theirs, the high ranks included, whether rank 0 comes first or last
    for before, delays in ((1, [0.3, 0.0, 0.0, 0.0]), (2, [0.3, 0.0, 0.0, 0.0]), (2, [0.0, 0.1, 0.1, 0.1])):
        grown = dist.HashStore()
        assert _incarnations(grown, before, [0.0] * before) == [1] * before
        got = _incarnations(grown, 4, delays)
        assert got == [2] * 4, (before, delays, got)
    # a rank 0 that never comes: the other gives up within its timeout, naming it
    t0 = time.monotonic()
    (err,) = _incarnations(store, 2, [None, 0.0], timeout=0.5)[1:]
    assert isinstance(err, RingError), err
    assert "rank 1: timed out after 0.5 s waiting for the set-up number of rank 0 (this rank joined set-up" in str(err), err
    # and a rank 0 whose peers never come names them
    (err,) = _incarnations(store, 3, [0.0, None, None], timeout=0.5)[:1]
    assert isinstance(err, RingError), err
    assert "rank 0: timed out after 0.5 s waiting for set-up" in str(err) and "joins of rank 1, rank 2;" in str(err), err
    assert time.monotonic() - t0 < 5
