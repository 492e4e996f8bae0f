"""A two-rank job for tests/test_failures.py::test_exit_with_an_unfinished_collective: rank 0
starts all-reduces with async_op, never waits for them and ends its script; rank 1 makes the
same all-reduces only once the test says so.

    python tests/_exit_job.py RANK PORT OUTDIR MODE

MODE: "ringdp" (ringdp.all_reduce on a gloo default group), "backend" (dist.all_reduce on a
cpu:ringdp default group, which the script never destroys), "two-groups" (ringdp.all_reduce
on the gloo default group and on a second group of the same ranks: two communicators, each
with a call left), "gloo-call" (dist.all_reduce with BXOR on a cpu:ringdp default group: a
call the backend hands to its inner gloo group; policy.GLOO_DRAIN_S, the exit's wait for it,
is GLOO_DRAIN_S from the environment, when set). Rank 0 writes OUTDIR/left once its script
has nothing more to run (its exit then waits for the all-reduces). Rank 1 waits for
OUTDIR/go, makes the all-reduces and writes OUTDIR/outcome: for each, the values it got or
the error it raised. In "gloo-call",
rank 0 writes OUTDIR/finalizing as Python finalizes and then takes FINAL_S seconds more (from
the environment, 0 by default); rank 1 that sees it before OUTDIR/go leaves without the call,
so that rank 0's gloo collective ends (fails) while rank 0 finalizes.
"join" (RingDDP on a gloo default group, inside its join()): rank 1 makes no call after the
set-up; rank 0's forward starts torch's Join notice (an async gloo all-reduce) and then fails
(RingError: rank 1 makes no control all-reduce within RINGDP_TIMEOUT_S), which rank 0's script
catches and writes to OUTDIR/raised; it then destroys the default group (the seconds that
took: OUTDIR/destroyed) and ends as in "gloo-call"; rank 1 leaves once it sees
OUTDIR/finalizing.
"""
import json
import os
import signal
import sys
import time

# (a parent that ignores SIGINT, as a shell's background job does, passes that on)
signal.signal(signal.SIGINT, signal.default_int_handler)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ringdp  # noqa: E402


def _write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


rank, port, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo" if mode in ("ringdp", "two-groups", "join") else "cpu:ringdp",
                        init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if "GLOO_DRAIN_S" in os.environ:
    ringdp.policy.GLOO_DRAIN_S = float(os.environ["GLOO_DRAIN_S"])
groups = [None] + ([dist.new_group([0, 1])] if mode == "two-groups" else [])


def reduce(t, group, async_op=False):
    if mode == "backend":
        return dist.all_reduce(t, async_op=async_op)
    if mode == "gloo-call":
        return dist.all_reduce(t, op=dist.ReduceOp.BXOR, async_op=async_op)
    return ringdp.all_reduce(t, group=group, async_op=async_op)


class _Finalizing:
    """Marks the start of Python's finalization (this object's __del__, as the module's globals
    are cleared: what it needs is bound now), which then takes FINAL_S seconds more."""

    def __init__(self):
        self.path, self.final_s = os.path.join(out, "finalizing"), float(os.environ.get("FINAL_S", "0"))
        self.open, self.sleep = open, time.sleep

    def __del__(self):
        with self.open(self.path, "w"):
            pass
        self.sleep(self.final_s)


if mode == "join":
    ddp = ringdp.RingDDP(torch.nn.Linear(4, 2))  # (the set-up: both ranks are in)
    if rank == 0:
        finalizing = _Finalizing()
        try:
            with ddp.join():
                ddp(torch.ones(2, 4))
        except ringdp.RingError as e:
            _write(os.path.join(out, "raised"), str(e))
        t0 = time.monotonic()
        dist.destroy_process_group()  # (as README asks)
        _write(os.path.join(out, "destroyed"), f"{time.monotonic() - t0:.3f}")
        _write(os.path.join(out, "left"), "")
    else:
        t0, seen = time.monotonic(), False
        while not seen and time.monotonic() - t0 < 60:
            seen = os.path.exists(os.path.join(out, "finalizing"))
            time.sleep(0.05)
        _write(os.path.join(out, "outcome"), json.dumps([{"left": seen}]))
        os._exit(0)
    sys.exit(0)

dtype = torch.int32 if mode == "gloo-call" else torch.float32
tensors = [torch.arange(1000, dtype=dtype) + rank for _ in groups]
for t, g in zip(tensors, groups):
    reduce(t.clone() if mode == "gloo-call" else t, g)  # (the set-up: both ranks are in)
if rank == 0:
    for t, g in zip(tensors, groups):
        reduce(t, g, async_op=True)
    if mode == "gloo-call":
        finalizing = _Finalizing()
        del tensors, t  # (the gloo Work holds the last reference: torch then keeps its Python object)
    _write(os.path.join(out, "left"), "")
else:
    go, finalizing = os.path.join(out, "go"), os.path.join(out, "finalizing")
    t0 = time.monotonic()
    while not os.path.exists(go) and time.monotonic() - t0 < 60:
        if os.path.exists(finalizing):
            _write(os.path.join(out, "outcome"), json.dumps([{"left": True}]))
            os._exit(0)  # (at once: rank 0's gloo collective then fails as rank 0 finalizes)
        time.sleep(0.05)
    outcome = []
    for t, g in zip(tensors, groups):
        try:
            reduce(t, g)
            outcome.append({"values": t[:4].tolist()})
        except Exception as e:  # noqa: BLE001 -- what rank 1 sees, for the test
            outcome.append({"error": f"{type(e).__name__}: {e}"})
    _write(os.path.join(out, "outcome"), json.dumps(outcome))
