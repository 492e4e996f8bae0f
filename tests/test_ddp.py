"""RingDDP against single-process training on the full batch, against torch DDP, and its
error paths. Multi-process: the `pool` fixture (conftest.py, tests/_dist.py) gives the
module two spawned workers (gloo on 127.0.0.1, one intra-op thread each), started once,
that run one case per test, so each test pays for the case, not for importing torch twice.
Cases are the module-level `case_*` functions, passed to `pool.run` by reference."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_ranks, values
from _torch_features import DDP_2_13_ARGUMENTS

STEPS = 6

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


# ============================================================== models and data
class MLP(nn.Module):
    def __init__(self, d_in=8, d_hidden=16, d_out=4, layers=3):
        super().__init__()
        dims = [d_in] + [d_hidden] * (layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, l in enumerate(self.layers):
            x = l(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Tied(nn.Module):
    """An embedding tied to the output projection, and a block applied twice."""

    def __init__(self, vocab=12, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        return self.out(h)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.c2 = nn.Conv2d(6, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.bn1(self.c1(x)))
        x = torch.relu(self.bn2(self.c2(x)))
        return self.fc(x.mean(dim=(2, 3)))


class ComplexMLP(nn.Module):
    """Complex weights between real inputs and outputs, and a real layer after them: complex
    and real parameters side by side (their buckets apart). `gain` is used conjugated, so
    autograd hands its gradient over as a lazy conjugate (is_conj())."""

    def __init__(self, d_in=8, d_hidden=16, d_out=4):
        super().__init__()
        self.c1 = nn.Linear(d_in, d_hidden, dtype=torch.complex64)
        self.gain = nn.Parameter(torch.randn(d_hidden, dtype=torch.complex64))
        self.c2 = nn.Linear(d_hidden, d_out // 2, dtype=torch.complex64)
        self.real = nn.Linear(d_out, d_out)

    def forward(self, x):
        h = self.c1(x.to(torch.complex64)) * self.gain.conj()
        h = h * torch.sigmoid(h.abs())
        return self.real(torch.view_as_real(self.c2(h)).flatten(-2))


class Branchy(nn.Module):
    """`b` is used only when asked; `never` is never used."""

    def __init__(self, d=4):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.never = nn.Linear(d, d)

    def forward(self, x, use_b=True):
        h = self.a(x)
        if use_b:
            h = h + self.b(x)
        return h


@dataclasses.dataclass
class BranchyOut:
    y: torch.Tensor
    note: str = "a model's output class"


class OutputDict(dict):
    pass


class BranchyStructured(Branchy):
    """Branchy whose forward returns a dataclass or a dict subclass (as models' output
    classes are): RingDDP finds the output tensors inside them, as torch DDP does."""

    def __init__(self, d=4, kind="dataclass"):
        super().__init__(d)
        self.kind = kind

    def forward(self, x, use_b=True):
        h = super().forward(x, use_b)
        return BranchyOut(h) if self.kind == "dataclass" else OutputDict(out=[h])


class Reordered(nn.Module):
    """Layers registered in one order and applied in the other, so that gradients become
    ready in registration order, not in reverse."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 8)

    def forward(self, x):
        return self.l1(torch.relu(self.l2(torch.relu(self.l3(x)))))


def build(cls, seed, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    m = cls(**kw)
    return m if dtype == torch.float32 else m.to(dtype)  # (.to(float32) would make complex weights real)


def batch(step, n, d_in=8, d_out=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g).to(dtype), torch.randn(n, d_out, generator=g).to(dtype)


def shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def params_of(m):
    return [p.detach().clone() for p in m.parameters()]


def max_diff(a, b):
    wide = lambda t: t if t.is_complex() else t.float()  # noqa: E731
    return max((wide(x) - wide(y)).abs().max().item() for x, y in zip(a, b))


def init_ddp(cls, rank, dtype=torch.float32, ddp_kwargs=None, **kw):
    """A RingDDP model initialised differently on each rank (rank 0's init must win) and
    the reference: a plain model with rank 0's init."""
    from ringdp.ddp import RingDDP

    ref = build(cls, 0, dtype, **kw)
    model = RingDDP(build(cls, 0 if rank == 0 else 100 + rank, dtype, **kw), **(ddp_kwargs or {}))
    return model, ref


# ============================================================== cases (run on every rank)
def case_train(rank, world, model="mlp", ddp_kwargs=None, dtype="float32", hook=None, steps=STEPS,
               set_to_none=True, per_rank=4):
    """Train RingDDP and a single-process reference on the full batch side by side."""
    import ringdp
    from ringdp import comm_hooks

    dt = getattr(torch, dtype)
    if model == "mlp":
        ddp, ref = init_ddp(MLP, rank, dt, ddp_kwargs)
    elif model == "bigmlp":  # > 1 MiB of parameters: several buckets with the default caps
        ddp, ref = init_ddp(MLP, rank, dt, ddp_kwargs, d_in=8, d_hidden=384, d_out=4, layers=4)
    elif model == "reordered":
        ddp, ref = init_ddp(Reordered, rank, dt, ddp_kwargs)
    elif model == "tied":
        ddp, ref = init_ddp(Tied, rank, dt, ddp_kwargs)
    elif model == "complex":
        ddp, ref = init_ddp(ComplexMLP, rank, dt, ddp_kwargs)
    else:
        raise ValueError(model)
    initial_diff = max_diff(params_of(ddp.module), params_of(ref))
    calls = []
    if hook is not None:
        h = getattr(comm_hooks, hook)

        def counting(state, bucket):
            calls.append((bucket.index(), bucket.buffer().dtype))
            return h(state, bucket)

        ddp.register_comm_hook(None, counting)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    layouts = [ddp.bucket_layout]
    grads_registered = []
    diffs = []
    for s in range(steps):
        n = world * per_rank
        if model == "tied":
            g = torch.Generator().manual_seed(2000 + s)
            x = torch.randint(0, 12, (n, 5), generator=g)
            y = torch.randint(0, 12, (n, 5), generator=g)
            loss_fn = lambda out, tgt: nn.functional.cross_entropy(out.reshape(-1, 12).float(), tgt.reshape(-1))  # noqa: E731
        else:
            x, y = batch(s, n, dtype=dt, d_out=8 if model == "reordered" else 4)
            loss_fn = lambda out, tgt: ((out.float() - tgt.float()) ** 2).mean()  # noqa: E731
        opt.zero_grad(set_to_none=set_to_none)
        ropt.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        grads_registered.append([ringdp.is_registered(p.grad) for p in ddp.parameters()])
        opt.step()
        loss_fn(ref(x), y).backward()
        ropt.step()
        diffs.append(max_diff(params_of(ddp.module), params_of(ref)))
        layouts.append(ddp.bucket_layout)
    views = []
    if (ddp_kwargs or {}).get("gradient_as_bucket_view"):
        for i, p in enumerate(ddp.reducer.params):
            b, slot = ddp.reducer.bucket_of(i)
            views.append(p.grad.data_ptr() == b.views[slot].data_ptr())
    buckets = ddp.reducer.buckets
    return {"params": params_of(ddp.module), "diffs": diffs, "initial_diff": initial_diff, "layouts": layouts,
            "hook_calls": calls, "n_buckets": len(buckets), "grads_registered": grads_registered,
            "grad_is_view": views, "in_grad_storage": [b.has_storage for b in buckets if b.in_grad]}


def case_convbn_vs_torch(rank, world, steps=5, join_counts=None):
    """RingDDP and torch DDP(gloo) on the same BatchNorm conv net and the same data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp.ddp import RingDDP

    ring = RingDDP(build(ConvBN, 7 + rank))  # different init per rank: broadcast must fix it
    tddp = DDP(build(ConvBN, 7 + rank))
    # the same rank-0 weights in both (torch DDP broadcast rank 0's too)
    tddp.module.load_state_dict(ring.module.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ring, tddp)]
    n_steps = steps if join_counts is None else join_counts[rank]
    ctxs = (ring.join(), tddp.join()) if join_counts is not None else (None, None)
    for m, opt, ctx in zip((ring, tddp), opts, ctxs):
        with ctx if ctx is not None else _null():
            for s in range(n_steps):
                g = torch.Generator().manual_seed(300 + 10 * s + rank)  # different data per rank
                x = torch.randn(4, 3, 6, 6, generator=g) * (1 + rank)
                y = torch.randint(0, 5, (4,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
    out = {}
    for tag, m in (("ring", ring), ("torch", tddp)):
        out[tag] = {k: v.detach().clone() for k, v in m.module.state_dict().items()}
    return out


def case_layouts_like_torch(rank, world, view, power_sgd=False, steps=4):
    """RingDDP and torch DDP(gloo) side by side on ConvBN in channels_last plus a parameter
    created transposed (dense, not row-major) and one with a gap (not dense): after each step
    the parameters (rtol) and every .grad's strides; with bucket views, whether each .grad is
    its bucket slot (RingDDP) and torch's bucket views' strides."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp.ddp import RingDDP

    def make():
        m = build(ConvBN, 11).to(memory_format=torch.channels_last)
        m.tw = nn.Parameter(torch.randn(5, 8).t())  # (8, 5), strides (1, 8)
        m.gap = nn.Parameter(torch.randn(4, 10)[:, ::2])  # (4, 5), strides (10, 2): has gaps
        return m

    ring, tddp = RingDDP(make(), gradient_as_bucket_view=view), DDP(make(), gradient_as_bucket_view=view)
    if power_sgd:  # its hook .view()s bucket.gradients(): row-major in both, whatever the slots' layout
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        for m in (ring, tddp):
            m.register_comm_hook(psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                                    min_compression_rate=0.5), psgd.powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ring, tddp)]
    out = {"param_strides": {n: tuple(p.stride()) for n, p in ring.module.named_parameters()},
           "names": [n for n, _ in ring.module.named_parameters()], "steps": []}
    for s in range(steps):
        g = torch.Generator().manual_seed(500 + 10 * s + rank)
        x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        y = torch.randn(4, 5, generator=g)
        row = {}
        for tag, m, opt in (("ring", ring, opts[0]), ("torch", tddp, opts[1])):
            opt.zero_grad()
            inner = m.module
            pred = (m(x) @ inner.tw.t() @ inner.tw) * 0.1 + inner.gap.sum() * 0.01
            ((pred - y) ** 2).mean().backward()
            row[tag] = [tuple(p.grad.stride()) for p in m.parameters()]
            opt.step()
        row["diff"] = max((a - b).abs().max().item() for a, b in zip(ring.parameters(), tddp.parameters()))
        row["params"] = [p.detach().clone() for p in ring.parameters()]
        out["steps"].append(row)
    if view:
        r = ring.reducer
        out["is_slot"] = [p.grad.data_ptr() == r.bucket_of(i)[0].views[r.bucket_of(i)[1]].data_ptr()
                          for i, p in enumerate(r.params)]
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def case_no_sync(rank, world, micro=3, per_rank=2, gradient_as_bucket_view=False):
    """`micro` micro-batches, all but the last under no_sync, equal one step on the
    whole (world * micro * per_rank) batch."""
    ddp, ref = init_ddp(MLP, rank, ddp_kwargs={"gradient_as_bucket_view": gradient_as_bucket_view})
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    diffs, nosync_grad_local = [], []
    for s in range(3):
        x, y = batch(s, world * micro * per_rank)
        xr, yr = shard(x, rank, world), shard(y, rank, world)
        opt.zero_grad()
        for k in range(micro):
            xs, ys = xr[k * per_rank:(k + 1) * per_rank], yr[k * per_rank:(k + 1) * per_rank]
            if k < micro - 1:
                with ddp.no_sync():
                    (((ddp(xs) - ys) ** 2).mean() / micro).backward()
            else:
                # before the synchronised backward the gradients are still local: compare
                # them with the local accumulation of the micro-batches seen so far
                local = ref_local_grad(ref, xr[:k * per_rank], yr[:k * per_rank], micro, per_rank)
                nosync_grad_local.append(max_diff([p.grad for p in ddp.parameters()], local))
                (((ddp(xs) - ys) ** 2).mean() / micro).backward()
        opt.step()
        ropt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ropt.step()
        diffs.append(max_diff(params_of(ddp.module), params_of(ref)))
    return {"diffs": diffs, "nosync_local": nosync_grad_local, "params": params_of(ddp.module)}


