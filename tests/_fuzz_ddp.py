"""Random data-parallel training runs, RingDDP and stock DDP (or FSDP2) on ringdp against
torch's DDP (FSDP2) on gloo: a differential fuzzer of the training path.

A run is drawn from a seed, the same on every rank: a model (a stack of Linear layers of
random widths; some of: a tied weight used twice, a frozen layer, a branch used only on some
steps, a branch used on some ranks only, a BatchNorm1d whose buffers DDP broadcasts, an
nn.Embedding with sparse gradients looked up by rows the input picks, a complex parameter
used conjugated), DDP's
options (bucket_cap_mb from one parameter per bucket to one bucket, find_unused_parameters,
gradient_as_bucket_view, static_graph where the graph allows it, broadcast_buffers), an
optimizer (SGD with momentum or Adam), a compression comm hook (fp16, bf16) or none, and a
few steps, some of them accumulated under no_sync, or uneven inputs (each rank its own
number of steps, inside Join). Each rank trains four copies of the model from the same
start, in float64:

    torch    torch.nn.parallel.DistributedDataParallel on the gloo default group (the reference)
    ring     ringdp.RingDDP on the gloo default group (ringdp's communicator over it)
    stock    torch's DistributedDataParallel on a cpu:ringdp group
    ring_pg  ringdp.RingDDP on that cpu:ringdp group (the backend's communicator, shared)

and after every step each copy's parameters (and buffers) must equal the reference's within
1e-9 (relative; the sums are reduced in another order; looser through a half-precision
hook: tolerance()), and at the end be bitwise identical on every rank. A run that torch's
DDP refuses is reported as skipped, not as a failure.

`--fsdp` draws FSDP2 runs instead (make_fsdp_run): a stack of Linear layers of random widths
(parameters of sizes the world size does not divide), fully_shard on each layer and the
root or on the root alone, reshard_after_forward or not, the mixed-precision policy
(bfloat16 parameters, float32 reduction) or none, SGD or Adam, gradient accumulation
(set_requires_gradient_sync(False)), set_gradient_divide_factor (PREMUL_SUM, which gloo
lacks: twice the learning rate instead). Each rank trains it over the gloo default group
and over a cpu:ringdp group; each step's shards must match within 1e-9 (1e-5 with the
mixed-precision policy).

    python tests/_fuzz_ddp.py --world 2 --seeds 0:50
    python tests/_fuzz_ddp.py --world 4 --hosts a,a,b,b --seeds 0:50   # simulated hosts
    python tests/_fuzz_ddp.py --world 3 --seeds 7 --show
    python tests/_fuzz_ddp.py --world 3 --seeds 0:50 --fsdp

`--kill` (DDP or FSDP2 runs) trains one copy on ringdp (drawn: RingDDP, stock DDP or RingDDP
on the cpu:ringdp group; FSDP2 with --fsdp), fresh ranks for each seed, and one rank
SIGKILLs itself at a drawn point: before a forward, in the middle of a backward (when the
gradient of the first layer's output comes, after later layers' reductions started) or
before the optimizer's step, of a drawn step and micro-batch (make_kill). Every survivor
must raise within twice ringdp's timeout (10 s) of the last point it passed, naming the
dead rank (or the cross-host step that cannot reach it), exit with 0, and leave no
shared-memory name behind; it may finish without an error only when the victim died after
its last collective (before its last optimizer step).

    python tests/_fuzz_ddp.py --world 3 --seeds 0:40 --kill
    python tests/_fuzz_ddp.py --world 4 --hosts a,a,b,b --seeds 0:40 --kill --fsdp

`--interrupt`: the same runs and points, but the victim gets a SIGINT (Ctrl-C, Python's own
handler) a drawn 0-10 ms after its point instead, and its script catches the
KeyboardInterrupt and ends (the victim waits for it: it raises nothing else; torch's
rewording of it, which stock DDP raised until the backend's futures held C++ tensor lists,
fails: torch_took_the_interrupt). Every rank must exit with 0 (never std::terminate, never
a hang), the survivors within the same bound, naming the victim when they raise; they may
train to the end only when the victim stopped in its last micro-batch (the interrupt may
land after its last collective), and no shared-memory name may be left. The survivors'
results are not compared (the differential runs do that). The summary counts where the
interrupts landed.

    python tests/_fuzz_ddp.py --world 3 --seeds 0:40 --interrupt

tests/test_fuzz.py runs a few seeds.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

D_IN, D_OUT = 6, 3
EMB_ROWS = 7
RTOL = 1e-9
TOL_MIXED = 1e-5


# ==================================================================== the run
def make_run(seed: int, world: int) -> dict:
    """What run `seed` trains and how (identical on every rank)."""
    rng = random.Random(seed)
    widths = [rng.choice([1, 3, 8, 17, 40]) for _ in range(rng.randint(1, 3))]
    extras = {x for x in ("tied", "frozen", "step_branch", "rank_branch", "batchnorm") if rng.random() < 0.35}
    run = {
        "widths": widths,
        "extras": sorted(extras),
        "bucket_cap_mb": rng.choice([1e-6, 1e-4, 2e-3, 25.0]),
        "find_unused_parameters": rng.random() < 0.5,
        "gradient_as_bucket_view": rng.random() < 0.5,
        "static_graph": rng.random() < 0.3,
        "broadcast_buffers": rng.random() < 0.7,
        "optimizer": rng.choice(["sgd", "adam"]),
        "momentum": 0.9,
        "steps": rng.randint(2, 4),
        "micro": [rng.choice([1, 1, 2, 3]) for _ in range(4)],  # forward/backward per step (the first ones no_sync)
        "per_rank": rng.choice([1, 2, 5]),
        "set_to_none": rng.random() < 0.5,
        # uneven inputs: rank r trains steps + uneven[r] steps, all of them inside Join
        "uneven": [rng.randint(0, 2) for _ in range(world)] if rng.random() < 0.3 else None,
        # a compression comm hook: torch's on torch's DDP, ringdp's on RingDDP (not inside Join)
        "hook": rng.choice([None, None, None, "fp16", "bf16"]),
        # an nn.Embedding(sparse=True) looked up by indices made from the input: sparse gradients
        "sparse": rng.random() < 0.25,
    }
    # a complex parameter used conjugated (torch's DDP and RingDDP reduce it as its real view);
    # drawn last, so that the runs of earlier seeds are otherwise what they were
    run["complex"] = rng.random() < 0.3
    if run["sparse"]:
        # (torch's DDP gives a hook each sparse gradient as a bucket, which the compression
        # hooks cannot cast; Adam takes no sparse gradient)
        run["hook"], run["optimizer"] = None, "sgd"
    if "batchnorm" in extras:
        run["per_rank"] = max(2, run["per_rank"])  # (BatchNorm1d trains on at least 2 samples)
    if run["uneven"] is not None:
        run["micro"] = [1] * 4  # (no no_sync inside Join: kept simple)
        run["hook"] = None
        # torch's DDP with static_graph inside Join: a joined rank's shadow collectives do not
        # match (gloo aborts the process: "Received data size doesn't match expected size")
        run["static_graph"] = False
        if "rank_branch" in extras or "step_branch" in extras:
            # A parameter that no rank still training uses: torch's DDP gives it a zero
            # gradient, as a joined rank's shadow adds its usage map of earlier steps (never
            # reset) to the others'; RingDDP leaves its gradient untouched, as both do without
            # join (torch PR 28883). Without momentum, SGD moves neither.
            run["optimizer"], run["momentum"] = "sgd", 0.0
    if run["hook"] is not None:
        # (SGD: Adam divides by a gradient's size, so that a rounding of a gradient near 0
        # can move a parameter by a whole step)
        run["optimizer"] = "sgd"
    # what torch's DDP needs: a parameter unused on some ranks or steps needs
    # find_unused_parameters, and static_graph a graph that never changes
    if "rank_branch" in extras or "step_branch" in extras:
        run["find_unused_parameters"] = True
        run["static_graph"] = False
    return run


class Net(nn.Module):
    """The run's model: Linear layers D_IN -> widths -> D_OUT with tanh between, and extras."""

    def __init__(self, run: dict):
        super().__init__()
        dims = [D_IN] + run["widths"] + [D_OUT]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        extras = set(run["extras"])
        self.tied = nn.Linear(D_OUT, D_OUT) if "tied" in extras else None  # applied twice
        self.frozen = nn.Linear(D_IN, D_IN) if "frozen" in extras else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.step_branch = nn.Linear(D_IN, D_OUT) if "step_branch" in extras else None
        self.rank_branch = nn.Linear(D_IN, D_OUT) if "rank_branch" in extras else None
        self.bn = nn.BatchNorm1d(D_IN) if "batchnorm" in extras else None
        self.emb = nn.Embedding(EMB_ROWS, D_IN, sparse=True) if run.get("sparse") else None
        # (complex128: .double() leaves it as it is)
        self.cgain = nn.Parameter(torch.randn(D_OUT, dtype=torch.complex128)) if run.get("complex") else None

    def forward(self, x, step: int, rank: int):
        if self.emb is not None:  # (rows picked by the input: some rows on some ranks only)
            x = x + self.emb((x[:, 0].abs() * 3).long() % EMB_ROWS)
        if self.bn is not None:
            x = self.bn(x)
        if self.frozen is not None:
            x = self.frozen(x)
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = torch.tanh(h)
        if self.tied is not None:
            h = self.tied(torch.tanh(self.tied(h)))
        if self.cgain is not None:  # (used conjugated: autograd may hand its gradient over as a lazy conjugate)
            h = h + (h * self.cgain.conj()).real
        if self.step_branch is not None and step % 2 == 0:  # every rank alike
            h = h + self.step_branch(x)
        if self.rank_branch is not None and rank % 2 == 1:  # some ranks only
            h = h + self.rank_branch(x)
        return h


