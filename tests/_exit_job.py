"""A two-rank job for tests/test_failures.py::test_exit_with_an_unfinished_collective: rank 0
starts all-reduces with async_op, never waits for them and ends its script; rank 1 makes the
same all-reduces only once the test says so.

    python tests/_exit_job.py RANK PORT OUTDIR MODE

MODE: "ringdp" (ringdp.all_reduce on a gloo default group), "backend" (dist.all_reduce on a
cpu:ringdp default group, which the script never destroys), "two-groups" (ringdp.all_reduce
on the gloo default group and on a second group of the same ranks: two communicators, each
with a call left). Rank 0 writes OUTDIR/left once its script has nothing more to run (its
exit then waits in ringdp's close for the all-reduces). Rank 1 waits for OUTDIR/go, makes
the all-reduces and writes OUTDIR/outcome: for each, the values it got or the error it raised.
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
dist.init_process_group("cpu:ringdp" if mode == "backend" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                        rank=rank, world_size=2)
groups = [None] + ([dist.new_group([0, 1])] if mode == "two-groups" else [])


def reduce(t, group, async_op=False):
    if mode == "backend":
        return dist.all_reduce(t, async_op=async_op)
    return ringdp.all_reduce(t, group=group, async_op=async_op)


tensors = [torch.arange(1000, dtype=torch.float32) + rank for _ in groups]
for t, g in zip(tensors, groups):
    reduce(t, g)  # (the set-up: both ranks are in)
if rank == 0:
    for t, g in zip(tensors, groups):
        reduce(t, g, async_op=True)
    _write(os.path.join(out, "left"), "")
else:
    go = os.path.join(out, "go")
    t0 = time.monotonic()
    while not os.path.exists(go) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    outcome = []
    for t, g in zip(tensors, groups):
        try:
            reduce(t, g)
            outcome.append({"values": t[:4].tolist()})
        except Exception as e:  # noqa: BLE001 -- what rank 1 sees, for the test
            outcome.append({"error": f"{type(e).__name__}: {e}"})
    _write(os.path.join(out, "outcome"), json.dumps(outcome))