def case_no_grad_forward_between(rank, world, find_unused=False, per_rank=4):
    """A forward without autograd (an evaluation, a logging pass) between a forward and its
    backward changes nothing: the backward still averages the gradients, as torch DDP's
    (which prepares no backward for such a forward). Before, it turned the next backward's
    synchronisation off, silently: every rank kept its local gradients."""
    ddp, ref = init_ddp(MLP, rank, ddp_kwargs={"find_unused_parameters": find_unused})
    x, y = batch(0, world * per_rank)
    xr, yr = shard(x, rank, world), shard(y, rank, world)
    out = ddp(xr)
    with torch.no_grad():
        ddp(xr)
    ((out - yr) ** 2).mean().backward()
    ((ref(x) - y) ** 2).mean().backward()
    return max_diff([p.grad for p in ddp.parameters()], [p.grad for p in ref.parameters()]), \
        [p.grad.clone() for p in ddp.parameters()]


def case_structured_output(rank, world, kind, static_graph=False, steps=3, d=4):
    """find_unused_parameters (or static_graph) with a model that returns a dataclass or a
    dict subclass: trains as the full batch does (rank 0 uses `b`, rank 1 does not)."""
    from ringdp.ddp import RingDDP

    ref = build(Branchy, 0, d=d)
    ddp = RingDDP(build(BranchyStructured, 0 if rank == 0 else 50 + rank, d=d, kind=kind),
                  find_unused_parameters=not static_graph, static_graph=static_graph)
    opt, ropt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    diffs = []
    for s in range(steps):
        x, y = batch(s, world * 3, d_in=d, d_out=d)
        opt.zero_grad()
        out = ddp(shard(x, rank, world), use_b=(rank == 0))
        h = out.y if kind == "dataclass" else out["out"][0]
        ((h - shard(y, rank, world)) ** 2).mean().backward()
        opt.step()
        _branchy_reference_step(ref, ropt, x, y, world)
        diffs.append(max_diff(params_of(ddp.module), params_of(ref)))
    return diffs, params_of(ddp.module)


def case_hook_result_wrong_size(rank, world, steps=3):
    """A comm hook whose future holds too few elements (bucket 0, step 0 only): a clear error
    naming the bucket; the later buckets' reductions, still running, are waited for before
    the error leaves backward, so the next steps (the error caught) train as the full batch."""
    from ringdp import comm_hooks

    ddp, ref = init_ddp(MLP, rank, ddp_kwargs={"bucket_cap_mb": 1e-9})
    calls = {"n": 0}

    def hook(state, bucket):
        fut = comm_hooks.allreduce_hook(state, bucket)
        calls["n"] += 1
        if calls["n"] == 1:  # the first bucket of step 0
            return fut.then(lambda f: f.value()[0][:-1])
        return fut

    ddp.register_comm_hook(None, hook)
    opt, ropt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    err, diffs = None, []
    for s in range(steps):
        x, y = batch(s, world * 4)
        opt.zero_grad()
        try:
            ((ddp(shard(x, rank, world)) - shard(y, rank, world)) ** 2).mean().backward()
        except RuntimeError as e:
            err = str(e)
            idle = all(b.future is None for b in ddp.reducer.buckets)
            continue  # (this step is skipped on every rank alike)
        opt.step()
        ropt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ropt.step()
        diffs.append(max_diff(params_of(ddp.module), params_of(ref)))
    return err, idle, diffs, params_of(ddp.module)


def case_freed_without_gc(rank, world):
    """A RingDDP whose model has a gradient reduced in its own .grad (an in-grad bucket) is
    freed, with its registered memory, as soon as the last reference goes: no reference
    cycle through the Reducer that only the cyclic GC would break."""
    import gc
    import weakref

    from ringdp.ddp import RingDDP

    gc.collect()
    gc.disable()
    try:
        m = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 4))  # 2 MiB of weight: an in-grad bucket
        ddp = RingDDP(m)
        for _ in range(2):
            ddp(torch.randn(2, 1024)).sum().backward()
        in_grad = sum(b.in_grad for b in ddp.reducer.buckets)
        r = weakref.ref(ddp.reducer)
        del ddp, m
        return in_grad, r() is None
    finally:
        gc.enable()


class _CastsBetween(nn.Module):
    """Two layers; the second may be converted alone (its input is cast to its dtype)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.b(self.a(x).to(self.b.weight.dtype)).float()


def case_dtype_changed_after_wrapping(rank, world):
    """torch gives a parameter a new gradient accumulator when its data changes dtype or device
    or is set anew: RingDDP's hook on the old one would be silent, the gradient never averaged.
    A model converted after wrapping raises a clear error on every rank, at the forward when
    the whole model was converted (through the wrapper or not), at the end of backward when a
    part was, and at every later forward. One converted and back, or whose parameters were
    set anew (p.set_(), same dtype and device), trains as if untouched: the gradients of each
    step as those of a model wrapped as it is."""
    from ringdp.ddp import RingDDP

    errors = {}

    def attempt(key, fn):
        try:
            fn()
            errors[key] = None
        except RuntimeError as e:
            errors[key] = str(e)

    x, y = batch(0, world * 4, dtype=torch.float64)
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    ddp = RingDDP(build(MLP, 0))
    ddp.double()
    attempt("wrapper", lambda: ddp(xs))
    attempt("wrapper, again", lambda: ddp(xs))
    ddp = RingDDP(build(MLP, 0))
    ddp.module.double()
    attempt("inner module", lambda: ddp(xs))
    torch.manual_seed(0)
    ddp = RingDDP(_CastsBetween())
    ddp.module.b.double()
    attempt("a part", lambda: ddp(torch.ones(2, 3)).sum().backward())
    attempt("a part, then forward", lambda: ddp(torch.ones(2, 3)))

    def grads(m, ys=ys):
        m.zero_grad()
        ((m(xs.float()) - ys.float()) ** 2).mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    untouched = grads(RingDDP(build(MLP, 0)))
    there_and_back = RingDDP(build(MLP, 0))
    there_and_back.module.double().float()
    set_anew = RingDDP(build(MLP, 0))
    with torch.no_grad():
        for p in list(set_anew.parameters())[1:]:  # (all but the first: found at the end of backward)
            p.set_(p.detach().clone())
    ok = RingDDP(build(MLP, 0).double())
    ((ok(xs) - ys) ** 2).mean().backward()
    return (errors, [p.grad.clone() for p in ok.parameters()], untouched,
            [grads(there_and_back), grads(there_and_back)], [grads(set_anew), grads(set_anew)])


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


def case_used_only_under_no_sync(rank, world):
    """find_unused_parameters: a parameter used only in no_sync micro-steps and unused in
    the synchronised one still has its accumulated gradient averaged (as torch DDP)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp import RingDDP

    out = {}
    for name, cls in (("ringdp", RingDDP), ("torch", DDP)):
        torch.manual_seed(0)
        m = cls(_TwoHeads(), find_unused_parameters=True)
        for step in range(2):  # each twice: the bookkeeping resets after a sync
            for p in m.parameters():
                p.grad = None
            x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1) + step
            with m.no_sync():
                m(x, True).square().sum().backward()  # b used only here
            m(x + 1, False).square().sum().backward()  # b unused in the synchronised step
            out[(name, step)] = [p.grad.clone() for p in m.module.parameters()]
    return out


