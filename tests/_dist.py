"""The multi-process test harness: run functions on local ranks (spawned processes, a gloo
process group on 127.0.0.1, one intra-op thread each) and collect what every rank returned.

Two ways in:

- `Pool(world)`: workers spawned once, then one case after another, so a test pays for its
  case rather than for importing torch on every rank. `pool.run(case, *args, timeout=...,
  env=..., **kwargs)` runs `case(rank, world, *args, **kwargs)` on every rank and returns
  the per-rank results (or fails the test with every rank's traceback). A case is a
  module-level function and travels by reference: the workers import its module by name,
  which works because spawned processes get the parent's sys.path, where conftest.py put
  tests/. Test modules get a 2-rank pool through the `pool` fixture of conftest.py.
- `run_ranks(fn, world, *args)`: fresh processes for one run, for what a pool cannot
  host: ranks that kill themselves, other world sizes, a different environment at start.

`free_port()` is the one free-port helper of the test suite.

A rank that has not answered when its run or case times out is asked for its Python stacks
(every thread, through faulthandler on SIGUSR2) before it is killed: they land in the
test's captured stderr, so that a hang that happened once says where it was.
"""
from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import queue as _queue
import signal
import socket
import sys
import time
import traceback

POOL_WORLD = 2  # ranks of the pool that the `pool` fixture hands out
CASE_TIMEOUT_S = 90  # default per-case limit of a Pool (and its gloo timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stacks_on_request() -> None:
    """(in a rank) Print every thread's Python stack on stderr when SIGUSR2 comes."""
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)


def _dump_stacks(procs, ranks) -> None:
    """Ask the live ones among `ranks` of `procs` for their stacks (_stacks_on_request), and
    give them a moment to write them, before they are killed."""
    asked = [r for r in ranks if procs[r].is_alive()]
    if not asked:
        return
    sys.stderr.write(f"\n=== test harness: Python stacks of ranks {asked}, which did not answer in time ===\n")
    sys.stderr.flush()
    for r in asked:
        try:
            os.kill(procs[r].pid, signal.SIGUSR2)
        except OSError:
            pass
    time.sleep(1.0)


