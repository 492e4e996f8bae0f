"""Build a C++ driver of csrc (a simulation, a policy check) with the system compiler, for
the tests that run one: tests/test_cuda.py (the IPC protocol simulation) and
tests/test_shm_wait.py (the shared-memory waits' spin)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build(out_dir: Path, name: str, *sources: str, flags: tuple[str, ...] = ()) -> Path:
    """Compile `sources` (paths relative to the repository) into out_dir/name, with csrc on
    the include path and `flags` added; skip the test where there is no C++ compiler."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        pytest.skip(f"no C++ compiler for {name}")
    exe = out_dir / name
    subprocess.run([cxx, "-std=c++17", "-O1", "-pthread", *flags, f"-I{ROOT / 'csrc'}",
                    *(str(ROOT / s) for s in sources), "-o", str(exe)], check=True, timeout=300)
    return exe
