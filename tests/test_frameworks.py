"""Frameworks that start the process group themselves, on a ringdp group (issue 11: "Lightning
or Accelerate"). Skipped where the framework is not installed (.ci/run installs both, pinned)."""
import os
import subprocess
import sys

import pytest
import torch

from _dist import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _torchrun(job, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGDP_TEST_OUT=str(out),
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.join(HERE, job)]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _check_params(outs):
    """Each rank's parameters: bitwise those of rank 0, and those of one process trained on
    the full batches."""
    from _accelerate_model import STEPS, batch, model_and_optimizer

    model, opt = model_and_optimizer()
    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for r, o in enumerate(outs):
        assert all(torch.equal(a, b) for a, b in zip(o["params"], outs[0]["params"])), r
        for a, b in zip(o["params"], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


def test_accelerate_on_a_ringdp_group(tmp_path):
    """Accelerate's prepare()d model on a cpu:ringdp group under torchrun, world 2; its
    gather and reduce through ringdp."""
    pytest.importorskip("accelerate")
    outs = _torchrun("_accelerate_job.py", tmp_path)
    _check_params(outs)
    for r, o in enumerate(outs):
        assert o["backend"] == "cpu:ringdp" and o["model"] == "DistributedDataParallel", (r, o["backend"], o["model"])
        assert torch.equal(o["gathered"], torch.tensor([0.0, 0.0, 1.0, 1.0])), o["gathered"]
        assert torch.equal(o["reduced"], torch.tensor([3.0])), o["reduced"]


def test_lightning_ddp_strategy_on_ringdp(tmp_path):
    """Lightning's DDPStrategy(process_group_backend="ringdp") under torchrun, world 2."""
    pytest.importorskip("lightning")
    outs = _torchrun("_lightning_job.py", tmp_path)
    _check_params(outs)
    assert [o["backend"] for o in outs] == ["ringdp", "ringdp"]
