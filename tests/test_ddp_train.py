"""bench/train.py end to end (two local ranks each run): RingDDP and torch DDP give the
same loss curve, and a run stopped and resumed from its checkpoint ends where an
uninterrupted run ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--world", "2", "--epochs", "2", "--train-size", "512", "--val-size", "128", "--batch", "16",
        "--accum", "2", "--log-every", "2", "--ckpt-every", "4"]


def run_train(*extra, timeout=240, base=TINY):
    """bench/train.py with the `base` arguments, then `extra`; its stdout (fails on an error)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGDP_TIMEOUT_S="60")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "train.py"), *base, *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"train.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout


def read_log(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_ring_and_torch_loss_curves_match(tmp_path):
    out = run_train("--ddp", "both", "--out-dir", str(tmp_path))
    ring, torch_ = read_log(tmp_path / "train_log_ring_cpu_w2.jsonl"), read_log(tmp_path / "train_log_torch_cpu_w2.jsonl")
    losses = lambda log: [(r["step"], r["loss"]) for r in log if "loss" in r]  # noqa: E731
    assert len(losses(ring)) == len(losses(torch_)) >= 8
    for (s1, a), (s2, b) in zip(losses(ring), losses(torch_)):
        assert s1 == s2 and abs(a - b) < 1e-4 * max(1.0, abs(b)), (s1, a, b)
    assert losses(ring)[-1][1] < losses(ring)[0][1]  # it learns
    assert (tmp_path / "train_loss_curves_cpu_w2.png").stat().st_size > 10_000
    assert "[ring] epoch 1 done" in out


def test_resume_continues_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_train("--ddp", "ring", "--out-dir", str(full), "--no-plot")
    out1 = run_train("--ddp", "ring", "--out-dir", str(part), "--no-plot", "--max-steps", "5")
    assert "epoch 1" not in out1  # really stopped inside epoch 0
    ck = torch.load(part / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    assert (ck["epoch"], ck["step"], ck["step_in_epoch"]) == (0, 5, 5)
    assert all(not k.startswith("module.") for k in ck["model"])
    out2 = run_train("--ddp", "ring", "--out-dir", str(part), "--no-plot", "--resume")
    assert "resumed from" in out2
    a = torch.load(full / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    b = torch.load(part / "train_ckpt_ring_cpu_w2.pt", weights_only=False)
    assert a["step"] == b["step"] == 16
    for k, v in a["model"].items():  # parameters and rank 0's BatchNorm statistics
        assert torch.equal(v, b["model"][k]), k
    la = [r for r in read_log(full / "train_log_ring_cpu_w2.jsonl") if "loss" in r and r["step"] > 6]
    lb = [r for r in read_log(part / "train_log_ring_cpu_w2.jsonl") if "loss" in r and r["step"] > 6]
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-6)
