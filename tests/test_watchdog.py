"""The watchdog that bounds work finishing elsewhere (csrc/common/watchdog.h: the NCCL
transport's guard against a step that waits on a dead peer while the program only joins
streams), in C++ on threads with fake work: tests/cpp/watchdog.cpp (in time, late, an
asynchronous error, a shorter timeout behind a longer one, no limit, stop() with work
stuck, 20000 items), once as built and once under ThreadSanitizer."""
from __future__ import annotations

import subprocess

import pytest

import _cpp


def _run(exe) -> str:
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"watchdog checks failed:\n{r.stdout}\n{r.stderr}"
    assert ", 0 failed" in r.stdout and "checks passed" in r.stdout, r.stdout
    return r.stdout + r.stderr


def test_watchdog(tmp_path):
    _run(_cpp.build(tmp_path, "watchdog", "tests/cpp/watchdog.cpp"))


def test_watchdog_thread_sanitizer(tmp_path):
    try:
        exe = _cpp.build(tmp_path, "watchdog_tsan", "tests/cpp/watchdog.cpp", flags=("-g", "-fsanitize=thread"))
    except subprocess.CalledProcessError as e:
        pytest.skip(f"no ThreadSanitizer with this compiler: {e}")
    out = _run(exe)
    assert "ThreadSanitizer" not in out, out
