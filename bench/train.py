"""Train a small conv net with RingDDP or torch DDP: the one-line switch in a real script.

Run it
    torchrun --nproc-per-node 2 bench/train.py                 # RingDDP
    torchrun --nproc-per-node 2 bench/train.py --ddp torch     # torch DDP (gloo)
    torchrun --nproc-per-node 2 bench/train.py --ddp both      # both, one after the other,
                                                               # then a loss-curve PNG
    python bench/train.py --world 2 ...                        # starts the ranks itself
    python bench/train.py plot --out-dir DIR [--world N]       # redraw the PNG from the logs
    python bench/train.py scaling --worlds 1,2,4 --ddp both    # samples/s and scaling efficiency

Data: "blobs", generated (no download): 10 classes of 1x16x16 images; each class is a
fixed smooth random pattern, each sample that pattern shifted by up to 2 pixels, scaled by
0.7-1.3 and buried in Gaussian noise, so the classes overlap and accuracy grows over a few
epochs. Every rank generates the same data set from --data-seed; a DistributedSampler
(set_epoch every epoch) gives each rank its share.

Model: conv(1->16)-BN-ReLU-conv(16->32)-BN-ReLU-pool-conv(32->32)-BN-ReLU-pool-dropout-linear
(~15k parameters; BatchNorm buffers are broadcast from rank 0 before each forward, as DDP
does; --dropout defaults to 0). AdamW with a cosine learning-rate schedule per optimizer step.

The recipe's switches:
--sync-bn       BatchNorm statistics over the global batch: torch.nn.SyncBatchNorm.
                convert_sync_batchnorm before wrapping; torch 2.13 refuses SyncBatchNorm on CPU
                (and torch DDP refuses a CPU module holding one), so on CPU each layer becomes
                CpuSyncBatchNorm (below): all-reduced sums in forward and backward.
--scale-lr      learning rate = --lr x world size (linear scaling rule).
--warmup-steps N  the learning rate rises linearly, (s+1)/N x lr for steps s < N, then the
                cosine runs over the remaining steps; every warmup step is logged.
--amp bf16|fp16 torch.autocast on the model's device (CPU here); fp16 adds a
                torch.amp.GradScaler, whose state is checkpointed.
--workers N     N DataLoader worker processes per loader and rank (persistent), started as
                --loader-start says (default: the rank's own start method: fork on Linux under
                torchrun, spawn for the ranks this script starts itself); forked, they are
                copies of a rank whose ringdp communicator and worker thread are running. The
                same batches, the same training as without them.
--dropout p     randomness in the loop: each rank draws from its own stream (seeded with
                --seed and its rank after the model is built), checkpointed per rank.

Gradient accumulation: --accum k micro-batches of --batch samples per rank make one
optimizer step; the first k-1 backward passes run under model.no_sync(), so gradients
are averaged across ranks once per optimizer step.

Output, in --out-dir OUT (default bench/out/, ignored by git; the committed curves are
refreshed with --out-dir bench/results), for <ddp> = ring or torch and world size n:
rank 0 logs every --log-every optimizer steps (loss averaged over ranks, accuracy on the
held-out set after each epoch) to stdout and OUT/train_log_<ddp>_cpu_w<n>.jsonl, writes
OUT/train_ckpt_<ddp>_cpu_w<n>.pt (model without the `module.` prefix, optimizer,
scheduler, GradScaler, position in the data, and every rank's random states: torch CPU,
CUDA where initialised, Python random, numpy; gathered to rank 0) every --ckpt-every steps
and at the end of each epoch,
and at the end draws the loss curves of whatever logs OUT holds for n into
OUT/train_loss_curves_cpu_w<n>.png. --resume (or --resume PATH) continues from a
checkpoint exactly where it stopped: same epoch, same batch, same learning rate, same
dropout masks, same logged losses (the same world size is needed for the random states).
--max-steps stops early (to try resumption). The logged "lr" is the learning rate the step
used.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import checkout_fallback, count, counts, positive, OUT_DIR, launch, training_group  # noqa: E402

checkout_fallback()  # last on sys.path: PYTHONPATH's or the installed ringdp wins


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", nargs="?", default="train", choices=["train", "plot", "scaling"])
    p.add_argument("--ddp", default="ring", choices=["ring", "torch", "both"])
    p.add_argument("--world", type=count(1), default=2,
                   help="ranks to start when not under torchrun (plot: whose logs to draw)")
    p.add_argument("--epochs", type=count(1), default=4)
    p.add_argument("--train-size", type=count(1), default=4096)
    p.add_argument("--val-size", type=count(1), default=1024)
    p.add_argument("--batch", type=count(1), default=32, help="micro-batch per rank")
    p.add_argument("--accum", type=count(1), default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=positive, default=3e-3, help="base learning rate (of one rank, see --scale-lr)")
    p.add_argument("--scale-lr", action="store_true",
                   help="linear scaling rule: learning rate = --lr x world size")
    p.add_argument("--warmup-steps", type=count(0), default=0,
                   help="ramp the learning rate linearly over this many optimizer steps before the cosine")
    p.add_argument("--sync-bn", action="store_true",
                   help="BatchNorm statistics over the global batch (SyncBatchNorm; on CPU train.CpuSyncBatchNorm)")
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"],
                   help="torch.autocast on the model's device; fp16 adds a GradScaler")
    p.add_argument("--scaler-growth-interval", type=count(1), default=2000,
                   help="GradScaler growth_interval (--amp fp16)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout before the classifier")
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0, help="model init and sampler seed")
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--threads", type=count(1), default=1, help="intra-op threads per rank")
    p.add_argument("--workers", type=count(0), default=0, help="DataLoader worker processes per loader and rank")
    p.add_argument("--loader-start", default=None, choices=["fork", "spawn", "forkserver"],
                   help="how the DataLoader starts its workers (default: this process's start method)")
    p.add_argument("--log-every", type=count(1), default=4)
    p.add_argument("--ckpt-every", type=count(1), default=16)
    p.add_argument("--max-steps", type=count(1), default=None, help="stop after this many optimizer steps in total")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue from OUT/train_ckpt_<ddp>_cpu_w<n>.pt (or the given path)")
    p.add_argument("--out-dir", default=str(OUT_DIR), help="default bench/out (ignored by git)")
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--worlds", default="1,2,4", help="scaling: world sizes to measure")
    p.add_argument("--scaling-steps", type=count(1), default=40, help="scaling: timed optimizer steps per run")
    p.add_argument("--scaling-warmup", type=count(0), default=5, help="scaling: untimed steps before the clock starts")
    p.add_argument("--repeats", type=count(1), default=3,
                   help="scaling: timed blocks of --scaling-steps per run; the best block counts")
    a = p.parse_args(argv)
    try:
        counts(a.worlds)
    except argparse.ArgumentTypeError as e:
        p.error(f"--worlds {e}")
    return a


# ------------------------------------------------------------------ data and model
def make_blobs(n: int, seed: int, classes: int = 10, size: int = 16, split: int = 0):
    """The generated data set (deterministic in seed and split)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.randn(classes, 1, 4, 4, generator=g), size=(size, size), mode="bilinear",
                              align_corners=False)
    templates = templates / templates.flatten(1).std(dim=1).view(-1, 1, 1, 1)
    g = torch.Generator().manual_seed(seed * 1000 + 17 + split)
    y = torch.randint(0, classes, (n,), generator=g)
    amp = 0.7 + 0.6 * torch.rand(n, 1, 1, 1, generator=g)
    x = templates[y] * amp
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    for i in range(n):
        x[i] = torch.roll(x[i], shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2))
    x = x + 1.2 * torch.randn(x.shape, generator=g)
    return x, y


