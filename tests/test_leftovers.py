"""No /dev/shm entries are left behind by a job whose ranks die during set-up (issue 10,
point 4), under torchrun: torchrun SIGTERMs the other ranks as soon as one fails.

- a rank failing before ringdp.init(): the others wait in the rendezvous, before any segment
  exists (the host exchange comes first), and nothing is left (this held before the fix);
- a rank failing while the others hold their segments and wait in the exchange: their
  SIGTERM guard (csrc/transport/shm/names.h) unlinks the names as they die; with a Python
  SIGTERM handler installed, the guard unlinks, then that handler still runs;
- a rank SIGKILLed after creating its segment leaves its name; the next set-up on this
  machine removes it (its creator is dead), and never a name whose creator is alive, of
  another pid namespace or of another user;
- a job that torchrun restarts after a rank died (--max-restarts) sets up again on a store
  that still holds the dead attempt's keys, runs right, and leaves no segment of either
  attempt (test_elastic_restart; ringdp/rendezvous.py Rendezvous.incarnation);
- a world that changes size under torchrun --nnodes 1:2 (a host joins, or one dies whole)
  goes on in the new world, and leaves no segment of either (test_elastic_world_change).

Segment names are "ringdp-<job>-r<rank>-p<pid>-n<pid namespace inode>" (names.h). The
failing rank's failure is simulated by the test scripts (a wrapper around ringdp.comm._C),
never by the library."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from _dist import free_port, run_ranks, values

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOB = os.path.join(HERE, "_leftovers_job.py")
NAME = re.compile(r"^ringdp-(?P<job>[0-9A-Za-z]+)-r(?P<rank>\d+)-p(?P<pid>\d+)-n(?P<ns>\d+)$")


def _shm():
    return set(os.listdir("/dev/shm"))


def _torchrun(mode, out, world=3, job=JOB, restarts=0, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.1",
           "--max-restarts", str(restarts), job, mode, str(out)]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout


def _read(out, name):
    path = out / name
    return path.read_text() if path.exists() else None


def _job_names(out):
    """The names of the job's segments now in /dev/shm (the job's prefix, written by its
    last rank, "ringdp-<uid>")."""
    job = _read(out, "job")
    assert job, "the last rank never reached its segment"
    return sorted(n for n in _shm() if n == job or n.startswith(job + "-"))


def _check_run(rc, log, out, world=3):
    assert rc != 0 and "SIGTERM" in log, log  # torchrun terminated the others
    for r in range(world - 1):  # the others were inside ringdp.init when the last rank failed
        assert _read(out, f"entered-{r}") is not None and _read(out, f"done-{r}") is None, log


def test_rank_failing_before_init_leaves_nothing(tmp_path):
    before = _shm()
    rc, log = _torchrun("fail-before-init", tmp_path)
    _check_run(rc, log, tmp_path)
    pids = {_read(tmp_path, f"pid-{r}") for r in range(3)}
    time.sleep(0.5)  # names of other programs' set-ups come and go within milliseconds
    new = {n for n in _shm() - before if n.startswith("ringdp-")}
    mine = [n for n in new if not NAME.match(n) or NAME.match(n)["pid"] in pids]
    assert mine == [], log


def test_sigterm_during_setup_unlinks(tmp_path):
    rc, log = _torchrun("fail-at-create", tmp_path)
    _check_run(rc, log, tmp_path)
    assert _job_names(tmp_path) == [], log  # the SIGTERMed ranks' names went with them


def _init_only(rank, world):
    import ringdp

    name = ringdp.init(timeout=60).shm.name.lstrip("/")
    return name, _sigterm_disposition()  # set-up is over: SIGTERM's default is back


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_setup_removes_names_of_dead_creators(tmp_path):
    # A real leftover: a torchrun rank SIGKILLed right after creating its segment; the
    # others, SIGTERMed by torchrun, took their names with them.
    rc, log = _torchrun("killed-after-create", tmp_path)
    _check_run(rc, log, tmp_path)
    killed = _job_names(tmp_path)
    assert len(killed) == 1 and NAME.match(killed[0]), (killed, log)
    assert NAME.match(killed[0])["rank"] == "2" and NAME.match(killed[0])["pid"] == _read(tmp_path, "pid-2")
    from ringdp._native import _C

    own = _C.shm_segment_name("leftovertest", 0).lstrip("/")
    m = NAME.match(own)
    assert m and m["pid"] == str(os.getpid()), own
    ns = m["ns"]
    assert ns != "0" and int(ns) == os.stat("/proc/self/ns/pid").st_ino
    dead = _dead_pid()
    planted = {
        "dead": f"ringdp-leftovertest-r1-p{dead}-n{ns}",
        "alive": f"ringdp-leftovertest-r2-p{os.getpid()}-n{ns}",  # this process: alive
        "other-ns": f"ringdp-leftovertest-r3-p{dead}-n{int(ns) + 1}",  # pid means nothing here
        "unparsed": f"ringdp-leftovertest-r4-p{dead}",  # not a name of this version's
        "huge-ns": f"ringdp-leftovertest-r6-p{dead}-n{'9' * 25}",  # nor this
    }
    if os.geteuid() == 0:
        planted["other-user"] = f"ringdp-leftovertest-r5-p{dead}-n{ns}"
    try:
        for key, n in planted.items():
            with open(f"/dev/shm/{n}", "w") as f:
                f.write("x")
            if key == "other-user":
                os.chown(f"/dev/shm/{n}", 4242, -1)
        res = values(run_ranks(_init_only, 2))  # the next job on this machine
        assert all(NAME.match(n) and handler == 0 for n, handler in res), res
        present = _shm()
        assert killed[0] not in present
        assert planted["dead"] not in present
        kept = {k for k, n in planted.items() if n in present}
        assert kept == set(planted) - {"dead"}
    finally:
        for n in [*planted.values(), *killed]:
            try:
                os.unlink(f"/dev/shm/{n}")
            except FileNotFoundError:
                pass


def _sigterm_disposition():
    """SIGTERM's handler as the kernel has it (signal.getsignal only knows Python's view):
    0 is SIG_DFL. sa_handler is the first field of glibc's struct sigaction."""
    import ctypes
    import signal

    buf = ctypes.create_string_buffer(256)
    assert ctypes.CDLL(None, use_errno=True).sigaction(signal.SIGTERM, None, buf) == 0
    return int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_void_p)], "little")


