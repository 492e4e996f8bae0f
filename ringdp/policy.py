"""Which algorithm and which sizes: decisions kept in Python where they are easy to test.

ONESHOT_MAX_BYTES comes from `python bench/allreduce.py --algo ring` vs `--algo oneshot`
on the 2-core CI machine (world 2 and 4, float32); see README.md "Choosing the algorithm".
"""
from __future__ import annotations

import os

ALGO_RING = 0
ALGO_ONESHOT = 1

# Messages up to this size use the one-shot path (every rank reduces all peers' copies),
# for world sizes of 3 and more; ONESHOT_MAX_BYTES_BY_WORLD overrides per world size.
ONESHOT_MAX_BYTES = 128 << 10
ONESHOT_MAX_BYTES_BY_WORLD = {1: 0, 2: 0}
# The one-shot buffer each rank keeps (twice, alternating by call parity).
ONESHOT_BYTES = 256 << 10
ONESHOT_BUFFER_BYTES = ONESHOT_BYTES
# Ring pipeline: bytes per FIFO slot and slots per connection.
SLOT_BYTES = 256 << 10
FIFO_SLOTS = 8
# Virtual size of each rank's registered-memory arena (pages are reserved on allocation).
ARENA_GB = 16
DEFAULT_TIMEOUT_S = 300.0
# Registered CUDA memory per rank (IPC arena), MiB.
CUDA_ARENA_MB = 256
# RingDDP: a gradient of at least this many bytes is reduced in its own .grad, in a bucket
# of its own, when .grad are not bucket views and no comm hook is set (ringdp stages it
# through the transport on its worker, instead of the backward copying it into a bucket
# and the end of backward copying it back). Measured on the 2-core CI machine, world 2,
# 4 x Linear(2560, 2560): ~90 ms per step with it vs ~100-110 ms through the buckets.
IN_GRAD_MIN_BYTES = 1 << 20


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


def oneshot_max_bytes(world: int = 3) -> int:
    default = ONESHOT_MAX_BYTES_BY_WORLD.get(world, ONESHOT_MAX_BYTES)
    return min(_env_int("RINGDP_ONESHOT_MAX_BYTES", default), oneshot_buffer_bytes())


def oneshot_buffer_bytes() -> int:
    return _env_int("RINGDP_ONESHOT_BUFFER_BYTES", ONESHOT_BUFFER_BYTES)


def choose_algo(nbytes: int, world: int, algo: str | None = None) -> int:
    """The algorithm for one all-reduce of `nbytes` over `world` ranks.

    `algo` (else RINGDP_ALGO) = ring|oneshot|auto forces a choice (for benchmarks); a forced
    one-shot still falls back to the ring for messages larger than the one-shot buffer.
    """
    forced = (algo if algo is not None else os.environ.get("RINGDP_ALGO", "auto")).strip().lower()
    if forced not in ("auto", "ring", "oneshot"):
        what = f"algo={forced!r}" if algo is not None else f"RINGDP_ALGO={forced!r}"
        raise ValueError(f"{what}: expected ring, oneshot or auto")
    if forced == "ring":
        return ALGO_RING
    if forced == "oneshot":
        return ALGO_ONESHOT if nbytes <= oneshot_buffer_bytes() else ALGO_RING
    return ALGO_ONESHOT if nbytes <= oneshot_max_bytes(world) else ALGO_RING


def timeout_s(timeout=None) -> float:
    """Seconds to wait for peers: argument (seconds or timedelta), else RINGDP_TIMEOUT_S."""
    if timeout is None:
        v = os.environ.get("RINGDP_TIMEOUT_S")
        timeout = float(v) if v else DEFAULT_TIMEOUT_S
    elif hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def spin_ns(world: int) -> int:
    """Busy-wait before sleeping: long when every rank has a core, short when oversubscribed."""
    v = os.environ.get("RINGDP_SPIN_US")
    if v:
        return int(float(v) * 1000)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 50_000 if world <= cores else 2_000