class _Usage(nn.Module):
    """A trunk, a head, an auxiliary head that the loss may ignore, an unused layer; the head
    optionally in a reentrant checkpoint (use_reentrant=True)."""

    def __init__(self, checkpoint_head=False):
        super().__init__()
        self.trunk, self.head, self.aux, self.unused = (nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2),
                                                         nn.Linear(2, 2))
        self.checkpoint_head = checkpoint_head

    def forward(self, x):
        import torch.utils.checkpoint as cp

        h = torch.tanh(self.trunk(x))
        out = cp.checkpoint(self.head, h, use_reentrant=True) if self.checkpoint_head else self.head(h)
        return out, self.aux(h)


class _SharedBlock(nn.Module):
    """One block applied three times (ALBERT's sharing), each time in a reentrant checkpoint:
    its parameters' gradients come in three parts; the head optionally in one too."""

    def __init__(self, checkpoint_head=False):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.checkpoint_head = checkpoint_head

    def forward(self, x):
        import torch.utils.checkpoint as cp

        h = self.inp(x)
        for _ in range(3):
            h = cp.checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        return (cp.checkpoint(self.head, h, use_reentrant=True) if self.checkpoint_head else self.head(h)), h


class _NestedHook(nn.Module):
    """A hook on the output (a tensor hook, or the head's backward pre-hook: module) runs a
    nested backward (a side loss, through a layer the output does not use) before any
    gradient of the main path: the first gradient hooks fire on that inner backward, which
    ends first. keep: the loss is not made from the outputs (the output kept in an attribute,
    none returned)."""

    def __init__(self, keep=False, module=False, aux=False):
        super().__init__()
        self.trunk, self.head, self.side = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(3, 1)
        self.keep, self.kept, self.module, self.x = keep, None, module, None
        self.aux, self.aux_out = aux, None  # aux: the side loss is made from a second output
        if module:
            self.head.register_full_backward_pre_hook(lambda *args: self._side_loss())

    def _side_loss(self, *args):
        with torch.enable_grad():
            (self.aux_out if self.aux else self.side(self.x)).square().sum().backward()

    def forward(self, x):
        self.x = x.detach()
        out = self.head(torch.tanh(self.trunk(x)))
        self.aux_out = self.side(x) if self.aux else None
        if out.requires_grad and not self.module:
            out.register_hook(self._side_loss)
        if self.keep:
            self.kept = out
            return None
        return (out, self.aux_out) if self.aux else out


# torch 2.13's DDP with static_graph fails the second step of a model with an ignored output
# ("Expected to have finished reduction in the prior iteration"): those scenarios are compared
# with torch's find_unused_parameters, which means the same for them ("torch:" in the name).
USAGE_SCENARIOS = {  # name: (constructor arguments, checkpoint the head, what a step does)
    "ignored output, find_unused": ({"find_unused_parameters": True}, False, "first"),
    "ignored output, static_graph (torch: find_unused)": ({"static_graph": True}, False, "first"),
    "ignored output, _set_static_graph() (torch: find_unused)": ({}, False, "first set_static"),
    "reentrant checkpoint last": ({}, True, "first frozen"),
    "reentrant checkpoint, static_graph": ({"static_graph": True}, True, "both"),
    "sync forward, then one under no_sync, one backward": ({}, False, "sync_then_nosync frozen"),
    "a second backward without a forward": ({"find_unused_parameters": True}, False, "twice"),
    "deepcopy": ({"find_unused_parameters": True}, False, "first deepcopy"),
    "pickled on rank 0, loaded on every rank": ({"find_unused_parameters": True}, False, "first pickle"),
    "deepcopy, process_group=WORLD": ({"find_unused_parameters": True}, False, "first deepcopy world"),
    "a post-accumulate-grad hook added after wrapping": ({"find_unused_parameters": True}, False, "first posthook"),
    "one block in three reentrant checkpoints, static_graph": ({"static_graph": True}, False, "first shared"),
    "and the head in one, static_graph": ({"static_graph": True}, True, "first shared"),
    "one block in three, static_graph and find_unused": ({"static_graph": True, "find_unused_parameters": True},
                                                         False, "first shared"),
    "a gradient penalty through the outputs": ({"find_unused_parameters": True}, False, "penalty"),
    "a nested backward from a hook on the output": ({}, False, "nested"),
    "and the loss not made from the outputs": ({}, False, "nested kept"),
    "a nested backward from a module's backward pre-hook": ({}, False, "nested module"),
    "a nested backward through another output": ({}, False, "nested aux"),
}


def case_usage_like_torch(rank, world, scenario, steps=3):
    """RingDDP and torch DDP through one usage scenario (USAGE_SCENARIOS), 3 steps each:
    the gradients per step (None where torch leaves None) and the parameters after."""
    import copy
    import io

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp import RingDDP

    kwargs, ckpt, how = USAGE_SCENARIOS[scenario]
    out = {}
    for name, cls in (("ringdp", RingDDP), ("torch", DDP)):
        torch.manual_seed(0)
        net = (_SharedBlock(ckpt) if "shared" in how else _NestedHook("kept" in how, "module" in how, "aux" in how) if "nested" in how
               else _Usage(ckpt))
        if "frozen" in how:  # (the head's checkpoint then runs first in backward)
            net.unused.requires_grad_(False)
            net.aux.requires_grad_(False)
        as_torch = name == "torch" and "torch: find_unused" in scenario
        kw = dict({"find_unused_parameters": True} if as_torch else kwargs)
        if "world" in how:
            kw["process_group"] = dist.group.WORLD
        m = cls(net, **kw)
        if "set_static" in how and not as_torch:
            m._set_static_graph()
        if "deepcopy" in how:
            m = copy.deepcopy(m)
        if "pickle" in how:
            buf = io.BytesIO()
            torch.save(m, buf)
            saved = [buf.getvalue()]
            dist.broadcast_object_list(saved, src=0)  # (rank 0's copy on every rank)
            m = torch.load(io.BytesIO(saved[0]), weights_only=False)
        if "posthook" in how:  # (scales the local gradient, before the reduction: torch's reducer runs last)
            def scale(t, f=rank + 2.0):
                if t.grad is not None:  # (torch's DDP runs it for an ignored output's parameters too)
                    t.grad.mul_(f)

            for p in m.module.parameters():
                p.register_post_accumulate_grad_hook(scale)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        grads = []
        for step in range(steps):
            opt.zero_grad()
            x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1) + step
            if "sync_then_nosync" in how:
                a, aux = m(x)
                with m.no_sync():
                    b, aux_b = m(x + 1)
                (a.square().sum() + aux.sum() + b.sum() + aux_b.sum()).backward()
            elif "penalty" in how:  # (torch.autograd.grad through the outputs first: WGAN-GP)
                x.requires_grad_()
                a, _ = m(x)
                g, = torch.autograd.grad(a.sum(), x, create_graph=True)
                (a.square().sum() + (g.norm(dim=1) - 1).square().sum()).backward()
            elif "nested" in how:
                a = m(x)
                (m.module.kept if "kept" in how else a[0] if "aux" in how else a).square().sum().backward()
            elif "twice" in how:
                a, _ = m(x)
                a.square().sum().backward()
                m.module.head.weight.square().sum().backward()  # no forward: accumulates locally
            else:
                a, aux = m(x)
                (a.square().sum() + (aux.sum() if "both" in how else 0)).backward()
            grads.append({n: None if p.grad is None else p.grad.clone() for n, p in m.module.named_parameters()})
            opt.step()
        out[name] = {"grads": grads, "params": {n: p.detach().clone() for n, p in m.module.named_parameters()},
                     "rank": getattr(m, "rank", rank)}
    return out


class _CheckpointedBody(nn.Module):
    def __init__(self, sparse=False, keep=False):
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=True) if sparse else None
        self.l1, self.l2, self.unused = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2)
        self.keep, self.kept = keep, None

    def forward(self, x):
        import torch.utils.checkpoint as cp

        h = self.emb(x).sum(1) if self.emb is not None else x
        out = cp.checkpoint(lambda t: self.l2(torch.tanh(self.l1(t))), h, use_reentrant=True)
        if self.keep:  # (the result kept in an attribute, none returned)
            self.kept = out
            return None
        return out


