"""Run a function on `world` local ranks (spawned processes, gloo process group on
127.0.0.1) and collect what each rank returned or raised."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, env, args, q):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        q.put((rank, "ok", result))
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


def run_ranks(fn, world, *args, timeout=240, env=None, allow_missing=()):
    """Returns a list indexed by rank of ("ok", value) or ("err", message). Ranks listed
    in allow_missing may exit without reporting (e.g. a rank that kills itself)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, dict(env or {}), args, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = [None] * world
    want = world - len(allow_missing)
    got = 0
    import queue as _queue
    import time

    deadline = time.monotonic() + timeout
    try:
        while got < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"ranks did not finish within {timeout} s: {results}")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except _queue.Empty:
                continue
            if results[rank] is None and rank not in allow_missing:
                got += 1
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def values(results):
    """The return values of every rank; fails the test with each rank's error otherwise."""
    errs = [f"rank {r}: {v[1]}" for r, v in enumerate(results) if v is None or v[0] != "ok"]
    if errs:
        raise RankFailed("\n".join(errs))
    return [v[1] for v in results]
