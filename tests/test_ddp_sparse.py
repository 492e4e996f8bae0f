"""RingDDP with sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True), against
torch DDP on the same gloo group and against single-process training on the full batch.

Data: rank r looks up rows [5r, 5r + 10) of a 24-row table, so neighbouring ranks share
five rows, rows 0-4 are touched by rank 0 alone, and rows 20-23 by nobody; every step and
rank draws other indices. Equality with torch DDP is bitwise wherever both take the same
path (see _check_vs_torch for where they cannot)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_ranks, values

V, D, OUT = 24, 6, 3
PER_RANK = 3

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


# ============================================================== models and data
class EmbNet(nn.Module):
    """A sparse embedding (or embedding bag) and a dense Linear. use_emb=False: the
    embedding takes no part in the output (a dense feature of the indices instead)."""

    def __init__(self, bag=False, sparse=True):
        super().__init__()
        self.bag = bag
        self.emb = nn.EmbeddingBag(V, D, mode="sum", sparse=sparse) if bag else nn.Embedding(V, D, sparse=sparse)
        self.lin = nn.Linear(D, OUT)

    def forward(self, idx, use_emb=True):
        if use_emb:
            h = self.emb(idx) if self.bag else self.emb(idx).mean(1)
        else:
            h = (idx.float() / V).mean(1, keepdim=True).expand(-1, D)
        return self.lin(torch.tanh(h))


class TiedSparse(nn.Module):
    """A sparse embedding whose weight is also the output projection: its gradient is
    dense when the projection is used (head=True), sparse when it is not."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D, sparse=True)
        self.mid = nn.Linear(D, D)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx, head=True):
        h = torch.tanh(self.mid(self.emb(idx).mean(1)))
        return self.out(h) if head else h


class Undeclared(nn.Module):
    """A table looked up with F.embedding(sparse=True) by a module that is no nn.Embedding:
    its gradient is sparse, but neither torch DDP nor RingDDP expects that."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, D))
        self.lin = nn.Linear(D, OUT)

    def forward(self, idx):
        return self.lin(nn.functional.embedding(idx, self.table, sparse=True).mean(1))


def build(cls, seed, **kw):
    torch.manual_seed(seed)
    return cls(**kw)


def indices(step, rank, n=PER_RANK, k=4):
    g = torch.Generator().manual_seed(5000 + 100 * step + rank)
    return torch.randint(5 * rank, 5 * rank + 10, (n, k), generator=g)


def targets(step, rank, n=PER_RANK, d=OUT):
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(n, d, generator=g)


def loss_of(out, y):
    return ((out - y) ** 2).mean()


def params_of(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def make_opts(model, kind):
    """Plain SGD with momentum, or SparseAdam for the embedding and Adam for the rest."""
    emb = [p for n, p in model.named_parameters() if n.startswith("emb.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
    if kind == "sgd":
        return [torch.optim.SGD(emb + rest, lr=0.5, momentum=0.9)]
    if kind == "sparse_adam":
        return [torch.optim.SparseAdam(emb, lr=0.05), torch.optim.Adam(rest, lr=0.05)]
    raise ValueError(kind)


def step_all(opts):
    for o in opts:
        o.step()


def zero_all(opts):
    for o in opts:
        o.zero_grad(set_to_none=True)


# ============================================================== cases (run on every rank)
def case_vs_torch(rank, world, steps=4, bag=False, opt="sgd", ddp_kwargs=None):
    """RingDDP and torch DDP side by side from the same init (other ranks start elsewhere:
    the broadcast must fix it), and a single-process reference on the full batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp.ddp import RingDDP

    kw = dict(ddp_kwargs or {})
    init_seed = 0 if rank == 0 else 100 + rank
    ring = RingDDP(build(EmbNet, init_seed, bag=bag), **kw)
    tddp = DDP(build(EmbNet, init_seed, bag=bag), **kw)
    ref = build(EmbNet, 0, bag=bag)
    assert max_diff(params_of(ring.module), params_of(ref)) == 0.0
    assert max_diff(params_of(tddp.module), params_of(ref)) == 0.0
    opts = {"ring": make_opts(ring.module, opt), "torch": make_opts(tddp.module, opt), "ref": make_opts(ref, opt)}
    out = {"exact": [], "vs_torch": [], "vs_ref": [], "grad_sparse": [], "layout": ring.bucket_layout}
    for s in range(steps):
        idx, y = indices(s, rank), targets(s, rank)
        for tag, m in (("ring", ring), ("torch", tddp)):
            zero_all(opts[tag])
            loss_of(m(idx), y).backward()
            if tag == "ring":
                out["grad_sparse"].append(ring.module.emb.weight.grad.is_sparse)
            step_all(opts[tag])
        zero_all(opts["ref"])
        full_idx = torch.cat([indices(s, r) for r in range(world)])
        full_y = torch.cat([targets(s, r) for r in range(world)])
        loss_of(ref(full_idx), full_y).backward()
        step_all(opts["ref"])
        pr, pt = params_of(ring.module), params_of(tddp.module)
        out["exact"].append({n: torch.equal(pr[n], pt[n]) for n in pr})
        out["vs_torch"].append(max_diff(pr, pt))
        out["vs_ref"].append(max_diff(pr, params_of(ref)))
    out["params"] = params_of(ring.module)
    out["sparse_names"] = ring.reducer.sparse_names
    return out