def tolerance(run: dict) -> float:
    """How far a copy's parameters may be from the reference's, relative (and absolute).
    Without a hook the gradients' sums differ only in their order: 1e-9. Through a
    half-precision hook they differ by a rounding of a half-precision value where the sums'
    order or the hooks differ (torch's casts, then divides by the world size; ringdp's
    divides in the gradients' dtype, then casts), a relative 2^-11 (fp16) or 2^-8 (bf16) of
    a gradient, and SGD (lr 0.05, a few steps) moves a parameter by much less: measured at
    most 5e-5 (fp16) and 2e-4 (bf16) after the first step at world 2-4. 1e-3 and 1e-2 still catch what a
    bucket left out, counted twice or divided wrongly moves."""
    return {None: RTOL, "fp16": 1e-3, "bf16": 1e-2}[run["hook"]]


def describe(run: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in run.items())


def _data(seed: int, step: int, micro: int, n: int):
    g = torch.Generator().manual_seed(seed * 7919 + step * 101 + micro)
    return torch.randn(n, D_IN, generator=g, dtype=torch.float64), torch.randn(n, D_OUT, generator=g,
                                                                                dtype=torch.float64)


# ==================================================================== training
def _wrap(kind: str, run: dict, ring_group):
    import ringdp

    torch.manual_seed(12345)
    model = Net(run).double()
    kw = {k: run[k] for k in ("bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
                              "broadcast_buffers")}
    if kind == "torch":
        ddp, hooks, state = nn.parallel.DistributedDataParallel(model, **kw), default_hooks, None
    elif kind == "ring":
        ddp, hooks, state = ringdp.RingDDP(model, **kw), ringdp.comm_hooks, None
    elif kind == "ring_pg":
        ddp = ringdp.RingDDP(model, process_group=ring_group, **kw)
        hooks, state = ringdp.comm_hooks, ring_group
    else:
        ddp = nn.parallel.DistributedDataParallel(model, process_group=ring_group, **kw)
        hooks, state = default_hooks, ring_group
    if run["hook"] is not None:
        hook = getattr(hooks, f"{run['hook']}_compress_hook")
        if run["hook"] == "bf16" and kind in ("torch", "stock"):
            # torch's DDP.register_comm_hook refuses its bf16 hook without CUDA and NCCL (a
            # check of the build, not of the hook, which runs on CPU): registered as it would
            dist._register_comm_hook(ddp.reducer, state, hook)
        else:
            ddp.register_comm_hook(state, hook)
    return ddp


