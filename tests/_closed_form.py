"""The all-reduce input pattern and its closed-form results, for every transport's tests.

Rank r of n contributes v(r, i) = (i % 13) + 2((r + i) % n) at index i: small integers, so
every dtype (fp16 and bf16 included) holds the inputs and the exact results of n ranks:
    SUM = n(i%13) + n(n-1)   MIN = i%13   MAX = i%13 + 2(n-1)   AVG = i%13 + n - 1
At every index the ranks hold the n values i%13 + 2k (k < n) in a rotated order, so for
n > 1 the MIN (MAX) comes from a different rank at consecutive indices: no single rank's
input (what a broadcast or a copy would leave) equals any reduction of a tensor of two or
more elements.
"""
from __future__ import annotations

import hashlib

import torch


def value(rank: int, count: int, dtype=torch.float32, device=None, *, world: int | None = None) -> torch.Tensor:
    """Rank `rank`'s input among `world` ranks: v(rank, i) for i < count. `world` defaults
    to torch.distributed's world size (an error when no process group is initialized)."""
    if world is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise TypeError("value(): pass world= (no torch.distributed process group is initialized)")
        world = dist.get_world_size()
    if not 0 <= rank < world:
        raise ValueError(f"value(): rank {rank} is not a rank of a world of {world}")
    i = torch.arange(count, device=device)
    return (i % 13 + 2 * ((rank + i) % world)).to(dtype)


def ops_for(dtype) -> list[str]:
    """The ReduceOp names with a closed form here: AVG only for floating types."""
    return ["SUM", "MIN", "MAX"] + (["AVG"] if dtype.is_floating_point else [])


def expected(op: str, n: int, count: int, dtype) -> torch.Tensor:
    """The result of all-reducing value(r, count, dtype, world=n) over n ranks with `op` (on the CPU)."""
    i = torch.arange(count, dtype=torch.float64) % 13
    e = {"SUM": n * i + n * (n - 1), "MIN": i, "MAX": i + 2 * (n - 1), "AVG": i + (n - 1)}[op]
    return e.to(dtype)


def nan_input(rank: int, world: int, count: int, dtype=torch.float32, also=()) -> torch.Tensor:
    """value() with NaN where (i + 3 rank) % 5 == 0 (at most one rank of five, which one
    depending on the index), on every rank where i % 11 == 4, and on the ranks in `also`
    where i % 7 == 2 (e.g. every rank of one host)."""
    t = value(rank, count, dtype, world=world)
    i = torch.arange(count)
    t[((i + 3 * rank) % 5 == 0) | (i % 11 == 4) | ((i % 7 == 2) & (rank in also))] = float("nan")
    return t


def nan_expected(op: str, world: int, count: int, dtype, also=()) -> torch.Tensor:
    """MIN or MAX of nan_input over `world` ranks as IEEE fmin/fmax (NCCL's and ringdp's
    rule): a NaN is ignored unless every rank has one there (i % 11 == 4)."""
    fn = {"MIN": torch.fmin, "MAX": torch.fmax}[op]
    e = nan_input(0, world, count, dtype, also)
    for r in range(1, world):
        e = fn(e, nan_input(r, world, count, dtype, also))
    return e


def same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: equal digests, bitwise-equal results."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def all_reduce_matrix(rank: int, world: int, all_reduce, dtypes, sizes, after_call=None):
    """Every dtype x op x size through `all_reduce(t, op, async_op)` (a ReduceOp; with
    async_op=True it returns a Work), each call twice (the second one at 4099 elements
    asynchronous), against expected(). Returns (bad: the calls that differ, digests: each
    call's result, keyed "dtype op count rep"); `after_call(count, op)` (op: its name) runs after each call."""
    import torch.distributed as dist

    bad, digests = [], {}
    for dtype in dtypes:
        for op in ops_for(dtype):
            for count in sizes:
                want = expected(op, world, count, dtype)
                for rep in range(2):
                    t = value(rank, count, dtype, world=world)
                    if rep == 1 and count == 4099:
                        all_reduce(t, getattr(dist.ReduceOp, op), True).wait()
                    else:
                        all_reduce(t, getattr(dist.ReduceOp, op), False)
                    if after_call is not None:
                        after_call(count, op)
                    if not torch.equal(t, want):
                        bad.append((str(dtype), op, count, rep, (t.double() - want.double()).abs().max().item()))
                    digests[f"{dtype} {op} {count} {rep}"] = digest(t)
    return bad, digests


def host_calls(comm) -> int:
    """Calls made so far on this rank's host-local shared-memory endpoint of a communicator
    across hosts (0: none), to count a call's in-host steps."""
    shm = comm.across.inhost if comm.across is not None else None
    if shm is None:
        return 0
    calls = shm.calls
    return calls() if callable(calls) else calls
