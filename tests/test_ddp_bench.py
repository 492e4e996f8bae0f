"""Smoke test of bench/ddp_step.py on a tiny model: it runs every mode, writes its JSON
and plot, and its rows are coherent. (Speed is measured by running the script, not here.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ddp_step_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGDP_TIMEOUT_S="60")
    cmd = [sys.executable, str(ROOT / "bench" / "ddp_step.py"), "--world", "2", "--hidden", "64,128", "--layers", "2",
           "--iters", "2", "--warmup", "1", "--rounds", "1", "--warmup-rounds", "0", "--modes", "none,torch,ring,ring_view,torch_view,ring_serial,torch_ringdp,torch_nocomm,torch_ringdp_view,torch_nocomm_view",
           "--out-dir", str(tmp_path), "--plot"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    doc = json.loads((tmp_path / "ddp_step_cpu_w2.json").read_text())
    rows = doc["rows"]
    assert {(x["hidden"], x["mode"]) for x in rows} == {(h, m) for h in (64, 128)
                                                       for m in ("none", "torch", "ring", "ring_view", "torch_view", "ring_serial",
                                                                 "torch_ringdp", "torch_nocomm", "torch_ringdp_view",
                                                                 "torch_nocomm_view")}
    for x in rows:
        assert x["step_ms"] > 0 and len(x["blocks_ms"]) == 1 and x["best_ms"] <= x["mean_ms"]
        assert x["params"] == 2 * (x["hidden"] ** 2 + x["hidden"])
        if x["mode"].startswith("ring"):
            assert x["ring_internal_exposed_ms"] >= 0
    assert doc["machine"]["world_size"] == 2
    assert (tmp_path / "ddp_step_cpu_w2.png").stat().st_size > 10_000
    assert "ring step / torch DDP(gloo) step" in r.stdout


def test_ddp_step_batchnorm_smoke(tmp_path):
    """--batchnorm: a BatchNorm1d after each Linear (its weight and bias among the parameters)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGDP_TIMEOUT_S="60")
    cmd = [sys.executable, str(ROOT / "bench" / "ddp_step.py"), "--world", "2", "--hidden", "64", "--layers", "2",
           "--batchnorm", "--iters", "2", "--warmup", "1", "--rounds", "1", "--warmup-rounds", "0", "--modes",
           "none,torch,ring,torch_ringdp", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    doc = json.loads((tmp_path / "ddp_step_cpu_w2.json").read_text())
    assert doc["args"]["batchnorm"] is True
    assert [x["mode"] for x in doc["rows"]] == ["none", "torch", "ring", "torch_ringdp"]
    assert all(x["params"] == 2 * (64 ** 2 + 64 + 2 * 64) and x["step_ms"] > 0 for x in doc["rows"])


def test_fsdp_step_smoke(tmp_path):
    """bench/fsdp_step.py on a tiny model: gloo, ringdp and alone (the no-traffic floor) rows,
    gloo and ringdp train to the same losses."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGDP_TIMEOUT_S="60")
    cmd = [sys.executable, str(ROOT / "bench" / "fsdp_step.py"), "--world", "2", "--d-model", "32", "--layers", "2",
           "--batch", "2", "--seq", "8", "--iters", "2", "--warmup", "1", "--rounds", "2", "--warmup-rounds", "0",
           "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    doc = json.loads((tmp_path / "fsdp_step_cpu_w2.json").read_text())
    assert [x["mode"] for x in doc["rows"]] == ["gloo", "ringdp", "alone"]
    for x in doc["rows"]:
        assert x["step_ms"] > 0 and len(x["blocks_ms"]) == 2 and x["best_ms"] <= x["step_ms"]
    assert doc["max_rel_loss_diff"] < 1e-5
    assert "with no traffic (alone) / on gloo" in r.stdout