class _SlowCreate:
    """ringdp's _C, except that creating the segment takes `delay` s (a slow rank)."""

    def __init__(self, native, delay):
        self._native, self._delay = native, delay

    def __getattr__(self, name):
        return getattr(self._native, name)

    def ShmComm(self, cfg):  # noqa: N802
        time.sleep(self._delay)
        return self._native.ShmComm(cfg)


class _Terminated(Exception):
    pass


def _sigterm_with_python_handler(rank, world):
    import signal
    import threading

    import ringdp
    import ringdp.comm

    if rank == 1:  # slow: rank 0 holds its segment and waits in the exchange meanwhile
        ringdp.comm._C = _SlowCreate(ringdp.comm._C, 2.0)
        try:
            ringdp.init(timeout=30)
        except ringdp.RingError as e:
            return str(e)
        return None

    def graceful(signum, frame):  # as a training script's handler: stop, by an exception
        raise _Terminated(signum)

    signal.signal(signal.SIGTERM, graceful)
    seen = {}

    def kill_once_created():
        mine = f"-p{os.getpid()}-"
        t0 = time.monotonic()
        while not seen.get("name") and time.monotonic() - t0 < 20:
            seen["name"] = next((n for n in os.listdir("/dev/shm") if n.startswith("ringdp-") and mine in n), None)
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # rank 0's main thread still waits in the exchange
        seen["after"] = os.path.exists(f"/dev/shm/{seen['name']}")

    before = _sigterm_disposition()  # Python's handler
    killer = threading.Thread(target=kill_once_created)
    killer.start()
    try:
        ringdp.init(timeout=30)
        err = None
    except _Terminated as e:
        err = f"terminated by {e.args[0]}"
    killer.join()
    return err, seen, _sigterm_disposition() == before


def test_sigterm_during_setup_chains_to_python_handler():
    res = values(run_ranks(_sigterm_with_python_handler, 2))
    err, seen, restored = res[0]
    assert err == f"terminated by {int(signal.SIGTERM)}"  # the script's handler ran, as it would have
    assert seen["name"] and NAME.match(seen["name"]), seen
    assert seen["after"] is False  # unlinked at the signal, while the rank still waited
    assert restored  # Python's handler is SIGTERM's disposition again
    # the peer fails with a RingError: it could not map the segment, or (rank 0 gone before it
    # got there: its wait sleeps, so the handler runs at once) it lost rank 0's store
    assert res[1] and ((seen["name"] in res[1] and "No such file" in res[1]) or "lost the store" in res[1]), res[1]
    assert seen["name"] not in _shm()


