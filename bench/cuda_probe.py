"""Where the time of a small CUDA all-reduce goes, and how much of RingDDP's communication a
CUDA training step exposes. One GPU, `--world` ranks on cuda:0 (run under MPS).

    python3 bench/cuda_probe.py --world 2 --out DIR
    RINGDP_CUDA_CHANNELS=8 python3 bench/cuda_probe.py --world 2 --out DIR --name ch8

Latency (8 KiB float32 by default, --bytes), each figure per call, median of 5 blocks:
    native_pipelined_us   the binding alone (csrc/cuda, one-shot), --calls calls back to back,
                          timed by CUDA events: what the device and the launch path cost
    native_host_us        the host time of one such call (enqueue only)
    native_roundtrip_us   the binding, host-synchronised after every call
    ringdp_pipelined_us   ringdp.all_reduce back to back (wall time / calls, then one sync)
    ringdp_host_us        host time of one ringdp.all_reduce (enqueue only)
    ringdp_roundtrip_us   ringdp.all_reduce + ringdp.synchronize() each call
Host time of ringdp's layers, per call (enqueue only; their difference is the layer's own):
    host_binding_tensor_us  the endpoint's tensor binding with ringdp's timeout (the call
                          ringdp makes in the end)
    host_method_us        Communicator.all_reduce (ringdp.all_reduce less the group lookup)
    host_current_stream_us  torch.cuda.current_stream(device) alone (one per ringdp call)
    host_endpoint_us      Communicator._cuda_endpoint (the group-alive check and endpoint lookup,
                          made three times per call)
    host_check_us         Communicator._check (dtype, op, layout, device)
    host_call_us          Communicator._call of a no-op (the lock and the inline bookkeeping)
    host_noop_us          a Python no-op lambda: this host's interpreter, the unit of the rest
    python_threads, worker_started, eager_by_exec_strategy: threads that could take the GIL
                          while the binding releases it; whether torch.compile's fallback
                          wrappers are in the way (False: three wrappers per call)
RingDDP step (an MLP of 4 Linear(H, H) layers, H=--hidden, batch 32 per rank, SGD):
    none_ms               the plain module on this rank (no communication)
    ring_ms               RingDDP
    exposed_ms            ring_ms - none_ms
    none_host_ms, ring_host_ms  the same steps' host time, the final synchronize left out:
                          close to the step time when the host is what limits it
    last_exposed_comm_ms  RingDDP's own figure: backward's wait for reductions after autograd
                          (on CUDA the host's wait until every reduction was enqueued; the
                          streams' waits on the GPU are not in it)
    allreduce_alone_ms    ringdp.all_reduce of all gradients in one tensor (the same bytes)
What the extra time of a RingDDP step is made of (docs/cuda.md, "Not yet shown", item 3):
    ring_no_kernels_ms    RingDDP with the endpoint's all-reduce binding a no-op: its Python
                          bucket path on the host (worker, events, futures), without the
                          binding's own enqueue (launches, its C++), no GPU work and no
                          coupling between ranks; near ring_ms: the host path is the cost
    ring_no_overlap_ms    RingDDP(overlap=False): every reduction after the backward, so no
                          ring block spins on an SM while backward kernels want it; below
                          ring_ms: the spinning blocks cost more than the overlap gains
    ring_device_allocs    cudaMallocs of the caching allocator over 13 RingDDP steps after
                          the others (record_stream keeping gradients alive): should be 0
    breakdown_error       what stopped these three, if anything did
Also recorded: channels_setting (RINGDP_CUDA_CHANNELS, or "auto") and endpoint (what
ringdp's CUDA endpoint says of itself: transport, channels, slots). The IPC ring's blocks spin
while they wait for a peer, on SMs the backward's kernels would use: the channel count is
the knob between the ring's bandwidth and the compute it leaves room for.
Writes DIR/cuda_probe_w<world>[_<name>].json (rank 0) and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def _median_block(fn, blocks=5):
    return statistics.median(fn() for _ in range(blocks))


class _NoKernels:
    """A CUDA endpoint's binding with a no-op all-reduce (every other attribute the real one's)."""

    def __init__(self, real):
        self._real = real

    def all_reduce_tensor(self, *args):
        return None

    def __getattr__(self, name):
        return getattr(self._real, name)


def breakdown(res, model, opt, mlp, step_ms):
    """ring_device_allocs, ring_no_kernels_ms, ring_no_overlap_ms (module doc)."""
    import torch

    import ringdp

    allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
    step_ms(model, opt)
    res["ring_device_allocs"] = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs
    ep = ringdp.get_communicator()._cuda
    real = ep.native
    ep.native = _NoKernels(real)
    try:
        res["ring_no_kernels_ms"] = statistics.median(step_ms(model, opt)[0] for _ in range(3))
    finally:
        ringdp.synchronize()
        ep.native = real
    torch.manual_seed(0)
    late = ringdp.RingDDP(mlp(), device_ids=[0], overlap=False)
    o3 = torch.optim.SGD(late.parameters(), lr=1e-3)
    res["ring_no_overlap_ms"] = statistics.median(step_ms(late, o3)[0] for _ in range(3))


def rank_main(rank, world, port, a):
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    import ringdp
    from ringdp import _C

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    res = {"world": world, "bytes": a.bytes, "calls": a.calls, "gpu": torch.cuda.get_device_name(0),
           "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))}
    n = a.bytes // 4
    stream = torch.cuda.current_stream()

    # ---- the binding alone
    o = _C.CudaOptions()
    o.kind, o.rank, o.world, o.device = "ipc", rank, world, 0
    o.timeout_s = 60.0
    c = _C.cuda_create(o)
    store.set(f"probe/{rank}", c.local_blob())
    store.wait([f"probe/{r}" for r in range(world)])
    c.connect([store.get(f"probe/{r}") for r in range(world)])
    x = torch.ones(n, device="cuda")
    algo = 1 if a.bytes <= c.oneshot_bytes else 0

    def native_block(sync_each):
        dist.barrier()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = 0.0
        e0.record()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            h = time.perf_counter()
            c.all_reduce(x.data_ptr(), n, 0, 0, stream.cuda_stream, algo, 0.0)
            host += time.perf_counter() - h
            if sync_each:
                c.synchronize()
        e1.record()
        c.synchronize()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        return e0.elapsed_time(e1) * 1e3 / a.calls, host * 1e6 / a.calls, wall * 1e6 / a.calls

    native_block(False)  # warm-up
    pipe = [native_block(False) for _ in range(5)]
    res["native_pipelined_us"] = statistics.median(p[0] for p in pipe)
    res["native_host_us"] = statistics.median(p[1] for p in pipe)
    res["native_roundtrip_us"] = _median_block(lambda: native_block(True)[2])
    c.quiesce()
    dist.barrier()
    c.destroy()

    # ---- through ringdp.all_reduce
    y = torch.ones(n, device="cuda")

    def ringdp_block(sync_each):
        dist.barrier()
        ringdp.synchronize()
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(a.calls):
            h = time.perf_counter()
            ringdp.all_reduce(y)
            host += time.perf_counter() - h
            if sync_each:
                ringdp.synchronize()
        ringdp.synchronize()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6 / a.calls, host * 1e6 / a.calls

    ringdp_block(False)
    pipe = [ringdp_block(False) for _ in range(5)]
    res["ringdp_pipelined_us"] = statistics.median(p[0] for p in pipe)
    res["ringdp_host_us"] = statistics.median(p[1] for p in pipe)
    res["ringdp_roundtrip_us"] = _median_block(lambda: ringdp_block(True)[0])

    # ---- where ringdp's host time goes: the same call, one layer at a time
    comm = ringdp.get_communicator()
    ep = comm._cuda
    algo_code = comm._cuda_algo(y.device, a.bytes, "")
    handle = torch.cuda.current_stream(0).cuda_stream
    layers = {
        "host_binding_tensor_us": lambda: ep.native.all_reduce_tensor(y, 0, handle, algo_code, comm.timeout),
        "host_method_us": lambda: comm.all_reduce(y),
        "host_current_stream_us": lambda: torch.cuda.current_stream(y.device),
        "host_endpoint_us": lambda: comm._cuda_endpoint(y.device),
        "host_check_us": lambda: comm._check(y, dist.ReduceOp.SUM),
        "host_call_us": lambda: comm._call(lambda: None),
        "host_noop_us": lambda: None,
    }
    # What else could take host time: a worker thread or other Python threads competing for
    # the GIL while the binding releases it, torch.compile's fallback wrappers.
    import threading

    from ringdp import _eager

    res["python_threads"] = len(threading.enumerate())
    res["worker_started"] = comm._worker is not None
    res["eager_by_exec_strategy"] = _eager.set_code_exec_strategy is not None
    for key, fn in layers.items():
        def layer_block(fn=fn):
            dist.barrier()
            ringdp.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            host = time.perf_counter() - t0
            ringdp.synchronize()
            torch.cuda.synchronize()
            return host * 1e6 / a.calls

        layer_block()
        res[key] = _median_block(layer_block)

    # ---- RingDDP step on CUDA
    H = a.hidden
    torch.manual_seed(0)

    def mlp():
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(H, H), nn.ReLU())]).cuda()

    plain, net = mlp(), mlp()
    model = ringdp.RingDDP(net, device_ids=[0])
    xb, yb = torch.randn(32, H, device="cuda"), torch.randn(32, H, device="cuda")

    def step_ms(m, opt, iters=10):
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(m(xb), yb).backward()
            opt.step()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            opt.zero_grad()
            nn.functional.mse_loss(m(xb), yb).backward()
            opt.step()
        host = time.perf_counter()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / iters, (host - t0) * 1e3 / iters

    o1, o2 = torch.optim.SGD(plain.parameters(), lr=1e-3), torch.optim.SGD(model.parameters(), lr=1e-3)
    times = {"none": [], "ring": []}
    exposed = []
    for _ in range(5):
        times["none"].append(step_ms(plain, o1))
        times["ring"].append(step_ms(model, o2))
        exposed.append(getattr(model, "last_exposed_comm_ms", float("nan")))
    res["ddp_hidden"] = H
    res["ddp_grad_MB"] = sum(p.numel() for p in net.parameters()) * 4 / 1e6
    for mode, runs in times.items():
        res[f"{mode}_ms"] = statistics.median(w for w, _ in runs)
        res[f"{mode}_host_ms"] = statistics.median(h for _, h in runs)
    res["exposed_ms"] = res["ring_ms"] - res["none_ms"]
    res["last_exposed_comm_ms"] = statistics.median(exposed)
    res["channels_setting"] = os.environ.get("RINGDP_CUDA_CHANNELS") or "auto"
    ep = ringdp.get_communicator()._cuda
    res["endpoint"] = ep.native.describe() if ep is not None else None
    g = torch.ones(sum(p.numel() for p in net.parameters()), device="cuda")

    def alone():
        ringdp.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            ringdp.all_reduce(g)
        ringdp.synchronize()
        return (time.perf_counter() - t0) * 1e3 / 10

    alone()
    res["allreduce_alone_ms"] = _median_block(alone)

    def save():
        if rank == 0:
            os.makedirs(a.out, exist_ok=True)
            name = f"cuda_probe_w{world}" + (f"_{a.name}" if a.name else "")
            path = os.path.join(a.out, f"{name}.json")
            with open(path + ".tmp", "w") as f:  # (replaced whole: a kill never leaves half a file)
                json.dump(res, f, indent=1)
            os.replace(path + ".tmp", path)
            print(json.dumps(res, indent=1))

    save()
    # ---- what the extra time is made of: last, and saved again after it (never run on a
    # GPU yet: a failure or a hang here leaves the figures above written)
    try:
        breakdown(res, model, o2, mlp, step_ms)
    except Exception as e:  # noqa: BLE001 -- recorded in the file; the rest is worth more
        res["breakdown_error"] = f"{type(e).__name__}: {e}"[:500]
    save()
    dist.barrier()
    ringdp.destroy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bytes", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--name", default="", help="suffix of the output file")
    a = ap.parse_args()
    if a.rank >= 0:
        rank_main(a.rank, a.world, a.port, a)
        return
    from _common import child_pythonpath, wait_all  # (bench/ is this script's directory)

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=child_pythonpath())
    args = ["--world", str(a.world), "--port", str(port), "--out", a.out, "--bytes", str(a.bytes), "--calls",
            str(a.calls), "--hidden", str(a.hidden), "--name", a.name]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r)] + args, env=env) for r in range(a.world)]
    sys.exit(wait_all(procs, timeout=240))


if __name__ == "__main__":
    main()