def _state(ddp) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(ddp.module.parameters()) + list(ddp.module.buffers())]


def _train(kind, run, seed, rank, world, ring_group, kill=None) -> list[list[torch.Tensor]]:
    """The states after each step of one copy (the first: after wrapping; the last: after
    Join, where the ranks take the model of a rank that joined last). `kill`: a _Kill."""
    ddp = _wrap(kind, run, ring_group)
    kill = kill or _Kill()
    kill.watch(ddp.module.layers[0])
    opt = (torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=run["momentum"]) if run["optimizer"] == "sgd"
           else torch.optim.Adam(ddp.parameters(), lr=0.01))
    states = [_state(ddp)]
    steps = run["steps"] + (run["uneven"][rank] if run["uneven"] else 0)
    with (Join([ddp]) if run["uneven"] else _Nothing()):
        for step in range(steps):
            _step(ddp, opt, run, seed, step, rank, world, kill)
            states.append(_state(ddp))
    if run["uneven"]:
        states.append(_state(ddp))
    return states


def _micro(run: dict, step: int) -> int:
    """Forward/backward passes of step `step` (the first ones without gradient sync)."""
    return run["micro"][step] if step < len(run["micro"]) else 1


def _step(ddp, opt, run, seed, step, rank, world, kill):
    """One optimizer step: its micro-batches, all but the last under no_sync."""
    opt.zero_grad(set_to_none=run["set_to_none"])
    micro = _micro(run, step)
    for m in range(micro):
        x, y = _data(seed, step, m, world * run["per_rank"])
        x, y = x[rank::world], y[rank::world]  # this rank's shard
        with (ddp.no_sync() if m < micro - 1 else _Nothing()):
            kill.at(step, m, "forward")
            loss = ((ddp(x, step, rank) - y) ** 2).mean()
            loss.backward()
    kill.at(step, micro - 1, "optimizer")
    opt.step()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Kill:
    """The kill points of one training copy (--kill): at(step, micro, phase) is called before
    each forward ("forward") and optimizer step ("optimizer"), and, through watch(first
    layer), when the gradient of the first layer's output comes ("backward": the later
    layers' gradients are in, their reductions started). The victim SIGKILLs itself at
    `point` (step, micro, phase), or, given `interrupt` (seconds), sends itself a SIGINT that
    much later (--interrupt: `timer`); every rank notes when it passed a point (`last`: the
    monotonic time) and which (`passed`: its step and micro-batch). Without a point (the differential runs): nothing happens."""

    def __init__(self, point=None, victim: int = -1, rank: int = -1, interrupt: float | None = None):
        self.point, self.victim, self.rank, self.interrupt = point, victim, rank, interrupt
        self.last = time.monotonic()
        self.timer = None
        self.passed = (-1, -1)  # (step, micro-batch) of the last point passed
        self._where = (-1, -1)

    def at(self, step: int, micro: int, phase: str) -> None:
        self.last = time.monotonic()
        self.passed = (step, micro)
        if phase == "forward":
            self._where = (step, micro)
        if self.point == (step, micro, phase) and self.rank == self.victim:
            if self.interrupt is not None:
                if self.timer is None:  # (case_kill installed Python's SIGINT handler)
                    self.timer = threading.Timer(self.interrupt, os.kill, (os.getpid(), signal.SIGINT))
                    self.timer.start()
                return
            sys.stdout.flush()
            os.kill(os.getpid(), 9)  # SIGKILL: no handler, no cleanup

    def watch(self, layer: nn.Module) -> None:
        if self.point is None or self.point[2] != "backward":
            return

        def arm(module, inputs, out):
            if self._where == self.point[:2] and out.requires_grad:
                where = self._where
                out.register_hook(lambda g: self.at(*where, "backward"))
        layer.register_forward_hook(arm)


