"""The all-reduce input pattern and its closed-form results, for every transport's tests.

Rank r contributes v(r, i) = (i % 13) + 2r at index i: small integers, so every dtype
(fp16 and bf16 included) holds the inputs and the exact results of n ranks:
    SUM = n(i%13) + n(n-1)   MIN = i%13   MAX = i%13 + 2(n-1)   AVG = i%13 + n - 1
"""
from __future__ import annotations

import hashlib

import torch


def value(rank: int, count: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Rank `rank`'s input: v(rank, i) for i < count."""
    return (torch.arange(count, device=device) % 13 + 2 * rank).to(dtype)


def ops_for(dtype) -> list[str]:
    """The ReduceOp names with a closed form here: AVG only for floating types."""
    return ["SUM", "MIN", "MAX"] + (["AVG"] if dtype.is_floating_point else [])


def expected(op: str, n: int, count: int, dtype) -> torch.Tensor:
    """The result of all-reducing value(r, count, dtype) over n ranks with `op` (on the CPU)."""
    i = torch.arange(count, dtype=torch.float64) % 13
    e = {"SUM": n * i + n * (n - 1), "MIN": i, "MAX": i + 2 * (n - 1), "AVG": i + (n - 1)}[op]
    return e.to(dtype)


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
                    t = value(rank, count, dtype)
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
