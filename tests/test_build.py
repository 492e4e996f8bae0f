"""The extension says what it was built with."""
import pytest
import torch

import ringdp


def test_build_info():
    info = ringdp.build_info()
    assert info["version"] == ringdp.__version__
    assert "shm" in info["transports"]
    assert isinstance(info["cuda"], bool)
    assert ("cuda_ipc" in info["transports"]) == info["cuda"]
    # built against the torch that is running (a mismatch would be an ABI hazard)
    assert torch.__version__.startswith(info["built_with_torch"])
    assert info["compiler"]


def _tracked(root) -> list[str] | None:
    """git's list of the checkout's files, or None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [p for p in out.stdout.decode().split("\0") if p]


def test_sdist_holds_the_sources(tmp_path):
    """A source distribution made from the tracked files carries every native source and
    header the build compiles (csrc/: setuptools alone would take the .cpp files it builds and
    leave out every .h, .cuh and .cu, so an sdist failed to compile), the package, the docs,
    the tests and the bench scripts and results they use: each tracked file but CI's own."""
    import shutil
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = _tracked(root)
    if files is None:
        pytest.skip("not a git checkout: no list of tracked files to compare with")
    src = tmp_path / "src"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, src / f)
    run = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src,
                         capture_output=True, text=True, env={**__import__("os").environ, "RINGDP_BUILD_CUDA": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("ringdp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        inside = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = {f for f in files if not f.startswith(".ci/") and f != ".gitignore"}
    missing = sorted(want - inside)
    assert not missing, f"{len(missing)} tracked files not in the sdist: {missing[:20]}"
    assert any(f.endswith(".cuh") for f in inside) and any(f.endswith(".cu") for f in inside)


def test_extension_that_does_not_load_says_why(tmp_path):
    """A package without its extension says to build it; one whose extension is there but does
    not load (built against another torch: an undefined symbol) says so, naming the torch
    that runs, rather than calling it missing. (ringdp/_native.py alone, in a package of
    another name: an editable install's finder would supply the checkout's ringdp._C.)"""
    import shutil
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    copy = tmp_path / "ringdp_alone"
    copy.mkdir()
    (copy / "__init__.py").write_text("")
    shutil.copy2(Path(ringdp.__file__).parent / "_native.py", copy / "_native.py")

    def import_error() -> str:
        run = subprocess.run([sys.executable, "-c", "import ringdp_alone._native"], cwd=tmp_path,
                             capture_output=True, text=True)
        assert run.returncode != 0, "the copy imported"
        return run.stderr.strip().splitlines()[-1]

    assert "ringdp._C is missing" in import_error()
    (copy / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))).write_bytes(b"not a shared object")
    msg = import_error()
    assert "does not load" in msg and f"torch {torch.__version__} here" in msg, msg