def case_runs(rank, world, seeds, hosts=None, fsdp=False):
    """Every seed's run on this rank: {seed: errors (empty: every copy matched torch's)}.
    `hosts`: each rank's RINGDP_HOST_ID (simulated hosts: RingDDP's communicator on the
    default group and the cpu:ringdp group both span them); None: one host. `fsdp`: the
    seeds' FSDP2 runs (make_fsdp_run) instead of their DDP runs."""
    if hosts is not None:
        os.environ["RINGDP_HOST_ID"] = hosts[rank]  # (read when ringdp makes a communicator)
    import ringdp  # noqa: F401 -- registers the backend

    torch.set_num_threads(1)
    ring_group = dist.new_group(backend="cpu:ringdp")
    if hosts is not None:  # (the layout took: both groups' communicators span the hosts)
        from ringdp.comm import get_communicator

        for group in (None, ring_group):
            seen = get_communicator(group).hosts
            if len(set(seen)) != len(set(hosts)):
                raise RuntimeError(f"simulated hosts {hosts}: the communicator sees {seen}")
    out = {}
    for seed in seeds:
        out[seed] = (_fsdp_seed if fsdp else _ddp_seed)(seed, rank, world, ring_group)
        dist.barrier()
    dist.destroy_process_group(ring_group)
    return out


def _ddp_seed(seed, rank, world, ring_group) -> list[str]:
    """Run `seed`'s DDP run in each copy; its errors on this rank."""
    run = make_run(seed, world)
    if run["static_graph"] and any(m > 1 for m in run["micro"][:run["steps"]]):
        run["static_graph"] = False  # (no_sync with static_graph: torch's DDP supports it; kept simple)
    try:
        ref = _train("torch", run, seed, rank, world, ring_group)
    except Exception as e:  # noqa: BLE001 -- a run torch's DDP refuses: not ringdp's to match
        return [f"skipped: torch's DDP raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"]
    errors, finals = [], {}
    for kind in ("ring", "stock", "ring_pg"):
        try:
            got = _train(kind, run, seed, rank, world, ring_group)
        except Exception as e:  # noqa: BLE001 -- reported
            errors.append(f"{kind}: raised {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            break  # (the ranks may be out of step now)
        finals[kind] = got[-1]
        errors += _differ(kind, got, ref, tolerance(run), "torch's DDP", joined=bool(run["uneven"]))
    return errors + _identical(finals, Net(run), world)


def _differ(kind: str, got, ref, tol: float, what: str, joined: bool = False) -> list[str]:
    """The first state of `got` (one per step, the first after wrapping; `joined`: the last
    after Join) not within `tol` of the reference's: an error naming the step and tensors."""
    for step, (a, b) in enumerate(zip(got, ref)):
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.allclose(x, y, rtol=tol, atol=tol)]
        if bad:
            worst = max((a[i] - b[i]).abs().max().item() for i in bad)
            when = "wrap" if step == 0 else "join" if joined and step == len(got) - 1 else step - 1
            return [f"{kind}: after step {when}: tensors {bad} differ from {what} (max {worst:.3g})"]
    return []


