"""A two-rank job for tests/test_failures.py::test_exit_with_an_unfinished_collective: rank 0
starts an all-reduce with async_op, never waits for it and ends its script; rank 1 makes
the same all-reduce only once the test says so.

    python tests/_exit_job.py RANK PORT OUTDIR

Rank 0 writes OUTDIR/left once its script has nothing more to run (the exit then waits in
ringdp's close for the all-reduce). Rank 1 waits for OUTDIR/go, makes the all-reduce and
writes OUTDIR/outcome: the values it got, or the error it raised.
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


rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.arange(1000, dtype=torch.float32) + rank
ringdp.all_reduce(t)  # (the set-up: both ranks are in)
if rank == 0:
    ringdp.all_reduce(t, async_op=True)
    _write(os.path.join(out, "left"), "")
else:
    go = os.path.join(out, "go")
    t0 = time.monotonic()
    while not os.path.exists(go) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    try:
        ringdp.all_reduce(t)
        outcome = {"values": t[:4].tolist()}
    except Exception as e:  # noqa: BLE001 -- what rank 1 sees, for the test
        outcome = {"error": f"{type(e).__name__}: {e}"}
    _write(os.path.join(out, "outcome"), json.dumps(outcome))
