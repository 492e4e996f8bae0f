"""Communication hooks for RingDDP, in the style of torch's ddp_comm_hooks.

A hook is ``hook(state, bucket) -> torch.futures.Future``: ``bucket`` is a
:class:`ringdp.buckets.GradBucket` holding the bucket's *raw summed* local gradients in
``bucket.buffer()`` (not yet divided by the world size); the hook starts the reduction and
returns a future whose value is the tensor holding the averaged gradients (or a list with
it first), as torch's hooks do. ``ringdp.all_reduce(..., async_op=True).get_future()`` is
such a future. ``state`` is the process group (or None for the default group), as for
torch's default hooks.

    model = ringdp.RingDDP(net)
    model.register_comm_hook(None, ringdp.comm_hooks.bf16_compress_hook)

The compression hooks divide by the world size *before* reducing (in the original dtype)
and reduce a half-precision copy that lives in registered memory, so the all-reduce moves
half the bytes and still needs no staging copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import get_communicator

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "compress_hook"]


def _group(state):
    """The process group a hook reduces over: the state itself, or state.process_group."""
    if state is None or isinstance(state, dist.ProcessGroup):
        return state
    return getattr(state, "process_group", None)


def _world(group) -> int:
    return dist.get_world_size(group)


def _scratch(bucket, dtype: torch.dtype, group) -> torch.Tensor:
    """A registered-memory tensor of the bucket's length in `dtype` (cached per bucket)."""
    if hasattr(bucket, "workspace"):
        return bucket.workspace(dtype)
    buf = bucket.buffer()
    try:
        return get_communicator(group).empty((buf.numel(),), dtype, buf.device)
    except ValueError:  # a device ringdp has no registered memory for
        return torch.empty(buf.numel(), dtype=dtype, device=buf.device)


def allreduce_hook(state, bucket) -> torch.futures.Future:
    """What RingDDP does without a hook: divide by the world size, all-reduce (sum)."""
    group = _group(state)
    buf = bucket.buffer()
    buf.div_(_world(group))
    return get_communicator(group).all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True).get_future()


def compress_hook(dtype: torch.dtype):
    """A hook that reduces the bucket in `dtype` (divided first) and decompresses back."""

    def hook(state, bucket) -> torch.futures.Future:
        group = _group(state)
        buf = bucket.buffer()
        world = _world(group)
        if buf.dtype == dtype:  # nothing to compress: reduce in place
            buf.div_(world)
            return get_communicator(group).all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True).get_future()
        comp = _scratch(bucket, dtype, group)
        # divide in the original precision, then round once into the compressed copy
        torch.div(buf, world, out=comp)
        fut = get_communicator(group).all_reduce(comp, op=dist.ReduceOp.SUM, async_op=True).get_future()

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            f.wait()  # re-raises the reduction's error
            buf.copy_(comp)
            return buf

        return fut.then(decompress)

    short = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).replace("torch.", ""))
    hook.__name__ = f"{short}_compress_hook"
    hook.__qualname__ = hook.__name__
    return hook


fp16_compress_hook = compress_hook(torch.float16)
fp16_compress_hook.__doc__ = "Reduce the bucket in float16 (divided by the world size first)."
bf16_compress_hook = compress_hook(torch.bfloat16)
bf16_compress_hook.__doc__ = "Reduce the bucket in bfloat16 (divided by the world size first)."