def make_model(dropout: float = 0.0):
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Dropout(dropout), nn.Linear(32, 10),
    )


# ------------------------------------------------------------------ SyncBatchNorm on CPU
# torch.nn.SyncBatchNorm refuses CPU input ("SyncBatchNorm expected input tensor to be on
# GPU ...", torch 2.13) and torch DDP refuses a CPU module holding one ("SyncBatchNorm layers
# only work with GPU modules"). CpuSyncBatchNorm is the smallest stand-in: per channel, the
# forward all-reduces [sum x, sum x^2, count] over the process group (float64), normalises
# with the global mean and biased variance and updates the running statistics with the
# unbiased one, as BatchNorm on the whole global batch would; the backward all-reduces
# [sum dy, sum dy*xhat] and gives the input gradient of that global BatchNorm. Weight and
# bias gradients stay local sums: DDP averages them like any parameter gradient.
def _sync_bn_function():
    import torch
    import torch.distributed as dist

    class _SyncBN(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps, group):
            c = x.shape[1]
            dims = [d for d in range(x.dim()) if d != 1]
            shape = [1, c] + [1] * (x.dim() - 2)
            xd = x.double()
            stats = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                               torch.tensor([x.numel() // c], dtype=torch.float64)])
            dist.all_reduce(stats, group=group)
            n = float(stats[-1])
            mean = stats[:c] / n
            var = (stats[c:2 * c] / n - mean * mean).clamp_min(0)
            invstd = (var + eps).rsqrt()
            xhat = ((xd - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
            y = xhat * weight.view(shape) + bias.view(shape) if weight is not None else xhat
            ctx.save_for_backward(xhat, weight, invstd.to(x.dtype))
            ctx.n, ctx.dims, ctx.shape, ctx.group, ctx.has_bias = n, dims, shape, group, bias is not None
            mean, var = mean.to(x.dtype), var.to(x.dtype)
            ctx.mark_non_differentiable(mean, var)
            return y, mean, var, n

        @staticmethod
        def backward(ctx, dy, _dmean, _dvar, _dn=None):
            xhat, weight, invstd = ctx.saved_tensors
            dims, shape, c = ctx.dims, ctx.shape, xhat.shape[1]
            sum_dy = dy.sum(dims)
            sum_dy_xhat = (dy * xhat).sum(dims)
            red = torch.cat([sum_dy, sum_dy_xhat]).double()
            dist.all_reduce(red, group=ctx.group)
            g_dy, g_dy_xhat = (red[:c] / ctx.n).to(dy.dtype), (red[c:] / ctx.n).to(dy.dtype)
            scale = invstd * (weight if weight is not None else 1)
            dx = (dy - g_dy.view(shape) - xhat * g_dy_xhat.view(shape)) * scale.view(shape)
            dw = sum_dy_xhat if weight is not None else None
            db = sum_dy if ctx.has_bias else None
            return dx, dw, db, None, None

    return _SyncBN


def cpu_sync_batchnorm_class():
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    global CpuSyncBatchNorm
    if "CpuSyncBatchNorm" in globals():
        return CpuSyncBatchNorm
    fn = _sync_bn_function()

    class CpuSyncBatchNorm(_BatchNorm):
        """BatchNorm over the global batch of a process group, for CPU tensors (see above)."""

        process_group = None

        def _check_input_dim(self, x):
            if x.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

        def forward(self, x):
            import torch.distributed as dist

            group = self.process_group
            sync = self.training and dist.is_available() and dist.is_initialized() and \
                dist.get_world_size(group) > 1
            if not sync:
                return super().forward(x)
            self._check_input_dim(x)
            factor = 0.0 if self.momentum is None else self.momentum
            if self.track_running_stats:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    factor = 1.0 / float(self.num_batches_tracked)
            if torch.is_autocast_enabled(x.device.type):  # statistics in float32, like BatchNorm under autocast
                with torch.autocast(x.device.type, enabled=False):
                    y, mean, var, n = fn.apply(x.float(), self.weight, self.bias, self.eps, group)
            else:
                y, mean, var, n = fn.apply(x, self.weight, self.bias, self.eps, group)
            if self.track_running_stats:
                with torch.no_grad():
                    unbiased = var * (n / (n - 1)) if n > 1 else var
                    self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                    self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
            return y

    return CpuSyncBatchNorm


def convert_sync_bn(module, device_type: str = "cpu", process_group=None):
    """torch.nn.SyncBatchNorm.convert_sync_batchnorm, then on CPU each SyncBatchNorm swapped
    for CpuSyncBatchNorm (same parameters, buffers and state-dict keys)."""
    import torch

    module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    if device_type != "cpu":
        return module
    cls = cpu_sync_batchnorm_class()

    def swap(m):
        if isinstance(m, torch.nn.SyncBatchNorm):
            new = cls(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats)
            new.load_state_dict(m.state_dict())
            new.process_group = m.process_group
            new.train(m.training)
            return new
        for name, child in m.named_children():
            setattr(m, name, swap(child))
        return m

    return swap(module)


# ------------------------------------------------------------------ learning rate
def lr_factor(step: int, warmup: int, total: int) -> float:
    """Multiplier of the (scaled) base learning rate for optimizer step `step` (0-based):
    (step+1)/warmup during the first `warmup` steps, then a cosine from 1 to 0 over the rest."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(step - warmup, total - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * t))


def base_lr(args, world: int) -> float:
    return args.lr * (world if args.scale_lr else 1)


def wrap(kind: str, module, args):
    if kind == "ring":
        import ringdp

        return ringdp.RingDDP(module, gradient_as_bucket_view=args.gradient_as_bucket_view)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, gradient_as_bucket_view=args.gradient_as_bucket_view)


# ------------------------------------------------------------------ file names
def log_name(kind: str, world: int) -> str:
    return f"train_log_{kind}_cpu_w{world}.jsonl"


def ckpt_name(kind: str, world: int) -> str:
    return f"train_ckpt_{kind}_cpu_w{world}.pt"


def curves_name(world: int) -> str:
    return f"train_loss_curves_cpu_w{world}.png"


# ------------------------------------------------------------------ training
def train(kind: str, args, rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    out = Path(args.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / ckpt_name(kind, world)
    log_path = out / log_name(kind, world)

    xtr, ytr = make_blobs(args.train_size, args.data_seed, split=0)
    xva, yva = make_blobs(args.val_size, args.data_seed, split=1)
    train_ds, val_ds = TensorDataset(xtr, ytr), TensorDataset(xva, yva)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=False)
    # the loaders get their own generators: iter(loader) draws a base seed from its generator,
    # and drawing it from the global one would shift the dropout masks of a resumed run
    workers = {"num_workers": args.workers, "persistent_workers": args.workers > 0,
               "multiprocessing_context": args.loader_start if args.workers > 0 else None}
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed), **workers)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler,
                            generator=torch.Generator().manual_seed(args.seed), **workers)

    device_type = "cpu"
    torch.manual_seed(args.seed)  # the same initial model on every rank
    module = make_model(args.dropout)
    if args.sync_bn:
        module = convert_sync_bn(module, device_type)
    model = wrap(kind, module, args)
    seed_rank(args.seed, rank)  # then each rank its own random stream (dropout)
    lr0 = base_lr(args, world)
    opt = torch.optim.AdamW(model.parameters(), lr=lr0, weight_decay=args.weight_decay)
    steps_per_epoch = len(loader) // args.accum
    total_steps = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.warmup_steps, total_steps))
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    scaler = torch.amp.GradScaler(device_type, enabled=args.amp == "fp16",
                                  growth_interval=args.scaler_growth_interval)

    def autocast():
        return torch.autocast(device_type, dtype=amp_dtype) if amp_dtype is not None else _nullcontext()

    epoch, step, step_in_epoch = 0, 0, 0
    run_loss = torch.zeros(2, dtype=torch.float64)  # this rank's loss sum, micro-batches since the last log
    resume = None
    if args.resume:
        path = ckpt_path if args.resume == "auto" else Path(args.resume)
        if path.exists():
            resume = torch.load(path, map_location="cpu", weights_only=False)
            model.module.load_state_dict(resume["model"])
            opt.load_state_dict(resume["optimizer"])
            sched.load_state_dict(resume["scheduler"])
            if resume.get("scaler") and scaler.is_enabled():
                scaler.load_state_dict(resume["scaler"])
            rngs = resume.get("rng") or []
            if len(rngs) == world:
                set_rng_state(rngs[rank])
                run_loss += torch.tensor(resume["run_loss"][rank], dtype=torch.float64)
            elif rank == 0:
                print(f"[{kind}] checkpoint holds the random states of {len(rngs)} ranks, not {world}: "
                      f"fresh random streams (not an exact resumption)", flush=True)
            epoch, step, step_in_epoch = resume["epoch"], resume["step"], resume["step_in_epoch"]
            if rank == 0:
                print(f"[{kind}] resumed from {path}: epoch {epoch}, step {step} ({step_in_epoch} into the epoch)",
                      flush=True)
        elif rank == 0:
            print(f"[{kind}] no checkpoint at {path}; starting fresh", flush=True)
    if rank == 0 and resume is None and log_path.exists():
        log_path.unlink()  # a fresh run starts a fresh log
    if rank == 0 and args.workers > 0:
        print(f"[{kind}] data: {args.workers} DataLoader worker processes per loader and rank, started by "
              f"{args.loader_start or torch.multiprocessing.get_start_method()}", flush=True)

    def save_checkpoint():
        per_rank = [None] * world  # every rank's random state and running loss, gathered to rank 0
        dist.all_gather_object(per_rank, {"rng": get_rng_state(), "run_loss": run_loss.tolist()})
        if rank == 0:
            rngs = [r["rng"] for r in per_rank]
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                     "rng": rngs, "run_loss": [r["run_loss"] for r in per_rank], "world": world,
                     "epoch": epoch, "step": step,
                     "step_in_epoch": step_in_epoch, "args": vars(args), "ddp": kind}
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    def log(rec):
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    loss_fn = torch.nn.CrossEntropyLoss()
    records = []
    stop = False
    while epoch < args.epochs and not stop:
        sampler.set_epoch(epoch)
        model.train()
        it = iter(loader)
        for _ in range(step_in_epoch * args.accum):  # resume inside an epoch: skip what was done
            next(it)
        t_log, timed = time.perf_counter(), 0  # micro-batches since t_log
        while step_in_epoch < steps_per_epoch:
            opt.zero_grad()
            for k in range(args.accum):
                x, y = next(it)
                sync = k == args.accum - 1
                with (model.no_sync() if not sync else _nullcontext()):
                    with autocast():
                        loss = loss_fn(model(x), y)
                    scaler.scale(loss / args.accum).backward()
                run_loss[0] += loss.item()
                run_loss[1] += 1
                timed += 1
            lr = sched.get_last_lr()[0]  # the learning rate of this step
            scaler.step(opt)  # opt.step(), unless fp16 gradients overflowed
            scaler.update()
            sched.step()
            step += 1
            step_in_epoch += 1
            if step % args.log_every == 0 or step <= args.warmup_steps or step_in_epoch == steps_per_epoch:
                dist.all_reduce(run_loss)  # mean over ranks and micro-batches
                dt = time.perf_counter() - t_log
                rec = {"ddp": kind, "step": step, "epoch": epoch, "loss": run_loss[0].item() / run_loss[1].item(),
                       "lr": lr,
                       "samples_per_s": timed * world * args.batch / dt if dt > 0 else None}
                records.append(rec)
                log(rec)
                if rank == 0:
                    print(f"[{kind}] epoch {epoch} step {step:4d} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                          f"{rec['samples_per_s']:.0f} samples/s", flush=True)
                run_loss.zero_()
                t_log, timed = time.perf_counter(), 0
            if step % args.ckpt_every == 0:
                save_checkpoint()
            if args.max_steps is not None and step >= args.max_steps:
                stop = True
                break
        if stop and step_in_epoch < steps_per_epoch:  # stopped inside the epoch
            save_checkpoint()
            break
        # end of epoch: held-out accuracy, checkpoint at the start of the next epoch
        model.eval()
        correct = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                with autocast():
                    pred = model(x).argmax(dim=1)
                correct[0] += (pred == y).sum().item()
                correct[1] += y.numel()
        dist.all_reduce(correct)
        acc = correct[0].item() / correct[1].item()
        rec = {"ddp": kind, "step": step, "epoch": epoch, "val_acc": acc}
        records.append(rec)
        log(rec)
        if rank == 0:
            print(f"[{kind}] epoch {epoch} done: held-out accuracy {acc:.3f}", flush=True)
        epoch += 1
        step_in_epoch = 0
        save_checkpoint()
    return records


def seed_rank(seed: int, rank: int) -> None:
    """Each rank its own random streams: torch (CPU and CUDA), Python random, numpy."""
    import random

    import numpy as np
    import torch

    s = seed * 1000 + 1 + rank
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)


def get_rng_state() -> dict:
    import random

    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None}


def set_rng_state(st: dict) -> None:
    import random

    import numpy as np
    import torch

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ------------------------------------------------------------------ plot
def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(out_dir: Path, world: int) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {k: read_log(out_dir / log_name(k, world)) for k in ("torch", "ring")}
    logs = {k: v for k, v in logs.items() if v}
    if not logs:
        print(f"no world-{world} logs under {out_dir}")
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    style = {"torch": dict(color="#d62728", lw=3, alpha=0.5, label="torch DDP (gloo)"),
             "ring": dict(color="#1f77b4", lw=1.2, marker=".", label="ringdp.RingDDP")}
    for k, recs in logs.items():
        tr = [r for r in recs if "loss" in r]
        ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], **style[k])
        va = [r for r in recs if "val_acc" in r]
        ax2.plot([r["epoch"] + 1 for r in va], [r["val_acc"] for r in va], **style[k])
    if len(logs) == 2:
        a = {r["step"]: r["loss"] for r in logs["torch"] if "loss" in r}
        b = {r["step"]: r["loss"] for r in logs["ring"] if "loss" in r}
        common = sorted(set(a) & set(b))
        if common:
            d = max(abs(a[s] - b[s]) for s in common)
            ax.set_title(f"training loss (max |ring - torch| = {d:.2e})", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (mean over ranks)")
    ax.legend()
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("held-out accuracy")
    ax2.set_title("held-out accuracy", fontsize=9)
    fig.suptitle(f"bench/train.py: conv net on generated blobs, world {world}", fontsize=10)
    fig.tight_layout()
    path = out_dir / curves_name(world)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ scaling efficiency
def scaling_name() -> str:
    return "train_scaling_cpu"


def scaling_rank(rank: int, world: int, args):
    """One (ddp, world) point: --scaling-warmup untimed optimizer steps, then --repeats
    blocks of --scaling-steps, each between two barriers; rank 0 writes the block times."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(args.threads)
    with training_group("gloo"):
        kind = args.scaling_kind
        x, y = make_blobs(args.train_size, args.data_seed)
        ds = TensorDataset(x, y)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                     drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True,
                            generator=torch.Generator().manual_seed(args.seed))
        torch.manual_seed(args.seed)
        module = make_model(args.dropout)
        if args.sync_bn:
            module = convert_sync_bn(module, "cpu")
        model = wrap(kind, module, args)
        seed_rank(args.seed, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=base_lr(args, world), weight_decay=args.weight_decay)
        amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
        scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
        loss_fn = torch.nn.CrossEntropyLoss()
        state = {"epoch": 0, "it": None}

        def batch():
            while True:
                if state["it"] is not None:
                    try:
                        return next(state["it"])
                    except StopIteration:
                        state["epoch"] += 1
                sampler.set_epoch(state["epoch"])
                state["it"] = iter(loader)

        def opt_step():
            opt.zero_grad()
            for k in range(args.accum):
                xb, yb = batch()
                with (model.no_sync() if k < args.accum - 1 else _nullcontext()):
                    with (torch.autocast("cpu", dtype=amp_dtype) if amp_dtype else _nullcontext()):
                        loss = loss_fn(model(xb), yb)
                    scaler.scale(loss / args.accum).backward()
            scaler.step(opt)
            scaler.update()

        model.train()
        for _ in range(args.scaling_warmup):
            opt_step()
        blocks = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.scaling_steps):
                opt_step()
            dist.barrier()
            blocks.append(time.perf_counter() - t0)
        if rank == 0:
            Path(args.scaling_result).write_text(json.dumps({"blocks_s": blocks}))


def scaling(args) -> dict:
    """Same model, same per-rank batch, --scaling-steps optimizer steps at each world size of
    --worlds, for each DDP of --ddp; throughput, speed-up and efficiency per point."""
    import copy

    from _common import machine_info, save_json, under_torchrun

    if under_torchrun():
        raise SystemExit("train.py scaling starts its own ranks for each world size: run it with python, "
                         "not torchrun")
    worlds = counts(args.worlds)
    kinds = ["torch", "ring"] if args.ddp == "both" else [args.ddp]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples_per_step = args.batch * args.accum  # per rank
    load_before = os.getloadavg()
    rows = []
    base = {}
    for w in worlds:  # both DDPs of one world size close together in time (a busy machine drifts)
        for kind in kinds:
            a = copy.copy(args)
            a.scaling_kind = kind
            a.scaling_result = str(out / f".{scaling_name()}_{kind}_w{w}.tmp.json")
            launch(scaling_rank, a, w, env={"OMP_NUM_THREADS": str(args.threads)})
            blocks = json.loads(Path(a.scaling_result).read_text())["blocks_s"]
            os.unlink(a.scaling_result)
            best = min(blocks)
            tput = args.scaling_steps * samples_per_step * w / best
            if w == 1:
                base[kind] = tput
            b = base.get(kind)
            row = {"ddp": kind, "world": w, "samples_per_s": tput, "step_ms": 1e3 * best / args.scaling_steps,
                   "blocks_s": blocks, "speedup": tput / b if b else None,
                   "efficiency": tput / (w * b) if b else None}
            rows.append(row)
            print(f"[{kind}] world {w}: {tput:.0f} samples/s, {row['step_ms']:.1f} ms/step"
                  + (f", speed-up {row['speedup']:.2f}, efficiency {row['efficiency']:.2f}" if b else ""),
                  flush=True)
    payload = {"benchmark": "train_scaling", "machine": machine_info(),
               "load_average_1_5_15min": {"before": list(load_before), "after": list(os.getloadavg())},
               "args": {k: v for k, v in vars(args).items() if k not in ("scaling_kind", "scaling_result")},
               "samples_per_step_per_rank": samples_per_step, "rows": rows}
    path = save_json(scaling_name(), payload, out)
    print(scaling_table(payload))
    print(f"wrote {path}")
    png = plot_scaling(payload, out / f"{scaling_name()}.png")
    print(f"wrote {png}")
    return payload


def scaling_table(payload: dict) -> str:
    lines = ["| DDP | world | samples/s | ms/step | speed-up | efficiency |", "|---|---|---|---|---|---|"]
    names = {"ring": "RingDDP", "torch": "torch DDP (gloo)"}
    for r in sorted(payload["rows"], key=lambda r: (r["ddp"] != "ring", r["world"])):
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        ef = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(f"| {names[r['ddp']]} | {r['world']} | {r['samples_per_s']:.0f} | {r['step_ms']:.1f} | "
                     f"{sp} | {ef} |")
    return "\n".join(lines)


def plot_scaling(payload: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    style = {"torch": dict(color="#d62728", marker="s", label="torch DDP (gloo)"),
             "ring": dict(color="#1f77b4", marker="o", label="ringdp.RingDDP")}
    for kind in ("torch", "ring"):
        rows = [r for r in payload["rows"] if r["ddp"] == kind]
        if not rows:
            continue
        ws = [r["world"] for r in rows]
        ax.plot(ws, [r["samples_per_s"] for r in rows], **style[kind])
        base = next((r["samples_per_s"] for r in rows if r["world"] == 1), None)
        if base:
            ax.plot(ws, [base * w for w in ws], color=style[kind]["color"], ls=":", lw=1,
                    label=f"{style[kind]['label']}: N x world 1")
            ax2.plot(ws, [r["efficiency"] for r in rows], **style[kind])
    m = payload["machine"]
    ax.set_xlabel("world size (ranks = processes, one thread each)")
    ax.set_ylabel("samples/s (all ranks)")
    ax.legend(fontsize=8)
    ax2.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax2.set_ylim(0, 1.1)
    ax2.set_xlabel("world size")
    ax2.set_ylabel("efficiency = tput(N) / (N x tput(1))")
    for a in (ax, ax2):
        a.set_xticks(sorted({r["world"] for r in payload["rows"]}))
    fig.suptitle(f"bench/train.py scaling: conv net, {payload['samples_per_step_per_rank']} samples per rank "
                 f"per step, {m['cpu_cores']} cores ({m['cpu_model']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ launch
def main_rank(rank: int, world: int, args):
    import torch

    torch.set_num_threads(args.threads)
    with training_group("gloo"):
        kinds = ["torch", "ring"] if args.ddp == "both" else [args.ddp]
        for kind in kinds:
            train(kind, args, rank, world)
        if rank == 0 and not args.no_plot:
            p = plot(Path(args.out_dir), world)
            if p:
                print(f"wrote {p}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "scaling":
        scaling(args)
        return
    if args.command == "plot":
        p = plot(Path(args.out_dir), args.world)
        if p:
            print(f"wrote {p}")
        return
    launch(main_rank, args, args.world)


if __name__ == "__main__":
    main()