def _python_m_ringdp(*args, env=None, torchrun=None, timeout=180):
    """`python -m ringdp ARGS` (under torchrun with `torchrun` ranks), from outside the
    checkout; (exit status, stdout, stderr)."""
    import os
    import subprocess
    import sys
    import tempfile

    from _dist import free_port

    cmd = [sys.executable, "-m", "ringdp", *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(torchrun),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "ringdp", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir(),
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return run.returncode, run.stdout, run.stderr


def test_python_m_ringdp_reports_the_install_and_the_settings():
    """python -m ringdp: versions, transports, /dev/shm's room against what a rank reserves
    (the native layout's figure), the settings set (unknown ones named); an invalid setting
    is exit status 1, naming it."""
    import json

    rc, out, err = _python_m_ringdp("--json", env={"RINGDP_TIMEOUT_S": "7", "RINGDP_NOPE": "1"})
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["ringdp"]["version"] == ringdp.__version__ and "shm" in rep["ringdp"]["transports"]
    assert rep["settings"] == {"RINGDP_TIMEOUT_S": "7"} and rep["timeout_s"] == 7.0
    assert rep["unknown_settings"] == ["RINGDP_NOPE"]
    # 8 slots of 256 KiB, two 256 KiB one-shot buffers and the control block, on 2 MiB pages
    assert rep["dev_shm"]["rank_reserves_bytes"] == 4 << 20 and rep["dev_shm"]["size_bytes"] > 0
    rc, out, err = _python_m_ringdp(env={"RINGDP_TIMEOUT_S": "abc"})
    assert rc == 1 and "INVALID: RINGDP_TIMEOUT_S='abc'" in out, (rc, out, err)
    assert "/dev/shm" in out and "transports" in out


def test_report_of_a_cuda_build_with_an_invalid_setting(monkeypatch):
    """A CUDA build's report (faked: WITH_CUDA and the NCCL query) names every invalid setting
    and applies the valid ones, RINGDP_NCCL_LIBRARY's choice of NCCL among them: build_info
    read the settings itself, and `python -m ringdp` ended in the parser's traceback (the
    CUDA build against torch 2.13+cu130 and 2.11+cu130, 2026-12-07). build_info called bare
    takes the valid settings too, and never raises."""
    import types

    from ringdp import __main__ as main, comm, config

    asked = []
    fake = types.SimpleNamespace(**{k: getattr(comm._C, k) for k in dir(comm._C) if not k.startswith("__")})
    fake.WITH_CUDA = True
    fake.cuda_nccl_info = lambda lib: (asked.append(lib), (True, 22803, ""))[1]  # (ok, version, why)
    monkeypatch.setattr(comm, "_C", fake)
    for name in ("RINGDP_SLOT_BYTES", "RINGDP_ONESHOT_BYTES"):  # (the reserve below: their defaults)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RINGDP_NCCL_LIBRARY", "/opt/libnccl.so.2")
    monkeypatch.setenv("RINGDP_TIMEOUT_S", "abc")
    rep = main.report()
    assert rep["settings_error"] == "RINGDP_TIMEOUT_S='abc': not a number", rep
    assert rep["ringdp"]["cuda"] and rep["ringdp"]["nccl"] == (True, 22803, ""), rep["ringdp"]
    monkeypatch.setenv("RINGDP_SPIN_US", "-5")
    monkeypatch.setenv("RINGDP_FIFO_SLOTS", "4")
    rep = main.report()
    assert rep["settings_error"].count("RINGDP_") == 2 and "RINGDP_SPIN_US='-5'" in rep["settings_error"], rep
    d = config.Config()
    assert rep["dev_shm"]["rank_reserves_bytes"] == comm._C.shm_reserved_bytes(4, d.slot_bytes, d.oneshot_bytes)
    assert comm.build_info()["nccl"] == (True, 22803, "")
    assert asked == ["/opt/libnccl.so.2"] * 3, asked


def test_python_m_ringdp_check_under_torchrun(monkeypatch, capsys):
    """torchrun -m ringdp --check, world 3: every native collective of 0, 1, 7, 1000 and 4099
    elements per rank, twice, gave its closed form on every rank; rank 0 reports for the
    job. Outside torchrun it says how to start it; a failed check is exit status 1, naming
    the rank and the collectives (reporting checked with a made-up outcome)."""
    import json

    import ringdp.__main__ as main

    rc, out, err = _python_m_ringdp("--check", "--json", torchrun=3)
    assert rc == 0, err[-3000:]
    rep = json.loads(out)  # (rank 0's alone: the others print nothing)
    assert rep["check"]["ok"] and rep["check"]["world"] == 3, rep["check"]
    assert [r["rank"] for r in rep["check"]["ranks"]] == [0, 1, 2]
    rc, out, err = _python_m_ringdp("--check")
    assert rc != 0 and "torchrun --nproc-per-node 2 -m ringdp --check" in err, (rc, out, err)
    bad = {"rank": 0, "world": 2, "ok": False, "ranks": [
        {"rank": 0, "failed": [], "error": None, "seconds": 0.1},
        {"rank": 1, "failed": ["all_reduce 7", "broadcast 1"], "error": None, "seconds": 0.1}]}
    monkeypatch.setattr(main, "check", lambda: bad)
    assert main.main(["--check"]) == 1
    shown = capsys.readouterr().out
    assert "check        FAILED: world 2" in shown and "rank 1: wrong values: all_reduce 7, broadcast 1" in shown


def _other_pythons() -> list[tuple[tuple[int, int], str]]:
    """Other CPython 3.x interpreters here (on PATH, or pyenv's) with their headers:
    ((major, minor), include dir), newest first."""
    import glob
    import os
    import shutil
    import subprocess
    import sys

    exes = [shutil.which(f"python3.{minor}") for minor in range(9, 16)]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    exes += sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3")))
    found = {}
    for exe in filter(None, exes):
        try:  # (a pyenv shim of a version that is not selected fails here)
            out = subprocess.run([exe, "-c", "import sys, sysconfig; print(*sys.version_info[:2], "
                                  "sysconfig.get_paths()['include'])"], capture_output=True, text=True, timeout=30)
            major, minor, inc = out.stdout.split(maxsplit=2)
        except (OSError, subprocess.SubprocessError, ValueError):
            continue
        version, inc = (int(major), int(minor)), inc.strip()
        if version != sys.version_info[:2] and glob.glob(os.path.join(inc, "Python.h")):
            found[version] = inc
    return sorted(found.items(), reverse=True)


def test_binding_compiles_against_the_newest_python():
    """The one file that includes Python's headers (csrc/bindings.cpp) compiles against the
    newest other CPython here (syntax only, with this torch's headers): Python 3.13 dropped
    _Py_IsFinalizing from its API, and the build failed there on it."""
    import os
    import subprocess
    from pathlib import Path

    import pybind11
    from torch.utils import cpp_extension

    others = _other_pythons()
    if not others:
        pytest.skip("no other CPython with its headers on PATH")
    (major, minor), inc = others[0]
    root = Path(__file__).resolve().parents[1]
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_C",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *(f"-I{p}" for p in cpp_extension.include_paths()),
           f"-I{pybind11.get_include()}", f"-I{inc}", f"-I{root / 'csrc'}", str(root / "csrc" / "bindings.cpp")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert run.returncode == 0, f"bindings.cpp against Python {major}.{minor}'s headers:\n" + "\n".join(errors[:20])
