"""The NCCL transport's guards against a peer that dies, in C++ on threads with
fake work (the transport itself needs a GPU: tests/test_cuda.py):

- tests/cpp/watchdog.cpp: the watchdog of work finishing on a stream
  (csrc/common/watchdog.h; what aborts a communicator whose step waits on a dead peer while
  the program only joins streams): in time, late, an asynchronous error, a shorter timeout
  behind a longer one, no limit (0, infinity, NaN, 10^12 s), stop() with work stuck, 20000
  items;
- tests/cpp/bounded.cpp: a blocking call bounded by a timeout (csrc/common/bounded.h;
  what runs ncclCommInitRank): on time, its exception, past the timeout (and what it made
  released when it returns after all), no limit;
- tests/cpp/failure.cpp: which collectives a failure struck (csrc/common/failure.h; what a
  CUDA Work's is_success()/exception() ask the transport): those not seen finished, or the
  one a device record names and every later one; the first reason stays; on threads.

Each once as built and once under ThreadSanitizer."""
from __future__ import annotations

import subprocess

import pytest

import _cpp

DRIVERS = ["watchdog", "bounded", "failure"]


def _run(exe, name: str) -> str:
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{name} checks failed:\n{r.stdout}\n{r.stderr}"
    assert f"{name}: " in r.stdout and "checks passed, 0 failed" in r.stdout, r.stdout
    return r.stdout + r.stderr


@pytest.mark.parametrize("name", DRIVERS)
def test_guard(tmp_path, name):
    _run(_cpp.build(tmp_path, name, f"tests/cpp/{name}.cpp"), name)


@pytest.mark.parametrize("name", DRIVERS)
def test_guard_thread_sanitizer(tmp_path, name):
    try:
        exe = _cpp.build(tmp_path, name + "_tsan", f"tests/cpp/{name}.cpp", flags=("-g", "-fsanitize=thread"))
    except subprocess.CalledProcessError as e:
        pytest.skip(f"no ThreadSanitizer with this compiler: {e}")
    out = _run(exe, name)
    assert "ThreadSanitizer" not in out, out
