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
    import ringdp

    src = payload["machine"]["ringdp_source"]  # which build ran: the one this test imports
    assert src["path"] == str(Path(ringdp.__file__).resolve().parent.parent), src
    head = subprocess.run(["git", "-C", src["path"], "rev-parse", "HEAD"], capture_output=True, text=True)
    assert src["commit"] == (head.stdout.strip() if head.returncode == 0 else None), src
    assert payload["memcpy"]["one_rank_GBps"] > 0
    assert payload["transport"] == "shm" and payload["complete"] is True
    # the algo column says what the engine ran (flight record): registered tensors go direct
    # past one-shot's sizes, and the roofline factor is named so
    ran = {(r["series"], r["algo"], r["path"]) for r in rows if r["kind"] != "baseline" and r["algo"] != "oneshot"}
    assert ran == {("ringdp", "ring", "ring_staged"), ("ringdp-reg", "direct", "direct")}, ran
    assert {r["path"] for r in rows if r["algo"] == "oneshot"} <= {"oneshot"}
    assert set(payload["roofline"]["bytes_per_rank_over_S"]) == {"ring_ordinary", "direct_registered",
                                                                 "oneshot_ordinary", "oneshot_registered"}
    assert all(r["path"] is None for r in rows if r["kind"] == "baseline")
    assert (tmp_path / "allreduce_cpu_w2_float32.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allreduce_cpu_w2_float32.json",
                                                          "allreduce_cpu_w2_float32.png"]