# ==================================================================== FSDP2 runs (--fsdp)
def make_fsdp_run(seed: int, world: int) -> dict:
    """What FSDP2 run `seed` trains and how (identical on every rank)."""
    rng = random.Random(seed)
    run = {
        "widths": [rng.choice([1, 3, 8, 17, 40]) for _ in range(rng.randint(1, 3))],
        "shard": rng.choice(["layers", "root"]),  # fully_shard each Linear, then the root; or the root alone
        "reshard_after_forward": rng.random() < 0.5,
        "mixed": rng.random() < 0.3,  # MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
        "optimizer": rng.choice(["sgd", "adam"]),
        "steps": rng.randint(2, 4),
        # forward/backward per step, the first ones with set_requires_gradient_sync(False)
        "micro": [rng.choice([1, 1, 2, 3]) for _ in range(4)],
        "per_rank": rng.choice([1, 2, 5]),
        # set_gradient_divide_factor(2 x world) on the cpu:ringdp copy: FSDP2 reduce-scatters
        # with PREMUL_SUM(1 / (2 world)), which gloo lacks; that copy takes twice the gloo
        # copy's learning rate, and SGD (linear in the gradient) the same steps
        "premul": rng.random() < 0.25,
    }
    if run["mixed"] or run["premul"]:
        run["optimizer"] = "sgd"  # (as with a hook: Adam would turn a rounding near 0 into a step)
    return run


def _fsdp_train(group, run, seed, rank, world, premul: bool = False, kill=None) -> list[list[torch.Tensor]]:
    """This rank's shards after each step of one FSDP2 copy over `group`; `premul`: with
    the gradients divided by 2 x world and twice the learning rate. `kill`: a _Kill."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(12345)
    dims = [D_IN] + run["widths"] + [D_OUT]
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1]).double()
    kill = kill or _Kill()
    kill.watch(model[0])
    kw = {"mesh": DeviceMesh.from_group(group, "cpu"), "reshard_after_forward": run["reshard_after_forward"]}
    if run["mixed"]:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if run["shard"] == "layers":
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, **kw)
    fully_shard(model, **kw)
    if premul:
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):  # (the fully_shard-ed modules)
                m.set_gradient_divide_factor(2.0 * world)
    lr = 0.1 if premul else 0.05  # (half the gradient, twice the rate)
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if run["optimizer"] == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    states = [[p.to_local().detach().clone() for p in model.parameters()]]
    for step in range(run["steps"]):
        opt.zero_grad()
        micro = run["micro"][step]
        for m in range(micro):
            x, y = _data(seed, step, m, world * run["per_rank"])
            model.set_requires_gradient_sync(m == micro - 1)
            kill.at(step, m, "forward")
            ((model(x[rank::world]).double() - y[rank::world]) ** 2).mean().backward()
        kill.at(step, micro - 1, "optimizer")
        opt.step()
        states.append([p.to_local().detach().clone() for p in model.parameters()])
    return states


def _fsdp_seed(seed, rank, world, ring_group) -> list[str]:
    """Run `seed`'s FSDP2 run over gloo (the reference) and over the cpu:ringdp group; the
    errors on this rank: each step's shards must match within fsdp_tolerance()."""
    run = make_fsdp_run(seed, world)
    try:
        ref = _fsdp_train(dist.group.WORLD, run, seed, rank, world)
    except Exception as e:  # noqa: BLE001 -- a run torch's FSDP2 refuses on gloo: not ringdp's to match
        return [f"skipped: FSDP2 on gloo raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"]
    try:
        got = _fsdp_train(ring_group, run, seed, rank, world, premul=run["premul"])
    except Exception as e:  # noqa: BLE001 -- reported
        return [f"fsdp: raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"]
    return _differ("fsdp", got, ref, fsdp_tolerance(run), "FSDP2 on gloo")


def fsdp_tolerance(run: dict) -> float:
    """1e-9 in float64 (the reduce-scatters' sums in another order); with the mixed-precision
    policy the gradients are reduced in float32: TOL_MIXED."""
    return TOL_MIXED if run["mixed"] else RTOL


