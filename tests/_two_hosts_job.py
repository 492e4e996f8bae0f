"""Run under two torchrun launchers, each its own host (tests/test_hierarchy.py:
test_torchrun_two_nodes, hosts simulated with RINGDP_HOST_ID; test_two_hosts_in_namespaces,
hosts in Linux namespaces of their own: hostname, network, /dev/shm): every rank all-reduces
closed-form inputs twice per op, at a size whose cross-host part goes with the call check and
at one whose part does not, then runs reduce_scatter_tensor, all_gather_into_tensor and
broadcast twice each on a group of ringdp's backend (whose cross-host gloo groups it makes
itself), and writes its results (and whether they match) to $RINGDP_TEST_OUT/rank<r>.pt,
with its host as the rank sees it."""
import os
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _closed_form import expected, value  # noqa: E402

import ringdp  # noqa: E402

SIZES = (4099, (1 << 18) + 3)  # 16 KiB a rank across 2 hosts: with the check; 512 KiB: a gloo step of its own

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
c = ringdp.init(timeout=60)
out = {"host": os.environ.get("RINGDP_HOST_ID") or socket.gethostname(), "path": c.cross_path,
       "local": (c.local_rank, c.local_size), "ok": [], "results": []}
for op in ("SUM", "AVG", "MIN", "MAX"):
    for count in SIZES:
        for rep in range(2):
            t = value(rank, count)
            ringdp.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out["ok"].append(torch.equal(t, expected(op, world, count, torch.float32)))
            out["results"].append(t)
g = dist.new_group(backend="ringdp")
for count in SIZES:
    for rep in range(2):
        rs = torch.empty(count)
        dist.reduce_scatter_tensor(rs, value(rank, world * count), group=g)
        ag = torch.empty(world * count)
        dist.all_gather_into_tensor(ag, value(rank, count), group=g)
        bc = value(rank, count)
        dist.broadcast(bc, src=1, group=g)
        out["ok"] += [torch.equal(rs, expected("SUM", world, world * count, torch.float32)[rank * count:(rank + 1) * count]),
                      torch.equal(ag, torch.cat([value(q, count) for q in range(world)])),
                      torch.equal(bc, value(1, count))]
        out["results"] += [ag, bc]
dist.destroy_process_group(g)
torch.save(out, os.path.join(os.environ["RINGDP_TEST_OUT"], f"rank{rank}.pt"))
ringdp.destroy()
dist.destroy_process_group()
