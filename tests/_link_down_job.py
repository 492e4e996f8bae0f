"""Run under two torchrun launchers on two namespace hosts (tests/test_hierarchy.py::
test_link_down_between_hosts): every rank all-reduces across the hosts in a loop (a size
whose cross-host part goes with the call check, then one whose part does not), leaving its
progress in $RINGDP_TEST_OUT/prog<r>, until the link between the hosts goes down. It then
records what it raised, how long after its last good call, and how long ringdp.destroy()
took, in $RINGDP_TEST_OUT/rank<r>.json, and leaves without torch.distributed's own teardown
(whose store is across the dead link)."""
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

import ringdp

TIMEOUT = 8.0
BACKEND = os.environ.get("JOB_BACKEND") == "1"  # dist.all_reduce on a cpu:ringdp group, async
torch.set_num_threads(1)
if BACKEND:
    dist.init_process_group("cpu:ringdp", timeout=datetime.timedelta(seconds=TIMEOUT))
else:
    dist.init_process_group("gloo")
    ringdp.init(timeout=TIMEOUT)
rank = dist.get_rank()
out = os.environ["RINGDP_TEST_OUT"]
tensors = [torch.ones(1024), torch.ones(1 << 16)]  # 4 KiB; 256 KiB (128 KiB a rank across hosts)
rec = {"rank": rank, "timeout": TIMEOUT}
i, last = 0, time.monotonic()
try:
    while i < 100000:
        t = tensors[i % 2]
        t.fill_(1.0)
        if BACKEND:
            dist.all_reduce(t, async_op=True).wait()
        else:
            ringdp.all_reduce(t)
        if t[0].item() != dist.get_world_size():
            raise AssertionError(f"rank {rank}: call {i} gave {t[0].item()}")
        i, last = i + 1, time.monotonic()
        if i % 10 == 0:
            with open(os.path.join(out, f"prog{rank}"), "w") as f:
                f.write(str(i))
        time.sleep(0.005)
    rec["error"] = "the loop ended without an error"
except Exception as e:  # noqa: BLE001
    rec.update(error=f"{type(e).__name__}: {e}"[:1000], after_s=time.monotonic() - last, calls=i)
t0 = time.monotonic()
try:
    ringdp.destroy()
    rec["destroy"] = "ok"
except Exception as e:  # noqa: BLE001
    rec["destroy"] = f"{type(e).__name__}: {e}"[:300]
rec["destroy_s"] = time.monotonic() - t0
with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
    json.dump(rec, f)
os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
os._exit(0)