def case_unused(rank, world, bag=False):
    """find_unused_parameters=True; the embedding is used by: every rank, every rank but
    the last, no rank, rank 0 only, every rank. (torch DDP raises "Expected sparse
    gradient to be defined." as soon as one rank leaves it unused: no comparison there.)"""
    from ringdp.ddp import RingDDP

    users = [set(range(world)), set(range(world - 1)), set(), {0}, set(range(world))]
    ring = RingDDP(build(EmbNet, 0 if rank == 0 else 100 + rank, bag=bag), find_unused_parameters=True)
    ref = build(EmbNet, 0, bag=bag)
    opt = torch.optim.SGD(ring.parameters(), lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out = {"vs_ref": [], "grad_none": [], "grad_nnz": [], "params": []}
    for s, use in enumerate(users):
        opt.zero_grad(set_to_none=True)
        loss_of(ring(indices(s, rank), use_emb=rank in use), targets(s, rank)).backward()
        g = ring.module.emb.weight.grad
        out["grad_none"].append(g is None)
        out["grad_nnz"].append(None if g is None else g.coalesce()._nnz())
        opt.step()
        ropt.zero_grad(set_to_none=True)
        full = torch.cat([ref(indices(s, r), use_emb=r in use) for r in range(world)])
        loss_of(full, torch.cat([targets(s, r) for r in range(world)])).backward()
        ropt.step()
        out["vs_ref"].append(max_diff(params_of(ring.module), params_of(ref)))
        out["params"].append(params_of(ring.module))
    return out


def case_world3(rank, world):
    return {"vs_torch": case_vs_torch(rank, world), "unused": case_unused(rank, world)}


def case_no_sync(rank, world, micro=3):
    """`micro` micro-batches per step, all but the last under no_sync, in RingDDP and torch
    DDP; during no_sync the embedding's gradient must stay local (and sparse)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp.ddp import RingDDP

    ring = RingDDP(build(EmbNet, 0 if rank == 0 else 5))
    tddp = DDP(build(EmbNet, 0 if rank == 0 else 5))
    ref = build(EmbNet, 0)
    opts = {"ring": torch.optim.SGD(ring.parameters(), lr=0.5), "torch": torch.optim.SGD(tddp.parameters(), lr=0.5)}
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out = {"local_vs_torch": [], "local_vs_ref": [], "exact": [], "vs_ref": []}
    for s in range(3):
        mb = [(indices(10 * s + k, rank), targets(10 * s + k, rank)) for k in range(micro)]
        local = {}
        for tag, m in (("ring", ring), ("torch", tddp)):
            opts[tag].zero_grad(set_to_none=True)
            for k, (idx, y) in enumerate(mb):
                if k < micro - 1:
                    with m.no_sync():
                        (loss_of(m(idx), y) / micro).backward()
                else:
                    local[tag] = m.module.emb.weight.grad.to_dense().clone()
                    (loss_of(m(idx), y) / micro).backward()
            opts[tag].step()
        # the local accumulation, from a copy of the reference (same weights before the step)
        import copy

        loc = copy.deepcopy(ref)
        for idx, y in mb[:-1]:
            (loss_of(loc(idx), y) / micro).backward()
        out["local_vs_torch"].append(torch.equal(local["ring"], local["torch"]))
        out["local_vs_ref"].append((local["ring"] - loc.emb.weight.grad.to_dense()).abs().max().item())
        ropt.zero_grad(set_to_none=True)
        for k in range(micro):
            idx = torch.cat([indices(10 * s + k, r) for r in range(world)])
            y = torch.cat([targets(10 * s + k, r) for r in range(world)])
            (loss_of(ref(idx), y) / micro).backward()
        ropt.step()
        pr = params_of(ring.module)
        pt = params_of(tddp.module)
        out["exact"].append({n: torch.equal(pr[n], pt[n]) for n in pr})
        out["vs_ref"].append(max_diff(pr, params_of(ref)))
    return out


def case_join(rank, world, counts, divide_by_initial_world_size=True, hook=None):
    """Rank r trains on counts[r] batches inside join(): a rank that ran out shadows the
    sparse reductions too. hook: a ringdp comm hook (sparse parameters are not passed)."""
    from ringdp import comm_hooks
    from ringdp.ddp import RingDDP

    ring = RingDDP(build(EmbNet, 0 if rank == 0 else 9))
    ref = build(EmbNet, 0)
    seen = []
    if hook:
        h = getattr(comm_hooks, hook)
        name_of = {id(p): n for n, p in ring.module.named_parameters()}

        def recording(state, bucket):
            seen.append([name_of[id(p)] for p in bucket.parameters()])
            return h(state, bucket)

        ring.register_comm_hook(None, recording)
    opt = torch.optim.SGD(ring.parameters(), lr=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    with ring.join(divide_by_initial_world_size=divide_by_initial_world_size):
        for s in range(counts[rank]):
            opt.zero_grad()
            loss_of(ring(indices(s, rank)), targets(s, rank)).backward()
            opt.step()
    for s in range(max(counts)):
        active = [r for r in range(world) if counts[r] > s]
        ropt.zero_grad()
        loss = sum(loss_of(ref(indices(s, r)), targets(s, r)) for r in active)
        (loss / (world if divide_by_initial_world_size else len(active))).backward()
        ropt.step()
    # training goes on normally after the join context
    opt.zero_grad()
    loss_of(ring(indices(50, rank)), targets(50, rank)).backward()
    opt.step()
    ropt.zero_grad()
    (sum(loss_of(ref(indices(50, r)), targets(50, r)) for r in range(world)) / world).backward()
    ropt.step()
    return {"diff": max_diff(params_of(ring.module), params_of(ref)), "params": params_of(ring.module),
            "hook_saw": seen}


def case_tied(rank, world, steps=4):
    """The sparse embedding tied to the output projection: rank 0 always uses the head (a
    dense gradient for emb.weight), the others only on even steps (sparse on odd ones), so
    the layouts differ across ranks on odd steps."""
    from ringdp.ddp import RingDDP

    ring = RingDDP(build(TiedSparse, 0 if rank == 0 else 3))
    ref = build(TiedSparse, 0)
    opt = torch.optim.SGD(ring.parameters(), lr=0.2)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.2)

    def loss(m, s, r):
        head = r == 0 or s % 2 == 0
        out = m(indices(s, r), head=head)
        return loss_of(out, targets(s, r, d=V if head else D))

    out = {"vs_ref": [], "layouts": [], "params": None}
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss(ring, s, rank).backward()
        out["layouts"].append(ring.module.emb.weight.grad.layout)
        opt.step()
        ropt.zero_grad()
        (sum(loss(ref, s, r) for r in range(world)) / world).backward()
        ropt.step()
        out["vs_ref"].append(max_diff(params_of(ring.module), params_of(ref)))
    out["params"] = params_of(ring.module)
    return out


def case_undeclared(rank, world):
    """A sparse gradient for a parameter that is no sparse Embedding's: a clear error,
    and RingDDP works afterwards."""
    from ringdp.ddp import RingDDP

    ring = RingDDP(build(Undeclared, 0))
    err = None
    try:
        loss_of(ring(indices(0, rank)), targets(0, rank)).backward()
    except RuntimeError as e:
        err = str(e)
    after = case_vs_torch(rank, world, steps=1)
    return {"error": err, "after_vs_ref": after["vs_ref"]}


def case_mismatch(rank, world):
    """Rank 0 declares the embedding sparse, rank 1 does not: refused at construction."""
    from ringdp.ddp import RingDDP

    try:
        RingDDP(build(EmbNet, 0, sparse=(rank == 0)))
    except RuntimeError as e:
        return str(e)
    return None


# ============================================================== tests
def _check_vs_torch(res, world, ref_tol=1e-5, torch_tol=1e-6):
    """Against torch DDP: the sparse embedding takes the same path in both (divided by the
    world size, then the process group's sparse all-reduce), so it is bitwise equal as
    long as its inputs are. The dense Linear is reduced by ringdp (sum, then divided) and
    by gloo in torch DDP (each rank's gradient divided, then summed in gloo's order): at
    world 2 both are exact (division by 2, a sum of two terms), at world 3 they differ by
    rounding, and from the second step on the embedding's gradients (which depend on the
    Linear) do too: a tight tolerance there."""
    for r, out in enumerate(res):
        assert out["sparse_names"] == ["emb.weight"]
        assert all("emb.weight" not in b for b in out["layout"]), "a sparse parameter is in a dense bucket"
        assert all(out["grad_sparse"]), "the embedding's gradient must stay sparse after the reduction"
        assert max(out["vs_ref"]) < ref_tol, f"rank {r}: RingDDP vs single process per step {out['vs_ref']}"
        if world == 2:
            for s, ex in enumerate(out["exact"]):
                assert all(ex.values()), f"rank {r} step {s}: not bitwise equal to torch DDP: {ex}"
        else:
            assert out["exact"][0]["emb.weight"], f"rank {r}: first step's embedding differs from torch DDP"
            assert max(out["vs_torch"]) < torch_tol, f"rank {r}: RingDDP vs torch DDP per step {out['vs_torch']}"
    for r in range(1, len(res)):
        for n, p in res[0]["params"].items():
            assert torch.equal(p, res[r]["params"][n]), f"rank {r}: {n} differs from rank 0's"


IN_GRAD = {"RINGDP_DDP_IN_GRAD_MIN_BYTES": "1"}  # every dense gradient reduced in its .grad


@pytest.mark.parametrize("bag,ddp_kwargs,env", [
    (False, None, None),
    (True, None, None),
    (False, {"find_unused_parameters": True}, None),
    (False, {"static_graph": True}, None),
    (False, {"gradient_as_bucket_view": True}, None),
    (False, {"overlap": False}, IN_GRAD),
])
def test_sparse_embedding_matches_torch_ddp(pool, bag, ddp_kwargs, env):
    kw = dict(ddp_kwargs or {})
    overlap = kw.pop("overlap", None)  # RingDDP's own argument: through the environment for both DDPs
    if overlap is not None:
        env = {**(env or {}), "RINGDP_DDP_OVERLAP": str(int(overlap))}
    _check_vs_torch(pool.run(case_vs_torch, bag=bag, ddp_kwargs=kw, env=env), 2)


def test_sparse_adam(pool):
    res = pool.run(case_vs_torch, opt="sparse_adam")
    _check_vs_torch(res, 2)


def _check_unused(res, world):
    for r, out in enumerate(res):
        assert max(out["vs_ref"]) < 1e-5, f"rank {r}: RingDDP vs single process per step {out['vs_ref']}"
        # step 1: unused on the last rank, which still gets the average of the others
        assert not out["grad_none"][1] and out["grad_nnz"][1] > 0
        # step 2: unused everywhere: .grad stays None (as for a dense unused parameter)
        assert out["grad_none"][2]
        assert not out["grad_none"][3] and not out["grad_none"][4]
    for s in range(len(res[0]["params"])):
        for r in range(1, world):
            for n, p in res[0]["params"][s].items():
                assert torch.equal(p, res[r]["params"][s][n]), f"step {s}: rank {r}'s {n} differs from rank 0's"


@pytest.mark.parametrize("bag", [False, True])
def test_unused_on_some_ranks(pool, bag):
    _check_unused(pool.run(case_unused, bag=bag), 2)


def test_world3_matches_torch_ddp_and_unused():
    res = values(run_ranks(case_world3, 3, timeout=240))
    _check_vs_torch([o["vs_torch"] for o in res], 3)
    _check_unused([o["unused"] for o in res], 3)


def test_no_sync_then_synced_step(pool):
    res = pool.run(case_no_sync)
    for r, out in enumerate(res):
        assert all(out["local_vs_torch"]), "no_sync: the local sparse gradients differ from torch DDP's"
        assert max(out["local_vs_ref"]) < 1e-6, "no_sync must leave the local gradients alone"
        assert max(out["vs_ref"]) < 1e-5, out["vs_ref"]
        for s, ex in enumerate(out["exact"]):
            assert all(ex.values()), f"rank {r} step {s}: not bitwise equal to torch DDP: {ex}"


@pytest.mark.parametrize("counts,divide_initial,hook", [((2, 4), True, None), ((3, 1), False, None),
                                                        ((2, 4), True, "allreduce_hook")])
def test_join_shadows_sparse_reductions(pool, counts, divide_initial, hook):
    res = pool.run(case_join, counts=counts, divide_by_initial_world_size=divide_initial, hook=hook)
    for r, out in enumerate(res):
        assert out["diff"] < 1e-5, f"rank {r}: {out['diff']}"
        if hook:
            assert out["hook_saw"], "the hook was never called"
            assert all("emb.weight" not in names for names in out["hook_saw"])
    for n, p in res[0]["params"].items():
        assert torch.equal(p, res[1]["params"][n])


def test_declared_sparse_with_dense_gradient(pool):
    res = pool.run(case_tied)
    assert res[0]["layouts"] == [torch.strided] * 4
    assert res[1]["layouts"] == [torch.strided, torch.sparse_coo] * 2  # as autograd made it
    for r, out in enumerate(res):
        assert max(out["vs_ref"]) < 1e-5, f"rank {r}: {out['vs_ref']}"
    for n, p in res[0]["params"].items():
        assert torch.equal(p, res[1]["params"][n])


def test_undeclared_sparse_gradient_raises(pool):
    res = pool.run(case_undeclared)
    for out in res:
        assert out["error"] is not None, "a sparse gradient for an undeclared parameter must raise"
        assert "'table'" in out["error"] and "sparse" in out["error"]
        assert max(out["after_vs_ref"]) < 1e-5


def test_sparse_flag_mismatch_across_ranks_raises(pool):
    res = pool.run(case_mismatch, timeout=60)
    for msg in res:
        assert msg is not None and "emb.weight" in msg and "sparse" in msg and "rank 1" in msg
