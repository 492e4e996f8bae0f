"""The CUDA endpoint of a Communicator: transport choice (CUDA IPC inside a host, NCCL across
hosts, ringdp/policy.py transport_for), creation and teardown through the communicator's
Rendezvous, and ringdp's stream as torch sees it. The transports themselves are in
csrc/cuda (see docs/cuda.md). Only used when ringdp was built with CUDA."""
from __future__ import annotations

import os
import pathlib
import socket

import torch

from . import policy
from ._native import _C


def nccl_library(cfg) -> str:
    """RINGDP_NCCL_LIBRARY if set, else libnccl.so.2 of the nvidia-nccl wheel CUDA torch depends
    on ("" lets the C++ side take what is loaded, then the loader's path)."""
    if cfg.nccl_library:
        return cfg.nccl_library
    try:
        import nvidia.nccl  # type: ignore

        for base in nvidia.nccl.__path__:
            p = pathlib.Path(base) / "lib" / "libnccl.so.2"
            if p.exists():
                return str(p)
    except Exception:
        pass
    return ""


class CudaEndpoint:
    """One rank's CUDA transport (a csrc/cuda Comm) for one device, plus ringdp's stream."""

    def __init__(self, kind: str, native, device: torch.device):
        self.kind = kind  # "ipc" or "nccl"
        self.native = native
        self.device = device
        # The stream the transport enqueues on, for events and record_stream.
        self.stream = torch.cuda.ExternalStream(native.stream, device=device)

    @classmethod
    def create(cls, comm, device: torch.device) -> "CudaEndpoint":
        """Create and connect the CUDA transport of Communicator `comm` for `device`.
        Collective: every rank of the group calls it (on its first CUDA call)."""
        if not _C.WITH_CUDA:
            raise ValueError(f"rank {comm.rank}: ringdp was built without CUDA (build_info(): no cuda); "
                             "rebuild with a CUDA build of torch and nvcc, RINGDP_BUILD_CUDA=1")
        cfg = comm.config
        kind = policy.transport_for(comm.hosts, cfg)
        o = _C.CudaOptions()
        o.kind, o.rank, o.world = kind, comm.rank, comm.world
        o.device = device.index if device.index is not None else torch.cuda.current_device()
        o.timeout_s = comm.timeout
        o.slot_bytes, o.slots, o.channels = cfg.cuda_slot_bytes, cfg.cuda_slots, cfg.cuda_channels
        o.oneshot_bytes = cfg.cuda_oneshot_bytes
        o.registered = cfg.cuda_registered
        if kind == "ipc":
            o.arena_bytes = int(cfg.cuda_arena_mb * (1 << 20))
        else:
            o.nccl_library = nccl_library(cfg)
            if cfg.nccl_hostid_per_rank:  # tests and benchmarks: several ranks on one GPU
                os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-ringdp-r{comm.rank}"
        native = _C.cuda_create(o)
        native.connect(comm.rendezvous.exchange(f"cuda-{kind}", native.local_blob(), f"the CUDA {kind} records"))
        return cls(kind, native, torch.device("cuda", o.device))

    def close(self, rendezvous) -> None:
        """Collective teardown: drain, drop peers' mappings, barrier, free own memory.
        `rendezvous` None (the process group was destroyed): no barrier, local teardown."""
        try:
            self.native.quiesce()
            if rendezvous is not None:
                rendezvous.barrier("cuda-closed", "peers to close the CUDA transport")
        finally:
            self.native.destroy()
