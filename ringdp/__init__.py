"""ringdp: a chunked, pipelined ring all-reduce for PyTorch data parallelism.

    import torch.distributed as dist, ringdp
    dist.init_process_group("gloo")          # torchrun sets rank, world size, store
    ringdp.all_reduce(t)                      # in place, like dist.all_reduce
    ringdp.reduce_scatter_tensor(out, inp)    # also all_gather_into_tensor, broadcast (CPU, CUDA);
                                              # reduce_scatter_single, all_gather_single: torch 2.13's names
    buf = ringdp.empty(1 << 20)              # registered memory: no staging copy
"""
from __future__ import annotations

__version__ = "0.1.0"

import torch
import torch.distributed as dist

from . import comm_hooks
from ._eager import eager  # the functions below run eagerly under torch.compile
from .comm import Communicator, RingError, Work, build_info, collective_tag, destroy, get_communicator, init
from .ddp import RingDDP
from . import backend
from .backend import ProcessGroupRingdp

backend.register()  # torch.distributed backend "ringdp": init_process_group("cpu:ringdp,cuda:nccl")


@eager
def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, timeout=None, algo=None, tag=None):
    """Reduce `tensor` across the ranks of `group` in place (SUM, AVG, MIN, MAX).

    `algo` forces "ring" or "oneshot" (None: RINGDP_ALGO, default "auto"); a forced one-shot
    falls back to the ring above the one-shot buffer (Communicator.algo_for tells which runs).

    Returns None, or a Work with wait()/is_completed() when async_op=True; the tensor must
    not be touched until wait() returns (with RINGDP_INLINE_ASYNC_MAX_BYTES set, a small
    async call runs before returning: policy.inline_async). Raises RingError (naming the
    rank and the problem) on a mismatch across ranks, a dead or stuck peer, or a timeout
    (`timeout` seconds, else RINGDP_TIMEOUT_S, default 300).

    `tag` names the call (at most 63 bytes; None: the enclosing ``collective_tag`` block's,
    else empty): every rank must make its calls in the same order with the same tags, or
    they fail with a RingError that names both sides (RingDDP tags "step S bucket B")."""
    return get_communicator(group).all_reduce(tensor, op=op, async_op=async_op, timeout=timeout, algo=algo,
                                              tag=tag)


@eager
def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, timeout=None, algo=None,
                          tag=None):
    """torch.distributed.reduce_scatter_tensor on ringdp (CPU or CUDA tensors): `input` holds world x
    output.numel() elements; rank r's `output` gets the reduction (SUM, AVG, MIN, MAX) of
    every rank's block r. The input is not modified. PREMUL_SUM: scale the input first, then
    SUM. Returns None or a Work (async_op=True); errors, `timeout`, `algo` and `tag` as
    all_reduce (CUDA tensors: the ring always, stream-ordered as CUDA all_reduce)."""
    return get_communicator(group).reduce_scatter_tensor(output, input, op=op, async_op=async_op, tag=tag,
                                                         timeout=timeout, algo=algo)


@eager
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, timeout=None, algo=None,
                           tag=None):
    """torch.distributed.all_gather_into_tensor on ringdp (CPU or CUDA tensors), with its
    arguments: block q of `output_tensor` (world x input_tensor.numel() elements) becomes
    rank q's `input_tensor`. Returns None or a Work (async_op=True); errors, `timeout`,
    `algo` and `tag` as all_reduce."""
    return get_communicator(group).all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op, tag=tag,
                                                          timeout=timeout, algo=algo)


@eager
def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, timeout=None, algo=None, tag=None):
    """torch.distributed.broadcast on ringdp (CPU or CUDA tensors), with its arguments: every
    rank's `tensor` becomes the root's. As in torch, the root is `src`, a global rank (the
    same as the group rank for the default group), or `group_src`, a rank of `group`: one of
    the two, not both. Returns None or a Work (async_op=True); errors, `timeout`, `algo` and
    `tag` as all_reduce."""
    comm = get_communicator(group)
    root, error = src, None  # (a bad root is bad input: the communicator announces it to the peers)
    if group_src is not None:
        root = group_src
        if src is not None:
            error = (f"ringdp.broadcast on rank {comm.rank}: give the root as src (a global rank) or as group_src "
                     f"(a rank of the group), not both: src={src!r}, group_src={group_src!r}")
    elif src is None:
        error = (f"ringdp.broadcast on rank {comm.rank}: the root is missing: give src (a global rank) or "
                 f"group_src (a rank of the group)")
    elif group is not None and group is not dist.group.WORLD and isinstance(src, int) and not isinstance(src, bool):
        try:
            root = dist.get_group_rank(group, src)
        except ValueError:
            error = (f"ringdp.broadcast on rank {comm.rank}: src={src} is a global rank outside the group (its "
                     f"global ranks: {dist.get_process_group_ranks(group)}); group_src= takes a rank of the group")
    return comm.broadcast(tensor, root, async_op=async_op, tag=tag, timeout=timeout, algo=algo, root_error=error)


# torch 2.13's names for the two halves (it deprecates reduce_scatter_tensor and
# all_gather_into_tensor in their favour): the same functions
reduce_scatter_single = reduce_scatter_tensor
all_gather_single = all_gather_into_tensor


def _size(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        return tuple(size[0])
    return tuple(size)


@eager
def empty(*size, dtype=torch.float32, device="cpu", group=None) -> torch.Tensor:
    """A tensor whose storage lives in ringdp's registered shared memory, so all_reduce of it
    (or of a contiguous slice of it) needs no staging copy. Not collective."""
    return get_communicator(group).empty(_size(size), dtype, device)


@eager
def zeros(*size, dtype=torch.float32, device="cpu", group=None) -> torch.Tensor:
    return empty(*size, dtype=dtype, device=device, group=group).zero_()


@eager
def synchronize(group=None):
    """Wait until every collective submitted so far finished (CUDA: ringdp's stream too)."""
    get_communicator(group).synchronize()


@eager
def is_registered(tensor: torch.Tensor, group=None) -> bool:
    return get_communicator(group).is_registered(tensor)



__all__ = [
    "ProcessGroupRingdp", "RingDDP", "backend", "comm_hooks",
    "Communicator", "RingError", "Work", "all_gather_into_tensor", "all_gather_single", "all_reduce", "broadcast",
    "build_info", "collective_tag", "destroy", "empty", "get_communicator", "init", "is_registered",
    "reduce_scatter_single", "reduce_scatter_tensor", "synchronize", "zeros",
]
