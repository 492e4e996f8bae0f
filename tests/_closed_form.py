"""The all-reduce input pattern and its closed-form results, for every transport's tests.

Rank r contributes v(r, i) = (i % 13) + 2r at index i: small integers, so every dtype
(fp16 and bf16 included) holds the inputs and the exact results of n ranks:
    SUM = n(i%13) + n(n-1)   MIN = i%13   MAX = i%13 + 2(n-1)   AVG = i%13 + n - 1
"""
from __future__ import annotations

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
