"""Mapping between torch's ReduceOps and the codes the native code uses
(csrc/common/types.h; never renumber). Dtypes need no mapping: the extension takes
torch.dtype and lists what it supports (_C.supported_dtypes()). And how Python writes a
caller's tensor (below_autograd)."""
from __future__ import annotations

import torch
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


def below_autograd():
    """The context in which ringdp's Python writes into a caller's tensors (the backend's
    copies back and PREMUL_SUM's scaling, the steps across hosts: hosts.py), as the C++
    transports and gloo write them, below autograd: the tensor may be a Parameter (a leaf
    that requires grad), a view of one, or an inference tensor, whose in-place writes
    autograd refuses outside inference mode (dist.broadcast of a transposed Parameter raised
    on cpu:ringdp, 2026-12-07). Inference mode, not no_grad: no_grad still refuses an
    inference tensor. Version counters still count the writes."""
    return torch.inference_mode()