def _identical(finals: dict, net: nn.Module, world: int) -> list[str]:
    """Every rank ends with the same parameters in each copy (collective: every rank gathers
    them, each checks against rank 0's; not the buffers, which differ between ranks without
    broadcast_buffers). Only when every rank trained every copy (else the ranks may be out
    of step)."""
    ran = torch.tensor([len(finals)], dtype=torch.int64)
    dist.all_reduce(ran, op=dist.ReduceOp.MIN)
    if ran.item() < 3:
        return []
    nparams = sum(1 for _ in net.parameters())
    errors = []
    for kind, state in sorted(finals.items()):
        flat = torch.cat([t.reshape(-1) for t in state[:nparams]])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        if not all(torch.equal(every[0], e) for e in every):
            errors.append(f"{kind}: the ranks end with different parameters")
    return errors


def run_seeds(world: int, seeds, timeout: float = 600, hosts: str | None = None, fsdp: bool = False) -> dict:
    """{rank: {seed: errors}} of run_ranks over `world` fresh ranks; `hosts`: a layout such
    as "a,a,b,b" (simulated hosts), None: one host; `fsdp`: the FSDP2 runs."""
    from _dist import run_ranks

    from _fuzz import host_env

    ids = host_env(hosts, world)
    res = run_ranks(case_runs, world, list(seeds), ids, fsdp, timeout=timeout, env={"RINGDP_TIMEOUT_S": "60"})
    out = {}
    for r, item in enumerate(res):
        out[r] = item[1] if item is not None and item[0] == "ok" else {"?": [f"rank {r}: {item}"]}
    return out


def failures(out: dict) -> list[str]:
    return [f"rank {r} seed {s}: {e}" for r, per in out.items() for s, errs in per.items() for e in errs
            if not e.startswith("skipped")]


# ==================================================================== --kill
KILL_PHASES = ("forward", "backward", "optimizer")
KILL_TIMEOUT_S = 10.0  # RINGDP_TIMEOUT_S of the kill runs
KILL_SLACK_S = 10.0  # on top of twice the timeout: a loaded machine


def torch_ddp_refuses(run: dict) -> bool:
    """Whether torch's DDP cannot train DDP run `run`, on any backend: a complex parameter
    used conjugated keeps autograd's lazy conjugate as its gradient (DDP copies the reduced
    bucket into it, unless gradient_as_bucket_view), and Adam's view_as_real of it raises
    "view_as_real doesn't work on unresolved conjugated tensors" (seed 54 at world 3, on gloo
    as on cpu:ringdp; the differential runs report it as skipped)."""
    return bool(run.get("complex")) and run["optimizer"] == "adam" and not run["gradient_as_bucket_view"]


def make_kill(seed: int, world: int, fsdp: bool = False, interrupt: bool = False) -> dict:
    """Where seed `seed`'s run (make_run, or make_fsdp_run) kills a rank: the copy that
    trains ("kind"), the victim, and the point (step, micro-batch, phase) of its training at
    which it SIGKILLs itself; "last": whether that point comes after its last collective;
    "gloo": whether the run has collectives on gloo (kill_on_gloo). `interrupt` (--interrupt):
    the same, and "interrupt": the seconds after its point at which the victim gets a SIGINT
    instead (drawn last: the points are --kill's); "final": the victim's last micro-batch (step,
    micro), whose backward synchronises (kill_errors)."""
    run = make_fsdp_run(seed, world) if fsdp else make_run(seed, world)
    rng = random.Random(seed * 7919 + 17)
    kind = "fsdp" if fsdp else rng.choice(["ring", "stock", "ring_pg"])
    if kind == "stock" and torch_ddp_refuses(run):
        kind = "ring_pg"  # (the differential runs skip these: torch's DDP raises on gloo too)
    victim = rng.randrange(world)
    steps = run["steps"] + (run["uneven"][victim] if run.get("uneven") else 0)
    step = rng.randrange(steps)
    micro = _micro(run, step)
    phase = rng.choice(KILL_PHASES)
    m = micro - 1 if phase == "optimizer" else rng.randrange(micro)
    k = {"kind": kind, "victim": victim, "point": (step, m, phase),
         "last": phase == "optimizer" and step == steps - 1 and not run.get("uneven"),
         "gloo": not fsdp and kill_on_gloo(kind, run)}
    if interrupt:
        k["interrupt"] = rng.random() * 0.01
        k["final"] = (steps - 1, _micro(run, steps - 1) - 1)  # (the victim's last micro-batch: it synchronises)
    return k


