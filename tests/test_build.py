"""The extension says what it was built with."""
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

    import pytest

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
