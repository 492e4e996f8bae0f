"""Where does a CUDA collective stop? Stage-by-stage probe of ringdp on one GPU machine.

    python3 bench/gpu_diag.py --world 2 --out DIR [--timeout-s 15] [--limit-s 90]

Runs `world` rank processes on cuda:0 (torch.distributed over a TCPStore on 127.0.0.1, gloo)
and has each log, with timestamps and unbuffered, every stage it enters: import, process
group, a CPU all-reduce through ringdp (shm), CUDA init, the native IPC endpoint (create,
blob exchange, connect), a one-shot and a ring all-reduce through the binding, then the
same through ringdp.all_reduce. Device waits time out after --timeout-s, so a stuck wait
reports which peer counter it was waiting for. After --limit-s the parent takes native
backtraces of ranks still running (cuda-gdb, when present), then kills them.
Writes DIR/diag.rank<r>.log and DIR/diag.json; prints a summary.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import socket
import subprocess
import sys
import time

T0 = time.time()


def log(f, msg):
    f.write(f"[{time.time() - T0:8.3f}] {msg}\n")
    f.flush()


def rank_main(rank, world, port, out, timeout_s, skip_cpu):
    f = open(os.path.join(out, f"diag.rank{rank}.log"), "w", buffering=1)
    faulthandler.enable(file=f, all_threads=True)
    faulthandler.dump_traceback_later(20, repeat=True, file=f)
    stage = "start"
    try:
        stage = "import torch"
        log(f, stage)
        import torch
        import torch.distributed as dist

        stage = "import ringdp"
        log(f, stage)
        import ringdp
        from ringdp import _C

        log(f, f"build_info {ringdp.build_info()}")
        stage = "init_process_group"
        log(f, stage)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        if not skip_cpu:
            stage = "cpu all_reduce (shm)"
            log(f, stage)
            t = torch.full((1000,), float(rank + 1))
            ringdp.all_reduce(t)
            log(f, f"  cpu ok: {t[0].item()} (want {world * (world + 1) / 2})")
        stage = "cuda init"
        log(f, stage)
        torch.cuda.set_device(0)
        torch.ones(1, device="cuda")
        torch.cuda.synchronize()
        log(f, f"  {torch.cuda.get_device_name(0)}")
        stage = "native create"
        log(f, stage)
        o = _C.CudaOptions()
        o.kind, o.rank, o.world, o.device = "ipc", rank, world, 0
        o.slot_bytes, o.slots, o.channels = 65536, 2, 2
        o.timeout_s = timeout_s
        c = _C.cuda_create(o)
        stage = "native blob exchange"
        log(f, stage)
        store.set(f"diag/{rank}", c.local_blob())
        store.wait([f"diag/{r}" for r in range(world)])
        stage = "native connect"
        log(f, stage)
        c.connect([store.get(f"diag/{r}") for r in range(world)])
        log(f, f"  {c.describe()}")
        for count, algo in ((1, 1), (1000, 1), (100_003, 0), (1, 0)):
            stage = f"native all_reduce count={count} algo={'oneshot' if algo else 'ring'}"
            log(f, stage)
            x = torch.arange(count, device="cuda", dtype=torch.float32) % 13 + 2 * rank
            c.all_reduce(x.data_ptr(), x.numel(), 0, 0, torch.cuda.current_stream().cuda_stream, algo, timeout_s)
            log(f, "  enqueued; synchronize")
            c.synchronize()
            want = (torch.arange(count, dtype=torch.float32) % 13) * world + world * (world - 1)
            log(f, f"  done, correct={torch.equal(x.cpu(), want)}")
        stage = "native quiesce/destroy"
        log(f, stage)
        c.quiesce()
        dist.barrier()
        c.destroy()
        for count in (1, 100_003, 1 << 22):
            stage = f"ringdp.all_reduce cuda count={count}"
            log(f, stage)
            x = torch.full((count,), float(rank + 1), device="cuda")
            ringdp.all_reduce(x)
            ringdp.synchronize()
            log(f, f"  done, correct={bool((x == world * (world + 1) / 2).all().item())}")
        stage = "ringdp.destroy"
        log(f, stage)
        ringdp.destroy()
        stage = "finished"
        log(f, stage)
        return 0
    except BaseException as e:  # noqa: BLE001
        log(f, f"FAILED at {stage}: {type(e).__name__}: {e}")
        return 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=15.0)
    ap.add_argument("--limit-s", type=float, default=90.0)
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--skip-cpu", action="store_true", help="no CPU (shm) all-reduce first")
    ap.add_argument("--gdb", action="store_true", help="run each rank under cuda-gdb (native backtrace on a crash)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.rank >= 0:
        sys.exit(rank_main(a.rank, a.world, a.port, a.out, a.timeout_s, a.skip_cpu))
    from _common import child_pythonpath  # (bench/ is this script's directory)

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONUNBUFFERED="1", RINGDP_TIMEOUT_S=str(a.timeout_s), PYTHONPATH=child_pythonpath())
    gdb = shutil.which("cuda-gdb")
    wrap = [gdb, "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40", "-ex", "info threads",
            "-ex", "thread apply all bt 12", "--args"] if (a.gdb and gdb) else []
    procs = [subprocess.Popen(wrap + [sys.executable, __file__, "--rank", str(r), "--world", str(a.world), "--port",
                                      str(port), "--out", a.out, "--timeout-s", str(a.timeout_s)]
                              + (["--skip-cpu"] if a.skip_cpu else []), env=env,
                              stdout=open(os.path.join(a.out, f"diag.rank{r}.stdout"), "w"), stderr=subprocess.STDOUT)
             for r in range(a.world)]
    deadline = time.time() + a.limit_s
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    res = {"world": a.world, "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "ranks": []}
    for r, p in enumerate(procs):
        info = {"rank": r, "rc": p.poll()}
        if p.poll() is None:
            info["hung"] = True
            if gdb:
                try:
                    bt = subprocess.run([gdb, "-batch", "-p", str(p.pid), "-ex", "thread apply all bt 30"],
                                        capture_output=True, text=True, timeout=60)
                    with open(os.path.join(a.out, f"diag.rank{r}.bt"), "w") as fh:
                        fh.write(bt.stdout + bt.stderr)
                except Exception as e:  # noqa: BLE001
                    info["bt_error"] = str(e)
        res["ranks"].append(info)
    try:
        res["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except Exception as e:  # noqa: BLE001
        res["nvidia_smi"] = str(e)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for r in range(a.world):
        try:
            res["ranks"][r]["log_tail"] = open(os.path.join(a.out, f"diag.rank{r}.log")).read()[-3000:]
        except OSError:
            pass
    json.dump(res, open(os.path.join(a.out, "diag.json"), "w"), indent=1)
    for r in res["ranks"]:
        print(f"---- rank {r['rank']} rc={r['rc']} hung={r.get('hung', False)}")
        print(r.get("log_tail", "")[-1500:])
        if a.gdb:
            try:
                print(open(os.path.join(a.out, f"diag.rank{r['rank']}.stdout")).read()[-2500:])
            except OSError:
                pass


if __name__ == "__main__":
    main()
