"""Mapping between torch's ReduceOps and the codes the native code uses
(csrc/common/types.h; never renumber). Dtypes need no mapping: the extension takes
torch.dtype and lists what it supports (_C.supported_dtypes())."""
from __future__ import annotations

import torch.distributed as dist

SUM, AVG, MIN, MAX = 0, 1, 2, 3
_OP_NAMES = {"SUM": SUM, "AVG": AVG, "MIN": MIN, "MAX": MAX}


def _members() -> dict:
    """ReduceOp members (and their RedOpType values) -> code: op_code's lookup of the common
    case, before the general one."""
    out = {}
    for name, code in _OP_NAMES.items():
        member = getattr(dist.ReduceOp, name, None)
        if member is not None:
            out[member] = code
    return out


_BY_MEMBER = _members()


def op_code(op) -> int:
    """Accept torch.distributed.ReduceOp members (or their names) and return our code."""
    try:
        return _BY_MEMBER[op]
    except (KeyError, TypeError):  # (a name, a ReduceOp instance, something unhashable)
        pass
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

