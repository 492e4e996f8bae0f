"""python -m ringdp: what this install is and what this machine gives it, for a bug report or
before a first run; under torchrun, --check also runs every native collective on the job's
ranks against its closed form (multi-host jobs included: their hierarchical path).

    python -m ringdp [--json]
    torchrun --nproc-per-node 2 -m ringdp --check [--json]

Exit status 1 when a RINGDP_* setting is invalid or a check failed. Reports, never changes
anything: the settings are parsed by ringdp's one parser (config.py), as a run would.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

from . import build_info, config, policy
from ._native import _C


def report() -> dict:
    """This install, this machine's room for ringdp, and the settings in effect."""
    # (an invalid setting is left at its default, and named: the report still comes. build_info
    # takes the settings, which a CUDA build reads for RINGDP_NCCL_LIBRARY: it raised there)
    cfg, errors = config.Config.from_env_and_errors()
    out = {"ringdp": build_info(cfg), "python": platform.python_version(), "platform": platform.platform()}
    out["cores"] = {"usable": len(os.sched_getaffinity(0)), "machine": os.cpu_count()}
    settings = {n: os.environ[n] for n in config.variables() if os.environ.get(n, "").strip()}
    out["settings"] = settings
    out["unknown_settings"] = config.unknown(os.environ)
    if errors:
        out["settings_error"] = "; ".join(errors)
    out["timeout_s"] = cfg.timeout_s
    reserve = _C.shm_reserved_bytes(cfg.fifo_slots, cfg.slot_bytes, cfg.oneshot_bytes)
    try:
        fs = os.statvfs("/dev/shm")
        out["dev_shm"] = {"free_bytes": fs.f_bavail * fs.f_frsize, "size_bytes": fs.f_blocks * fs.f_frsize,
                          "rank_reserves_bytes": reserve, "arena_gb": cfg.arena_gb}
    except OSError as e:
        out["dev_shm"] = {"error": str(e), "rank_reserves_bytes": reserve}
    return out


def _mib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def describe(rep: dict) -> list[str]:
    """The report as lines for a person."""
    info = rep["ringdp"]
    lines = [f"ringdp {info['version']}: built with torch {info['built_with_torch']} ({info['compiler']}); "
             f"running torch {info['torch']}, Python {rep['python']}",
             f"transports   {', '.join(info['transports'])}" + ("" if info["cuda"] else " (CUDA: not built)"),
             f"cores        {rep['cores']['usable']} usable of {rep['cores']['machine']}"]
    shm = rep["dev_shm"]
    if "error" in shm:
        lines.append(f"/dev/shm     cannot be read: {shm['error']}")
    else:
        lines.append(f"/dev/shm     {_mib(shm['free_bytes'])} free of {_mib(shm['size_bytes'])}; each rank of a host "
                     f"reserves {_mib(shm['rank_reserves_bytes'])} at set-up, and its arena "
                     f"(up to {shm['arena_gb']:g} GiB) as tensors register")
        if shm["free_bytes"] < shm["rank_reserves_bytes"] * 2:
            lines.append("             too little for two ranks: enlarge it (docker run --shm-size) or lower "
                         "RINGDP_FIFO_SLOTS / RINGDP_SLOT_BYTES / RINGDP_ONESHOT_BYTES")
    set_ = rep["settings"]
    lines.append("settings     " + (", ".join(f"{k}={v}" for k, v in set_.items()) if set_ else "none set: defaults")
                 + f" (timeout {rep['timeout_s']:g} s)")
    if rep.get("settings_error"):
        lines.append(f"             INVALID: {rep['settings_error']}")
    if rep["unknown_settings"]:
        lines.append(f"             unknown, ignored: {', '.join(rep['unknown_settings'])}")
    return lines


# ----------------------------------------------------------------------------- the check
_SIZES = (0, 1, 7, 1000, 4099)  # elements per rank: empty, one, primes, not divisible by the world
_CHECK_TIMEOUT_S = 60.0  # each collective of the check (a rank that failed before one: the others' wait)


def _closed_forms(rank: int, world: int) -> list[tuple[str, bool]]:
    """Each native collective, every size, twice: (name, whether it gave its closed form)."""
    import ringdp

    results = []
    total = world * (world + 1) / 2  # the sum of (rank + 1) over the ranks

    def small(k: int) -> torch.Tensor:
        # values below 64: every partial sum of a job of up to 4096 ranks is an integer
        # below 2^24, exact in float32 whatever order the ranks add in
        return (torch.arange(k) % 64).float()

    for n in _SIZES:
        for rep in range(2):
            t = small(n) + (rank + 1)
            ringdp.all_reduce(t, timeout=_CHECK_TIMEOUT_S)
            results.append((f"all_reduce {n}", torch.equal(t, small(n) * world + total)))
            out = torch.empty(n)
            ringdp.reduce_scatter_tensor(out, small(world * n) + (rank + 1), timeout=_CHECK_TIMEOUT_S)
            results.append((f"reduce_scatter {n}", torch.equal(out, small(world * n)[rank * n:(rank + 1) * n] * world + total)))
            got = torch.empty(world * n)
            ringdp.all_gather_into_tensor(got, torch.full((n,), float(rank)), timeout=_CHECK_TIMEOUT_S)
            results.append((f"all_gather {n}", torch.equal(got, torch.arange(world).repeat_interleave(n).float())))
            b = torch.full((n,), float(rank + rep))
            ringdp.broadcast(b, src=world - 1, timeout=_CHECK_TIMEOUT_S)
            results.append((f"broadcast {n}", torch.equal(b, torch.full((n,), float(world - 1 + rep)))))
    return results


def check() -> dict:
    """Under torchrun: every rank runs _closed_forms; rank 0 gets every rank's outcome."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("python -m ringdp --check runs on a job's ranks: "
                         "torchrun --nproc-per-node 2 -m ringdp --check")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=policy.DEFAULT_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    try:
        failed = [name for name, ok in _closed_forms(rank, world) if not ok]
        mine = {"rank": rank, "failed": failed, "error": None}
    except Exception as e:  # noqa: BLE001 -- reported, with every other rank's outcome
        mine = {"rank": rank, "failed": [], "error": f"{type(e).__name__}: {e}"}
    mine["seconds"] = round(time.monotonic() - t0, 3)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    import ringdp

    ringdp.destroy()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "ranks": everyone,
            "ok": all(not r["failed"] and r["error"] is None for r in everyone)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringdp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="run every native collective on the job's ranks "
                    "against its closed form (under torchrun)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    a = ap.parse_args(argv)
    rep = report()
    bad = bool(rep.get("settings_error"))
    if a.check and not bad:
        rep["check"] = check()
        bad = not rep["check"]["ok"]
    if a.check and os.environ.get("RANK", "0") != "0":  # (under torchrun rank 0 speaks for the job)
        return int(bad)
    if a.json:
        print(json.dumps(rep, indent=1, default=str))
        return int(bad)
    print("\n".join(describe(rep)))
    if "check" in rep:
        c = rep["check"]
        slow = max(r["seconds"] for r in c["ranks"])
        print(f"check        {'ok' if c['ok'] else 'FAILED'}: world {c['world']}, all_reduce, reduce_scatter, "
              f"all_gather, broadcast of {', '.join(map(str, _SIZES))} elements per rank, twice ({slow:g} s)")
        for r in c["ranks"]:
            if r["failed"] or r["error"]:
                print(f"             rank {r['rank']}: {r['error'] or 'wrong values: ' + ', '.join(r['failed'])}")
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
