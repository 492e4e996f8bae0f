"""The CUDA side of a Communicator: transport choice (CUDA IPC inside a host, NCCL across
hosts), creation through the torch.distributed store, and teardown. The transports
themselves are in csrc/cuda (see docs/cuda.md). Only used when ringdp was built with CUDA."""
from __future__ import annotations

import os
import pathlib
import socket

import torch

from . import _C


def transport_for(hosts: list[str]) -> str:
    """RINGDP_TRANSPORT=ipc|nccl forces one; else IPC when every rank is on one host."""
    forced = os.environ.get("RINGDP_TRANSPORT", "auto").strip().lower()
    if forced in ("ipc", "nccl"):
        return forced
    if forced not in ("auto", "shm"):
        raise ValueError(f"RINGDP_TRANSPORT={forced!r}: expected ipc, nccl, shm or auto")
    return "ipc" if len(set(hosts)) == 1 else "nccl"


def _forced(algo=None) -> str:
    forced = (algo if algo is not None else os.environ.get("RINGDP_ALGO", "auto")).strip().lower()
    if forced not in ("auto", "ring", "oneshot"):
        raise ValueError(f"algo={forced!r}: expected ring, oneshot or auto")
    return forced


def algo_code(nbytes: int, world: int, capacity: int, algo=None) -> int:
    """The algorithm code (0 ring, 1 one-shot) the CUDA transport is told to run."""
    return 1 if algo_for(nbytes, world, algo, capacity) == "oneshot" else 0


def algo_for(nbytes: int, world: int, algo=None, capacity=None) -> str:
    """One-shot when forced (`algo`/RINGDP_ALGO) or, automatically, up to
    RINGDP_CUDA_ONESHOT_MAX_BYTES (default: all of it), and only within the transport's one-shot
    capacity (CudaComm.oneshot_bytes; None: what the IPC transport would have); else the ring."""
    forced = _forced(algo)
    if capacity is None:  # no CUDA transport yet: what it would say
        capacity = 0 if transport_for(["?"]) == "nccl" or world > 16 else (
            _env_int("RINGDP_CUDA_ONESHOT_BYTES") or (256 << 10))
    if capacity == 0 or nbytes > capacity or forced == "ring":
        return "ring"
    limit = min(_env_int("RINGDP_CUDA_ONESHOT_MAX_BYTES") or capacity, capacity)
    return "oneshot" if forced == "oneshot" or nbytes <= limit else "ring"


def wheel_nccl() -> str:
    """RINGDP_NCCL_LIBRARY if set, else libnccl.so.2 of the nvidia-nccl wheel CUDA torch depends
    on ("" lets C++ search what is loaded and the loader's path)."""
    if os.environ.get("RINGDP_NCCL_LIBRARY"):
        return os.environ["RINGDP_NCCL_LIBRARY"]
    try:
        import nvidia.nccl  # type: ignore

        for base in nvidia.nccl.__path__:
            p = pathlib.Path(base) / "lib" / "libnccl.so.2"
            if p.exists():
                return str(p)
    except Exception:
        pass
    return ""


def _env_int(name: str) -> int:
    return int(float(os.environ.get(name, 0)))


def create(comm, device: torch.device):
    """Create and connect the CUDA transport of Communicator `comm` for `device`. Collective."""
    if not getattr(_C, "WITH_CUDA", False):
        raise ValueError(f"rank {comm.rank}: ringdp was built without CUDA (build_info(): no cuda); "
                         "rebuild with a CUDA build of torch and nvcc, RINGDP_BUILD_CUDA=1")
    kind = transport_for(comm.hosts)
    o = _C.CudaOptions()
    o.kind, o.rank, o.world = kind, comm.rank, comm.world
    o.device = device.index if device.index is not None else torch.cuda.current_device()
    o.timeout_s = comm.timeout
    o.slot_bytes = _env_int("RINGDP_CUDA_SLOT_BYTES")
    o.slots = _env_int("RINGDP_CUDA_SLOTS")
    o.channels = _env_int("RINGDP_CUDA_CHANNELS")
    o.oneshot_bytes = _env_int("RINGDP_CUDA_ONESHOT_BYTES")
    o.registered = os.environ.get("RINGDP_CUDA_REGISTERED", "1") != "0"
    if kind == "ipc":
        o.arena_bytes = int(float(os.environ.get("RINGDP_CUDA_ARENA_MB", 256)) * (1 << 20))
    else:
        o.nccl_library = wheel_nccl()
        if os.environ.get("RINGDP_NCCL_HOSTID_PER_RANK") == "1":  # tests: several ranks on one GPU
            os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-ringdp-r{comm.rank}"
    native = _C.cuda_create(o)
    key = f"cuda/{kind}"
    comm._store.set(f"{key}/{comm.rank}", native.local_blob())
    comm._wait_keys(f"the CUDA {kind} records", [f"{key}/{r}" for r in range(comm.world)])
    native.connect([comm._store.get(f"{key}/{r}") for r in range(comm.world)])
    return native


def close(comm, native):
    """Collective teardown: drain, drop peers' mappings, then free own memory."""
    try:
        native.quiesce()
        comm._store.set(f"cuda/closed/{comm.rank}", "1")
        comm._wait_keys("peers to close the CUDA transport", [f"cuda/closed/{r}" for r in range(comm.world)])
    finally:
        native.destroy()
