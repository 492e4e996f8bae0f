"""Run under torchrun by tests/test_frameworks.py: Hugging Face Accelerate on a cpu:ringdp
default group. Accelerate's CPU path names only gloo or MPI, and keeps a default group that
exists: the group is made first (README "As a torch.distributed backend"). Writes
RINGDP_TEST_OUT/rank<r>.pt: the backend, the prepared model's type, its parameters after 5
steps, and an Accelerate gather and reduce."""
import os

import torch
import torch.distributed as dist

import ringdp  # noqa: F401 -- registers the backend
from accelerate import Accelerator

from _accelerate_model import STEPS, batch, model_and_optimizer

dist.init_process_group("cpu:ringdp")
acc = Accelerator(cpu=True)
model, opt = acc.prepare(*model_and_optimizer())
r, w = acc.process_index, acc.num_processes
for step in range(STEPS):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x[r::w]), y[r::w])
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
gathered = acc.gather(torch.full((2,), float(r)))
reduced = acc.reduce(torch.tensor([float(r + 1)]), reduction="sum")
torch.save({"backend": dist.get_backend(), "model": type(model).__name__, "params": params,
            "gathered": gathered, "reduced": reduced}, os.path.join(os.environ["RINGDP_TEST_OUT"], f"rank{r}.pt"))
dist.destroy_process_group()
