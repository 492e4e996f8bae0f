"""Training-step time of RingDDP against torch DDP and against no communication at all.

Run it
    python bench/ddp_step.py                          # starts --world (2) local ranks itself
    python bench/ddp_step.py --hidden 1024,2560 --plot
    torchrun --nproc-per-node 2 bench/ddp_step.py     # uses the ranks torchrun gives it

Model: an MLP of --layers Linear(H, H)+ReLU layers for each H in --hidden (the issue's
target is H=2560, 4 layers: 26M parameters, 105 MB of float32 gradients), batch --batch
per rank, SGD. One step = zero_grad, forward, MSE loss, backward (gradients averaged when
it returns), optimizer step. --batchnorm puts a BatchNorm1d(H) after each Linear: buffers,
which both DDPs broadcast from rank 0 before each forward (broadcast_buffers).

Modes, all in the same run, on the same data and initial weights:
    none        the plain module: the compute alone, no communication
    torch       torch.nn.parallel.DistributedDataParallel on the gloo process group
    ring        ringdp.RingDDP (buckets in registered memory, copies in and out)
    ring_view   ringdp.RingDDP(gradient_as_bucket_view=True) (.grad are bucket views)
    torch_view  torch DDP with gradient_as_bucket_view=True (--modes to add it)
    torch_ringdp torch DDP on a "cpu:ringdp" group (ringdp's torch.distributed backend,
                ringdp/backend.py; a group beside the default gloo one: --modes to add it)
    ring_serial RingDDP(overlap=False): every all-reduce after backward (--modes to add
                it; the difference to `ring` is what overlapping brings)
    torch_nocomm torch DDP whose comm hook returns the bucket untouched: no communication,
                only DDP's reducer (gradients copied into buckets and back, its hooks and
                bookkeeping). The floor of any backend under stock DDP (--modes to add it)
    torch_ringdp_view, torch_nocomm_view  the same with gradient_as_bucket_view=True (stock
                DDP's own option: .grad are views of the buckets, no copies in and out)
    torch_ringdp_adopt, torch_ringdp_view_adopt  torch_ringdp(_view) on a group made with
                RINGDP_BACKEND_ADOPT_MIN_BYTES=1 MiB: DDP's buckets move into registered
                memory in place at their second all-reduce, which then needs no staging copies

Timing. Every rank runs the same mode at the same time (a barrier before each timed
block), one intra-op thread per rank unless --threads. Rounds interleave the modes (none,
torch, ring, ... then again) so that a slow spell of a shared machine hits all of them;
the first --warmup-rounds rounds are not recorded (first touch of memory, allocator).
Each timed block is --iters steps after --warmup untimed ones; a rank's figure is its
wall time per step, a block's figure the max over ranks. Reported: the median over rounds
(step_ms; robust to a round hit by other load), the mean and the best round.

Exposed communication = median step time of the mode - median step time of `none` (what
the communication adds to a step). For RingDDP the script also reports the time backward()
spent waiting for all-reduces after autograd finished (RingDDP.last_exposed_comm_ms),
measured inside the step.

Output: a table on rank 0, <out-dir>/ddp_step_<device>_w<world>[_<name>].json (machine info,
arguments, every block) and, with --plot, a PNG next to it. Default --out-dir: bench/out/
(ignored by git); the committed results are refreshed with --out-dir bench/results.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import checkout_fallback, Console, count, counts, positive, OUT_DIR, launch, machine_info, save_json, training_group  # noqa: E402

checkout_fallback()  # last on sys.path: PYTHONPATH's or the installed ringdp wins

ALL_MODES = ("none", "torch", "ring", "ring_view", "torch_view", "ring_serial", "torch_ringdp", "torch_nocomm",
             "torch_ringdp_view", "torch_nocomm_view", "torch_ringdp_adopt", "torch_ringdp_view_adopt")
ADOPT_MIN_BYTES = 1 << 20  # the *_adopt modes: RINGDP_BACKEND_ADOPT_MIN_BYTES of their group


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=count(1), default=2, help="ranks to start when not under torchrun")
    p.add_argument("--hidden", default="1024,2560", help="comma-separated hidden sizes H")
    p.add_argument("--layers", type=count(1), default=4)
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d(H) after each Linear (buffers)")
    p.add_argument("--batch", type=count(1), default=8, help="samples per rank")
    p.add_argument("--modes", default="none,torch,ring,ring_view")
    p.add_argument("--warmup", type=count(0), default=3)
    p.add_argument("--iters", type=count(1), default=5)
    p.add_argument("--rounds", type=count(1), default=5)
    p.add_argument("--warmup-rounds", type=count(0), default=1, help="untimed rounds first (first touch of memory)")
    p.add_argument("--threads", type=count(1), default=1, help="intra-op threads per rank")
    p.add_argument("--bucket-cap-mb", type=positive, default=None)
    p.add_argument("--name", default="", help="suffix of the result file name")
    p.add_argument("--out-dir", default=str(OUT_DIR),
                   help="where the JSON/PNG go (default bench/out, ignored by git)")
    p.add_argument("--plot", action="store_true")
    a = p.parse_args(argv)
    try:
        a.hidden = counts(a.hidden)
    except argparse.ArgumentTypeError as e:
        p.error(f"--hidden {e}")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in ALL_MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {ALL_MODES}")
    if "none" not in a.modes:
        a.modes.insert(0, "none")
    return a


def build_model(hidden: int, layers: int, batchnorm: bool = False):
    import torch
    from torch import nn

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden)] + ([nn.BatchNorm1d(hidden)] if batchnorm else []) + [nn.ReLU()]
    return nn.Sequential(*mods)


_ringdp_groups: dict = {}


def ringdp_group(adopt: bool = False):
    """One "cpu:ringdp" group for every torch_ringdp model of the run, and one made with
    RINGDP_BACKEND_ADOPT_MIN_BYTES for the *_adopt ones (made on first use, collectively:
    every rank builds the same modes in the same order)."""
    if adopt not in _ringdp_groups:
        import torch.distributed as dist

        import ringdp  # noqa: F401 -- registers the backend

        # the group's communicator reads the setting when the group is made; the environment
        # is restored after, so a value set outside neither leaks into nor is lost by the run
        with mock.patch.dict(os.environ, {"RINGDP_BACKEND_ADOPT_MIN_BYTES": str(ADOPT_MIN_BYTES if adopt else -1)}):
            _ringdp_groups[adopt] = dist.new_group(backend="cpu:ringdp")
    return _ringdp_groups[adopt]


def _no_comm_hook(state, bucket):
    """torch_nocomm's DDP comm hook: the bucket comes back as it went in, no communication."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def wrap(mode: str, module, args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ringdp.ddp import RingDDP

    cap = args.bucket_cap_mb
    if mode == "none":
        return module
    if mode in ("torch", "torch_view"):
        kw = {} if cap is None else {"bucket_cap_mb": cap}
        return DDP(module, gradient_as_bucket_view=(mode == "torch_view"), **kw)
    if mode in ("torch_ringdp", "torch_ringdp_view", "torch_ringdp_adopt", "torch_ringdp_view_adopt"):
        kw = {} if cap is None else {"bucket_cap_mb": cap}
        return DDP(module, process_group=ringdp_group(adopt=mode.endswith("_adopt")),
                   gradient_as_bucket_view="_view" in mode, **kw)
    if mode in ("torch_nocomm", "torch_nocomm_view"):
        kw = {} if cap is None else {"bucket_cap_mb": cap}
        ddp = DDP(module, gradient_as_bucket_view=mode.endswith("_view"), **kw)
        ddp.register_comm_hook(None, _no_comm_hook)
        return ddp
    if mode in ("ring", "ring_view", "ring_serial"):
        return RingDDP(module, bucket_cap_mb=cap, gradient_as_bucket_view=(mode == "ring_view"),
                       overlap=(mode != "ring_serial"))
    raise ValueError(mode)


