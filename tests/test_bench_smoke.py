"""The benchmark runs end to end: a tiny sweep, every series correct, JSON and PNG written."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "allreduce.py"


def _have_native() -> bool:
    try:
        import ringdp._C  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    cmd = [sys.executable, str(BENCH), "--world", "2", "--max-bytes", "65536", "--iters", "2",
           "--warmup", "1", "--out-dir", str(tmp_path), "--plot"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    result = tmp_path / "allreduce_cpu_w2_float32.json"
    assert result.exists(), proc.stdout
    payload = json.loads(result.read_text())
    rows = payload["rows"]
    series = {r["series"] for r in rows}
    assert {"gloo", "ringdp", "ringdp-reg"} <= series, (series, payload["notes"])
    assert all(r["wrong"] == 0 for r in rows), [r for r in rows if r["wrong"]]
    assert payload["total_wrong"] == 0
    sizes = sorted({r["size"] for r in rows})
    assert sizes[0] == 4096 and sizes[-1] == 65536
    for r in rows:
        assert r["time_us"] > 0 and r["busbw_GBps"] > 0 and r["iters"] == 2
        if r["series"].startswith("ringdp"):
            assert r["speedup"] is not None and r["roof_us"] > 0
    assert payload["machine"]["world_size"] == 2
    assert payload["memcpy"]["one_rank_GBps"] > 0
    assert (tmp_path / "allreduce_cpu_w2_float32.png").stat().st_size > 0