class _PartsBlock(nn.Module):
    """A layer whose weight is used again inside a reentrant checkpoint: its gradient comes in
    two parts (static_graph), and a layer after it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        import torch.utils.checkpoint as cp

        h = torch.tanh(self.a(x))
        h = cp.checkpoint(lambda t: torch.tanh(t + (t @ self.a.weight).sum(1, keepdim=True)), h, use_reentrant=True)
        return self.b(h)


def case_static_parts_join(rank, world):
    """static_graph whose first iteration a rank spends joined (no data): it learns the other
    ranks' gradient parts and unused parameters from the usage map, so the steps after are
    averaged (its own first backward would otherwise take a gradient's first part as final)."""
    import copy

    from ringdp import RingDDP

    torch.manual_seed(0)
    local = _PartsBlock()
    m = RingDDP(copy.deepcopy(local), static_graph=True)
    with m.join():
        for s in range(2 if rank == 0 else 0):
            m(torch.full((2, 3), 1.0 + s)).square().sum().backward()
    got, want = [], []
    for step in range(2):
        x = torch.full((2, 3), rank + 1.0 + step) + torch.arange(3.0)
        m.zero_grad()
        m(x).square().sum().backward()
        got.append([p.grad.clone() for p in m.parameters()])
        local.zero_grad()
        local(x).square().sum().backward()
        mine = [p.grad.clone() for p in local.parameters()]
        for g in mine:
            dist.all_reduce(g)
            g /= world
        want.append(mine)
    return got, want


def case_usage_edges(rank, world):
    """(a) a sparse embedding before a reentrant checkpoint: averaged as by torch DDP; (b) a
    backward that ends inside a reentrant checkpoint with a parameter that got no gradient: it
    raises naming it, as without a checkpoint, also when the loss is not made from the forward's
    outputs (RingDDP cannot see where that backward begins: the checkpoint hands the end over to
    the outer backward); (c) a nested backward whose gradients are the only ones, the loss not
    made from the outputs, a parameter unused: started from a tensor hook, its end hands over
    to the end of the hook's node, so the backward raises naming the parameter; started from
    a module's backward pre-hook (a post hook of a node) it can hand over only to a later
    gradient hook, and none comes, so the next forward raises, and every later one, as torch
    DDP's "expected to have finished reduction"; under static_graph (the unused parameter
    learnt) every step averages; (d) static_graph whose first iteration runs under no_sync: a
    parameter never used keeps grad None; (e) a loss in two parts, two backwards after one
    forward, with find_unused_parameters or static_graph: the second raises naming a parameter
    the first counted unused (its gradient stayed local, silently)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp import RingDDP

    out = {}
    for name, cls in (("ringdp", RingDDP), ("torch", DDP)):
        torch.manual_seed(0)
        net = _CheckpointedBody(sparse=True)
        net.unused.requires_grad_(False)
        m = cls(net)
        m(torch.tensor([[rank, 3], [4 + rank, 9]])).square().sum().backward()
        out[("sparse", name)] = [p.grad.to_dense().clone() if p.grad is not None else None
                                 for p in m.module.parameters() if p.requires_grad][:3]
    x = torch.full((2, 3), float(rank), requires_grad=True)  # (a reentrant checkpoint needs one)
    torch.manual_seed(0)
    m = RingDDP(_CheckpointedBody())
    try:
        m(x).sum().backward()
        out["no gradient"] = None
    except RuntimeError as e:
        out["no gradient"] = str(e)
    torch.manual_seed(0)
    m = RingDDP(_CheckpointedBody(keep=True))
    m(x)
    try:
        m.module.kept.sum().backward()
        out["not from the outputs"] = None
    except RuntimeError as e:
        out["not from the outputs"] = str(e)
    for via in ("tensor", "module", "static"):
        torch.manual_seed(0)
        net = _NestedHook(keep=True, module=via == "module")
        net.trunk.requires_grad_(False)
        net.head.requires_grad_(False)
        net.unused = nn.Linear(2, 2)
        m = RingDDP(net, static_graph=via == "static")
        said = []
        for step in range(3):
            try:
                m(x)
            except RuntimeError as e:
                said.append(f"forward: {e}")
                continue
            try:
                net.kept.sum().backward()
                side = [p.grad for p in net.side.parameters()]
                w, b = (p.detach().clone().requires_grad_() for p in net.side.parameters())
                want = torch.autograd.grad(nn.functional.linear(net.x, w, b).square().sum(), (w, b))
                for g in want:  # (the reference: this rank's own side gradient, averaged)
                    dist.all_reduce(g)
                    g /= world
                said.append(f"backward: averaged {all(torch.allclose(a, b) for a, b in zip(side, want))}")
            except RuntimeError as e:
                said.append(f"backward: {e}")
            m.zero_grad()
        out[f"nested, nothing after, {via}"] = said
    torch.manual_seed(0)
    m = RingDDP(_Usage(), static_graph=True)
    for step in range(3):
        ctx = m.no_sync() if step == 0 else contextlib.nullcontext()
        with ctx:
            a, aux = m(torch.ones(2, 3) * (rank + step))
        (a.sum() + aux.sum()).backward()
    out["static unused grad"] = [p.grad for p in m.module.unused.parameters()]
    for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
        torch.manual_seed(0)
        m = RingDDP(_Usage(), **kw)
        out_, aux = m(torch.ones(2, 3) * (rank + 1))
        aux.square().sum().backward(retain_graph=True)  # (trunk and aux; head not)
        try:
            out_.square().sum().backward()
            out[f"split backward {kw}"] = None
        except RuntimeError as e:
            out[f"split backward {kw}"] = str(e)
    return out


def ref_local_grad(ref, x, y, micro, per_rank):
    """Gradient of rank-local micro-batches (pre-step reference weights are the same as
    the RingDDP model's at this point of the step)."""
    import copy

    m = copy.deepcopy(ref)
    m.zero_grad()
    for k in range(x.shape[0] // per_rank):
        xs, ys = x[k * per_rank:(k + 1) * per_rank], y[k * per_rank:(k + 1) * per_rank]
        (((m(xs) - ys) ** 2).mean() / micro).backward()
    return [p.grad for p in m.parameters()]


def _branchy_reference_step(ref, ropt, x, y, world):
    """One step of the single-process Branchy on the full batch: rank 0's shard goes
    through b, the other ranks' do not."""
    ropt.zero_grad()
    out = torch.cat([ref(shard(x, r, world), use_b=(r == 0)) for r in range(world)])
    ((out - y) ** 2).mean().backward()
    ropt.step()


def case_unused(rank, world, find_unused=True, static_graph=False, steps=5, d=4):
    """Rank 0 uses `b`, the others do not; nobody uses `never`. Above world 2 the weights
    go one-shot at d=4 and take the ring at d=256 (256 KiB, over policy's 128 KiB one-shot
    threshold there); at world 2 every all-reduce takes the ring. "paths": what moved the
    steps' data (flight record)."""
    import ringdp
    from ringdp.ddp import RingDDP

    ref = build(Branchy, 0, d=d)
    ddp = RingDDP(build(Branchy, 0 if rank == 0 else 50 + rank, d=d), find_unused_parameters=find_unused,
                  static_graph=static_graph)
    comm = ringdp.get_communicator()
    set_up = max((rec["seq"] for rec in comm.flight_record()), default=-1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    diffs, never_none, b_grad_defined = [], [], []
    for s in range(steps):
        x, y = batch(s, world * 3, d_in=d, d_out=d)
        opt.zero_grad()
        try:
            ((ddp(shard(x, rank, world), use_b=(rank == 0)) - shard(y, rank, world)) ** 2).mean().backward()
        except RuntimeError as e:
            return {"error": str(e)}
        never_none.append(ddp.module.never.weight.grad is None and ddp.module.never.bias.grad is None)
        b_grad_defined.append(ddp.module.b.weight.grad is not None)
        opt.step()
        _branchy_reference_step(ref, ropt, x, y, world)
        diffs.append(max_diff(params_of(ddp.module), params_of(ref)))
    paths = sorted({rec["path"] for rec in comm.flight_record() if rec["seq"] > set_up})
    return {"diffs": diffs, "never_none": never_none, "b_grad_defined": b_grad_defined,
            "params": params_of(ddp.module), "paths": paths}


def case_join(rank, world, counts, divide_by_initial_world_size=True, per_rank=3, unused=False, hook=None,
              throw=False):
    """Rank r trains on counts[r] batches inside join(); compare with a reference that
    replays the same global steps. unused: the Branchy model with find_unused_parameters
    (rank 0 uses `b`, rank 1 does not). hook: a comm hook from ringdp.comm_hooks."""
    from ringdp import comm_hooks

    if unused:
        ddp, ref = init_ddp(Branchy, rank, ddp_kwargs={"find_unused_parameters": True})
        d = 4
        fwd = lambda m, x, r: m(x, use_b=(r == 0))  # noqa: E731
    else:
        ddp, ref = init_ddp(MLP, rank)
        d = 8
        fwd = lambda m, x, r: m(x)  # noqa: E731
    if hook:
        ddp.register_comm_hook(None, getattr(comm_hooks, hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    b_grad_defined = []  # unused: per step of this rank, whether `b` has a gradient
    try:
        with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size, throw_on_early_termination=throw):
            for s in range(counts[rank]):
                x, y = batch(s, world * per_rank, d_in=d, d_out=4)
                opt.zero_grad()
                ((fwd(ddp, shard(x, rank, world), rank) - shard(y, rank, world)) ** 2).mean().backward()
                if unused:
                    b_grad_defined.append(ddp.module.b.weight.grad is not None)
                opt.step()
    except RuntimeError as e:
        if not throw:
            raise
        return {"error": str(e)}
    for s in range(max(counts)):
        x, y = batch(s, world * per_rank, d_in=d, d_out=4)
        active = [r for r in range(world) if counts[r] > s]
        ropt.zero_grad()
        loss = sum(((fwd(ref, shard(x, r, world), r) - shard(y, r, world)) ** 2).mean() for r in active)
        loss = loss / (world if divide_by_initial_world_size else len(active))
        loss.backward()
        ropt.step()
    # training goes on normally after the join context
    x, y = batch(99, world * per_rank, d_in=d, d_out=4)
    opt.zero_grad()
    ((fwd(ddp, shard(x, rank, world), rank) - shard(y, rank, world)) ** 2).mean().backward()
    opt.step()
    ropt.zero_grad()
    (sum(((fwd(ref, shard(x, r, world), r) - shard(y, r, world)) ** 2).mean() for r in range(world)) / world).backward()
    ropt.step()
    return {"diff": max_diff(params_of(ddp.module), params_of(ref)), "params": params_of(ddp.module),
            "layout": ddp.bucket_layout, "b_grad_defined": b_grad_defined}


def case_state_dict(rank, world, tmpdir):
    from ringdp.ddp import RingDDP

    ddp, _ = init_ddp(MLP, rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(2):
        x, y = batch(s, world * 2)
        opt.zero_grad()
        ((ddp(shard(x, rank, world)) - shard(y, rank, world)) ** 2).mean().backward()
        opt.step()
    sd = ddp.state_dict()
    path = os.path.join(tmpdir, "ckpt.pt")
    if rank == 0:
        torch.save(sd, path)
    dist.barrier()
    loaded = torch.load(path)
    plain = build(MLP, 123)
    plain.load_state_dict({k.removeprefix("module."): v for k, v in loaded.items()})
    x, _ = batch(7, 5)
    same_out = torch.equal(plain(x), ddp.module(x))
    # and back into a fresh RingDDP (through its own keys)
    again = RingDDP(build(MLP, 321 + rank))
    again.load_state_dict(loaded)
    same_again = all(torch.equal(a, b) for a, b in zip(again.module.parameters(), ddp.module.parameters()))
    return {"keys": sorted(sd), "plain_keys": sorted(plain.state_dict()), "same_out": same_out,
            "same_again": same_again}


def case_mismatch(rank, world, kind):
    from ringdp.ddp import RingDDP

    if kind == "shape":
        m = MLP(d_hidden=16 if rank == 0 else 17)
    elif kind == "extra":
        m = MLP(layers=3 if rank == 0 else 4)
    elif kind == "dtype":
        m = MLP().to(torch.float32 if rank == 0 else torch.float64)
    else:
        raise ValueError(kind)
    try:
        RingDDP(m)
    except Exception as e:
        err = (type(e).__name__, str(e), isinstance(e, RuntimeError))
    else:
        err = None
    # the group still works afterwards (no half-finished collective left behind)
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return {"error": err, "after": t.item()}


def case_trace(rank, world, tmpdir, steps=4):
    os.environ["RINGDP_TRACE"] = os.path.join(tmpdir, "trace.json")
    try:
        ddp, _ = init_ddp(MLP, rank, ddp_kwargs={"bucket_cap_mb": 0.0008}, d_hidden=64, layers=4)
    finally:
        del os.environ["RINGDP_TRACE"]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        x, y = batch(s, world * 4)
        opt.zero_grad()
        ((ddp(shard(x, rank, world)) - shard(y, rank, world)) ** 2).mean().backward()
        opt.step()
    path = ddp.flush_trace()
    return {"path": str(path), "summary": ddp.trace_summary(), "n_buckets": len(ddp.reducer.buckets)}


def case_trace_written_when_freed(rank, world, tmpdir):
    """`def main(): model = RingDDP(...)`: the trace file is written when the RingDDP goes away
    (here, when train() returns), not only at exit (the pool's workers live on)."""
    from ringdp.ddp import RingDDP

    def train():
        ddp = RingDDP(build(MLP, 0), trace=os.path.join(tmpdir, "freed.json"))
        for s in range(2):
            x, y = batch(s, world * 2)
            ((ddp(shard(x, rank, world)) - shard(y, rank, world)) ** 2).mean().backward()
        return ddp._trace.tracer.path

    path = train()
    # The last reference may go on ringdp's worker thread a moment after train() returned:
    # a bucket's future keeps its done-callbacks (the trace's observer among them) until the
    # worker lets the future go, after it woke the waiter. Written before exit is the point.
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(path) as f:
        return {"path": str(path), "steps": json.load(f)["ringdp_summary"]["steps"]}


def case_trace_subgroups(rank, world, tmpdir):
    """Each rank is rank 0 of a one-rank group: the trace files are named by the global rank
    (and the group), so neither overwrites the other's."""
    from ringdp.comm import _group_key
    from ringdp.ddp import RingDDP

    singles = [dist.new_group([r]) for r in range(world)]
    ddp = RingDDP(build(MLP, 0, d_hidden=8 + rank), process_group=singles[rank],
                  trace=os.path.join(tmpdir, "sub.json"))
    for s in range(2 + rank):  # a different number of steps per rank: whose file is it?
        x, y = batch(s, 2)
        ((ddp(x) - y) ** 2).mean().backward()
    path = ddp.flush_trace()
    dist.barrier()
    with open(path) as f:
        summary = json.load(f)["ringdp_summary"]
    return {"path": str(path), "steps": summary["steps"], "rank": summary["rank"],
            "group": _group_key(singles[rank])}


class ReturnsParam(nn.Module):
    """The forward returns a parameter (a leaf) beside its output, as uncertainty weighting
    does (the loss uses log_var)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log_var = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.lin(x), self.log_var


def case_trace_leaf_output_hooks(rank, world, tmpdir, steps=20):
    """The trace's backward-start hook goes on output tensors of this step only, never on a
    leaf returned by forward (its hooks would pile up, all run by every backward)."""
    from ringdp.ddp import RingDDP

    ddp = RingDDP(build(ReturnsParam, 0), trace=os.path.join(tmpdir, "leaf.json"))
    counts = []
    for s in range(steps):
        y, lv = ddp(torch.randn(2, 4))
        (y.sum() * torch.exp(-lv) + lv).backward()
        counts.append(len(ddp.module.log_var._backward_hooks or {}))
    return {"counts": counts, "steps": ddp.trace_summary()["steps"]}


class RankBuffers(nn.Module):
    """A rank-dependent buffer that forward updates, and a shared and a rank-local layer."""

    def __init__(self, rank, ragged=False):
        super().__init__()
        self.shared = nn.Linear(2, 2)
        self.local = nn.Linear(2, 2)
        self.register_buffer("count", torch.full((1,), float(rank)))
        self.register_buffer("local_buf", torch.full((2,), float(10 + rank)))
        if ragged:  # of a rank-dependent shape (when it is ignored)
            self.register_buffer("extra", torch.zeros(rank + 1))

    def forward(self, x):
        self.count += 1
        return self.shared(x) + self.local(x)


def _wrap_both(rank, kwargs, ignore=()):
    """torch DDP and RingDDP around the same rank-dependent model (seed per rank), with
    `ignore` set as torch's _set_params_and_buffers_to_ignore_for_model sets it."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp.ddp import RingDDP

    out = []
    for wrap in (DDP, RingDDP):
        torch.manual_seed(rank)
        net = RankBuffers(rank, ragged="extra" in ignore)
        if ignore:
            DDP._set_params_and_buffers_to_ignore_for_model(net, list(ignore))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13: broadcast_buffers is deprecated
            out.append(wrap(net, **kwargs))
    return out


def _state(m):
    return {k: v.detach().clone() for k, v in m.module.state_dict().items()}


def case_buffers_like_torch(rank, world, kwargs):
    """RingDDP's buffers and parameters at construction and after forwards, as torch DDP's
    (broadcast_buffers / forward_sync_buffers / init_sync), and what will_sync_module_buffers()
    says before each forward (the second forward runs under no_grad: the third syncs nothing)."""
    res = {}
    for tag, m in zip(("torch", "ring"), _wrap_both(rank, kwargs)):
        states, will = [_state(m)], []
        for s in range(3):
            will.append(m.will_sync_module_buffers())
            with torch.set_grad_enabled(s != 1):
                m(torch.full((1, 2), float(rank + s)))
            states.append(_state(m))
        res[tag], res[f"{tag} will sync"] = states, will
    return res


def case_ignored_params_like_torch(rank, world, steps=3):
    """module._ddp_params_and_buffers_to_ignore: those parameters and buffers are not checked,
    not broadcast and not averaged, by RingDDP as by torch DDP."""
    ignore = ("local.weight", "local.bias", "local_buf", "extra")
    tddp, ring = _wrap_both(rank, {}, ignore)
    res = {"layout": ring.bucket_layout, "init": {"torch": _state(tddp), "ring": _state(ring)}}
    for tag, m in (("torch", tddp), ("ring", ring)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        grads = []
        for s in range(steps):
            opt.zero_grad()
            m(torch.full((1, 2), float(rank + 1 + s))).pow(2).sum().backward()
            grads.append({n: p.grad.clone() for n, p in m.module.named_parameters()})
            opt.step()
        res[tag] = {"state": _state(m), "grads": grads}
    return res


def case_positional_like_torch(rank, world):
    """One real positional construction: the same names bound as torch DDP binds them; and
    torch's arguments that RingDDP does not support are a clear error naming them."""
    from ringdp.ddp import RingDDP

    torch.manual_seed(rank)
    net = RankBuffers(rank)
    m = RingDDP(net, None, None, 0, False, True, None, 1)  # ..., dim, broadcast_buffers, init_sync, group, cap
    out = {"dim": m.dim, "broadcast_buffers": m.broadcast_buffers, "count": m.module.count.item(),
           "layout": m.bucket_layout}
    errors = {}
    for name, value in (("mixed_precision", object()), ("skip_all_reduce_unused_params", True),
                        ("bucket_cap_mb_list", [1, 2]), ("device_mesh", object())):
        try:
            RingDDP(RankBuffers(rank), **{name: value})
        except NotImplementedError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def case_bad_trace_field(rank, world):
    from ringdp.ddp import RingDDP

    try:
        RingDDP(build(MLP, 0))
    except ValueError as e:
        return str(e)
    return None


class TwoBranch(nn.Module):
    """Two branches of the same shapes but different gradients; which one gets its
    gradients first depends on the order the forward computed them in."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(8, 8)
        self.q = nn.Linear(8, 8)

    def forward(self, x, q_first=False):
        # autograd runs the later-created node first: the branch computed second gets its
        # gradients first
        if q_first:
            b = self.q(torch.tanh(x))
            a = self.p(x)
        else:
            a = self.p(x)
            b = self.q(torch.tanh(x))
        return a + 2 * b


def case_rank_order(rank, world, steps=4):
    """Ranks see different gradient-ready orders; rank 0's must be adopted by all, and
    buckets reduced in the same order everywhere."""
    from ringdp.ddp import RingDDP

    ddp = RingDDP(build(TwoBranch, 0), bucket_cap_mb=1e-9)
    ref = build(TwoBranch, 0)
    ready_orders, diffs = [], []
    for s in range(steps):
        x, y = batch(s, world * 2, d_out=8)
        ddp.zero_grad()
        ((ddp(shard(x, rank, world), q_first=(rank == 1)) - shard(y, rank, world)) ** 2).mean().backward()
        ref.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        diffs.append(max_diff([p.grad for p in ddp.parameters()], [p.grad for p in ref.parameters()]))
        if s == 0:
            ready_orders.append([ddp.reducer.names[i] for i in ddp.reducer.ready_order])
    return {"layout": ddp.bucket_layout, "ready_order": ready_orders[0], "diffs": diffs,
            "grads": [p.grad.clone() for p in ddp.parameters()]}


def case_groups(rank, world, steps=5):
    """World 3: RingDDP over the subgroup {1, 2} (group rank 0 is global rank 1), and over
    a one-rank group (no communication at all)."""
    from ringdp.ddp import RingDDP

    sub = dist.new_group([1, 2])
    singles = [dist.new_group([r]) for r in range(world)]
    out = {}
    # one-rank group: RingDDP must train exactly like the plain model
    solo = RingDDP(build(MLP, 0), process_group=singles[rank])
    ref = build(MLP, 0)
    opt, ropt = torch.optim.SGD(solo.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(steps):
        x, y = batch(s, 4)
        for m, o in ((solo, opt), (ref, ropt)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    out["solo_diff"] = max_diff(params_of(solo.module), params_of(ref))
    if rank in (1, 2):
        grank = rank - 1
        ddp = RingDDP(build(MLP, 0 if grank == 0 else 77), process_group=sub)
        ref = build(MLP, 0)
        opt, ropt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for s in range(steps):
            x, y = batch(s, 2 * 4)
            opt.zero_grad()
            ((ddp(shard(x, grank, 2)) - shard(y, grank, 2)) ** 2).mean().backward()
            opt.step()
            ropt.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            ropt.step()
        out["sub_diff"] = max_diff(params_of(ddp.module), params_of(ref))
        out["params"] = params_of(ddp.module)
    dist.barrier()
    return out


# ============================================================== tests
def _check_train(res, tol):
    for r, out in enumerate(res):
        assert out["initial_diff"] == 0.0, f"rank {r} did not start from rank 0's parameters"
        assert len(out["diffs"]) >= 5
        assert max(out["diffs"]) < tol, f"rank {r}: max |RingDDP - reference| per step {out['diffs']}"
    for r in range(1, len(res)):
        for a, b in zip(res[0]["params"], res[r]["params"]):
            assert torch.equal(a, b), f"parameters of rank {r} are not bitwise equal to rank 0's"
        assert res[r]["layouts"] == res[0]["layouts"], "bucket layouts differ across ranks"


IN_GRAD = {"RINGDP_DDP_IN_GRAD_MIN_BYTES": "1"}  # every gradient reduced in its .grad


def test_mlp_matches_single_process(pool):
    res = pool.run(case_train, model="mlp")
    _check_train(res, 1e-5)
    assert all(all(flags) for flags in res[0]["grads_registered"]) is False  # .grad are ordinary tensors


@pytest.mark.parametrize("model", ["mlp", "tied"])
def test_reduced_in_grad(pool, model):
    res = pool.run(case_train, model=model, env=IN_GRAD)
    _check_train(res, 1e-5)
    assert all(len(b) == 1 for b in res[0]["layouts"][-1])  # one gradient per bucket
    for out in res:  # reduced in .grad: the buckets never needed storage of their own
        assert out["in_grad_storage"] and not any(out["in_grad_storage"])


def test_default_buckets_several_and_rebuilt(pool):
    # ~1.1 MiB of parameters: the 1 MiB first bucket splits them
    res = pool.run(case_train, model="bigmlp", steps=5)
    _check_train(res, 1e-5)
    assert res[0]["n_buckets"] >= 2
    first = res[0]["layouts"][0]
    # reverse parameter order: the first bucket starts with the last layer
    assert first[0][0] == "layers.3.bias"


def test_tied_and_shared_weights(pool):
    res = pool.run(case_train, model="tied")
    _check_train(res, 1e-5)
    names = [n for b in res[0]["layouts"][0] for n in b]
    assert names.count("emb.weight") == 1 and "out.weight" not in names  # shared once


def test_tiny_buckets_one_parameter_each(pool):
    res = pool.run(case_train, model="mlp", ddp_kwargs={"bucket_cap_mb": 1e-9})
    _check_train(res, 1e-5)
    assert all(len(b) == 1 for b in res[0]["layouts"][-1])
    assert res[0]["n_buckets"] == 6


def test_without_overlap_same_result(pool):
    res = pool.run(case_train, model="mlp", ddp_kwargs={"overlap": False, "bucket_cap_mb": 1e-9})
    _check_train(res, 1e-5)


def test_one_huge_bucket(pool):
    res = pool.run(case_train, model="bigmlp", ddp_kwargs={"bucket_cap_mb": 1024}, steps=5)
    _check_train(res, 1e-5)
    assert res[0]["n_buckets"] == 1


@pytest.mark.parametrize("view, power_sgd", [(False, False), (True, False), (True, True)])
def test_gradient_layouts_like_torch(pool, view, power_sgd):
    """Each parameter's bucket slot follows its layout when it is dense (channels_last conv
    weights, a transposed weight), as torch's reducer lays out its bucket views, and is
    row-major when it is not (a weight with gaps): the .grad RingDDP leaves has torch DDP's
    strides, with and without gradient_as_bucket_view, and training matches torch's. Before,
    RingDDP's bucket-view .grad were row-major (a strided copy of every conv gradient).
    power_sgd: torch's PowerSGD hook, which .view()s bucket.gradients() (row-major parts of
    the buffer, as torch's GradBucket gives): it runs, ranks stay bitwise equal (its
    compression depends on the bucketing, so not compared with torch's values)."""
    res = pool.run(case_layouts_like_torch, view=view, power_sgd=power_sgd)
    for r, out in enumerate(res):
        strides = out["param_strides"]
        assert strides["tw"] == (1, 8) and strides["gap"] == (10, 2) and strides["c2.weight"] == (54, 1, 18, 6)
        for s, row in enumerate(out["steps"]):
            assert row["ring"] == row["torch"], (r, s, row)
            assert row["diff"] < (1.0 if power_sgd else 1e-5), (r, s, row["diff"])
            for a, b in zip(row["params"], res[0]["steps"][s]["params"]):
                assert torch.equal(a, b), f"rank {r} step {s}: parameters differ from rank 0's"
            # dense parameters keep their own layout; the one with gaps is row-major in both
            got = dict(zip(out["names"], row["ring"]))
            assert got == dict(strides, gap=(5, 1)), (r, s, got)
        if view:
            assert all(out["is_slot"]), out["is_slot"]


@pytest.mark.parametrize("view", [False, True])
def test_bucket_rebuild_follows_ready_order(pool, view):
    # with views, the rebuild moves this step's gradients into the new buckets
    res = pool.run(case_train, model="reordered", ddp_kwargs={"bucket_cap_mb": 1e-9,
                                                                 "gradient_as_bucket_view": view})
    _check_train(res, 1e-5)
    before, after = res[0]["layouts"][0], res[0]["layouts"][1]
    assert before[0] == ["l3.bias"]  # reverse registration order at first
    assert after[0][0].startswith("l1.")  # l1 is applied last, so its gradients come first
    assert res[0]["layouts"][1:] == [after] * (len(res[0]["layouts"]) - 1)  # rebuilt once


def test_rank0_ready_order_adopted(pool):
    res = pool.run(case_rank_order)
    assert res[0]["ready_order"] != res[1]["ready_order"], "the case should give ranks different orders"
    assert res[0]["layout"] == res[1]["layout"]
    assert [b[0] for b in res[0]["layout"]] == res[0]["ready_order"]
    for out in res:
        assert max(out["diffs"]) < 1e-5, out["diffs"]  # averaged gradients = full-batch gradients
    for a, b in zip(res[0]["grads"], res[1]["grads"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["plain", "keep_grad", "view", "tiny_in_grad", "fp16_hook"])
def test_complex_parameters(pool, variant):
    """Complex parameters (reduced as their real views, as torch's DDP does) beside real ones:
    the single-process run on the full batch, bitwise identical ranks; a hook sees a real bucket.
    keep_grad: zero_grad(set_to_none=False), so the write-back copies into the complex .grad."""
    kwargs = {"view": {"gradient_as_bucket_view": True}, "tiny_in_grad": {"bucket_cap_mb": 1e-9}}.get(variant)
    res = pool.run(case_train, model="complex", ddp_kwargs=kwargs, steps=5, set_to_none=variant != "keep_grad",
                   env=IN_GRAD if variant == "tiny_in_grad" else None,
                   hook="fp16_compress_hook" if variant == "fp16_hook" else None)
    _check_train(res, 2e-3 if variant == "fp16_hook" else 1e-5)
    layout = res[0]["layouts"][-1]
    complex_names = {"c1.weight", "c1.bias", "gain", "c2.weight", "c2.bias"}
    for b in layout:  # complex and real apart
        assert set(b) <= complex_names or not set(b) & complex_names, layout
    if variant == "view":
        assert all(all(out["grad_is_view"]) for out in res)
    if variant == "tiny_in_grad":
        assert all(len(b) == 1 for b in layout) and not any(res[0]["in_grad_storage"])
    if variant == "fp16_hook":
        assert {dtype for _, dtype in res[0]["hook_calls"]} == {torch.float32}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view(pool, set_to_none):
    res = pool.run(case_train, model="mlp", ddp_kwargs={"gradient_as_bucket_view": True},
                   set_to_none=set_to_none)
    _check_train(res, 1e-5)
    for out in res:
        assert out["grad_is_view"] and all(out["grad_is_view"])
        assert all(all(flags) for flags in out["grads_registered"]), "grads should live in registered memory"


@pytest.mark.parametrize("dtype,hook,tol", [
    ("float32", "fp16_compress_hook", 2e-3),
    ("float32", "bf16_compress_hook", 2e-2),
    ("bfloat16", "bf16_compress_hook", 3e-2),
    ("float16", "fp16_compress_hook", 5e-3),
])
def test_compression_hooks(pool, dtype, hook, tol):
    res = pool.run(case_train, model="mlp", dtype=dtype, hook=hook, steps=5)
    _check_train(res, tol)
    for out in res:
        assert len(out["hook_calls"]) == 5 * out["n_buckets"]


def test_comm_hook_result_of_the_wrong_size_is_clear(pool):
    res = pool.run(case_hook_result_wrong_size)
    for r, (err, idle, diffs, _) in enumerate(res):
        assert err is not None and f"rank {r}" in err and "bucket" in err and "elements" in err, err
        assert idle, "reductions still in flight after the failed backward"
        assert len(diffs) == 2 and max(diffs) < 1e-5, diffs
    for a, b in zip(res[0][3], res[1][3]):
        assert torch.equal(a, b)


def test_freed_without_the_cyclic_gc(pool):
    for in_grad, freed in pool.run(case_freed_without_gc):
        assert in_grad >= 1 and freed


def test_dtype_changed_after_wrapping_is_clear(pool):
    res = pool.run(case_dtype_changed_after_wrapping)
    for r, (errors, _, untouched, there_and_back, set_anew) in enumerate(res):
        assert len(errors) == 5
        for key, err in errors.items():
            assert err is not None and f"rank {r}" in err and "after it was wrapped" in err, (key, err)
        assert "'b.weight'" in errors["a part"] and "torch.float64" in errors["a part"], errors["a part"]
        for step in there_and_back + set_anew:
            for g, u in zip(step, untouched):
                assert torch.equal(g, u)
    for a, b in zip(res[0][1], res[1][1]):
        assert torch.equal(a, b)
    for a, b in zip(res[0][2], res[1][2]):  # (averaged: the same on every rank)
        assert torch.equal(a, b)


def test_allreduce_hook_equals_default(pool):
    res = pool.run(case_train, model="mlp", hook="allreduce_hook")
    _check_train(res, 1e-5)


def _assert_states_close(r, ring, ref):
    for k in ring:
        a, b = ring[k], ref[k]
        if a.dtype.is_floating_point:
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), f"rank {r} {k}: {(a - b).abs().max()}"
        else:
            assert torch.equal(a, b), f"rank {r} {k}"


def test_convnet_batchnorm_matches_torch_ddp(pool):
    res = pool.run(case_convbn_vs_torch)
    for r, out in enumerate(res):
        assert out["ring"].keys() == out["torch"].keys()
        _assert_states_close(r, out["ring"], out["torch"])
    # buffers were broadcast from rank 0 before each forward, then updated locally: rank 1's
    # running stats are rank 0's previous ones plus one local update, so they differ from a
    # run without broadcast; the comparison with torch DDP above checks exactly that.
    assert not torch.equal(res[0]["ring"]["bn1.running_mean"], res[1]["ring"]["bn1.running_mean"])


@pytest.mark.parametrize("view,env", [(False, None), (True, None), (False, IN_GRAD)])
def test_no_sync_accumulation_equals_large_batch(pool, view, env):
    res = pool.run(case_no_sync, gradient_as_bucket_view=view, env=env)
    for r, out in enumerate(res):
        assert max(out["diffs"]) < 1e-5, out["diffs"]
        assert max(out["nosync_local"]) < 1e-6, "no_sync should leave the local gradients alone"
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("find_unused", [False, True])
def test_no_grad_forward_between_forward_and_backward(pool, find_unused):
    res = pool.run(case_no_grad_forward_between, find_unused=find_unused)
    for r, (diff, _) in enumerate(res):
        assert diff < 1e-6, f"rank {r}: gradients not averaged (max diff {diff} from the full batch)"
    for a, b in zip(res[0][1], res[1][1]):
        assert torch.equal(a, b)


def test_parameter_used_only_under_no_sync_is_averaged_like_torch(pool):
    res = pool.run(case_used_only_under_no_sync)
    for out in res:
        for step in range(2):
            for g, t in zip(out[("ringdp", step)], out[("torch", step)]):
                torch.testing.assert_close(g, t, rtol=1e-6, atol=0)
    for step in range(2):  # the same averaged b on every rank (it differed before)
        assert torch.equal(res[0][("ringdp", step)][2], res[1][("ringdp", step)][2])


@pytest.mark.parametrize("scenario", list(USAGE_SCENARIOS))
def test_usage_like_torch(pool, scenario):
    """What torch DDP does, RingDDP does (each failed or differed before): an output the loss
    ignores (find_unused_parameters, static_graph: its parameters unused, grad None); a
    reentrant checkpoint around the last layer (finalize ran at the inner backward's end);
    static_graph with one (its first backward learns usage from the hooks); a synchronising
    forward followed by one under no_sync syncs the backward; a backward with no forward
    before it accumulates locally; a deep copy and a pickled wrapper reduce (a new Reducer); a
    post-accumulate-grad hook added after wrapping runs before the reduction; static_graph takes
    a gradient in parts (a block used in several reentrant checkpoints); a nested backward
    started from a tensor hook or a module's backward pre-hook, where the first gradients
    come (finalize ran at its end)."""
    res = pool.run(case_usage_like_torch, scenario=scenario)
    for r, out in enumerate(res):
        for step, (g, t) in enumerate(zip(out["ringdp"]["grads"], out["torch"]["grads"])):
            assert g.keys() == t.keys()
            for n in g:
                assert (g[n] is None) == (t[n] is None), (r, step, n, g[n], t[n])
                if g[n] is not None:
                    torch.testing.assert_close(g[n], t[n], rtol=1e-6, atol=1e-7, msg=f"rank {r} step {step} {n}")
        for n, v in out["ringdp"]["params"].items():
            torch.testing.assert_close(v, out["torch"]["params"][n], rtol=1e-6, atol=1e-7)
        assert out["ringdp"]["rank"] == r  # (a copy pickled on rank 0 is rank r's where loaded)
    if "second backward" not in scenario:  # (the local accumulation differs between ranks, as torch's)
        for n, v in res[0]["ringdp"]["params"].items():
            assert torch.equal(v, res[1]["ringdp"]["params"][n]), n


def test_static_graph_parts_learned_through_join(pool):
    for got, want in pool.run(case_static_parts_join):
        for g_step, w_step in zip(got, want):
            for g, w in zip(g_step, w_step):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_usage_edges(pool):
    res = pool.run(case_usage_edges)
    for r, out in enumerate(res):
        for g, t in zip(out[("sparse", "ringdp")], out[("sparse", "torch")]):
            torch.testing.assert_close(g, t, rtol=1e-6, atol=1e-7)
        for key in ("no gradient", "not from the outputs"):
            assert out[key] is not None and "received no gradient" in out[key], out[key]
            assert "unused.weight" in out[key] and "l1.weight" not in out[key], out[key]
        said = out["nested, nothing after, tensor"]
        assert all(w.startswith("backward: ") and "received no gradient" in w for w in said), said
        assert all("unused.weight" in w and "side.weight" not in w for w in said), said
        said = out["nested, nothing after, module"]
        assert said[0] == "backward: averaged False", said  # (the end never came)
        assert all(w.startswith("forward: ") and "expected to have finished reduction" in w for w in said[1:]), said
        assert all("unused.weight" in w and "side.weight" not in w for w in said[1:]), said
        assert out["nested, nothing after, static"] == ["backward: averaged True"] * 3, out
        assert out["static unused grad"] == [None, None], out["static unused grad"]
        for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
            said = out[f"split backward {kw}"]
            assert said is not None and "received a gradient in a backward after the synchronised" in said, said
            assert "'head." in said, said


def _check_unused(res):
    for r, out in enumerate(res):
        assert "error" not in out, out.get("error")
        assert max(out["diffs"]) < 1e-5, out["diffs"]
        assert all(out["never_none"]), "a parameter unused on every rank must keep grad None"
        assert all(out["b_grad_defined"]), "a parameter used on some rank gets the averaged gradient"
    for other in res[1:]:
        for a, b in zip(res[0]["params"], other["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("static_graph,env", [(False, None), (True, None), (False, IN_GRAD)])
def test_unused_parameters_with_flag(pool, static_graph, env):
    # with IN_GRAD, rank 0 reduces b's .grad in place while rank 1 reduces its zeroed bucket
    _check_unused(pool.run(case_unused, find_unused=not static_graph, static_graph=static_graph, env=env))


@pytest.mark.parametrize("d,path", [(4, "oneshot"), (256, "ring_staged")])
def test_unused_parameters_in_grad_one_shot_and_ring(d, path):
    """The in-grad buckets with a parameter used on rank 0 only, at world 3, where the
    small weights go one-shot and the large ones take the ring (at world 2 both take the
    ring): each path must see the same zeroed gradients on the ranks that did not use it."""
    res = values(run_ranks(case_unused, 3, True, False, 5, d, env=IN_GRAD))
    _check_unused(res)
    for r, out in enumerate(res):
        assert path in out["paths"], (r, out["paths"])  # (at d=256 the biases still go one-shot)


@pytest.mark.parametrize("kind,static_graph", [("dataclass", False), ("dict", False), ("dataclass", True)])
def test_unused_parameters_with_structured_outputs(pool, kind, static_graph):
    res = pool.run(case_structured_output, kind=kind, static_graph=static_graph)
    for diffs, _ in res:
        assert max(diffs) < 1e-5, diffs
    for a, b in zip(res[0][1], res[1][1]):
        assert torch.equal(a, b)


def test_unused_parameters_without_flag_explains(pool):
    res = pool.run(case_unused, find_unused=False, steps=1)
    for out in res:
        msg = out.get("error")
        assert msg is not None, "expected an error about unused parameters"
        assert "find_unused_parameters=True" in msg and "never.weight" in msg
    # the pool still works: a normal case afterwards
    _check_train(pool.run(case_train, model="mlp", steps=5), 1e-5)


@pytest.mark.parametrize("counts,divide_initial,env", [((3, 5), True, None), ((3, 5), False, None),
                                                      ((0, 2), True, None), ((3, 5), False, IN_GRAD)])
def test_join_uneven_inputs(pool, counts, divide_initial, env):
    res = pool.run(case_join, counts=counts, divide_by_initial_world_size=divide_initial, env=env)
    for r, out in enumerate(res):
        assert out["diff"] < 1e-5, f"rank {r}: {out['diff']}"
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)
    assert res[0]["layout"] == res[1]["layout"]


@pytest.mark.parametrize("unused,hook,tol", [(True, None, 1e-5), (False, "fp16_compress_hook", 2e-3)])
def test_join_with_unused_parameters_or_hook(pool, unused, hook, tol):
    res = pool.run(case_join, counts=(2, 4), unused=unused, hook=hook)
    for r, out in enumerate(res):
        assert out["diff"] < tol, f"rank {r}: {out['diff']}"
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)
    if unused:
        # `b` (rank 0's only) has a gradient while rank 0 trains, and none once rank 0 has
        # joined: a parameter no training rank uses keeps its gradient untouched, as without
        # join. (torch's DDP gives it a zero gradient there, which SGD's momentum then moves:
        # its joined rank adds its usage map of earlier steps, never reset, to the others'.)
        assert res[1]["b_grad_defined"] == [True, True, False, False], res[1]["b_grad_defined"]


def test_join_throw_on_early_termination(pool):
    res = pool.run(case_join, counts=(2, 4), throw=True)
    assert "exhausted" in res[0]["error"]  # rank 0 ran out first
    assert "exhausted" in res[1]["error"]  # and rank 1 is told so
    _check_train(pool.run(case_train, model="mlp", steps=5), 1e-5)  # the group still works


def test_join_convnet_batchnorm_matches_torch_ddp(pool):
    res = pool.run(case_convbn_vs_torch, join_counts=(2, 4))
    for r, out in enumerate(res):
        _assert_states_close(r, out["ring"], out["torch"])


def test_state_dict_round_trip(pool, tmp_path):
    res = pool.run(case_state_dict, tmpdir=str(tmp_path))
    for out in res:
        assert out["keys"] and all(k.startswith("module.") for k in out["keys"])
        assert [k.removeprefix("module.") for k in out["keys"]] == out["plain_keys"]
        assert out["same_out"] and out["same_again"]


@pytest.mark.parametrize("kind", ["shape", "extra", "dtype"])
def test_mismatched_model_raises(pool, kind):
    res = pool.run(case_mismatch, kind=kind, timeout=60)
    for out in res:
        assert out["error"] is not None, "a mismatched model must raise"
        name, msg, is_runtime = out["error"]
        assert is_runtime
        assert "rank 1" in msg and "rank 0" in msg
        assert "layers." in msg  # names the parameter
        assert out["after"] == 3.0


def test_trace_file_and_summary(pool, tmp_path):
    res = pool.run(case_trace, tmpdir=str(tmp_path))
    for r, out in enumerate(res):
        with open(out["path"]) as f:
            doc = json.load(f)
        assert out["path"].endswith(f"trace.rank{r}.json")
        names = [e["name"] for e in doc["traceEvents"]]
        assert names.count("backward") == 4
        nb = out["n_buckets"]
        assert nb >= 3
        for i in range(nb):
            assert names.count(f"bucket {i} ready") == 4
            assert names.count(f"all_reduce bucket {i}") == 4
            assert names.count(f"write back bucket {i}") == 4
        comm = [e for e in doc["traceEvents"] if e["name"].startswith("all_reduce bucket")]
        ready = {(e["name"], e["ts"]) for e in doc["traceEvents"] if e["name"].endswith(" ready")}
        assert all(e["dur"] >= 0 and e["args"]["submitted_us"] <= e["ts"] for e in comm)
        assert ready
        s = doc["ringdp_summary"]
        assert s == json.loads(json.dumps(out["summary"]))
        assert s["steps"] == 4 and len(s["per_step"]) == 4
        assert s["mean_comm_ms"] > 0
        assert 0.0 <= s["overlap_fraction"] <= 1.0
        assert s["mean_exposed_comm_ms"] >= 0


def test_subgroup_and_single_rank_group():
    res = values(run_ranks(case_groups, 3, timeout=120))
    for r, out in enumerate(res):
        assert out["solo_diff"] < 1e-6, f"rank {r}: RingDDP on a one-rank group differs from plain training"
    assert "sub_diff" not in res[0]
    for r in (1, 2):
        assert res[r]["sub_diff"] < 1e-5, f"rank {r}: {res[r]['sub_diff']}"
    for a, b in zip(res[1]["params"], res[2]["params"]):
        assert torch.equal(a, b)


def test_trace_written_when_the_ringddp_is_freed(pool, tmp_path):
    res = pool.run(case_trace_written_when_freed, tmpdir=str(tmp_path))
    for r, out in enumerate(res):
        assert out["path"].endswith(f"freed.rank{r}.json") and out["steps"] == 2


def test_trace_files_of_subgroups_named_by_global_rank(pool, tmp_path):
    res = pool.run(case_trace_subgroups, tmpdir=str(tmp_path))
    paths = [out["path"] for out in res]
    assert len(set(paths)) == len(res), f"ranks share a trace file: {paths}"
    for r, out in enumerate(res):
        assert out["path"].endswith(f"sub.rank{r}.{out['group']}.json")
        assert out["rank"] == r and out["steps"] == 2 + r  # its own file, written by itself
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(p) for p in paths)


def test_trace_hooks_no_leaf_output(pool, tmp_path):
    res = pool.run(case_trace_leaf_output_hooks, tmpdir=str(tmp_path))
    for out in res:
        assert out["steps"] == 20
        assert max(out["counts"]) <= 1 and out["counts"][-1] == out["counts"][0], out["counts"]


BUFFER_ARGS = [{}, {"broadcast_buffers": True}, {"broadcast_buffers": False}, {"forward_sync_buffers": False},
               {"forward_sync_buffers": True, "broadcast_buffers": False}, {"init_sync": False},
               {"init_sync": False, "broadcast_buffers": False}]


@pytest.mark.parametrize("kwargs", BUFFER_ARGS, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()) or "default")
def test_buffers_and_init_sync_like_torch(pool, kwargs):
    if "forward_sync_buffers" in kwargs and not DDP_2_13_ARGUMENTS:
        pytest.skip("this torch's DDP has no forward_sync_buffers (torch 2.13's) to compare with")
    res = pool.run(case_buffers_like_torch, kwargs=kwargs)
    for r, out in enumerate(res):
        for i, (t, g) in enumerate(zip(out["torch"], out["ring"])):
            assert t.keys() == g.keys()
            for k in t:
                assert torch.equal(t[k], g[k]), (f"rank {r}, {kwargs}, after {i} forwards: {k} is {g[k].tolist()} "
                                                 f"in RingDDP, {t[k].tolist()} in torch DDP")
        assert out["ring will sync"] == out["torch will sync"], (r, kwargs, out["ring will sync"], out["torch will sync"])
        assert out["ring will sync"][2] is False  # (after the no_grad forward)


def test_ignored_params_and_buffers_like_torch(pool):
    res = pool.run(case_ignored_params_like_torch)
    for r, out in enumerate(res):
        assert all(not n.startswith("local.") for b in out["layout"] for n in b)
        for when in ("init",):
            t, g = out[when]["torch"], out[when]["ring"]
            for k in t:
                assert torch.equal(t[k], g[k]), f"rank {r}, at construction: {k}"
        for step, (tg, gg) in enumerate(zip(out["torch"]["grads"], out["ring"]["grads"])):
            for k in tg:
                assert torch.allclose(tg[k], gg[k], atol=1e-6), f"rank {r}, step {step}: the gradient of {k}"
        for k, v in out["torch"]["state"].items():
            assert torch.allclose(v, out["ring"]["state"][k], atol=1e-6), f"rank {r}: {k} after training"
    # the ignored layer stayed each rank's own; the shared one is the same everywhere
    assert not torch.equal(res[0]["ring"]["state"]["local.weight"], res[1]["ring"]["state"]["local.weight"])
    assert torch.equal(res[0]["ring"]["state"]["shared.weight"], res[1]["ring"]["state"]["shared.weight"])


@pytest.mark.skipif(not DDP_2_13_ARGUMENTS, reason="RingDDP takes torch 2.13's DDP arguments; this torch's differ")
def test_positional_arguments_bind_like_torch():
    """torch's arguments in torch's order (positional as there); RingDDP's own keyword-only."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp.ddp import RingDDP

    tsig, rsig = inspect.signature(DDP.__init__), inspect.signature(RingDDP.__init__)
    tparams = [(p.name, p.kind, p.default) for p in tsig.parameters.values()]
    rparams = [(p.name, p.kind, p.default) for p in rsig.parameters.values()]
    assert rparams[:len(tparams)] == tparams
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(rsig.parameters.values())[len(tparams):])
    args = ("self", "net", None, None, 0, False, True, "group", 1, True, False, True, False)
    for n in range(2, len(args) + 1):
        assert rsig.bind(*args[:n]).arguments == tsig.bind(*args[:n]).arguments


def test_positional_construction_and_unsupported_arguments(pool):
    res = pool.run(case_positional_like_torch)
    for r, out in enumerate(res):
        assert out["dim"] == 0 and out["broadcast_buffers"] is False
        assert out["count"] == float(r)  # broadcast_buffers=False: the rank's own buffer, as torch
        assert len(out["layout"]) == 1  # bucket_cap_mb=1 (positional, after process_group)
        assert sorted(out["errors"]) == ["bucket_cap_mb_list", "device_mesh", "mixed_precision",
                                         "skip_all_reduce_unused_params"]
        for name, msg in out["errors"].items():
            assert name in msg


def test_unknown_trace_field_is_a_value_error(pool):
    res = pool.run(case_bad_trace_field, env={"RINGDP_TRACE": "/tmp/ringdp-never/{run}/t.json"})
    for msg in res:
        assert msg is not None and "RINGDP_TRACE" in msg and "{run}" in msg