def _to_bytes(obj) -> bytes:
    """Results travel as torch.save bytes: tensors by value, never as shared-memory handles
    that need the sending process alive when the parent unpickles them."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(payload: bytes):
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def _init_group(rank, world, port, timeout_s=None, backend="gloo"):
    import torch
    import torch.distributed as dist

    if "ringdp" in backend:
        import ringdp  # noqa: F401 -- registers the backend

    torch.set_num_threads(1)
    kw = {}
    if timeout_s is not None:
        from datetime import timedelta

        kw["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kw)
    # No rank goes on before every rank's group is made. gloo's init returns on a rank once its
    # own connections are up; a case that then drops the group (destroy_process_group, to make
    # its own on the store) or ends its process closes sockets that a slower rank's init has
    # already counted as connected, and that rank's init fails ("Gloo connectFullMesh failed
    # ... Connection closed by peer"): seen once in CI, test_fuzz.py[w4-gloo-default-aabb].
    dist.barrier()


# ============================================================== persistent pool
class _env_overrides:
    """Sets `env` in os.environ and restores what was there (or its absence) on exit."""

    def __init__(self, env):
        self.env = dict(env or {})

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return False


def _pool_worker(rank, world, port, timeout_s, env, inq, outq):
    _stacks_on_request()
    os.environ.update(env)  # before torch is imported: OMP_NUM_THREADS, RINGDP_TIMEOUT_S
    import torch.distributed as dist

    _init_group(rank, world, port, timeout_s)
    while True:
        item = inq.get()
        if item is None:
            break
        try:
            fn, args, kwargs, case_env = pickle.loads(item)
        except BaseException:
            outq.put((rank, False, "the worker could not load the case (its module must be importable by name "
                                   "in the workers: tests/ on sys.path, see conftest.py)\n" + traceback.format_exc()))
            continue
        with _env_overrides(case_env):
            try:
                outq.put((rank, True, _to_bytes(fn(rank, world, *args, **kwargs))))
            except BaseException:
                outq.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    """`world` spawned workers in one gloo group that run cases one after another.

    Workers start with OMP_NUM_THREADS=1 and RINGDP_TIMEOUT_S at half the case timeout (a
    collective that hangs raises inside the case, naming the rank, before the case
    deadline), then `env` on top. A case that is not answered by every rank within its
    timeout, or a worker that dies, leaves the pool `broken`: it refuses further cases and
    is replaced by whoever owns it (the `pool` fixture does so)."""

    def __init__(self, world: int = POOL_WORLD, *, timeout: float = CASE_TIMEOUT_S, env: dict | None = None):
        self.world = world
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self.inqs = [ctx.SimpleQueue() for _ in range(world)]
        self.outq = ctx.Queue()
        start_env = {"OMP_NUM_THREADS": "1", "RINGDP_TIMEOUT_S": str(int(timeout) // 2), **(env or {})}
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world, port, timeout, start_env, self.inqs[r],
                                                             self.outq), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, case, *args, timeout: float | None = None, env: dict | None = None, **kwargs) -> list:
        """Run `case(rank, world, *args, **kwargs)` on every rank with `env` set in os.environ
        for the duration of the case; returns the results indexed by rank."""
        if self.broken:
            raise RuntimeError("this pool is broken (a case hung or a worker died); start a new one")
        timeout = self.timeout if timeout is None else timeout
        name = getattr(case, "__qualname__", repr(case))
        payload = pickle.dumps((case, args, kwargs, dict(env or {})))  # fails here, for all ranks, or not at all
        for q in self.inqs:
            q.put(payload)
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:
            left = deadline - time.monotonic()
            try:
                r, ok, answer = self.outq.get(timeout=min(max(0.1, left), 1.0))
            except _queue.Empty:
                if left <= 0 or not all(p.is_alive() for p in self.procs):
                    self.broken = True
                    missing = sorted(set(range(self.world)) - set(results) - set(errors))
                    _dump_stacks(self.procs, missing)
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    why = f"workers {dead} died" if dead else f"none within {timeout} s: a hang?"
                    raise AssertionError(f"case {name}: ranks {missing} gave no answer ({why}); "
                                         f"errors so far: {errors}")
                continue
            if ok:
                results[r] = _from_bytes(answer)
            else:
                errors[r] = answer
        if errors:
            raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
        return [results[r] for r in range(self.world)]

    def close(self):
        if not self.broken:
            for q in self.inqs:
                q.put(None)
            for p in self.procs:
                p.join(timeout=20)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class PoolKeeper:
    """Owns one Pool at a time, started on first use and replaced when a case broke it."""

    def __init__(self, world: int = POOL_WORLD, **pool_kwargs):
        self.world = world
        self.pool_kwargs = pool_kwargs
        self._pool: Pool | None = None

    def get(self) -> Pool:
        if self._pool is None or self._pool.broken:
            if self._pool is not None:
                self._pool.close()
            self._pool = Pool(self.world, **self.pool_kwargs)
        return self._pool

    def close(self):
        if self._pool is not None:
            self._pool.close()
            self._pool = None


# ============================================================== one-off runs
def _entry(fn, rank, world, port, env, args, q, backend="gloo"):
    _stacks_on_request()
    os.environ.update(env)
    try:
        _init_group(rank, world, port, backend=backend)
        result = fn(rank, world, *args)
        q.put((rank, "ok", _to_bytes(result)))
    except BaseException as e:  # report, do not hang the parent
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            import ringdp

            ringdp.destroy()
        except Exception:
            pass


class RankFailed(AssertionError):
    pass


def run_ranks(fn, world, *args, timeout=240, env=None, allow_missing=(), backend="gloo", exitcodes=None):
    """Run `fn(rank, world, *args)` once on `world` fresh processes with `env` set from the
    start, in a default group of `backend` (e.g. "cpu:ringdp"). Returns a list indexed by
    rank of ("ok", value) or ("err", message). Ranks listed in allow_missing may exit
    without reporting (e.g. a rank that kills itself). `exitcodes`: a list that gets each
    rank's exit code (None: still running 10 s after the last report, then killed)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, dict(env or {}), args, q, backend),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = [None] * world
    want = world - len(allow_missing)
    got = 0
    deadline = time.monotonic() + timeout
    try:
        while got < want:
            left = deadline - time.monotonic()
            if left <= 0:
                _dump_stacks(procs, [r for r in range(world) if results[r] is None])
                raise RankFailed(f"ranks did not finish within {timeout} s: {results}")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except _queue.Empty:
                continue
            if results[rank] is None and rank not in allow_missing:
                got += 1
            results[rank] = (status, _from_bytes(value) if status == "ok" else value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if exitcodes is not None:
                exitcodes.append(p.exitcode)
            if p.is_alive():
                p.kill()
    return results


def cyclic_garbage(fn) -> list[str]:
    """The types of the objects that `fn()` left in reference cycles (garbage only the cyclic
    GC frees: a library call should leave none), sorted; the GC is off meanwhile."""
    import gc

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fn()
        gc.collect()
        return sorted({type(x).__qualname__ for x in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def values(results):
    """The return values of every rank; fails the test with each rank's error otherwise."""
    errs = [f"rank {r}: {v[1]}" for r, v in enumerate(results) if v is None or v[0] != "ok"]
    if errs:
        raise RankFailed("\n".join(errs))
    return [v[1] for v in results]