def run(rank: int, world: int, args) -> dict | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rows = []
    out = Console(rank)  # (rank 0: a live [block/blocks] counter on stderr)
    n_rounds = args.warmup_rounds + args.rounds
    total, done = len(args.hidden) * n_rounds * len(args.modes), 0
    for hidden in args.hidden:
        models = {m: wrap(m, build_model(hidden, args.layers, args.batchnorm), args) for m in args.modes}
        opts = {m: torch.optim.SGD(models[m].parameters(), lr=1e-3) for m in args.modes}
        g = torch.Generator().manual_seed(rank)
        data = [(torch.randn(args.batch, hidden, generator=g), torch.randn(args.batch, hidden, generator=g))
                for _ in range(4)]
        n_params = sum(p.numel() for p in models["none"].parameters())

        def step(mode, i):
            m, opt = models[mode], opts[mode]
            x, y = data[i % len(data)]
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()

        blocks = {m: [] for m in args.modes}
        internal = {m: [] for m in args.modes}
        for rnd in range(args.warmup_rounds + args.rounds):
            for mode in args.modes:
                for i in range(args.warmup):
                    step(mode, i)
                dist.barrier()
                ex = []
                t0 = time.perf_counter()
                for i in range(args.iters):
                    step(mode, i)
                    if mode.startswith("ring"):
                        ex.append(models[mode].last_exposed_comm_ms)
                dt = (time.perf_counter() - t0) / args.iters * 1e3
                t = torch.tensor([dt, statistics.mean(ex) if ex else 0.0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rnd >= args.warmup_rounds:
                    blocks[mode].append(t[0].item())
                    internal[mode].append(t[1].item())
                done += 1
                warm = " (warm-up)" if rnd < args.warmup_rounds else ""
                out.progress(done, total, f"H={hidden} round {rnd + 1}/{n_rounds}{warm}: {mode} {t[0].item():.1f} ms/step")
        base = statistics.median(blocks["none"])
        for mode in args.modes:
            med = statistics.median(blocks[mode])
            row = {"hidden": hidden, "layers": args.layers, "params": n_params,
                   "grad_mb": n_params * 4 / 1e6, "mode": mode, "step_ms": med,
                   "mean_ms": statistics.mean(blocks[mode]), "best_ms": min(blocks[mode]),
                   "blocks_ms": blocks[mode], "exposed_comm_ms": med - base if mode != "none" else 0.0}
            if mode.startswith("ring"):
                row["ring_internal_exposed_ms"] = statistics.median(internal[mode])
            rows.append(row)
        if rank == 0:
            print_table([r for r in rows if r["hidden"] == hidden], out.line)
        del models, opts
    return rows if rank == 0 else None


def print_table(rows, say=print):
    tref = {r["hidden"]: r["step_ms"] for r in rows if r["mode"] == "torch"}
    say(f"{'H':>6} {'params':>10} {'mode':>10} {'step(ms)':>9} {'best(ms)':>9} {'exposed(ms)':>11} "
          f"{'internal(ms)':>12} {'vs torch':>8}")
    for r in rows:
        vs = r["step_ms"] / tref[r["hidden"]] if r["hidden"] in tref else float("nan")
        internal = r.get("ring_internal_exposed_ms")
        say(f"{r['hidden']:>6} {r['params']:>10} {r['mode']:>10} {r['step_ms']:>9.1f} {r['best_ms']:>9.1f} "
            f"{r['exposed_comm_ms']:>11.1f} {'' if internal is None else f'{internal:.1f}':>12} {vs:>8.2f}")


def plot(rows, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hiddens = sorted({r["hidden"] for r in rows})
    modes = [m for m in ALL_MODES if any(r["mode"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(hiddens), 4.2))
    width = 0.8 / len(modes)
    colors = {"none": "#999999", "torch": "#d62728", "torch_view": "#ff9896", "ring": "#1f77b4",
              "ring_view": "#2ca02c", "ring_serial": "#9467bd", "torch_ringdp": "#ff7f0e",
              "torch_nocomm": "#c5b0d5", "torch_ringdp_view": "#ffbb78", "torch_nocomm_view": "#e7dcef",
              "torch_ringdp_adopt": "#8c564b", "torch_ringdp_view_adopt": "#c49c94"}
    for j, mode in enumerate(modes):
        for k, h in enumerate(hiddens):
            r = next((r for r in rows if r["hidden"] == h and r["mode"] == mode), None)
            if r is None:
                continue
            x = k + (j - (len(modes) - 1) / 2) * width
            compute = r["step_ms"] - max(0.0, r["exposed_comm_ms"])
            ax.bar(x, compute, width, color=colors[mode], label=mode if k == 0 else None)
            if mode != "none":
                ax.bar(x, max(0.0, r["exposed_comm_ms"]), width, bottom=compute, color=colors[mode], alpha=0.45,
                       hatch="//", edgecolor="white")
            ax.text(x, r["step_ms"], f"{r['step_ms']:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(hiddens)))
    ax.set_xticklabels([f"H={h}\n{next(r['params'] for r in rows if r['hidden'] == h) / 1e6:.1f}M params"
                        for h in hiddens])
    ax.set_ylabel("step time (ms); hatched: exposed communication")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_rank(rank, world, args):
    with training_group("gloo"):
        rows = run(rank, world, args)
        if rank == 0:
            info = machine_info(world, "cpu")
            name = f"ddp_step_cpu_w{world}" + (f"_{args.name}" if args.name else "")
            payload = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "rows": rows}
            out = save_json(name, payload, args.out_dir)
            print(f"wrote {out}")
            for h in sorted({r["hidden"] for r in rows}):
                t = {r["mode"]: r for r in rows if r["hidden"] == h}
                if "torch" in t:
                    for m in ("ring", "ring_view", "torch_view", "torch_ringdp", "torch_nocomm", "torch_ringdp_view",
                              "torch_nocomm_view", "torch_ringdp_adopt", "torch_ringdp_view_adopt"):
                        if m in t:
                            print(f"H={h}: {m} step / torch DDP(gloo) step = {t[m]['step_ms'] / t['torch']['step_ms']:.2f}"
                                  f" (exposed comm {t[m]['exposed_comm_ms']:.1f} ms vs {t['torch']['exposed_comm_ms']:.1f} ms)")
            if args.plot:
                png = out.with_suffix(".png")
                who = "RingDDP vs torch DDP(gloo)" if any(m.startswith("ring") for m in args.modes) else \
                    "stock DDP: ringdp vs gloo"
                layer = "Linear(H,H)+BatchNorm1d+ReLU" if args.batchnorm else "Linear(H,H)+ReLU"
                plot(rows, png, f"{who}: world {world}, {args.layers}x {layer}, "
                                f"batch {args.batch}/rank, {args.threads} thread(s)/rank")
                print(f"wrote {png}")


def main(argv=None):
    args = parse_args(argv)
    launch(main_rank, args, args.world, env={"OMP_NUM_THREADS": str(args.threads)})


if __name__ == "__main__":
    main()