def test_segment_moves_release_the_old_one(tmp_path):
    """A shared-memory segment moved into one that holds another releases that one (its
    name unlinked, its mapping gone) and leaves the source empty: tests/cpp/segment_move.cpp,
    built with AddressSanitizer where the compiler has it (the move assignment used to run
    the destructor on the live object, then free a long name twice)."""
    import _cpp

    sources = ("tests/cpp/segment_move.cpp", "csrc/transport/shm/segment.cpp", "csrc/transport/shm/names.cpp")
    try:
        exe = _cpp.build(tmp_path, "segment_move", *sources, flags=("-fsanitize=address", "-fno-omit-frame-pointer"))
    except subprocess.CalledProcessError:  # no AddressSanitizer here: glibc still catches a double free
        exe = _cpp.build(tmp_path, "segment_move", *sources)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"segment move checks failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    assert "checks passed, 0 failed" in r.stdout, r.stdout


RESTART_JOB = os.path.join(HERE, "_restart_job.py")


@pytest.mark.parametrize("mode", ["raise", "sigkill"])
def test_elastic_restart(tmp_path, mode):
    """torchrun --max-restarts 1: the last rank dies in the first attempt (an exception
    between two collectives, or SIGKILL inside a 32 MiB all-reduce); torchrun SIGTERMs the
    others and starts the job again. The second attempt's collectives and stock DDP on
    cpu:ringdp are right (closed forms; parameters equal to one process on the full batch,
    identical on every rank), and no segment of either attempt is left."""
    import json

    import torch
    from _restart_job import train

    world = 3
    rc, log = _torchrun(mode, tmp_path, world=world, job=RESTART_JOB, restarts=1, timeout=240)
    assert rc == 0, log
    for r in range(world):
        seen = json.loads(_read(tmp_path, f"attempt1-{r}.json") or "{}")
        assert seen and all(seen.values()), (r, seen, log)
    # one prefix per attempt: every rank's of the second; of the first, the ranks' that wrote
    # theirs before torchrun ended them (the last rank's, at least: it dies after its own)
    second = {_read(tmp_path, f"job1-{r}") for r in range(world)}
    first = {_read(tmp_path, f"job0-{r}") for r in range(world)} - {None}
    assert None not in second and len(second) == 1 and len(first) == 1 and first != second, (first, second)
    jobs = first | second
    torch.testing.assert_close(torch.load(tmp_path / "params.pt"), train(world), rtol=1e-6, atol=1e-7)
    # the SIGTERMed ranks took their names with them; a SIGKILLed rank's was removed by the
    # second attempt's set-up (its creator was dead); the second attempt's at its end
    left = sorted(n for n in _shm() if any(n == j or n.startswith(j + "-") for j in jobs))
    assert left == [], (left, log)
    # the first attempt: a survivor whose collective failed names a dead rank (the last one,
    # directly or through the rank that aborted on seeing it; or, SIGTERMed by torchrun just
    # before, its other peer). None has to: torchrun (monitor 0.1 s) reaps the dead rank and
    # SIGTERMs the others at once, at times before they see it (2 in 7 runs on 2 cores).
    # A survivor whose traceback is in the log wrote its error first.
    reports = {r: msg for r in range(world - 1) if (msg := _read(tmp_path, f"error0-{r}")) is not None}
    for r in set(map(int, re.findall(r"\[rank(\d+)\]: Traceback", log))) - {world - 1}:
        assert r in reports, (r, log)
    for r, msg in reports.items():
        died = [int(d) for d in re.findall(r"rank (\d+) \(pid \d+\) died", msg)]
        assert msg.startswith("RingError: ") and died and r not in died, (r, msg, log)
    # torchrun saw how it died: its first failure is the last rank's, or (reaped in the same
    # poll, listed first) a survivor's that had reported it
    if mode == "raise":
        assert "RuntimeError: simulated failure between two collectives" in log, log
    seen = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", log)
    assert seen, log
    code, local = int(seen[1]), int(seen[2])
    assert (local, code) == (world - 1, -9 if mode == "sigkill" else 1) or (local in reports and code == 1), log