def case_kill(rank, world, seed, hosts=None, fsdp=False, interrupt=False):
    """Seed `seed`'s kill run on this rank (make_kill): the victim dies at its point (or is
    interrupted: `interrupt`); the others, and an interrupted victim, return (exception type
    or None, its message, seconds from the last point passed to the end, that point's step and
    micro-batch); an interrupted victim's message is where the KeyboardInterrupt landed
    (_fuzz._landed). The victim waits for its SIGINT: it always comes before this returns."""
    if hosts is not None:
        os.environ["RINGDP_HOST_ID"] = hosts[rank]
    import ringdp  # noqa: F401 -- registers the backend

    from _fuzz import _landed

    torch.set_num_threads(1)
    ring_group = dist.new_group(backend="cpu:ringdp")
    k = make_kill(seed, world, fsdp, interrupt)
    kill = _Kill(k["point"], k["victim"], rank, k.get("interrupt"))
    if interrupt and rank == k["victim"]:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            if fsdp:
                _fsdp_train(ring_group, make_fsdp_run(seed, world), seed, rank, world, kill=kill)
            else:
                _train(k["kind"], make_run(seed, world), seed, rank, world, ring_group, kill=kill)
        finally:
            if kill.timer is not None:
                kill.timer.join()  # (a SIGINT in this join lands here: after the training)
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        hidden = e.__context__  # (an error of the training, which the SIGINT in the join replaced)
        if isinstance(hidden, Exception):
            return type(hidden).__name__, str(hidden)[:2000], time.monotonic() - kill.last, kill.passed
        return "KeyboardInterrupt", _landed(e), time.monotonic() - kill.last, kill.passed
    except Exception as e:  # noqa: BLE001 -- what a survivor must see
        return type(e).__name__, str(e)[:2000], time.monotonic() - kill.last, kill.passed
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return None, None, time.monotonic() - kill.last, kill.passed


def kill_errors(k: dict, world: int, res, codes, left) -> dict:
    """{rank: errors} of one kill run (case_kill's results, exit codes, shared-memory names
    left). A run with collectives on gloo (k["gloo"]) may end in gloo's errors, which name no
    rank. An interrupted victim (k["interrupt"]) must exit with 0 too, and raise only its
    KeyboardInterrupt (torch's rewording of it, torch_took_the_interrupt, fails too); its peers
    may train to the end only when it passed the start of its last micro-batch (k["final"]:
    the interrupt may land after its last collective; before that micro-batch it had not made
    that backward's reductions)."""
    victim, bound = k["victim"], 2 * KILL_TIMEOUT_S + KILL_SLACK_S
    interrupt = "interrupt" in k
    out = {r: [] for r in range(world)}
    if not interrupt and codes[victim] != -9:
        out[victim].append(f"the victim did not die at {k['point']} (exit code {codes[victim]})")
    if left:
        out[victim].append(f"shared-memory names left: {sorted(left)}")
    stopped = None  # (where the interrupted victim stopped: its last point's step and micro-batch)
    if interrupt and res[victim] is not None and res[victim][0] == "ok":
        etype, msg, _, stopped = res[victim][1]
        if torch_took_the_interrupt(etype, msg):
            out[victim].append(f"interrupted at {k['point']}, torch reworded its KeyboardInterrupt: it read a "
                               "future's tensors in Python (work.set_outputs)")
        elif etype != "KeyboardInterrupt":
            out[victim].append(f"interrupted at {k['point']}, it raised {etype}: "
                               + (msg.splitlines()[0][:300] if msg else "(its interrupt was lost)"))
    for r in range(world):
        if r == victim and not interrupt:
            continue
        if res[r] is None or res[r][0] != "ok":
            out[r].append(f"failed outside its training: {res[r]} (exit code {codes[r]})")
            continue
        etype, msg, took, _ = res[r][1]
        if r != victim:
            may_finish = k["last"] if not interrupt else stopped is None or tuple(stopped) >= k["final"]
            if etype is None and not may_finish:
                out[r].append(f"trained on after rank {victim} " + (f"died at {k['point']}" if not interrupt else
                                                                      f"was interrupted at step/micro {stopped}"))
            elif etype is not None and not k["gloo"] and f"rank {victim}" not in msg and "across hosts" not in msg:
                out[r].append(f"{etype} names neither rank {victim} nor the cross-host step: "
                              f"{msg.splitlines()[0][:300]}")
        if took > bound:
            out[r].append(f"ended {took:.1f} s after its last point (bound {bound:g} s): {etype}")
        if codes[r] != 0:
            out[r].append(f"exit code {codes[r]}")
    return out


