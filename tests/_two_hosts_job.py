"""Run under two torchrun launchers (tests/test_hierarchy.py::test_torchrun_two_nodes), each
with its own RINGDP_HOST_ID: every rank all-reduces closed-form inputs twice per op and
writes its results (and whether they match) to $RINGDP_TEST_OUT/rank<r>.pt."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _closed_form import expected, value  # noqa: E402

import ringdp  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
c = ringdp.init(timeout=60)
out = {"host": os.environ["RINGDP_HOST_ID"], "path": c.cross_path, "local": (c.local_rank, c.local_size),
       "ok": [], "results": []}
for op in ("SUM", "AVG", "MIN", "MAX"):
    for rep in range(2):
        t = value(rank, 4099)
        ringdp.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out["ok"].append(torch.equal(t, expected(op, world, 4099, torch.float32)))
        out["results"].append(t)
torch.save(out, os.path.join(os.environ["RINGDP_TEST_OUT"], f"rank{rank}.pt"))
ringdp.destroy()
dist.destroy_process_group()
