"""The adaptive spin of the shared-memory ring's waits (csrc/transport/shm/wait.h,
SpinLearner), in C++ on threads: tests/cpp/wait_policy.cpp, built here with the system
compiler (the rule in closed form, waits against a peer that is not running, and a
ping-pong against a running peer 5 and 20 us late that must keep the whole spin)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_adaptive_spin(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "wait_policy"
    subprocess.run([cxx, "-std=c++17", "-O1", "-pthread", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "tests/cpp/wait_policy.cpp"), str(ROOT / "csrc/transport/shm/wait.cpp"),
                    "-o", str(exe)], check=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"adaptive spin checks failed:\n{r.stdout}\n{r.stderr}"
    assert "checks passed, 0 failed" in r.stdout, r.stdout