def test_ringdp_source_outside_a_checkout(tmp_path):
    """A ringdp outside any git work tree: its path, and no commit (nothing invented)."""
    import types

    sys.path.insert(0, str(REPO / "bench"))
    import _common

    pkg = tmp_path / "site" / "ringdp"
    pkg.mkdir(parents=True)
    fake = types.SimpleNamespace(__file__=str(pkg / "__init__.py"))
    assert _common.ringdp_source(fake) == {"path": str(tmp_path / "site"), "commit": None, "dirty": None}


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_busy(tmp_path):
    """--busy 2: the sweep runs beside two busy processes (their pids in the JSON), correct,
    named _busy2, and none of them outlives it."""
    cmd = [sys.executable, str(BENCH), "--world", "2", "-b", "4K", "-e", "64K", "--busy", "2", "--iters", "2",
           "--warmup", "1", "--series", "baseline,ringdp", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    payload = json.loads((tmp_path / "allreduce_cpu_w2_float32_busy2.json").read_text())
    assert payload["args"]["busy"] == 2 and payload["complete"] is True
    assert {r["series"] for r in payload["rows"]} == {"gloo", "ringdp"}
    assert payload["total_wrong"] == 0 and len(payload["rows"]) == 2 * 3
    pids = payload["busy_pids"]
    assert len(pids) == 2 and not any(_alive(p) for p in pids), pids


def test_busy_process_ends_with_its_parent():
    """A busy process whose rank died without cleaning up (SIGTERM, SIGKILL) ends by itself."""
    import time

    code = ("import os, subprocess, sys\n"
            f"sys.path.insert(0, {str(REPO / 'bench')!r})\n"
            "from allreduce import busy_processes\n"
            "h, = busy_processes(1)\n"
            "print(h.pid, flush=True)\n"
            "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"busy process {pid} outlived its parent"


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_forced_algorithms(tmp_path):
    """--algo ring,oneshot: one series per forced algorithm (named by its algo=), its algo
    column what ran: the flight record's path (registered tensors' ring runs direct)."""
    cmd = [sys.executable, str(BENCH), "--world", "2", "-b", "1K", "-e", "4K", "--algo", "ring,oneshot",
           "--no-baseline", "--iters", "2", "--warmup", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    payload = json.loads((tmp_path / "allreduce_cpu_w2_float32_ring+oneshot.json").read_text())
    rows = payload["rows"]
    assert {r["series"] for r in rows} == {"ringdp:ring", "ringdp:oneshot", "ringdp-reg:ring", "ringdp-reg:oneshot"}
    for r in rows:
        want = "direct" if r["series"] == "ringdp-reg:ring" else r["series"].split(":")[1]
        assert r["algo"] == want and r["wrong"] == 0 and r["speedup"] is None, r
        assert r["path"] == {"ring": "ring_staged"}.get(want, want), r
    assert "summary" not in payload  # summaries are bench/report.py's (readme_table.py prints them)


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_halves_algo_column(tmp_path):
    """--coll on one host: the algo column says what ran for what one-shot would stage (world
    3, 128 KiB threshold: a 384 KiB reduce_scatter or broadcast the ring, an all_gather's
    128 KiB input one-shot; 96 KiB one-shot)."""
    cmd = [sys.executable, str(BENCH), "--world", "3", "--coll", "reduce_scatter,all_gather,broadcast", "-b", "96K",
           "-e", "384K", "-f", "4", "--series", "ringdp", "--no-baseline", "--iters", "2", "--warmup", "1",
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    want = {"reduce_scatter": "ring", "all_gather": "oneshot", "broadcast": "ring"}
    for coll, big in want.items():
        rows = json.loads((tmp_path / f"{coll}_cpu_w3_float32.json").read_text())["rows"]
        assert {(r["size"], r["algo"]) for r in rows} == {(96 << 10, "oneshot"), (384 << 10, big)}, coll
        assert all(r["wrong"] == 0 for r in rows), coll


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_hosts(tmp_path):
    """--hosts 2: four ranks as two simulated hosts; the hierarchical series (ordinary and
    registered tensors) run two_level, ringdp-flat the inter-host engine on the whole group,
    all exact, beside flat gloo."""
    cmd = [sys.executable, str(BENCH), "--hosts", "2", "-b", "4K", "-e", "64K", "--iters", "2",
           "--warmup", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    payload = json.loads((tmp_path / "allreduce_cpu_w4_float32_hosts2.json").read_text())
    assert payload["hosts"] == ["sim0", "sim0", "sim1", "sim1"] and payload["cross_path"] == "two_level"
    assert payload["machine"]["world_size"] == 4 and payload["args"]["world"] == 4
    rows = payload["rows"]
    assert {(r["series"], r["algo"]) for r in rows} == {("gloo", "-"), ("ringdp", "two_level"),
                                                         ("ringdp-reg", "two_level"), ("ringdp-flat", "flat")}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["roof_us"] is None for r in rows)
    assert len(rows) == 4 * 3  # 4K, 16K, 64K


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_hosts_parts(tmp_path):
    """--series parts: the two-level all-reduce's steps timed alone beside it (part:inhost
    on each host's ranks, part:cross on each cross-host pair, S / 2 elements), each exact
    against the op over its own group; a "# parts" line per size; the other collectives'
    sweeps leave them out."""
    cmd = [sys.executable, str(BENCH), "--hosts", "2", "-b", "4K", "-e", "64K", "-f", "16", "--iters", "2",
           "--warmup", "1", "--series", "baseline,ringdp,parts", "--coll", "all_reduce,broadcast", "--op", "max",
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = json.loads((tmp_path / "allreduce_cpu_w4_float32_max_hosts2.json").read_text())["rows"]
    assert {(r["series"], r["algo"]) for r in rows} == {("gloo", "-"), ("ringdp", "two_level"),
                                                         ("part:inhost", "-"), ("part:cross", "-")}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows) and len(rows) == 4 * 2
    assert {r["count"] for r in rows if r["series"] == "part:cross"} == {512, 8192}  # S / 2 elements
    assert {r["count"] for r in rows if r["series"] == "part:inhost"} == {1024, 16384}
    assert all(r["speedup"] is None for r in rows if r["series"].startswith("part:"))  # (not all-reduces)
    assert [line.startswith("# parts at ") for line in proc.stdout.splitlines()].count(True) == 2, proc.stdout
    other = json.loads((tmp_path / "broadcast_cpu_w4_float32_max_hosts2.json").read_text())["rows"]
    assert {r["series"] for r in other} == {"gloo", "ringdp"}


def test_part_pattern_is_the_op_over_its_group_alone():
    """PartPattern's result is the op over the part's members of v(r, i) (module doc), not
    over all ranks: for n = 4, members 0 and 1 (a host) and 1 and 3 (a cross-host pair)."""
    pytest.importorskip("ringdp._C", reason="ringdp._C is not built")
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import allreduce

    n, k = 4, 3
    i = torch.arange(allreduce.Pattern("float32", "sum", n, 0, "cpu").block_len)
    v = [n * (i % (2 * k + 1) - k) + 2 * ((i + r) % n) - (n - 1) for r in range(n)]
    for members in ([0, 1], [1, 3]):
        a, b = v[members[0]], v[members[1]]
        for op, want in (("sum", a + b), ("max", torch.maximum(a, b)), ("min", torch.minimum(a, b))):
            got = allreduce.PartPattern("float32", op, n, members[1], "cpu", members)
            assert torch.equal(got.expect, want.float()), (members, op)
            assert torch.equal(got.value, v[members[1]].float())
    full = allreduce.Pattern("float32", "sum", n, 0, "cpu").expect
    assert not torch.equal(allreduce.PartPattern("float32", "sum", n, 0, "cpu", [0, 1]).expect, full)


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_namespace_hosts(tmp_path):
    """bench/netns_hosts.py: the sweep under torchrun on two hosts in namespaces of their own,
    the link shaped (tc tbf): ringdp finds two hosts by hostname (no RINGDP_HOST_ID), takes
    the two-level path, ringdp-flat the inter-host engine, all exact; the JSON says what
    joined the hosts. Skipped where the machine does not allow the namespaces."""
    cmd = [sys.executable, str(REPO / "bench" / "netns_hosts.py"), "--rate", "1gbit", "--timeout", "180", "--",
           str(BENCH), "--series", "baseline,ringdp,ringdp-flat", "-b", "4K", "-e", "256K", "-f", "64", "--iters", "2",
           "--warmup", "1", "--out-dir", str(tmp_path), "--name", "netns"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        p.terminate()  # (its SIGTERM handler removes the namespaces and what runs in them)
        out, err = p.communicate(timeout=60)
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if proc.returncode == 2 and "does not allow the namespaces" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    payload = json.loads((tmp_path / "allreduce_cpu_w4_float32_netns.json").read_text())
    hosts = [h.split("/")[0] for h in payload["hosts"]]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and hosts[0].startswith("ringdp-"), hosts
    assert payload["cross_path"] == "two_level"
    assert payload["machine"]["network"] == "2 hosts in network namespaces, one veth link, 1gbit each way (tc tbf)"
    rows = payload["rows"]
    assert {(r["series"], r["algo"]) for r in rows} == {("gloo", "-"), ("ringdp", "two_level"), ("ringdp-flat", "flat")}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows) and len(rows) == 3 * 2, rows


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_hosts_uneven_other_collectives(tmp_path):
    """--hosts 2 --world 3 (hosts a,a,b: the leaders' path) with reduce_scatter, all_gather
    and broadcast: every series exact, the registered series too (the rank alone on its host
    gets ordinary memory from ringdp.empty)."""
    cmd = [sys.executable, str(BENCH), "--hosts", "2", "--world", "3", "--coll", "reduce_scatter,all_gather,broadcast",
           "-b", "4K", "-e", "16K", "--iters", "2", "--warmup", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for coll in ("reduce_scatter", "all_gather", "broadcast"):
        payload = json.loads((tmp_path / f"{coll}_cpu_w3_float32_hosts2.json").read_text())
        assert payload["hosts"] == ["sim0", "sim0", "sim1"] and payload["cross_path"] == "leaders"
        rows = payload["rows"]
        assert {(r["series"], r["algo"]) for r in rows} == {("gloo", "-"), ("ringdp", "leaders"),
                                                             ("ringdp-reg", "leaders"), ("ringdp-flat", "flat")}
        assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows) and len(rows) == 4 * 2, coll


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_bench_process_group_series(tmp_path):
    """--series ringdp-pg: torch.distributed's collectives on a group of ringdp's backend,
    exact, beside gloo (its speedup column) and ringdp's own calls."""
    cmd = [sys.executable, str(BENCH), "--world", "2", "--series", "baseline,ringdp,ringdp-pg", "--coll",
           "all_reduce,broadcast", "-b", "4K", "-e", "64K", "-f", "16", "--iters", "2", "--warmup", "1",
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"bench failed\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for coll in ("allreduce", "broadcast"):
        rows = json.loads((tmp_path / f"{coll}_cpu_w2_float32.json").read_text())["rows"]
        assert {r["series"] for r in rows} == {"gloo", "ringdp", "ringdp-pg"}, coll
        pg = [r for r in rows if r["series"] == "ringdp-pg"]
        assert len(pg) == 2 and all(r["wrong"] == 0 and r["speedup"] > 0 and r["algo"] == "ring" for r in pg), pg


def test_bench_hosts_rejects_what_needs_one_host():
    """--hosts with a series, op or world it cannot run: a clear usage error (--device cuda is
    allowed with --hosts: the CUDA two-level all-reduce; without a GPU it is the usual
    usage error)."""
    import torch

    cuda = [] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA device visible")]
    for extra, why in (*cuda, (["--series", "baseline,ringdp-flat"], "ringdp-flat needs ringdp too"),
                       (["--world", "1"], "at least as many ranks"),
                       (["--series", "baseline,parts", "--op", "avg"], "--series parts: CPU tensors across hosts")):
        proc = subprocess.run([sys.executable, str(BENCH), "--hosts", "2", *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and why in proc.stderr, (extra, proc.stderr)


@pytest.mark.skipif(not _have_native(), reason="ringdp._C is not built")
def test_fsdp_step_counts_the_unsharded_parameters(tmp_path):
    """bench/fsdp_step.py's params is the model's parameter count, not world times it
    (FSDP2's DTensor parameters count the whole tensor already)."""
    import os

    from torch import nn

    cmd = [sys.executable, str(REPO / "bench" / "fsdp_step.py"), "--world", "2", "--d-model", "16", "--layers", "2",
           "--batch", "1", "--seq", "4", "--iters", "1", "--warmup", "0", "--rounds", "1", "--warmup-rounds", "0",
           "--out-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGDP_TIMEOUT_S="60")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    model = nn.Sequential(*[nn.TransformerEncoderLayer(16, 8, 64, dropout=0.0, batch_first=True) for _ in range(2)])
    want = sum(p.numel() for p in model.parameters())
    rows = json.loads((tmp_path / "fsdp_step_cpu_w2.json").read_text())["rows"]
    assert [r["params"] for r in rows] == [want] * 3, (want, rows)


def test_wait_all_leaves_no_rank_behind():
    """bench/_common.wait_all (bench/cuda_probe.py's ranks): the first failure's status, and
    the ranks still running then are killed and reaped, not left waiting for a dead peer;
    124 past the timeout (all killed); 0 when every one exits 0."""
    import time

    sys.path.insert(0, str(REPO / "bench"))
    from _common import wait_all

    def start(code):
        return subprocess.Popen([sys.executable, "-c", code])

    procs = [start("import time; time.sleep(60)"), start("import sys, time; time.sleep(0.5); sys.exit(3)"),
             start("import sys, time; time.sleep(3); sys.exit(5)"), start("import time; time.sleep(60)")]
    t0 = time.monotonic()
    assert wait_all(procs, timeout=120) == 3  # the first failure, not the later one
    assert time.monotonic() - t0 < 30
    assert all(p.returncode is not None and not _alive(p.pid) for p in procs), [p.returncode for p in procs]
    hung = start("import time; time.sleep(60)")
    assert wait_all([start("pass"), hung], timeout=1) == 124 and hung.returncode is not None
    assert wait_all([start("pass"), start("pass")], timeout=60) == 0