def torch_took_the_interrupt(etype, msg) -> bool:
    """Whether an interrupted victim's error is torch's rewording of its KeyboardInterrupt: torch
    DDP's C++ reducer, in backward, read the tensors of a future that Python completed (the
    cpu:ringdp backend's) through torch._jit_internal._extract_tensors, the first Python code
    after its wait, where the SIGINT's KeyboardInterrupt landed; torch's C++ turned it into
    this RuntimeError (6 of 21 stock-DDP interrupts at world 3, before work.set_outputs)."""
    return etype == "RuntimeError" and bool(msg) and msg.startswith("Cannot extract tensors from value: KeyboardInterrupt")


def kill_on_gloo(kind: str, run: dict) -> bool:
    """Whether DDP run `run`, trained as copy `kind`, has collectives on gloo, which may be
    the ones that meet the death: sparse gradients (torch's DDP and RingDDP reduce them
    through the process group: its inner gloo group on cpu:ringdp), and torch's Join's own
    all-reduces on RingDDP's process group, the gloo default group for kind "ring"."""
    return run["sparse"] or (kind == "ring" and run["uneven"] is not None)


def run_kills(world: int, seeds, timeout: float = 300, hosts: str | None = None, fsdp: bool = False,
              interrupt: bool = False, landed: collections.Counter | None = None) -> dict:
    """{rank: {seed: errors}} of each seed's kill run (interrupt run: `interrupt`) on `world`
    fresh ranks; `landed` counts where the interrupts landed (in parentheses: the error the
    victim raised instead, a failure)."""
    from _dist import run_ranks

    from _fuzz import _shm_names, host_env

    ids = host_env(hosts, world)
    out = {r: {} for r in range(world)}
    for seed in seeds:
        k = make_kill(seed, world, fsdp, interrupt)
        before, codes = _shm_names(), []
        res = run_ranks(case_kill, world, seed, ids, fsdp, interrupt, timeout=timeout,
                        allow_missing=() if interrupt else (k["victim"],),
                        exitcodes=codes, env={"RINGDP_TIMEOUT_S": str(KILL_TIMEOUT_S)})
        for r, errs in kill_errors(k, world, res, codes, _shm_names() - before).items():
            out[r][seed] = errs
        mine = res[k["victim"]]
        if interrupt and landed is not None and mine is not None and mine[0] == "ok":
            etype, msg = mine[1][:2]
            landed[msg if etype == "KeyboardInterrupt" else
                   "_extract_tensors (torch's RuntimeError)" if torch_took_the_interrupt(etype, msg) else f"({etype})"] += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seeds", default="0:20", help="A:B (a range) or a comma list")
    ap.add_argument("--batch", type=int, default=20, help="runs per set of fresh ranks")
    ap.add_argument("--hosts", default=None, help="each rank's simulated host, e.g. a,a,b,b")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for a batch")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 runs (fully_shard) instead of DDP runs")
    ends = ap.add_mutually_exclusive_group()
    ends.add_argument("--kill", action="store_true",
                      help="one copy on ringdp, one rank SIGKILLed at a drawn point (fresh ranks per seed)")
    ends.add_argument("--interrupt", action="store_true",
                      help="as --kill, with a SIGINT (Ctrl-C) 0-10 ms after the point instead")
    ap.add_argument("--show", action="store_true", help="print the runs instead of training them")
    a = ap.parse_args(argv)
    import _fuzz_ddp  # the ranks import this module by name (not as __main__)

    from _fuzz import _seeds

    seeds = list(_seeds(a.seeds))
    if a.show:
        for s in seeds:
            make = _fuzz_ddp.make_fsdp_run if a.fsdp else _fuzz_ddp.make_run
            print(f"seed {s}: {_fuzz_ddp.describe(make(s, a.world))}"
                  + (f" kill={_fuzz_ddp.make_kill(s, a.world, a.fsdp, a.interrupt)}" if a.kill or a.interrupt
                     else ""))
        return 0
    bad, skipped, t0, landed = [], 0, time.monotonic(), collections.Counter()
    for i in range(0, len(seeds), a.batch):
        batch = seeds[i:i + a.batch]
        if a.kill or a.interrupt:
            out = _fuzz_ddp.run_kills(a.world, batch, a.timeout, a.hosts, a.fsdp, a.interrupt, landed)
        else:
            out = _fuzz_ddp.run_seeds(a.world, batch, a.timeout, a.hosts, a.fsdp)
        bad += _fuzz_ddp.failures(out)
        skipped += sum(1 for errs in out[0].values() for e in errs if e.startswith("skipped"))
        print(f"seeds {batch[0]}..{batch[-1]}: {len(_fuzz_ddp.failures(out))} failures, {skipped} skipped so far "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    for line in bad:
        print(line)
    if landed:
        print("interrupts landed in: " + ", ".join(f"{w} x{n}" for w, n in landed.most_common()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
