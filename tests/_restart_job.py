"""A torchrun job for tests/test_leftovers.py::test_elastic_restart: a job that torchrun
restarts after a rank dies (--max-restarts 1) runs again on ringdp, right, and leaves no
shared memory behind.

    python -m torch.distributed.run --nproc-per-node 3 --max-restarts 1 tests/_restart_job.py MODE OUTDIR

Attempt 0 (TORCHELASTIC_RESTART_COUNT=0): every rank joins a cpu:ringdp group and runs a
first all-reduce; then the last rank dies (MODE):
  raise        raises between two collectives (the others wait in the second);
  sigkill      SIGKILLs itself inside one of the 32 MiB all-reduces that follow (the others
               are in it), leaving its segment behind it (its creator is dead: the next
               set-up removes it).
torchrun SIGTERMs the others and starts every rank again. A survivor whose collective
failed first writes the error in OUTDIR/error0-<rank>.

Attempt 1: the same group, then stock DDP on cpu:ringdp for a few steps and the
collectives twice each, against closed forms. Each rank writes OUTDIR/attempt<k>-<rank>.json
(what it saw) and OUTDIR/job<k>-<rank> (its segment-name prefix); rank 0 of attempt 1 also
writes the parameters it ends with (OUTDIR/params.pt).
"""
import contextlib
import json
import os
import signal
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn


def _write(path, text):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _error_recorded(out, rank):
    """An exception raised inside goes on, after its type and message are written to
    OUTDIR/error0-<rank> (torchrun may SIGTERM the rank before it gets there)."""
    try:
        yield
    except Exception as e:
        _write(os.path.join(out, f"error0-{rank}"), f"{type(e).__name__}: {e}")
        raise


def _segment_prefix(out, attempt):
    """This rank's segment-name prefix ("ringdp-<uid>") from its communicator's in-host
    endpoint (the group's, or on a group that spans hosts, its host's), in OUTDIR/job<k>-<rank>,
    and its group's incarnation (ringdp/rendezvous.py) in OUTDIR/incarnation<k>-<rank>."""
    import ringdp

    c, rank = ringdp.get_communicator(dist.group.WORLD), dist.get_rank()
    name = (c.shm or c.across.inhost).name
    _write(os.path.join(out, f"job{attempt}-{rank}"), name.lstrip("/").split("-r")[0])
    incarnation = dist.distributed_c10d._get_default_group()._ringdp_incarnation()
    _write(os.path.join(out, f"incarnation{attempt}-{rank}"), str(incarnation))


def _die_inside_the_next_collective(delay_s=0.3):
    """SIGKILL this process `delay_s` from now: inside the all-reduce the caller starts."""
    threading.Timer(delay_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def train(world, rank=None, steps=3):
    """The job's model after `steps` SGD steps, flattened: stock DDP on this rank's quarter of
    each batch, or (rank None) one process on the full batches, which it must equal (DDP
    averages the ranks' mean-loss gradients: the full batch's mean-loss gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    run = model if rank is None else nn.parallel.DistributedDataParallel(model)
    mine = slice(None) if rank is None else slice(4 * rank, 4 * rank + 4)
    opt = torch.optim.SGD(run.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4 * world, 16, generator=gen), torch.randn(4 * world, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(run(x[mine]), y[mine]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def attempt0(rank, world, mode, out):
    import ringdp

    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), world * (world + 1) / 2)), t[:4]
    _segment_prefix(out, 0)
    big = torch.ones(8 << 20)  # 32 MiB
    if rank == world - 1:
        if mode == "raise":
            raise RuntimeError("simulated failure between two collectives")
        _die_inside_the_next_collective()
    with _error_recorded(out, rank):
        for _ in range(200):  # seconds of all-reduces: the last rank dies inside one of them
            dist.all_reduce(big)
            ringdp.all_reduce(big)
    raise SystemExit(f"rank {rank}: the collectives returned although the last rank died")


def attempt1(rank, world, out):
    s = world * (world + 1) / 2
    seen = {}
    for k in range(2):  # each collective twice, closed forms of rank and index
        x = torch.arange(1001, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(x)
        seen[f"all_reduce{k}"] = torch.equal(x, torch.arange(1001, dtype=torch.float32) * s)
        g = torch.empty(world * 7)
        dist.all_gather_into_tensor(g, torch.arange(7, dtype=torch.float32) + 100 * rank)
        seen[f"all_gather{k}"] = torch.equal(
            g, torch.cat([torch.arange(7, dtype=torch.float32) + 100 * r for r in range(world)]))
        b = torch.full((13,), float(rank))
        dist.broadcast(b, src=world - 1)
        seen[f"broadcast{k}"] = torch.equal(b, torch.full((13,), float(world - 1)))
    _segment_prefix(out, 1)

    flat = train(world, rank)
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    seen["ddp_identical"] = all(torch.equal(e, flat) for e in everyone)
    if rank == 0:
        torch.save(flat, os.path.join(out, "params.pt"))
    return seen


def hold(rank, world, out, limit_s=120):
    """The first round of a world that changes (mode "elastic"): a right all-reduce, then
    all-reduces until the round ends: torchrun stops it for a larger world (a node joined),
    or a node dies and these fail (torchrun then starts a smaller one). Each rank writes its
    pid in OUTDIR/ready-<rank> once it is in the loop, and the error that ended it, if one did, in
    OUTDIR/error0-<rank>."""
    import time

    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), world * (world + 1) / 2)), t[:4]
    _segment_prefix(out, 0)
    _write(os.path.join(out, f"ready-{rank}"), str(os.getpid()))
    end = time.monotonic() + limit_s
    with _error_recorded(out, rank):
        while time.monotonic() < end:
            dist.all_reduce(t)
            time.sleep(0.01)
    raise SystemExit(f"rank {rank}: the world did not change within {limit_s} s")


def main():
    mode, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the first round: TORCHELASTIC_RESTART_COUNT 0, or in a world that changes (mode
    # "elastic", torchrun --nnodes a:b), a world of FIRST_WORLD ranks: torchrun starts a
    # larger world after a node joined without counting a restart (and counts per node)
    if mode == "elastic":
        first = world == int(os.environ["FIRST_WORLD"])
        if world < int(os.environ["FIRST_WORLD"]) and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            raise SystemExit(f"rank {rank}: the first world formed with {world} ranks, without every node")
    else:
        first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    torch.set_num_threads(1)
    import ringdp  # noqa: F401 -- registers the backend

    timeout = timedelta(seconds=float(os.environ.get("RESTART_JOB_TIMEOUT_S", 600)))
    dist.init_process_group(os.environ.get("RESTART_JOB_BACKEND", "cpu:ringdp"), timeout=timeout)
    if first:  # (neither returns)
        hold(rank, world, out) if mode == "elastic" else attempt0(rank, world, mode, out)
    seen = attempt1(rank, world, out)
    _write(os.path.join(out, f"attempt1-{rank}.json"), json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
