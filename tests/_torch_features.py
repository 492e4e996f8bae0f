"""What the installed torch has, for the few tests of features newer than the oldest torch
ringdp runs on.

The suite is written against torch 2.13 (CI's). The GPU machine's python3 has torch 2.11
(bench/gpu_check.sh), where ringdp runs too but a few things are not there: those tests
check the fallback there instead, or skip saying which feature is missing. Everything else
runs alike on both.
"""
from __future__ import annotations

import inspect

import torch
from torch.nn.parallel import DistributedDataParallel

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# UntypedStorage._swap_data_ptr_ (torch 2.13; not in 2.11): Communicator.register_in_place
# moves a tensor's memory with it, and declines (returns False) without it
STORAGE_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

# DDP's forward_sync_buffers and batched_grad_copy (torch 2.13): RingDDP takes 2.13's
# arguments on every torch, so the tests that compare them with torch's DDP need them there
DDP_2_13_ARGUMENTS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters

# gloo's alltoall of tensor lists (dist.all_to_all; all_to_all_single is older): 2.11's gloo
# raises "Backend gloo does not support alltoall", as the backend's inner gloo group then does
GLOO_ALLTOALL_LIST = TORCH >= (2, 13)