def _elastic(tmp_path, change, timeout_s=10):
    """RESTART_JOB in mode "elastic" under two torchrun launchers (--nnodes 1:2, c10d
    rendezvous on 127.0.0.1), each its own simulated host (RINGDP_HOST_ID a, b), 2 ranks
    each. grow: host b's launcher starts once host a's ranks train alone; shrink: both start,
    and once all four train, host b dies whole (its launcher and ranks SIGKILLed). Returns
    ((rc, log) per host, the time host b was killed or None)."""
    if os.path.join(ROOT, "bench") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
    import netns_hosts

    ready = lambda n: all((tmp_path / f"ready-{r}").exists() for r in range(n))  # noqa: E731
    killed = {}

    def kill_b():
        if ready(4):
            killed["at"] = time.time()
            return True
        return False

    env = {"OMP_NUM_THREADS": "1", "FIRST_WORLD": str(2 if change == "grow" else 4),
           "RESTART_JOB_TIMEOUT_S": str(timeout_s)}
    if change == "grow":
        # torch 2.13's launcher cannot take a node in while it shares its store with the
        # ranks: the node that stays rank 0 does not publish the new round's store address,
        # and the joining node waits for it (dynamic_rendezvous.py next_rendezvous): each
        # round gets a store of its own
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    hosts = {"prefix": [[], []], "addr": ["127.0.0.1"] * 2, "env": [{"RINGDP_HOST_ID": "a"}, {"RINGDP_HOST_ID": "b"}]}
    results = netns_hosts.launch(
        hosts, [RESTART_JOB, "elastic", str(tmp_path)], free_port(), nproc=2, env=env, timeout=150,
        rdzv_id=f"elastic{os.getpid()}", stop_on_failure=False, nnodes="1:2",
        # the wait for more nodes once one is there: shrink's first world needs both (the job
        # fails at once without), its second forms after that wait. (torchrun's keep-alive
        # stays at its default: at 1 s x 2 tries a busy machine dropped a live node.)
        rdzv_conf=f"last_call_timeout={1 if change == 'grow' else 8}",
        torchrun_args=("--monitor-interval", "0.1", "--max-restarts", str(int(change == "shrink"))),
        start_second=(lambda: ready(2)) if change == "grow" else None,
        kill_second=kill_b if change == "shrink" else None)
    return results, killed.get("at")


@pytest.mark.parametrize("change", ["grow", "shrink"])
def test_elastic_world_change(tmp_path, change):
    """torchrun --nnodes 1:2 with two simulated hosts: the world changes and the job goes on
    on ringdp in the new one.
    grow: host a's 2 ranks train alone; host b joins; torchrun stops them and starts a world
    of 4 over both hosts (ringdp's two-level path).
    shrink: 4 ranks over both hosts; host b dies whole; host a's ranks raise a RingError
    naming the cross-host step within their timeout; torchrun (--max-restarts 1) starts them
    again as a world of 2 on one host, on the store that still holds the world of 4's keys
    (a later incarnation: ringdp/rendezvous.py).
    The new world's collectives and stock DDP are right (closed forms; one process on the
    full batch, identical on every rank), and no segment of either world is left."""
    import json

    import torch
    from _restart_job import train

    timeout_s = 10
    (host_a, host_b), killed_at = _elastic(tmp_path, change, timeout_s)
    first, then = (2, 4) if change == "grow" else (4, 2)
    log = f"host a:\n{host_a[1][-6000:]}\nhost b:\n{host_b[1][-3000:]}"
    assert host_a[0] == 0 and host_b[0] == (0 if change == "grow" else -9), log
    for r in range(first):
        assert _read(tmp_path, f"ready-{r}") is not None, log
    for r in range(then):
        seen = json.loads(_read(tmp_path, f"attempt1-{r}.json") or "{}")
        assert seen and all(seen.values()), (r, seen, log)
    torch.testing.assert_close(torch.load(tmp_path / "params.pt"), train(then), rtol=1e-6, atol=1e-7)
    errors = {r: _read(tmp_path, f"error0-{r}") for r in range(first)}
    if change == "grow":  # torchrun stopped the first world (SIGTERM): no rank failed
        assert not any(errors.values()), errors
    else:
        # host a's ranks: a RingError, in time; one names its cross-host step with host b's
        # rank (the other may have failed on it in the in-host step first, or been ended by
        # torchrun before it wrote)
        assert any(errors.values()), (errors, log)
        for r, e in errors.items():
            if e is not None:
                assert e.startswith("RingError: ") and f"rank {r}:" in e, (r, errors)
                assert os.path.getmtime(tmp_path / f"error0-{r}") - killed_at < timeout_s + 5, e
        assert any(e and f"across hosts (gloo, ranks [{r}, {r + 2}] of the group)" in e
                   for r, e in errors.items()), errors
        # one store for both worlds: the second drew a later incarnation over the first's keys
        inc = [int(_read(tmp_path, f"incarnation{k}-0")) for k in (0, 1)]
        assert inc[1] > inc[0], inc
    jobs = {_read(tmp_path, f"job{k}-{r}") for k, n in ((0, first), (1, then)) for r in range(n)}
    assert None not in jobs and len(jobs) == 3, jobs  # (a prefix per host per world: 1 + 2, or 2 + 1)
    # the SIGTERMed ranks took their segments with them; host b's SIGKILLed ones were removed
    # by the next set-up on this machine (their creators were dead); the last world's at its end
    left = sorted(n for n in _shm() if any(n == j or n.startswith(j + "-") for j in jobs))
    assert left == [], (left, log)
