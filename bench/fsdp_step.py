"""Training-step time of stock FSDP2 (torch.distributed.fsdp.fully_shard) on a "cpu:ringdp"
group (ringdp's torch.distributed backend, ringdp/backend.py) against the same on gloo.

Run it
    python bench/fsdp_step.py                          # starts --world (2) local ranks itself
    python bench/fsdp_step.py --d-model 512 --layers 4
    torchrun --nproc-per-node 2 bench/fsdp_step.py

Model: --layers nn.TransformerEncoderLayer(d_model, 8 heads, 4 x d_model feed-forward,
no dropout), each layer and the root fully_shard-ed over the group's DeviceMesh; batch
--batch sequences of --seq tokens per rank; SGD. One step = forward, loss, backward
(FSDP2's reduce-scatter of the gradients; its all-gathers of the parameters in forward and
backward), optimizer step, zero_grad. --mixed: MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32).

Modes: gloo and ringdp (the group's backend); alone: the same FSDP2 model over a mesh of the
rank alone (a gloo group of one), so every all-gather and reduce-scatter is a local copy: FSDP2's
own machinery and the compute with no traffic between ranks, the floor any backend's step
stands on (as ddp_step.py's torch_nocomm is DDP's). Its losses differ (each rank trains on its own
batch only) and are not compared.

Timing as bench/ddp_step.py: the modes in the same run, rounds interleaved (gloo, ringdp,
gloo, ...), a barrier before each timed block of --iters steps after --warmup untimed ones,
a block's figure is the max over ranks of the wall time per step, reported the median over
--rounds (first --warmup-rounds not recorded). Output: a table and the ratio on rank 0,
<out-dir>/fsdp_step_cpu_w<world>[_<name>].json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import checkout_fallback, Console, count, OUT_DIR, launch, machine_info, save_json, training_group  # noqa: E402

checkout_fallback()  # last on sys.path: PYTHONPATH's or the installed ringdp wins

MODES = ("gloo", "ringdp", "alone")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=count(1), default=2, help="ranks to start when not under torchrun")
    p.add_argument("--d-model", type=count(8), default=512)
    p.add_argument("--layers", type=count(1), default=4)
    p.add_argument("--batch", type=count(1), default=4, help="sequences per rank")
    p.add_argument("--seq", type=count(1), default=64)
    p.add_argument("--mixed", action="store_true", help="bf16 parameters, fp32 reduction")
    p.add_argument("--warmup", type=count(0), default=2)
    p.add_argument("--iters", type=count(1), default=4)
    p.add_argument("--rounds", type=count(1), default=3)
    p.add_argument("--warmup-rounds", type=count(0), default=1)
    p.add_argument("--threads", type=count(1), default=1, help="intra-op threads per rank")
    p.add_argument("--name", default="")
    p.add_argument("--out-dir", default=str(OUT_DIR))
    a = p.parse_args(argv)
    if a.d_model % 8:
        p.error(f"--d-model {a.d_model}: a multiple of 8 (the layers' attention heads)")
    return a


def build(args, group):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    d = args.d_model
    model = nn.Sequential(*[nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True)
                            for _ in range(args.layers)])
    kw = {"mesh": DeviceMesh.from_group(group, "cpu")}
    if args.mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def run(rank, world, args):
    import torch
    import torch.distributed as dist

    import ringdp  # noqa: F401 -- registers the backend

    torch.set_num_threads(args.threads)
    alone, _ = dist.new_subgroups(group_size=1, backend="gloo")
    groups = {"gloo": dist.new_group(backend="gloo"), "ringdp": dist.new_group(backend="cpu:ringdp"),
              "alone": alone}
    models = {m: build(args, groups[m]) for m in MODES}
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(args.batch, args.seq, args.d_model, generator=g) for _ in range(2)]
    losses = {m: [] for m in MODES}

    def step(mode, i):
        model, opt = models[mode]
        loss = model(data[i % len(data)]).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    blocks = {m: [] for m in MODES}
    out = Console(rank)  # (rank 0: a live [block/blocks] counter on stderr)
    n_rounds = args.warmup_rounds + args.rounds
    for rnd in range(n_rounds):
        for mode in MODES:
            for i in range(args.warmup):
                losses[mode].append(step(mode, i).item())
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.iters):
                losses[mode].append(step(mode, i).item())
            t = torch.tensor([(time.perf_counter() - t0) * 1e3 / args.iters])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rnd >= args.warmup_rounds:
                blocks[mode].append(t.item())
            warm = " (warm-up)" if rnd < args.warmup_rounds else ""
            out.progress(rnd * len(MODES) + MODES.index(mode) + 1, n_rounds * len(MODES),
                         f"round {rnd + 1}/{n_rounds}{warm}: {mode} {t.item():.1f} ms/step")
    out.clear()
    # FSDP2's parameters are DTensors: numel() is the whole (unsharded) parameter's already
    n_params = sum(p.numel() for p in models["gloo"][0].parameters())
    rows = [{"mode": m, "step_ms": statistics.median(blocks[m]), "best_ms": min(blocks[m]),
             "blocks_ms": blocks[m], "params": n_params} for m in MODES]
    same = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["gloo"], losses["ringdp"]))
    for g_ in (groups["gloo"], groups["ringdp"]):
        dist.destroy_process_group(g_)
    return rows, same


def main_rank(rank, world, args):
    with training_group("gloo"):
        rows, same = run(rank, world, args)
        if rank == 0:
            payload = {"machine": machine_info(world, "cpu"), "args": vars(args), "rows": rows,
                       "max_rel_loss_diff": same}
            out = save_json(f"fsdp_step_cpu_w{world}" + (f"_{args.name}" if args.name else ""), payload,
                            args.out_dir)
            print(f"{'mode':>8} {'step(ms)':>9} {'best(ms)':>9}")
            for r in rows:
                print(f"{r['mode']:>8} {r['step_ms']:>9.1f} {r['best_ms']:>9.1f}")
            t = {r["mode"]: r["step_ms"] for r in rows}
            print(f"FSDP2 step on cpu:ringdp / on gloo = {t['ringdp'] / t['gloo']:.2f}, "
                  f"with no traffic (alone) / on gloo = {t['alone'] / t['gloo']:.2f} "
                  f"({rows[0]['params'] / 1e6:.1f}M parameters, world {world}, mixed={args.mixed}); "
                  f"max relative loss difference {same:.2e}")
            print(f"wrote {out}")


def main(argv=None):
    args = parse_args(argv)
    launch(main_rank, args, args.world, env={"OMP_NUM_THREADS": str(args.threads)})


if __name__ == "__main__":
    main()
