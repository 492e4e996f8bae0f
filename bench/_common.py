"""Helpers shared by the benchmarks: machine facts, result files, local launching."""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"  # the committed results (README)
OUT_DIR = REPO / "bench" / "out"  # default output of every script (git-ignored)


def count(low: int = 1):
    """An argparse type: a whole number >= low (ranks, steps, rounds), so that a bad value is
    a usage error naming the option, not a traceback (or a silent run of nothing) later."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        return value

    parse.__name__ = f"whole number >= {low}"
    return parse


def positive(text: str) -> float:
    """An argparse type: a number > 0 (seconds, megabytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not above 0")
    return value


def counts(text: str, low: int = 1) -> list[int]:
    """An argparse type (or a check): a comma list of whole numbers >= low (hidden sizes,
    world sizes, host counts)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < low:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of whole numbers >= {low}")
    return out


def result_file(text: str) -> Path:
    """An argparse type: a result file that exists (a shell pattern that matched nothing comes
    through as itself)."""
    path = Path(text)
    if not path.is_file():
        more = " (a pattern that matched no file?)" if any(c in text for c in "*?[") else ""
        raise argparse.ArgumentTypeError(f"no such file: {text}{more}")
    return path


def checkout_fallback() -> None:
    """Let this checkout's ringdp (uninstalled, built in place) be found, last: its root goes
    at the end of sys.path, so a ringdp on PYTHONPATH (in an A/B, a worktree of the code
    before) or an installed one wins. ddp_step.py, fsdp_step.py and train.py used to put it
    first, so an A/B through PYTHONPATH measured this checkout on both sides (machine
    info's ringdp_source now says which ran)."""
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))


def child_pythonpath() -> str:
    """PYTHONPATH for a process a script starts that imports ringdp (cuda_probe.py's and
    gpu_diag.py's ranks, netns_hosts.py's launchers): this one's PYTHONPATH first, this
    checkout last, so that a ringdp on PYTHONPATH wins there too (checkout_fallback)."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(parts + ([] if str(REPO) in parts else [str(REPO)]))


def wait_all(procs: list, timeout: float, poll_s: float = 0.1) -> int:
    """Wait for every process of `procs` (ranks a script started), `timeout` seconds at most
    in all. Returns 0 if all exited 0, else the first failure seen: its exit status, or 124
    for running past `timeout`. From then on none is left behind: the ones still running are
    killed and reaped (a rank whose peer died would wait for it until its own timeout)."""
    deadline, rc = time.monotonic() + timeout, 0
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or None not in codes:
            rc = failed[0] if failed else 0
            break
        if time.monotonic() >= deadline:
            rc = 124
            break
        time.sleep(poll_s)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    return rc


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ringdp_source(ringdp) -> dict:
    """Which ringdp a run measured: its checkout, and where that is a git work tree, its
    commit and whether tracked files had changes. Runs of two builds interleaved (a
    worktree of the code before on PYTHONPATH) otherwise leave no trace of which was which."""
    root = Path(ringdp.__file__).resolve().parent.parent
    out: dict = {"path": str(root), "commit": None, "dirty": None}

    def git(*argv):
        r = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else None

    try:
        out["commit"] = git("rev-parse", "HEAD")
        if out["commit"]:
            status = git("status", "--porcelain", "--untracked-files=no")
            out["dirty"] = None if status is None else bool(status)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung: the path alone
        pass
    return out


def machine_info(world_size: int | None = None, device: str = "cpu") -> dict:
    """Facts a reader needs to judge a result: where, on what, with which versions."""
    import torch

    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    import ringdp

    info["ringdp"] = ringdp.build_info()
    info["ringdp_source"] = ringdp_source(ringdp)
    if world_size is not None:
        info["world_size"] = world_size
    if os.environ.get("BENCH_NETWORK"):  # what joins the hosts (bench/netns_hosts.py sets it)
        info["network"] = os.environ["BENCH_NETWORK"]
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def save_json(name: str, payload: dict, out_dir: Path | str | None = None) -> Path:
    out = Path(out_dir) if out_dir else OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _spawned(rank, world, port, main_rank, args, env):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), **env)
    main_rank(rank, world, args)


def init_training_group(backend: str = "gloo") -> None:
    """init_process_group(backend) from the environment, for a script that trains (an
    optimizer, torch DDP or FSDP). torch._dynamo is imported first: torch 2.13 imports it at
    the first optimizer step or DDP wrap, and imported after the group exists it keeps
    hidden references to that group, so destroy_process_group() no longer frees it. gloo's
    threads then outlive the script and may drop a finished collective's tensors while the
    interpreter shuts down: the process aborts ("terminate called without an active
    exception", SIGABRT) after its work is done, about once in 30-40 runs on 2 cores. Imported
    before, it keeps none, and destroy_process_group() joins gloo's threads (README
    "Failures"; tests/test_train_recipe.py::test_training_group_is_freed_at_destroy)."""
    import importlib

    import torch.distributed as dist

    importlib.import_module("torch._dynamo")  # imported here anyway by the first optimizer step
    dist.init_process_group(backend)


@contextlib.contextmanager
def training_group(backend: str = "gloo"):
    """A training rank's default group: set up by init_training_group unless the caller
    already has one, and destroyed at the end; after a barrier when the body succeeded (no
    rank tears down while another still runs), at once when it raised (a barrier could wait
    for a rank that is gone)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        init_training_group(backend)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(main_rank, args, world: int, env: dict | None = None):
    """Run main_rank(rank, world, args) on the ranks torchrun gives, or else on `world` local
    ranks started here (env:// rendezvous on 127.0.0.1, extra environment `env`)."""
    if under_torchrun():
        main_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(world, free_port(), main_rank, args, dict(env or {})), nprocs=world)


class Console:
    """Rank 0's output: lines on stdout, a live [done/total] counter on stderr."""

    def __init__(self, rank: int):
        self.on, self.t0, self.live = rank == 0, time.perf_counter(), False

    def line(self, text: str = ""):
        if not self.on:
            return
        self.clear()  # (the counter wiped before the line lands)
        print(text, flush=True)

    def clear(self):
        """Wipe the live counter (before others print)."""
        if self.live:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.live = False

    def progress(self, done: int, total: int, what: str):
        if not self.on:
            return
        el = time.perf_counter() - self.t0
        if sys.stderr.isatty():
            sys.stderr.write(f"\r\033[K[{done}/{total}] {el:.1f}s {what}")
            self.live = True
        elif what.startswith("done"):
            sys.stderr.write(f"[{done}/{total}] {el:.1f}s {what}\n")
        sys.stderr.flush()
