"""The data-parallel recipe of bench/train.py: SyncBatchNorm on CPU against a single-process
BatchNorm on the full batch (two ranks, RingDDP and torch DDP), the learning-rate schedule
(linear scaling, warmup, cosine), and exact resumption with each switch on (sync-bn,
scale-lr + warmup, amp bf16, amp fp16 with its GradScaler), dropout making the per-rank
random states matter."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import train  # noqa: E402
from test_ddp_train import run_train as _run_train  # noqa: E402

TINY = ["--world", "2", "--epochs", "2", "--train-size", "512", "--val-size", "128", "--batch", "16",
        "--accum", "2", "--log-every", "2", "--ckpt-every", "4", "--no-plot", "--dropout", "0.3"]


def run_train(*extra, timeout=240):
    return _run_train(*extra, timeout=timeout, base=TINY)


read_log = train.read_log


# ------------------------------------------------------------------ SyncBatchNorm
def _bn_model():
    from torch import nn

    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 5 * 5, 3))


def _bn_batches(world, per_rank, steps=3):
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x = torch.randn(world * per_rank, 2, 5, 5, generator=g)
        x[per_rank:] = 3 * x[per_rank:] + 2  # other ranks' samples: other statistics
        out.append((x, torch.randint(0, 3, (world * per_rank,), generator=g)))
    return out


def _syncbn_case(rank, world, kind, per_rank):
    import ringdp
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = train.convert_sync_bn(_bn_model(), "cpu")
    assert sum(type(m).__name__ == "CpuSyncBatchNorm" for m in model.modules()) == 2
    ddp = ringdp.RingDDP(model) if kind == "ring" else DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    outs, xgrads, pgrads = [], [], []
    for x, y in _bn_batches(world, per_rank):
        x = x[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
        y = y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        out = ddp(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        outs.append(out.detach())
        xgrads.append(x.grad.clone())
        pgrads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    model.eval()
    x, _ = _bn_batches(world, per_rank)[0]
    evals = model(x[rank * per_rank:(rank + 1) * per_rank]).detach()
    return {"outs": outs, "xgrads": xgrads, "pgrads": pgrads, "state": model.state_dict(), "eval": evals}


@pytest.mark.parametrize("kind", ["ring", "torch"])
def test_sync_bn_equals_full_batch_batchnorm(pool, kind):
    """Two ranks with --sync-bn's CpuSyncBatchNorm under RingDDP / torch DDP, three SGD steps:
    forward outputs, input gradients, parameter gradients, parameters, running statistics
    and eval outputs equal one process training the same model on the whole batch."""
    world, per_rank = 2, 4
    got = pool.run(_syncbn_case, kind, per_rank)
    ref = _bn_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want_outs, want_xgrads, want_pgrads = [], [], []
    for x, y in _bn_batches(world, per_rank):
        x = x.clone().requires_grad_()
        opt.zero_grad()
        out = ref(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        want_outs.append(out.detach())
        want_xgrads.append(x.grad.clone())
        want_pgrads.append([p.grad.clone() for p in ref.parameters()])
        opt.step()
    ref.eval()
    want_eval = ref(_bn_batches(world, per_rank)[0][0]).detach()
    tol = dict(rtol=1e-4, atol=1e-5)
    for r in range(world):
        sl = slice(r * per_rank, (r + 1) * per_rank)
        for i in range(3):
            torch.testing.assert_close(got[r]["outs"][i], want_outs[i][sl], **tol)
            # each rank's loss is a mean over its own samples: d(sum of the ranks' losses)/dx
            # = world x d(full-batch mean)/dx
            torch.testing.assert_close(got[r]["xgrads"][i], world * want_xgrads[i][sl], **tol)
            for a, b in zip(got[r]["pgrads"][i], want_pgrads[i]):
                torch.testing.assert_close(a, b, **tol)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[r]["state"][k], v, **tol, msg=k)
        torch.testing.assert_close(got[r]["eval"], want_eval[sl], **tol)
    # the check can tell: a plain BatchNorm on rank 0's samples alone gets other statistics
    local = _bn_model().train()
    local(_bn_batches(world, per_rank)[0][0][:per_rank])
    assert not torch.allclose(local.state_dict()["1.running_mean"], got[0]["state"]["1.running_mean"], atol=1e-3)


def _cpu_syncbn_refused_by_torch(rank, world):
    bn = torch.nn.SyncBatchNorm(3).train()
    try:
        bn(torch.randn(4, 3, 2, 2))
    except ValueError as e:
        return str(e)
    return None


def test_torch_syncbn_still_refuses_cpu(pool):
    """Why --sync-bn brings its own CPU layer: torch's refuses CPU input. When a torch
    release accepts it, this fails and CpuSyncBatchNorm can go."""
    msgs = pool.run(_cpu_syncbn_refused_by_torch)
    assert all(m and "GPU" in m for m in msgs), msgs


# ------------------------------------------------------------------ teardown
def _group_after_destroy(rank, world, args):
    """A training rank's lifetime: the group set up as `args.how` says, an optimizer step
    (which imports torch._dynamo), destroy_process_group(); writes whether the group's object
    survived it and how many of the threads started since are still there."""
    import gc
    import weakref

    import torch.distributed as dist
    from _common import init_training_group

    before = len(os.listdir("/proc/self/task"))  # the process's threads before the group
    if args.how == "helper":
        init_training_group("gloo")
    else:
        dist.init_process_group("gloo")
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.ones(3, 4)).sum().backward()
    opt.step()
    dist.barrier()  # barriers only: no tensor of Python's for gloo's threads to drop at exit
    dist.destroy_process_group()
    gc.collect()
    (Path(args.out) / f"r{rank}.json").write_text(json.dumps(
        {"alive": group() is not None, "threads_left": len(os.listdir("/proc/self/task")) - before}))


def _teardown_run(tmp_path, how):
    from types import SimpleNamespace

    from _common import launch

    out = tmp_path / how
    out.mkdir()
    launch(_group_after_destroy, SimpleNamespace(how=how, out=str(out)), 2, env={"OMP_NUM_THREADS": "1"})
    return [json.loads((out / f"r{r}.json").read_text()) for r in range(2)]


def test_training_group_is_freed_at_destroy(tmp_path):
    """bench/_common.init_training_group imports torch._dynamo before the group exists, so
    destroy_process_group() frees the group and joins gloo's threads: none is left to drop a
    collective's tensors while the interpreter shuts down (which aborted train.py after its
    last step about once in 30-40 runs). The plain init_process_group, for contrast, leaves
    the group alive once the first optimizer step has imported torch._dynamo: when a torch
    release stops that, this fails and the helper can go."""
    plain = _teardown_run(tmp_path, "plain")
    assert all(r["alive"] for r in plain), plain
    helper = _teardown_run(tmp_path, "helper")
    assert not any(r["alive"] for r in helper), helper
    # the threads the group started (gloo's workers and transport loop) are joined
    assert all(r["threads_left"] == 0 for r in helper), helper
    assert all(r["threads_left"] > 0 for r in plain), plain


# ------------------------------------------------------------------ learning rate
def test_lr_factor_values():
    # warmup 4 of 20 steps: 1/4, 2/4, 3/4, 1, then cosine over the 16 steps left
    assert [train.lr_factor(s, 4, 20) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert train.lr_factor(12, 4, 20) == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert train.lr_factor(20, 4, 20) == pytest.approx(0.0, abs=1e-12)
    assert train.lr_factor(25, 4, 20) == pytest.approx(0.0, abs=1e-12)
    # no warmup: the plain cosine of earlier releases
    assert [train.lr_factor(s, 0, 10) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)
    a = train.parse_args(["--lr", "0.01", "--scale-lr"])
    assert train.base_lr(a, 4) == pytest.approx(0.04)
    assert train.base_lr(train.parse_args(["--lr", "0.01"]), 4) == pytest.approx(0.01)


# ------------------------------------------------------------------ exact resumption
SWITCHES = {
    "sync-bn": ["--sync-bn"],
    "scale-lr-warmup": ["--scale-lr", "--warmup-steps", "3"],
    "amp-bf16": ["--amp", "bf16"],
    "amp-fp16": ["--amp", "fp16", "--scaler-growth-interval", "2"],
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_resume_is_exact_with_each_switch(tmp_path, name):
    """An uninterrupted run to step 12 and a run stopped at step 5 (inside epoch 0; 8 steps
    per epoch) then resumed to step 12 log the same losses and end with the same model,
    optimizer (and GradScaler) state. Dropout (0.3) draws from each rank's own random
    stream, so a checkpoint without every rank's random state would not pass."""
    sw = SWITCHES[name]
    full, part = tmp_path / "full", tmp_path / "part"
    run_train("--ddp", "ring", "--out-dir", str(full), "--max-steps", "12", *sw)
    run_train("--ddp", "ring", "--out-dir", str(part), "--max-steps", "5", *sw)
    ck = torch.load(part / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    assert (ck["epoch"], ck["step"], ck["step_in_epoch"]) == (0, 5, 5)
    assert len(ck["rng"]) == 2 and not torch.equal(ck["rng"][0]["torch"], ck["rng"][1]["torch"])
    out = run_train("--ddp", "ring", "--out-dir", str(part), "--max-steps", "12", "--resume", *sw)
    assert "resumed from" in out and "not an exact resumption" not in out
    la = [(r["step"], r["loss"], r["lr"]) for r in read_log(full / "train_log_ring_cpu_w2.jsonl") if "loss" in r]
    lb = [(r["step"], r["loss"], r["lr"]) for r in read_log(part / "train_log_ring_cpu_w2.jsonl") if "loss" in r]
    assert [s for s, _, _ in la] == [s for s, _, _ in lb] and la[-1][0] == 12
    assert [x for _, x, _ in la] == pytest.approx([x for _, x, _ in lb], rel=1e-6, abs=1e-7)
    assert [x for _, _, x in la] == pytest.approx([x for _, _, x in lb], rel=1e-12)
    a = torch.load(full / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    b = torch.load(part / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    assert a["step"] == b["step"] == 12
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for i, st in a["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg"], b["optimizer"]["state"][i]["exp_avg"]), i
    for r in range(2):
        assert torch.equal(a["rng"][r]["torch"], b["rng"][r]["torch"]), r
    if name == "amp-fp16":
        # growth every 2 steps: 12 steps without overflow double the scale 6 times; a
        # resumption that lost the scaler state would be 2 doublings short of it
        assert a["scaler"] is not None and a["scaler"] == b["scaler"]
        assert a["scaler"]["scale"] > 65536.0
    else:
        assert a["scaler"] is None
    if name == "scale-lr-warmup":  # lr logged per step during warmup: 2 x 3e-3 x (1/3, 2/3, 1)
        lrs = {s: lr for s, _, lr in la}
        total = 2 * 8  # 2 epochs of 8 steps
        for s in (1, 2, 3, 4, 6, 8, 10, 12):
            assert lrs[s] == pytest.approx(2 * 3e-3 * train.lr_factor(s - 1, 3, total)), s
        assert lrs[1] == pytest.approx(2e-3)


# ------------------------------------------------------------------ scaling efficiency
def test_scaling_command_reports_consistent_efficiency(tmp_path):
    """`train.py scaling` at worlds 1 and 2 (a few steps, RingDDP): one row per world, with
    samples/s = steps x batch x accum x world / best block, speed-up and efficiency relative
    to the same DDP at world 1; JSON with machine facts, PNG, markdown table."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGDP_TIMEOUT_S="60")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "train.py"), "scaling", "--worlds", "1,2", "--ddp", "ring",
                        "--train-size", "256", "--batch", "8", "--accum", "2", "--scaling-steps", "3",
                        "--scaling-warmup", "1", "--repeats", "2", "--out-dir", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    d = json.loads((tmp_path / "train_scaling_cpu.json").read_text())
    assert d["machine"]["cpu_cores"] == os.cpu_count() and "torch" in d["machine"]
    assert d["args"]["worlds"] == "1,2" and d["samples_per_step_per_rank"] == 16
    rows = {(x["ddp"], x["world"]): x for x in d["rows"]}
    assert set(rows) == {("ring", 1), ("ring", 2)}
    for (kind, w), x in rows.items():
        assert len(x["blocks_s"]) == 2
        assert x["samples_per_s"] == pytest.approx(3 * 16 * w / min(x["blocks_s"]))
        one = rows[(kind, 1)]["samples_per_s"]
        assert x["speedup"] == pytest.approx(x["samples_per_s"] / one)
        assert x["efficiency"] == pytest.approx(x["samples_per_s"] / (w * one))
    assert rows[("ring", 1)]["efficiency"] == pytest.approx(1.0)
    assert (tmp_path / "train_scaling_cpu.png").stat().st_size > 10_000
    assert "| RingDDP | 2 |" in r.stdout
    assert not list(tmp_path.glob(".*tmp*"))  # the per-run hand-over files are gone


# ------------------------------------------------------------------ DataLoader worker processes
def test_loader_workers_change_nothing(tmp_path):
    """--workers 2 --loader-start fork (persistent DataLoader workers forked from ranks whose
    ringdp communicator, shared memory and worker thread are live; SyncBatchNorm adds collectives to
    every forward): the same logged losses and the same final model, bitwise, as the run
    without workers."""
    plain, forked = tmp_path / "plain", tmp_path / "forked"
    run_train("--ddp", "ring", "--out-dir", str(plain), "--max-steps", "12", "--sync-bn")
    out = run_train("--ddp", "ring", "--out-dir", str(forked), "--max-steps", "12", "--sync-bn", "--workers", "2",
                    "--loader-start", "fork")
    assert "2 DataLoader worker processes per loader and rank, started by fork" in out, out
    la = [(r["step"], r["loss"]) for r in read_log(plain / "train_log_ring_cpu_w2.jsonl") if "loss" in r]
    lb = [(r["step"], r["loss"]) for r in read_log(forked / "train_log_ring_cpu_w2.jsonl") if "loss" in r]
    assert la == lb and la[-1][0] == 12, (la, lb)
    a = torch.load(plain / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    b = torch.load(forked / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    assert a["step"] == b["step"] == 12
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
