"""Mapping between torch's dtypes / ReduceOps and the codes the native code uses
(csrc/common/types.h; never renumber)."""
from __future__ import annotations

import torch
import torch.distributed as dist

DTYPE_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
}

SUM, AVG, MIN, MAX = 0, 1, 2, 3
_OP_NAMES = {"SUM": SUM, "AVG": AVG, "MIN": MIN, "MAX": MAX}


def op_code(op) -> int:
    """Accept torch.distributed.ReduceOp members (or their names) and return our code."""
    if isinstance(op, str):
        name = op.upper()
    else:
        name = None
        for cand in ("SUM", "AVG", "MIN", "MAX"):
            member = getattr(dist.ReduceOp, cand, None)
            if member is not None and op == member:
                name = cand
                break
        if name is None:
            name = str(op).rsplit(".", 1)[-1].upper()
    if name not in _OP_NAMES:
        raise ValueError(f"ringdp.all_reduce supports ReduceOp SUM, AVG, MIN and MAX, not {op!r}")
    return _OP_NAMES[name]


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise TypeError(f"ringdp.all_reduce does not support dtype {dtype}; supported: {names}") from None
