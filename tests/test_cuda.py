"""ringdp on CUDA: the IPC ring (world 2, 3, 4 on cuda:0), the NCCL transport (world 2 on
one GPU, each rank its own NCCL_HOSTID), reduce_scatter / all_gather / broadcast on both
(world 2 and 3), RingDDP on CUDA against a single process, the torch.distributed backend on
CUDA, and stream ordering. All of these carry the `cuda` marker and are skipped without a GPU and a
CUDA build of ringdp.

Two tests run everywhere: the CPU simulations (csrc/cuda/sim) of the IPC protocol, which
drives the real ring engine and the real step planner with threads as ranks and checks
every slot/tensor reuse, the results, and freedom from deadlock; and of the NCCL
transport's steps (nccl_steps.h), with NCCL's point-to-point emulated.

RINGDP_REQUIRE_CUDA=1 (bench/gpu_check.sh sets it) turns every such skip into a failure
that says why (no GPU, ringdp built without CUDA, libnccl missing), so that a run on a GPU
machine where everything was skipped never reads as a pass.

Values are small integers that depend on rank and index, exact in every dtype:
    v(r, i) = (i % 13) + 2((r + i) % n)   (tests/_closed_form.py value)
    SUM = n(i%13) + n(n-1)   MIN = i%13   MAX = i%13 + 2(n-1)   AVG = i%13 + n - 1
Ranks sharing one GPU without MPS are time-sliced: correct, slow. Keep the matrix modest.
"""
from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys

import pytest
import torch

import _cpp
from _closed_form import expected, nan_expected, nan_input, same_with_nan, value
from _dist import run_ranks, values

REQUIRE_CUDA = os.environ.get("RINGDP_REQUIRE_CUDA", "") == "1"


def _why_no_cuda() -> str | None:
    """None when the CUDA tests can run here, else the reason they cannot."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__} (torch.version.cuda={torch.version.cuda})"
    try:
        import ringdp

        info = ringdp.build_info()
    except Exception as e:  # noqa: BLE001
        return f"ringdp cannot be imported: {type(e).__name__}: {e}"
    if not info.get("cuda"):
        return f"ringdp was built without CUDA (build_info(): {info}); rebuild with RINGDP_BUILD_CUDA=1"
    return None


WHY_NO_CUDA = _why_no_cuda()
HAVE_CUDA = WHY_NO_CUDA is None


def _skip(reason: str):
    """Skip, or fail under RINGDP_REQUIRE_CUDA=1: a GPU run must not pass by skipping."""
    if REQUIRE_CUDA:
        pytest.fail(f"RINGDP_REQUIRE_CUDA=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def needs_cuda(fn):
    """The `cuda` marker; skipped (RINGDP_REQUIRE_CUDA=1: failed) without a GPU and a CUDA build."""
    if not HAVE_CUDA:
        inner = fn

        @functools.wraps(inner)
        def fn(*args, **kwargs):
            _skip(f"needs a CUDA GPU and ringdp built with CUDA: {WHY_NO_CUDA}")

    return pytest.mark.cuda(fn)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 13, 1000, 4099, 65537, 300_007]

CONFIGS = {
    "default": {},
    # small slots, two per connection, 3 channels: many rounds and back-pressure on every
    # step; the ring even for small messages
    "tiny-ring": {"RINGDP_CUDA_SLOT_BYTES": "65536", "RINGDP_CUDA_SLOTS": "2", "RINGDP_CUDA_CHANNELS": "3",
                  "RINGDP_ALGO": "ring"},
    # the one-shot kernel for everything that fits its buffer
    "oneshot": {"RINGDP_ALGO": "oneshot", "RINGDP_CUDA_ONESHOT_BYTES": str(4 << 20)},
}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ============================================================== CPU: protocol simulation
def test_protocol_simulation(tmp_path):
    """The IPC ring protocol (csrc/cuda/protocol.h + csrc/ring/ring.cpp) on threads."""
    exe = _cpp.build(tmp_path, "protocol_sim", "csrc/cuda/sim/protocol_sim.cpp", "csrc/ring/ring.cpp")
    r = subprocess.run([str(exe), "--quick"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"protocol simulation failed:\n{r.stdout}\n{r.stderr}"
    assert "configurations passed" in r.stdout


def test_nccl_step_simulation(tmp_path):
    """The NCCL transport's steps (csrc/cuda/nccl_steps.h + csrc/ring/ring.cpp) on threads,
    NCCL's point-to-point emulated as a rendezvous: every send meets a receive of its size,
    no deadlock, results of all four collectives (every broadcast root) at world 1-6."""
    exe = _cpp.build(tmp_path, "nccl_sim", "csrc/cuda/sim/nccl_sim.cpp", "csrc/ring/ring.cpp")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"NCCL step simulation failed:\n{r.stdout}\n{r.stderr}"
    assert "4500 configurations passed" in r.stdout, r.stdout


# ============================================================== rank bodies (spawned)
def _setup(rank):
    torch.cuda.set_device(0)


def _matrix(rank, world, sizes, dtypes, registered):
    import torch.distributed as dist

    import ringdp

    _setup(rank)
    failures, digests, checked = [], [], 0
    for dtype in dtypes:
        ops = ["SUM", "MIN", "MAX"] + (["AVG"] if dtype.is_floating_point else [])
        for op in ops:
            for count in sizes:
                exp = expected(op, world, count, dtype)
                for rep in range(2):  # each collective twice in a row, fresh input each time
                    if registered:
                        t = ringdp.empty(count, dtype=dtype, device="cuda")
                    else:
                        t = torch.empty(count, dtype=dtype, device="cuda")
                    t.copy_(value(rank, count, dtype, "cuda", world=world))
                    ringdp.all_reduce(t, op=getattr(dist.ReduceOp, op))
                    got = t.cpu()  # the current stream waits for ringdp's result
                    checked += 1
                    digests.append(_digest(got))
                    if not torch.equal(got, exp):
                        bad = (got.to(torch.float64) != exp.to(torch.float64)).nonzero()
                        failures.append((str(dtype), op, count, rep, bad[:5].flatten().tolist()))
    torch.cuda.synchronize()
    w = ringdp.all_reduce(torch.ones(5, device="cuda"), async_op=True)  # surfaces device-side errors
    w.wait()
    return checked, failures, digests


def _assert_matrix(res):
    vals = values(res)
    for r, (checked, failures, _) in enumerate(vals):
        assert checked > 0
        assert not failures, f"rank {r}: wrong results (dtype, op, count, rep, first bad indices): {failures[:10]}"
    d0 = vals[0][2]
    for r, (_, _, d) in enumerate(vals):
        assert d == d0, f"rank {r}'s results are not bitwise identical to rank 0's"


# ============================================================== IPC ring
@needs_cuda
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ipc_matrix(world, config):
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "120", **CONFIGS[config]}
    res = run_ranks(_matrix, world, SIZES, DTYPES, False, env=env, timeout=1500)
    _assert_matrix(res)


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", ["default", "tiny-ring"])
def test_ipc_registered(world, config):
    """Tensors from ringdp.empty(device="cuda") live in the IPC arena: the successor reads
    them in place (no staging copy) and the drain keeps them until it is done."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "120", "RINGDP_CUDA_ARENA_MB": "64", **CONFIGS[config]}
    res = run_ranks(_matrix, world, [1, 4099, 300_007], [torch.float32, torch.float16, torch.int64], True, env=env,
                    timeout=900)
    _assert_matrix(res)


def _mismatch(rank, world):
    import ringdp

    _setup(rank)
    t = torch.ones(100 + rank, device="cuda")  # rank 1 has one element more
    try:
        w = ringdp.all_reduce(t, async_op=True)
        w.wait()  # waits for the device and raises what it reported
        torch.cuda.synchronize()
        ringdp.all_reduce(torch.ones(3, device="cuda"))  # at the latest, the next call raises
    except Exception as e:  # RingError
        return f"{type(e).__name__}: {e}"
    return "no error"


@needs_cuda
@pytest.mark.parametrize("algo", ["oneshot", "ring"])
def test_ipc_mismatch_raises(algo):
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "20", "RINGDP_ALGO": algo}
    msgs = values(run_ranks(_mismatch, 2, env=env, timeout=180))
    for r, m in enumerate(msgs):
        assert m != "no error", f"rank {r} did not notice the size mismatch"
        assert f"rank {r}" in m, m
        assert "mismatch" in m or "gave up" in m or "timed out" in m, m


def _stream_order(rank, world):
    import ringdp

    _setup(rank)
    n = 1 << 20
    t = torch.zeros(n, device="cuda")
    results = []
    for it in range(3):
        # A slow kernel, then the kernel that writes the "gradient", both on the current
        # stream, right before the all-reduce is issued: ringdp must wait for them.
        torch.cuda._sleep(50_000_000)
        t.fill_(float(rank + 1 + it))
        ringdp.all_reduce(t)
        # The "optimizer" reads right after, on the current stream; then overwrites.
        r = t.clone()
        t.fill_(-1.0)
        results.append((r.min().item(), r.max().item()))
    # The same on a non-default stream.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        t.fill_(float(rank + 10))
        ringdp.all_reduce(t)
        r = t.clone()
    s.synchronize()
    results.append((r.min().item(), r.max().item()))
    return results


@needs_cuda
@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_stream_ordering(transport):
    world = 2
    env = _transport_env(transport)
    res = values(run_ranks(_stream_order_entry, world, transport, env=env, timeout=600))
    for r, got in enumerate(res):
        for it in range(3):
            want = float(sum(q + 1 + it for q in range(world)))
            assert got[it] == (want, want), f"rank {r} iteration {it}: {got[it]} != {want}"
        want = float(sum(q + 10 for q in range(world)))
        assert got[3] == (want, want), f"rank {r} side stream: {got[3]} != {want}"


def _work_semantics(rank, world, transport):
    """CUDA Work as torch's NCCL work: wait() returns once the collective is enqueued and
    makes the current stream wait (no host synchronisation), is_completed() asks the GPU,
    get_future() is CUDA-aware."""
    import ringdp

    _nccl_env(rank)
    _setup(rank)
    n = 1 << 20
    t = torch.empty(n, device="cuda")
    ringdp.all_reduce(t)  # sets the CUDA endpoint up
    torch.cuda.synchronize()
    want = float(sum(q + 1 for q in range(world)))
    out = {}
    t.fill_(float(rank + 1))
    torch.cuda._sleep(500_000_000)  # the GPU is busy on the current stream before the call
    w = ringdp.all_reduce(t, async_op=True)
    w.wait()
    out["pending_after_wait"] = not w.is_completed()  # the host did not wait for the GPU
    r = t.clone()  # ordered after the collective by wait()
    torch.cuda.synchronize()
    out["completed_later"] = w.is_completed()
    out["wait_result"] = (r.min().item(), r.max().item())
    t.fill_(float(rank + 1))
    torch.cuda._sleep(100_000_000)
    fut = ringdp.all_reduce(t, async_op=True).get_future()
    v = fut.wait()[0].clone()  # the future orders the current stream after ringdp's
    torch.cuda.synchronize()
    out["future_result"] = (v.min().item(), v.max().item())
    out["want"] = want
    return out


@needs_cuda
@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_cuda_work_semantics(transport):
    env = _transport_env(transport)
    for r, out in enumerate(values(run_ranks(_work_semantics, 2, transport, env=env, timeout=300))):
        want = (out["want"], out["want"])
        assert out["pending_after_wait"], f"rank {r}: Work.wait() synchronised the host with the GPU"
        assert out["completed_later"], f"rank {r}: is_completed() stayed False after the GPU finished"
        assert out["wait_result"] == want, f"rank {r}: after wait(): {out['wait_result']} != {want}"
        assert out["future_result"] == want, f"rank {r}: get_future(): {out['future_result']} != {want}"


def _registered_freed_in_flight(rank, world):
    """A registered tensor dropped while its all-reduce still waits on ringdp's stream (behind
    a busy GPU; the call returned once enqueued): the next ringdp.empty() must not hand its
    block out before the collective is done (the caching allocator's record_stream does not
    cover ringdp's arena: IpcComm::free defers the block to an event on ringdp's stream). The
    new tensor, filled at once on a stream that does not wait for the collective, keeps its
    values: the collective's result is not written into it."""
    import ringdp

    _setup(rank)
    n = 1 << 18
    warm = ringdp.empty(n, device="cuda")
    warm.fill_(1.0)
    ringdp.all_reduce(warm)  # sets the CUDA endpoint up
    del warm
    torch.cuda.synchronize()
    t = ringdp.empty(n, device="cuda")
    t.fill_(float(rank + 1))
    torch.cuda._sleep(500_000_000)  # the collective waits behind this on ringdp's stream
    ringdp.all_reduce(t)  # (inline: enqueued when it returns; the current stream joins ringdp's)
    old = t.data_ptr()
    del t
    u = ringdp.empty(n, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # not ordered after the collective
        u.fill_(100.0 + rank)
    torch.cuda.synchronize()
    ringdp.synchronize()
    return u.data_ptr() == old, (u.min().item(), u.max().item())


@needs_cuda
def test_registered_tensor_freed_in_flight():
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "60", "RINGDP_CUDA_ARENA_MB": "16"}
    for r, (same_block, (lo, hi)) in enumerate(values(run_ranks(_registered_freed_in_flight, 2, env=env, timeout=240))):
        assert (lo, hi) == (100.0 + r, 100.0 + r), (
            f"rank {r}: a new registered tensor got {lo}..{hi} instead of {100 + r} (its block was "
            f"handed out while the collective of a dropped tensor still used it; same block: {same_block})")


def _nan_min_max(rank, world, transport):
    """MIN and MAX of CUDA tensors with NaNs on some ranks (tests/_closed_form.py nan_input):
    a NaN ignored unless every rank has one (fmin/fmax, as NCCL and ringdp's CPU kernels),
    all_reduce by ring and (IPC) one-shot, and reduce_scatter."""
    import torch.distributed as dist

    import ringdp

    _nccl_env(rank)
    _setup(rank)
    bad = []
    for op in ("MIN", "MAX"):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for n in (7, 4099, 300007):
                want = nan_expected(op, world, n, dtype)
                for algo in ("ring", "oneshot") if transport == "ipc" and n < 65536 else ("ring",):
                    t = nan_input(rank, world, n, dtype).cuda()
                    ringdp.all_reduce(t, op=getattr(dist.ReduceOp, op), algo=algo)
                    if not same_with_nan(t.cpu(), want):
                        bad.append(("all_reduce", op, str(dtype), n, algo))
                res = torch.empty(n, dtype=dtype, device="cuda")
                inp = torch.cat([nan_input(rank, world, n, dtype)] * world).cuda()
                ringdp.reduce_scatter_tensor(res, inp, op=getattr(dist.ReduceOp, op))
                if not same_with_nan(res.cpu(), want):
                    bad.append(("reduce_scatter", op, str(dtype), n))
    return bad


@needs_cuda
@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_cuda_min_max_ignore_nan(transport):
    env = _transport_env(transport)
    for r, bad in enumerate(values(run_ranks(_nan_min_max, 2, transport, env=env, timeout=600))):
        assert not bad, (r, bad)


def _stream_order_entry(rank, world, transport):
    _nccl_env(rank)
    return _stream_order(rank, world)


# ============================================================== NCCL transport
def _skip_without_nccl():
    try:
        from ringdp import _C

        ok = bool(getattr(_C, "cuda_nccl_available", lambda: False)())
    except Exception:
        ok = False
    if not ok:
        _skip("libnccl.so.2 cannot be loaded (nvidia-nccl wheel missing?)")


def _transport_env(transport):
    """The ranks' environment for a world-2 test of `transport` ("ipc" or "nccl": skipped
    without libnccl; each rank its own NCCL host, _nccl_env)."""
    env = {"RINGDP_TRANSPORT": transport, "RINGDP_TIMEOUT_S": "120"}
    if transport == "nccl":
        _skip_without_nccl()
        env["RINGDP_TEST_NCCL_HOSTID"] = "1"
    return env


def _nccl_env(rank):
    # Two ranks on one GPU: NCCL refuses duplicates unless each rank looks like its own host
    # (sockets between them: slow, fine for correctness).
    if os.environ.get("RINGDP_TEST_NCCL_HOSTID"):
        os.environ["NCCL_HOSTID"] = f"ringdp-test-host-{rank}"


def _nccl_matrix(rank, world, sizes, dtypes):
    _nccl_env(rank)
    return _matrix(rank, world, sizes, dtypes, False)


@needs_cuda
@pytest.mark.parametrize("config", ["default", "tiny"])
def test_nccl_world2(config):
    _skip_without_nccl()
    env = {"RINGDP_TRANSPORT": "nccl", "RINGDP_TIMEOUT_S": "180", "RINGDP_TEST_NCCL_HOSTID": "1"}
    if config == "tiny":
        env["RINGDP_CUDA_SLOT_BYTES"] = "65536"
    res = run_ranks(_nccl_matrix, 2, [0, 1, 7, 4099, 300_007], DTYPES, env=env, timeout=1200)
    _assert_matrix(res)



_NCCL_LIBRARY_SCRIPT = r"""
import json, os, sys
import ringdp
from ringdp import _native, config, cuda_comm
C, link, libc = _native._C, sys.argv[1], sys.argv[2]
out = {"named_not_nccl": ringdp.build_info()["nccl"],  # (RINGDP_NCCL_LIBRARY=libc)
       "named_missing": C.cuda_nccl_info(link + ".missing")}
wheel = cuda_comm.nccl_library(config.Config(nccl_library=""))
if wheel:
    out["wheel"] = C.cuda_nccl_info(wheel)
    os.symlink(wheel, link)
    out["symlink_to_it"] = C.cuda_nccl_info(link)
    out["any"] = C.cuda_nccl_info("")
    out["another"] = C.cuda_nccl_info(libc)
print(json.dumps(out))
"""


def test_nccl_library_named_is_the_one(tmp_path):
    """A RINGDP_NCCL_LIBRARY that cannot be loaded (missing, or not NCCL) is an error naming
    it: it fell back quietly to the libnccl.so.2 on the loader's path (found 2026-12-07).
    Once one NCCL is loaded, naming it again (or a symlink to it) is that one, and naming
    another is an error saying one NCCL per process: the second name was ignored. Needs a
    CUDA build of ringdp (the NCCL query needs no GPU: runs on a CUDA build without one)."""
    import json

    from ringdp import _C

    if not _C.WITH_CUDA:
        _skip("ringdp was built without CUDA (rebuild with RINGDP_BUILD_CUDA=1)")
    libc = next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libc.so.6", "/lib64/libc.so.6")
                if os.path.exists(p))
    env = {**os.environ, "RINGDP_NCCL_LIBRARY": libc}
    r = subprocess.run([sys.executable, "-c", _NCCL_LIBRARY_SCRIPT, str(tmp_path / "libnccl.so.2"), libc],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    ok, version, why = out["named_not_nccl"]
    assert not ok and f"{libc}: loaded, but lacks ncclSend" in why and "RINGDP_NCCL_LIBRARY" in why, why
    assert why.count("\n  ") == 1, why  # (that library alone was tried)
    ok, _, why = out["named_missing"]
    assert not ok and "libnccl.so.2.missing" in why and why.count("\n  ") == 1, why
    if "wheel" not in out:
        _skip("no nvidia-nccl wheel here: the checks after a load need it")
    assert out["wheel"][0] and out["wheel"][1] >= 20700, out
    assert out["symlink_to_it"] == out["wheel"] and out["any"] == out["wheel"], out
    ok, _, why = out["another"]
    assert not ok and "one NCCL per process" in why and libc in why and "nvidia/nccl" in why, why
# ============================================================== the halves and broadcast
# per rank: empty, one element, whole 16-byte blocks (the one-shot kernel's vector path), a
# prime (not divisible by any world)
HALF_SIZES = [0, 1, 1024, 4099]
HALF_DTYPES = [torch.float32, torch.bfloat16]
HALF_OPS = ["SUM", "AVG", "MAX"]


def _half_dtypes(transport: str) -> list:
    """The dtypes of _halves: the one-shot variant adds an 8-byte type (2 elements a vector)."""
    return HALF_DTYPES + [torch.float64] if transport.endswith("oneshot") else HALF_DTYPES


def _halves(rank, world, transport, registered):
    """reduce_scatter_tensor, all_gather_into_tensor and broadcast on CUDA tensors through
    ringdp's module functions, each call twice (the second asynchronous), against closed
    forms (module doc: v(r, i) = (i % 13) + 2((r + i) % n)). registered: every buffer from
    ringdp.empty(device="cuda") (IPC: all_gather and broadcast read it in place).
    transport "ipc-oneshot": every call must be one the communicator runs one-shot, "ipc": the
    ring (each checked with algo_for on what one-shot would stage).
    Returns (calls checked, wrong calls, whether the buffers were registered)."""
    import torch.distributed as dist

    import ringdp

    _nccl_env(rank)
    _setup(rank)
    want_algo = {"ipc": "ring", "ipc-oneshot": "oneshot"}.get(transport)

    def algo_is(t, what, dtype, count):
        """(for a call that one-shot would stage `t` for) that it runs the variant's algorithm."""
        if want_algo and count:
            got = ringdp.get_communicator().algo_for(t.numel() * t.element_size(), "cuda")
            if got != want_algo:
                bad.append((what, str(dtype), count, f"runs {got}, not {want_algo}"))

    def buf(n, dtype, fill):
        t = ringdp.empty(n, dtype=dtype, device="cuda") if registered else torch.empty(n, dtype=dtype, device="cuda")
        t.fill_(fill)  # garbage where the collective must write
        return t

    def run(rep, fn, *args, **kwargs):
        if rep == 0:
            return fn(*args, **kwargs)
        return fn(*args, async_op=True, **kwargs).wait()

    checked, bad, reg = 0, [], []
    for dtype in _half_dtypes(transport):
        for count in HALF_SIZES:
            n = world * count
            for op in HALF_OPS:  # reduce_scatter: rank r gets the reduction of block r
                want = expected(op, world, n, dtype)[rank * count:(rank + 1) * count]
                for rep in range(2):
                    inp = buf(n, dtype, 0)
                    inp.copy_(value(rank, n, dtype, "cuda", world=world))
                    out = buf(count, dtype, -1)
                    algo_is(inp, "reduce_scatter", dtype, count)
                    run(rep, ringdp.reduce_scatter_tensor, out, inp, op=getattr(dist.ReduceOp, op))
                    got, kept = out.cpu(), inp.cpu()
                    checked += 1
                    if not torch.equal(got, want):
                        bad.append(("reduce_scatter", str(dtype), op, count, rep))
                    if not torch.equal(kept, value(rank, n, dtype, world=world)):
                        bad.append(("reduce_scatter modified its input", str(dtype), op, count, rep))
            want = torch.cat([value(q, count, dtype, world=world) for q in range(world)])
            for rep in range(2):  # all_gather: block q = rank q's input; rep 1 from a block of the output
                out = buf(n, dtype, -1)
                if rep == 1:
                    inp = out[rank * count:(rank + 1) * count]
                else:
                    inp = torch.empty(count, dtype=dtype, device="cuda")
                inp.copy_(value(rank, count, dtype, "cuda", world=world))
                if count:  # (an empty tensor's data pointer says nothing)
                    reg.append(ringdp.get_communicator().is_registered(out))
                algo_is(inp, "all_gather", dtype, count)
                run(rep, ringdp.all_gather_into_tensor, out, inp)
                checked += 1
                if not torch.equal(out.cpu(), want):
                    bad.append(("all_gather", str(dtype), count, rep))
            for root in range(world):  # broadcast: from every root, sync and async
                rep = root % 2
                t = buf(count, dtype, -1)
                if rank == root:
                    t.copy_(value(root, count, dtype, "cuda", world=world))
                algo_is(t, "broadcast", dtype, count)
                run(rep, ringdp.broadcast, t, root)
                checked += 1
                if not torch.equal(t.cpu(), value(root, count, dtype, world=world)):
                    bad.append(("broadcast", str(dtype), count, root))
    ringdp.synchronize()  # surfaces device-side errors
    return checked, bad, all(reg) if reg else None


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("transport", ["ipc", "ipc-oneshot", "nccl"])
def test_cuda_halves(transport, world):
    """reduce_scatter_tensor (SUM, AVG, MAX), all_gather_into_tensor and broadcast on CUDA
    tensors, float32 and bfloat16, 0 / 1 / 1024 / 4099 elements per rank, sync then async.
    ipc: the ring (forced: these sizes would go one-shot); ipc-oneshot: the one-shot kernel;
    nccl: the ring."""
    env = {"RINGDP_TRANSPORT": transport.split("-")[0], "RINGDP_TIMEOUT_S": "120"}
    if transport.startswith("ipc"):
        env["RINGDP_ALGO"] = "oneshot" if transport.endswith("oneshot") else "ring"
    if transport == "nccl":
        _skip_without_nccl()
        env["RINGDP_TEST_NCCL_HOSTID"] = "1"
    res = values(run_ranks(_halves, world, transport, False, env=env, timeout=480))
    for r, (checked, bad, reg) in enumerate(res):
        assert checked == len(_half_dtypes(transport)) * len(HALF_SIZES) * (2 * len(HALF_OPS) + 2 + world)
        assert not bad, f"rank {r}: wrong results: {bad[:10]}"
        assert reg is False, f"rank {r}: ordinary tensors reported as registered"


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
def test_ipc_halves_registered(world):
    """The same with every buffer from ringdp.empty(device="cuda"): all_gather and broadcast
    read them in place (and drain before the caller gets them back), reduce_scatter stays
    staged (its input is checked untouched)."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "120", "RINGDP_CUDA_ARENA_MB": "32",
           "RINGDP_ALGO": "ring"}  # (in place is the ring's; these sizes would go one-shot)
    res = values(run_ranks(_halves, world, "ipc", True, env=env, timeout=480))
    for r, (checked, bad, reg) in enumerate(res):
        assert checked > 0
        assert not bad, f"rank {r}: wrong results: {bad[:10]}"
        assert reg is True, f"rank {r}: ringdp.empty(device='cuda') buffers were not registered"


def _halves_mismatch(rank, world):
    import ringdp

    _setup(rank)
    t = torch.ones(1000, device="cuda")
    try:
        if rank == 0:  # rank 0 gathers, rank 1 broadcasts (from rank 0: only the collective differs)
            out = torch.empty(2000, device="cuda")
            ringdp.all_gather_into_tensor(out, t, async_op=True).wait()
        else:
            ringdp.broadcast(t, 0, async_op=True).wait()
        torch.cuda.synchronize()
        ringdp.synchronize()  # the rank that consumed the other's slice reports the mismatch here
        # the other one (whose own call completed) fails here, when the first has given up
        ringdp.all_reduce(torch.ones(3, device="cuda"))
        ringdp.synchronize()
    except Exception as e:  # RingError
        return f"{type(e).__name__}: {e}"
    return "no error"


@needs_cuda
@pytest.mark.parametrize("algo", ["ring", "oneshot"])
def test_ipc_halves_mismatch_raises(algo):
    """Ranks in different collectives (all_gather vs broadcast) fail, naming the rank,
    instead of mixing them (the slot's or the one-shot buffer's descriptor carries the
    collective)."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "20", "RINGDP_ALGO": algo}
    msgs = values(run_ranks(_halves_mismatch, 2, env=env, timeout=180))
    for r, m in enumerate(msgs):
        assert m != "no error", f"rank {r} did not notice the mismatch"
        assert f"rank {r}" in m, m
        assert "mismatch" in m or "gave up" in m or "timed out" in m, m


def _roots_disagree(rank, world, numel):
    import ringdp

    _setup(rank)
    t = torch.full((numel,), float(rank + 1), device="cuda")
    try:
        ringdp.broadcast(t, rank)  # every rank believes it is the root
        torch.cuda.synchronize()
        ringdp.synchronize()
    except Exception as e:  # RingError
        return f"{type(e).__name__}: {e}"
    return "no error"


@needs_cuda
@pytest.mark.parametrize("numel, algo", [(1000, "ring"), (5 << 20, "ring"), (1000, "oneshot")],
                         ids=["one-slice", "many-slices", "oneshot"])
def test_ipc_broadcast_roots_disagree_raises(numel, algo):
    """Two ranks that both believe they are the broadcast's root both fail in that call,
    naming the mismatch (the chain is closed: the root checks its predecessor's descriptor,
    ring.cpp ring_broadcast), instead of each keeping its own values. With more slices than
    slots too: the check comes before either waits for a slot the other never frees. One-shot:
    the buffers' descriptors carry the root."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "20", "RINGDP_CUDA_SLOT_BYTES": str(1 << 20),
           "RINGDP_CUDA_SLOTS": "2", "RINGDP_ALGO": algo}
    msgs = values(run_ranks(_roots_disagree, 2, numel, env=env, timeout=180))
    for r, m in enumerate(msgs):
        assert m != "no error", f"rank {r} returned from a broadcast whose ranks disagree on the root"
        assert f"rank {r}" in m, m
        assert "mismatch" in m or "gave up" in m, m


# ============================================================== RingDDP on CUDA
class _ComplexNet(torch.nn.Module):
    """Complex layers between real ones, `gain` used conjugated (autograd hands its gradient
    over as a lazy conjugate): RingDDP reduces complex gradients as their real views, in
    buckets apart from the real ones, as torch's DDP does (tests/test_ddp.py ComplexMLP on
    the CPU)."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.inp = nn.Linear(32, 64)
        self.c1 = nn.Linear(64, 32, dtype=torch.complex64)
        self.gain = nn.Parameter(torch.randn(32, dtype=torch.complex64))
        self.c2 = nn.Linear(32, 16, dtype=torch.complex64)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        h = self.c1(torch.relu(self.inp(x)).to(torch.complex64)) * self.gain.conj()
        h = self.c2(h * torch.sigmoid(h.abs()))
        return self.out(torch.view_as_real(h).flatten(-2))


def _ddp_net(complex_params: bool):
    from torch import nn

    if complex_params:
        return _ComplexNet()
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _ddp_case(rank, world, steps, complex_params=False):
    import torch.distributed as dist
    from torch import nn

    import ringdp

    _setup(rank)
    torch.manual_seed(0)
    net = _ddp_net(complex_params).cuda()
    ref = _ddp_net(complex_params).cuda()
    ref.load_state_dict(net.state_dict())
    model = ringdp.RingDDP(net, device_ids=[0], bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234)
    per = 16
    for _ in range(steps):
        x = torch.randn(world * per, 32, generator=g).cuda()
        y = torch.randn(world * per, 8, generator=g).cuda()
        # RingDDP: this rank's shard; mean loss per shard -> averaged gradients = full batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        # single process on the full batch
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    worst = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
    digest = hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes() for p in net.parameters())).hexdigest()
    dist.barrier()
    return worst, digest


@needs_cuda
@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_ringddp_cuda_matches_single_process(transport):
    env = {"RINGDP_TRANSPORT": transport, "RINGDP_TIMEOUT_S": "120", "RINGDP_CUDA_ARENA_MB": "16"}
    if transport == "nccl":
        _skip_without_nccl()
        env["RINGDP_TEST_NCCL_HOSTID"] = "1"
    res = values(run_ranks(_ddp_entry, 2, 5, env=env, timeout=600))
    for r, (worst, _) in enumerate(res):
        assert worst < 1e-5, f"rank {r}: parameters differ from single-process training by {worst}"
    assert res[0][1] == res[1][1], "ranks ended with different parameters"


def _ddp_entry(rank, world, steps, complex_params=False):
    _nccl_env(rank)
    return _ddp_case(rank, world, steps, complex_params)


@needs_cuda
def test_ringddp_cuda_complex_parameters():
    """RingDDP on CUDA (IPC) with complex parameters beside real ones, one used conjugated:
    the single-process run on the full batch, ranks bitwise identical."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "120", "RINGDP_CUDA_ARENA_MB": "16"}
    res = values(run_ranks(_ddp_entry, 2, 5, True, env=env, timeout=600))
    for r, (worst, _) in enumerate(res):
        assert worst < 1e-5, f"rank {r}: parameters differ from single-process training by {worst}"
    assert res[0][1] == res[1][1], "ranks ended with different parameters"


# ============================================================== two simulated hosts (issue 12)
# Hosts a,a,b,b (or a,a,a,b) on one GPU (RINGDP_HOST_ID), NCCL between "hosts" over sockets (a
# host id per rank). Two levels: CUDA IPC inside each host, ringdp's NCCL transport between
# the ranks of one local rank (uneven hosts: between the hosts' first ranks; ringdp/cuda_comm.py
# _hierarchy, ringdp/hosts.py on_cuda); RINGDP_HIERARCHY=0: the flat NCCL ring.
# 16 blocks per IPC ring: two hosts' rings on one GPU (4 x 16 blocks) stay resident together
_TWO_HOSTS_ENV = {"RINGDP_TIMEOUT_S": "120", "RINGDP_TEST_NCCL_HOSTID": "1", "RINGDP_CUDA_ARENA_MB": "16",
                  "RINGDP_CUDA_CHANNELS": "16"}


def _as_two_hosts(rank, hosts="aabb"):
    os.environ["RINGDP_HOST_ID"] = hosts[rank]
    _nccl_env(rank)


def _two_hosts_matrix(rank, world, sizes, dtypes, hosts):
    import ringdp

    _as_two_hosts(rank, hosts)
    checked, failures, digests = _matrix(rank, world, sizes, dtypes, False)
    comm = ringdp.get_communicator()
    return checked, failures, digests, comm.cross_path, comm._cuda.hier is not None


@needs_cuda
@pytest.mark.parametrize("path", ["two_level", "leaders", "flat"])
def test_cuda_two_hosts(path):
    _skip_without_nccl()
    env = dict(_TWO_HOSTS_ENV, RINGDP_HIER_PIECE_BYTES="65536")  # 300007 float32: two pieces
    if path == "flat":
        env["RINGDP_HIERARCHY"] = "0"
    hosts = "aaab" if path == "leaders" else "aabb"  # (leaders: rank 3 alone on host b, no IPC)
    res = run_ranks(_two_hosts_matrix, 4, [0, 1, 7, 4099, 300_007], DTYPES, hosts, env=env, timeout=600)
    _assert_matrix([("ok", v[:3]) for v in values(res)])
    for r, (_, _, _, cross, hier) in enumerate(values(res)):
        assert cross == path and hier == (path != "flat"), (r, cross, hier)


def _two_hosts_halves(rank, world, hosts, registered):
    os.environ["RINGDP_HOST_ID"] = hosts[rank]
    return _halves(rank, world, "hosts", registered)


@needs_cuda
@pytest.mark.parametrize("registered", [False, True])
@pytest.mark.parametrize("path", ["two_level", "leaders"])
def test_cuda_two_hosts_halves(path, registered):
    """reduce_scatter_tensor, all_gather_into_tensor and broadcast of CUDA tensors across two
    simulated hosts on the hierarchy (IPC in the host, NCCL across), closed forms, sync and
    async, from every root; registered: buffers from ringdp.empty(device="cuda"), this
    host's IPC arena (a rank alone on its host: the flat endpoint's memory)."""
    _skip_without_nccl()
    hosts = "aaab" if path == "leaders" else "aabb"
    res = values(run_ranks(_two_hosts_halves, 4, hosts, registered, env=dict(_TWO_HOSTS_ENV), timeout=480))
    for r, (checked, bad, reg) in enumerate(res):
        assert checked == len(HALF_DTYPES) * len(HALF_SIZES) * (2 * len(HALF_OPS) + 2 + 4)
        assert not bad, f"rank {r}: wrong results: {bad[:10]}"


def _ddp_two_hosts(rank, world, steps):
    _as_two_hosts(rank)
    return _ddp_case(rank, world, steps)


@needs_cuda
def test_ringddp_cuda_two_hosts():
    """RingDDP on CUDA across two simulated hosts (two levels) against the single-process model."""
    _skip_without_nccl()
    res = values(run_ranks(_ddp_two_hosts, 4, 5, env=dict(_TWO_HOSTS_ENV), timeout=600))
    for r, (worst, _) in enumerate(res):
        assert worst < 1e-5, f"rank {r}: parameters differ from single-process training by {worst}"
    assert len({d for _, d in res}) == 1, "ranks ended with different parameters"


def _two_hosts_mismatch(rank, world):
    import time

    import ringdp

    _as_two_hosts(rank)
    _setup(rank)
    t0 = time.monotonic()
    try:
        ringdp.all_reduce(torch.ones(4099 + (rank == 3), device="cuda"))  # the same padded block on every rank
        ringdp.synchronize()  # (a device-side failure is raised here at the latest)
        return None, time.monotonic() - t0
    except ringdp.RingError as e:
        return str(e), time.monotonic() - t0


@needs_cuda
def test_cuda_two_hosts_mismatch_raises():
    """Rank 3 all-reduces 4100 elements, the others 4099, on two simulated hosts: ranks 1 and 3
    fail their call check (naming both calls), abort NCCL and reject their IPC call; ranks 0
    and 2, whose check passed, get the rejection from the device by synchronize(): a
    RingError on every rank within the timeout, no hang."""
    _skip_without_nccl()
    res = values(run_ranks(_two_hosts_mismatch, 4, env=dict(_TWO_HOSTS_ENV, RINGDP_TIMEOUT_S="20"), timeout=240))
    for r, (msg, took) in enumerate(res):
        assert msg is not None, f"rank {r}: no error"
        assert took < 20 + 30, (r, took, msg)
    for r in (1, 3):
        assert "4100 elements" in res[r][0], res[r][0]


def _cuda_host_dies(rank, world, when):
    """Host b's ranks (2, 3) SIGKILLed after a good call: before the survivors' next calls, or
    while the survivors are calling (within the NCCL step across hosts)."""
    _as_two_hosts(rank)
    return _cuda_peer_killed(rank, world, when, victims=(2, 3))


@needs_cuda
@pytest.mark.parametrize("when", ["before", "during"])
def test_cuda_two_hosts_host_dies(when):
    """A whole host dies under the two-level CUDA all-reduce: each survivor gets a RingError
    within the timeout (10 s), from the call check (gloo) or ringdp's NCCL step, never a hang
    or a process killed by a watchdog."""
    _skip_without_nccl()
    env = dict(_TWO_HOSTS_ENV, RINGDP_TIMEOUT_S="10")
    res = run_ranks(_cuda_host_dies, 4, when, env=env, allow_missing=(2, 3), timeout=240)
    for r in (0, 1):
        status, value = res[r]
        assert status == "ok", (r, value)
        assert value is not None, f"rank {r} never noticed host b died"
        msg, took = value
        assert f"rank {r}" in msg, msg
        assert took < 10 + 30, f"rank {r} took {took:.1f} s to fail (timeout 10 s): {msg}"


def _cross_step_aborted(rank, world):
    """Hosts a,a,b (the leaders' path): host b's rank starts its cross-host step late (a long
    kernel first); meanwhile host a's leader (rank 0) aborts its NCCL endpoint, as its
    watchdog does on a timeout or an NCCL error, while its in-host broadcast waits behind that
    step. Returns, of the good call before and of this call: whether each Work says success,
    its exception, and whether the tensor holds the closed form."""
    import threading

    import ringdp

    _as_two_hosts(rank, "aab")
    _setup(rank)
    n, want = 1 << 20, float(world * (world + 1) // 2)
    first = torch.full((n,), float(rank + 1), device="cuda")
    good = ringdp.all_reduce(first, async_op=True)
    ringdp.synchronize()
    t = torch.full((n,), float(rank + 1), device="cuda")
    if rank == 2:
        torch.cuda._sleep(int(4e9))  # ~2 s of GPU time before its cross-host step
    w = ringdp.all_reduce(t, async_op=True)
    try:
        w.wait()  # (returns once the call is enqueued: its host-side steps are done)
    except ringdp.RingError:
        pass  # (what it says is the Work's exception() below)
    if rank == 0:  # while its NCCL step waits for rank 2's, and its in-host broadcast behind it
        nccl = next(ep.native for ep, _ in ringdp.get_communicator()._cuda._parts if ep.kind == "nccl")
        threading.Timer(0.3, lambda: nccl.abort("test: the cross-host step was aborted")).start()
    torch.cuda.synchronize()
    e = w.exception()
    return (good.is_success(), bool((first == want).all().item()), w.is_completed(), w.is_success(),
            None if e is None else str(e), bool((t == want).all().item()))


@needs_cuda
def test_cuda_two_hosts_aborted_cross_step_fails_host_peers():
    """An aborted cross-host NCCL step returns, and the in-host steps queued behind it would
    run on what it left: its rank's IPC endpoint follows the NCCL one (cuda_api.h follow), so
    the abort halts it first; that rank's in-host broadcast fails at its start, and rank 1,
    which reads it, fails with the reason, instead of a Work that says success over a wrong
    result. No Work says success with a wrong result on any rank."""
    _skip_without_nccl()
    res = values(run_ranks(_cross_step_aborted, 3, env=dict(_TWO_HOSTS_ENV, RINGDP_TIMEOUT_S="20"), timeout=240))
    for r, (good_ok, good_right, done, ok, err, right) in enumerate(res):
        assert good_ok and good_right, (r, res[r])
        assert done, (r, res[r])
        assert right or not ok, f"rank {r}: its Work says success, but its tensor is wrong ({err})"
    for r in (0, 1):
        assert not res[r][3] and res[r][4] is not None, (r, res[r])
    assert "test: the cross-host step was aborted" in res[0][4], res[0][4]
    assert "rank 0 stopped: its NCCL endpoint was aborted" in res[1][4], res[1][4]
    assert "test: the cross-host step was aborted" in res[1][4], res[1][4]


# ============================================================== the backend on CUDA (issue 11)
def _backend_ddp(rank, world, steps, spec):
    """Stock torch DDP on a CUDA model in a default group of ringdp's backend (`spec`):
    with "cuda:ringdp" its gradient all-reduces run on ringdp's CUDA transport (the
    communicator's CUDA endpoint exists afterwards), with "cuda:nccl" on the inner NCCL
    group (no endpoint); both equal one process on the full batch."""
    import torch.distributed as dist
    from torch import nn

    import ringdp

    _nccl_env(rank)  # with "cuda:nccl" DDP's broadcasts (its start) go to the inner NCCL group
    _setup(rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    ref = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    ref.load_state_dict(net.state_dict())
    model = nn.parallel.DistributedDataParallel(net, device_ids=[0], bucket_cap_mb=0.01)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(99)
    per = 8
    for _ in range(steps):
        x, y = torch.randn(world * per, 32, generator=g).cuda(), torch.randn(world * per, 8, generator=g).cuda()
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    worst = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
    digest = hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes() for p in net.parameters())).hexdigest()
    endpoint = ringdp.get_communicator(dist.group.WORLD)._cuda is not None
    t = torch.full((1000,), float(rank + 1), device="cuda")
    dist.all_reduce(t)  # and a plain all_reduce through the backend
    ok = bool((t == world * (world + 1) / 2).all().item())
    dist.barrier()
    return worst, digest, endpoint, ok


@needs_cuda
@pytest.mark.parametrize("spec", ["cpu:ringdp,cuda:ringdp", "cpu:ringdp,cuda:nccl"])
def test_backend_stock_ddp_cuda(spec):
    _skip_without_nccl()
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "120", "RINGDP_CUDA_ARENA_MB": "16",
           "RINGDP_TEST_NCCL_HOSTID": "1"}
    res = values(run_ranks(_backend_ddp, 2, 4, spec, env=env, timeout=600, backend=spec))
    for r, (worst, _, endpoint, ok) in enumerate(res):
        assert worst < 1e-5, f"rank {r}: stock DDP on {spec} differs from one process by {worst}"
        assert endpoint == (spec.endswith("cuda:ringdp")), f"rank {r}: ringdp's CUDA path ran: {endpoint} ({spec})"
        assert ok, f"rank {r}: dist.all_reduce on {spec} gave a wrong sum"
    assert res[0][1] == res[1][1], "ranks ended with different parameters"


def _graph_capture(rank, world, via):
    """A collective made while the current stream captures a CUDA graph. via "ringdp":
    ringdp.all_reduce refuses it (ValueError naming the capture) without touching its
    endpoint, which works as before afterwards. via "backend": dist.all_reduce on a
    "cpu:ringdp,cuda:ringdp" group hands it to its inner NCCL group (made eagerly first, by a
    PRODUCT all-reduce, which ringdp does not reduce), whose call the graph holds: replayed,
    it sums the values filled in before the replay."""
    import torch.distributed as dist

    import ringdp

    _nccl_env(rank)
    _setup(rank)
    want = float(world * (world + 1) // 2)
    t = torch.full((4099,), float(rank + 1), device="cuda")
    ringdp.all_reduce(t) if via == "ringdp" else dist.all_reduce(t)  # the endpoint, outside the capture
    torch.cuda.synchronize()
    if via == "backend":
        dist.all_reduce(torch.ones(4, device="cuda"), op=dist.ReduceOp.PRODUCT)  # the inner NCCL group
        torch.cuda.synchronize()
    x = torch.zeros(4099, device="cuda")
    g = torch.cuda.CUDAGraph()
    refused = None
    try:
        with torch.cuda.graph(g):
            x.fill_(float(rank + 1))
            ringdp.all_reduce(x) if via == "ringdp" else dist.all_reduce(x)
    except ValueError as e:
        refused = str(e)
    replayed = None
    if refused is None:
        x.zero_()
        g.replay()
        torch.cuda.synchronize()
        replayed = bool((x == want).all().item())
    u = torch.full((4099,), float(rank + 1), device="cuda")
    ringdp.all_reduce(u) if via == "ringdp" else dist.all_reduce(u)
    torch.cuda.synchronize()
    return refused, replayed, bool((t == want).all().item()), bool((u == want).all().item())


@needs_cuda
@pytest.mark.parametrize("via", ["ringdp", "backend"])
def test_graph_capture(via):
    """ringdp's CUDA collectives cannot be captured into a CUDA graph (a replay would reuse
    the counter values its kernels wait for): the direct API refuses the call with a clear
    error and stays usable; the backend runs captured calls on its inner NCCL group."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "60", "RINGDP_CUDA_ARENA_MB": "16"}
    if via == "backend":
        _skip_without_nccl()
        env["RINGDP_TEST_NCCL_HOSTID"] = "1"
    spec = "cpu:ringdp,cuda:ringdp" if via == "backend" else "gloo"
    res = values(run_ranks(_graph_capture, 2, via, env=env, timeout=240, backend=spec))
    for r, (refused, replayed, before, after) in enumerate(res):
        assert before and after, (r, res[r])
        if via == "ringdp":
            assert refused is not None and f"rank {r}" in refused and "capturing a CUDA graph" in refused, refused
        else:
            assert refused is None and replayed, (r, res[r])


def _backend_halves(rank, world):
    """torch.distributed's reduce_scatter_tensor (SUM, AVG, PREMUL_SUM; complex PREMUL_SUM,
    async), reduce_scatter (list), all_gather_into_tensor, all_gather (list; also async on a
    side stream) and broadcast on CUDA tensors in a default group of "cpu:ringdp,cuda:ringdp":
    they run on ringdp's CUDA transport (its endpoint exists, the inner NCCL group was never
    made), with closed-form results."""
    import torch.distributed as dist

    _setup(rank)
    n, bad = 4099, []
    inp = value(rank, world * n, torch.float32, "cuda", world=world)

    def block(q):
        return (torch.arange(world * n) % 13).float()[q * n:(q + 1) * n]

    out = torch.empty(n, device="cuda")
    dist.reduce_scatter_tensor(out, inp)
    if not torch.equal(out.cpu(), world * block(rank) + world * (world - 1)):
        bad.append("reduce_scatter_tensor SUM")
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG, async_op=True).wait()
    if not torch.equal(out.cpu(), block(rank) + (world - 1)):
        bad.append("reduce_scatter_tensor AVG")
    dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(0.5))  # FSDP2's way
    if not torch.equal(out.cpu(), (world * block(rank) + world * (world - 1)) * 0.5):
        bad.append("reduce_scatter_tensor PREMUL_SUM")
    if not torch.equal(inp.cpu(), value(rank, world * n, torch.float32, world=world)):
        bad.append("reduce_scatter_tensor modified its input")
    # complex, as FSDP2 reduce-scatters a complex parameter's gradient: its real view on
    # ringdp's path (torch passes it on complex: backend.py _summed_as_real), async, and
    # the future's wait() orders the current stream after it (no host synchronisation)
    z, zo = torch.complex(inp, -2 * inp), torch.empty(n, dtype=torch.complex64, device="cuda")
    dist.reduce_scatter_tensor(zo, z, op=dist._make_nccl_premul_sum(0.5), async_op=True).get_future().wait()
    half = (world * block(rank) + world * (world - 1)) * 0.5
    if not torch.equal(zo.cpu(), torch.complex(half, -2 * half)):
        bad.append("reduce_scatter_tensor complex PREMUL_SUM")
    if not torch.equal(z, torch.complex(inp, -2 * inp)):
        bad.append("reduce_scatter_tensor complex PREMUL_SUM modified its input")
    dist.reduce_scatter(out, list(inp.chunk(world)))
    if not torch.equal(out.cpu(), world * block(rank) + world * (world - 1)):
        bad.append("reduce_scatter (list)")
    mine = torch.full((n,), float(rank + 1), device="cuda")
    gathered = torch.empty(world * n, device="cuda")
    dist.all_gather_into_tensor(gathered, mine)
    if not torch.equal(gathered.cpu(), torch.cat([torch.full((n,), float(q + 1)) for q in range(world)])):
        bad.append("all_gather_into_tensor")
    outs = [torch.empty(n, device="cuda") for _ in range(world)]
    dist.all_gather(outs, mine)
    if [o.cpu().unique().tolist() for o in outs] != [[float(q + 1)] for q in range(world)]:
        bad.append("all_gather (list)")
    # async on a side stream, the list form (a copy-out after the ring, run by whichever thread
    # completes the work): wait() orders the side stream after the copy-out
    side, big = torch.cuda.Stream(), 1 << 22
    with torch.cuda.stream(side):
        src = torch.full((big,), float(rank + 1), device="cuda")
        for rep in range(4):
            outs = [torch.zeros(big, device="cuda") for _ in range(world)]
            dist.all_gather(outs, src, async_op=True).wait()
            sums = torch.stack([o.sum() for o in outs])  # on the side stream, at once
            if sums.cpu().tolist() != [float((q + 1) * big) for q in range(world)]:
                bad.append(f"all_gather (list, async) on a side stream, repetition {rep}")
    t = torch.full((n,), float(rank * 10 + 7), device="cuda")
    dist.broadcast(t, src=world - 1)
    if not torch.equal(t.cpu(), torch.full((n,), float((world - 1) * 10 + 7))):
        bad.append("broadcast")
    import ringdp

    pg = dist.distributed_c10d._get_default_group()
    native = ringdp.get_communicator(dist.group.WORLD)._cuda is not None and getattr(pg, "_nccl", 1) is None
    dist.barrier()
    return bad, native


@needs_cuda
def test_backend_halves_cuda():
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "120"}
    res = values(run_ranks(_backend_halves, 2, env=env, timeout=300, backend="cpu:ringdp,cuda:ringdp"))
    for r, (bad, native) in enumerate(res):
        assert not bad, f"rank {r}: wrong results: {bad}"
        assert native, f"rank {r}: the collectives went to the inner NCCL group instead of ringdp's CUDA path"


# ============================================================== large tensors, dead peers, memory
def _large(rank, world, count):
    """Each dtype/op twice on a tensor of `count` elements (256 MiB of float32 at 1 << 26)."""
    import torch.distributed as dist

    import ringdp

    _setup(rank)
    bad, digests = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("SUM", "MAX"):
            exp = expected(op, world, count, dtype)
            for rep in range(2):
                t = value(rank, count, dtype, "cuda", world=world)
                ringdp.all_reduce(t, op=getattr(dist.ReduceOp, op))
                got = t.cpu()
                digests.append(_digest(got))
                if not torch.equal(got, exp):
                    bad.append((str(dtype), op, rep, (got != exp).nonzero()[:5].flatten().tolist()))
                del t, got
    return len(digests), bad, digests


@needs_cuda
@pytest.mark.parametrize("world", [2, 4])
def test_ipc_large(world):
    """256 MiB of float32 (and 128 MiB of bf16), not divisible by the world size."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "120"}
    _assert_matrix(run_ranks(_large, world, (1 << 26) + 5, env=env, timeout=900))


def _cuda_peer_killed(rank, world, when, victims=None, destroy=False, sync="ringdp", works=False):
    """The survivor's RingError and how long it took; with `destroy`, how long
    ringdp.destroy() took after it (it must not wait on the dead peer). `sync`: how the
    survivor waits after each call: "ringdp" (ringdp.synchronize(), a bounded wait of
    ringdp's own) or "torch" (the host reads the result through the current stream, as
    `loss.item()` does: only the NCCL transport's watchdog bounds that wait). `works`: the
    calls are async (Work.wait() before the survivor's read), and the value ends with
    _work_states() of the good call's Work and of the survivor's last two."""
    import signal
    import threading
    import time

    import ringdp

    _nccl_env(rank)
    _setup(rank)
    t = torch.ones(1 << 22, device="cuda")
    good = ringdp.all_reduce(t, async_op=works)  # one good call first
    ringdp.synchronize()
    if rank in (victims or (world - 1,)):
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            ringdp.all_reduce(t)
    t0 = time.monotonic()
    recent = []  # (works) the survivor's last two Works
    try:
        while time.monotonic() - t0 < 120:
            if works:
                w = ringdp.all_reduce(t, async_op=True)
                recent = [*recent, w][-2:]
                if sync == "torch":
                    w.wait()
            else:
                ringdp.all_reduce(t)
            if sync == "ringdp":
                ringdp.synchronize()
            else:
                t[:1].item()
        return None
    except ringdp.RingError as e:
        failed = str(e), time.monotonic() - t0
    if works:
        failed = (*failed, _work_states([good, *recent]))
    if not destroy:
        return failed
    t1 = time.monotonic()
    try:
        ringdp.destroy()
    except Exception:  # noqa: BLE001 -- a failed teardown is fine here: returning is what counts
        pass
    return (*failed, time.monotonic() - t1)


def _work_states(works) -> list:
    """(is_completed(), is_success(), the exception's type name or None, whether the call
    itself ran: enqueued without an error) of each Work."""
    out = []
    for w in works:
        e = w.exception()
        out.append((w.is_completed(), w.is_success(), type(e).__name__ if e is not None else None,
                    w._future.exception() is None))
    return out


def _assert_struck(states) -> None:
    """A dead peer's failure struck a collective the survivor had enqueued without error,
    and its Work (its end event complete all the same: an IPC kernel that gave up, an NCCL
    kernel the watchdog's abort returned) says so; the good call's Work, finished before
    the peer died, stays a success; its last Work failed (struck, or refused at its start)."""
    good, *recent = states
    assert good == (True, True, None, True), states
    assert (True, False, "RingError", True) in recent, states
    assert recent[-1][1:3] == (False, "RingError"), states


@needs_cuda
@pytest.mark.parametrize("when", ["before", "during"])
def test_ipc_peer_killed(when):
    """A SIGKILLed peer: the survivor's kernels stop waiting and it gets a RingError naming
    its rank within the timeout (RINGDP_TIMEOUT_S=10)."""
    world = 2
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "10"}
    res = run_ranks(_cuda_peer_killed, world, when, None, False, "ringdp", True, env=env, allow_missing=(world - 1,),
                    timeout=240)
    status, value = res[0]
    assert status == "ok", value
    assert value is not None, "the survivor never noticed its peer died"
    msg, took, states = value
    assert "rank 0" in msg, msg
    assert took < 10 + 30, f"the survivor took {took:.1f} s to fail (timeout 10 s): {msg}"
    _assert_struck(states)


def _ctrl_c_at_close(rank, world):
    """Two groups of both ranks. Rank 0 ends with a CUDA all-reduce on the first that rank 1
    never makes, and its destroy() waits for the device (comm.py _wait_for_device); rank 1
    meanwhile waits in a kernel of an all-reduce on the second for rank 0, which never makes
    it either. A SIGINT to rank 0 at 1.5 s ends that wait: (what destroy() raised, seconds).
    Rank 0 leaves every communicator, so the second's halt tells rank 1's kernel (close()'s
    check(): no kernel of rank 0 was there to meet it): (rank 1's RingError, seconds)."""
    import signal
    import threading
    import time

    import torch.distributed as dist

    import ringdp

    signal.signal(signal.SIGINT, signal.default_int_handler)
    _setup(rank)
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    for g in (first, second):
        ringdp.all_reduce(t, group=g)
    ringdp.synchronize()
    if rank == 0:
        ringdp.all_reduce(t, group=first)  # rank 1 never makes it
        threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            ringdp.destroy()
            raised = None
        except BaseException as e:  # noqa: BLE001 -- the KeyboardInterrupt
            raised = f"{type(e).__name__}: {e}"
        return raised, time.monotonic() - t0
    t0 = time.monotonic()
    try:
        ringdp.all_reduce(t, group=second)  # rank 0 never makes it
        ringdp.get_communicator(second).synchronize()
        return None, time.monotonic() - t0
    except ringdp.RingError as e:
        return str(e), time.monotonic() - t0


@needs_cuda
def test_ipc_ctrl_c_at_close():
    """Ctrl-C while the exit (destroy()) waits for a CUDA collective its peer never makes:
    the wait ends at once with the KeyboardInterrupt (it sat in the transport's stream
    synchronisation, in C++, until the device's timeout), and the peer, waiting on this
    rank in another group's kernel, fails naming rank 0 and the interrupt instead of
    waiting out its timeout (RINGDP_TIMEOUT_S=30). (A peer that comes only after rank 0
    tore down would read memory rank 0 freed: CUDA IPC leaves that undefined.) The same
    without a GPU: tests/test_failures.py::test_cuda_work_at_close."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "30"}
    (raised, took), (err, peer_took) = values(run_ranks(_ctrl_c_at_close, 2, env=env, timeout=180))
    assert str(raised).startswith("KeyboardInterrupt"), raised
    assert took < 1.5 + 2.0, f"destroy() took {took:.1f} s (the SIGINT came at 1.5 s)"
    assert err is not None and "rank 0" in err and "interrupted" in err, err
    assert peer_took < 10, f"rank 1 took {peer_took:.1f} s to fail (timeout 30 s): {err}"


@needs_cuda
@pytest.mark.parametrize("sync", ["ringdp", "torch"])
def test_nccl_peer_killed(sync):
    """The NCCL transport, a SIGKILLed peer: the survivor gets a RingError naming its rank
    within the timeout, and ringdp.destroy() afterwards returns at once: a communicator that
    failed is aborted, never destroyed (ncclCommDestroy would wait with the work stuck on the
    dead peer). [ringdp]: the survivor waits with ringdp.synchronize(), whose bounded stream
    wait aborts the communicator. [torch]: it only reads its result on the host through the
    current stream (`loss.item()`), which waits in CUDA for the NCCL kernel: the watchdog
    (csrc/common/watchdog.h) aborts the communicator at the timeout, the kernel returns, the
    read goes on, and the next call raises the watchdog's reason."""
    _skip_without_nccl()
    env = {"RINGDP_TRANSPORT": "nccl", "RINGDP_TIMEOUT_S": "10", "RINGDP_TEST_NCCL_HOSTID": "1"}
    res = run_ranks(_cuda_peer_killed, 2, "during", None, True, sync, True, env=env, allow_missing=(1,), timeout=240)
    status, value = res[0]
    assert status == "ok", value
    assert value is not None, "the survivor never noticed its peer died"
    msg, took, states, destroy_took = value
    _assert_struck(states)
    assert "rank 0" in msg, msg
    assert took < 10 + 30, f"the survivor took {took:.1f} s to fail (timeout 10 s): {msg}"
    assert destroy_took < 10, f"ringdp.destroy() took {destroy_took:.1f} s after the failure"
    if sync == "torch":  # (the deadline, or NCCL's own error while the work was in flight)
        assert "watchdog aborted" in msg, msg


def _nccl_peer_dies_before_init(rank, world):
    """The last rank SIGKILLs itself right after the NCCL records were exchanged, before
    ncclCommInitRank; the others' first call (which initialises) must raise, not wait."""
    import signal
    import time

    import ringdp
    from ringdp import rendezvous

    _nccl_env(rank)
    _setup(rank)
    if rank == world - 1:
        exchange = rendezvous.Rendezvous.exchange

        def exchange_then_die(self, key, value, what=None):
            got = exchange(self, key, value, what)
            if key.startswith("cuda-nccl"):
                os.kill(os.getpid(), signal.SIGKILL)
            return got

        rendezvous.Rendezvous.exchange = exchange_then_die
    t0 = time.monotonic()
    try:
        ringdp.all_reduce(torch.ones(4, device="cuda"))
        ringdp.synchronize()
        return None
    except ringdp.RingError as e:
        return str(e), time.monotonic() - t0


@needs_cuda
def test_nccl_peer_dies_before_init():
    """A peer that dies between the exchange of the NCCL records and ncclCommInitRank (which
    waits in NCCL's bootstrap for every rank): the survivor's init is bounded by the timeout
    (csrc/common/bounded.h) and raises a RingError naming its rank and ncclCommInitRank."""
    _skip_without_nccl()
    env = {"RINGDP_TRANSPORT": "nccl", "RINGDP_TIMEOUT_S": "10", "RINGDP_TEST_NCCL_HOSTID": "1"}
    res = run_ranks(_nccl_peer_dies_before_init, 2, env=env, allow_missing=(1,), timeout=240)
    status, value = res[0]
    assert status == "ok", value
    assert value is not None, "the survivor initialised NCCL with a dead peer"
    msg, took = value
    assert "rank 0" in msg and "ncclCommInitRank did not return within" in msg, msg
    assert took < 10 + 30, f"the survivor took {took:.1f} s to fail (timeout 10 s): {msg}"


def _memory_cycles(rank, world):
    """Free device memory before ringdp, then after each of two init/use/destroy cycles,
    measured by every rank at the same moment (barriers around each reading)."""
    import torch.distributed as dist

    import ringdp

    _setup(rank)
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()

    def free():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dist.barrier()
        f = torch.cuda.mem_get_info()[0]
        dist.barrier()
        return f

    readings, ok = [free()], []
    for _ in range(2):
        # recorded on ringdp's stream and freed only after destroy(): the caching allocator
        # then records an event on that stream, which must still exist
        keep = torch.full((1 << 16,), float(rank + 1), device="cuda")
        ringdp.all_reduce(keep)
        for registered in (False, True):
            t = ringdp.empty(1 << 20, device="cuda") if registered else torch.empty(1 << 20, device="cuda")
            t.fill_(float(rank + 1))
            ringdp.all_reduce(t)
            ok.append(bool((t == float(sum(range(1, world + 1)))).all().item()))
            del t
        ringdp.destroy()
        ok.append(bool((keep == float(sum(range(1, world + 1)))).all().item()))
        del keep
        readings.append(free())
    return readings, ok


@needs_cuda
def test_ipc_memory_released():
    """ringdp.destroy() gives the IPC region (FIFO slots and arena: 64 MiB + 64 MiB per
    rank here) back, and a tensor freed after it does not crash the process: free device memory after a second init/use/destroy cycle equals that
    after the first, and the first keeps at most what loading ringdp's kernels costs."""
    env = {"RINGDP_TRANSPORT": "ipc", "RINGDP_TIMEOUT_S": "60", "RINGDP_CUDA_ARENA_MB": "64"}
    for r, (readings, ok) in enumerate(values(run_ranks(_memory_cycles, 2, env=env, timeout=300))):
        assert all(ok), f"rank {r}: wrong all-reduce results {ok}"
        before, first, second = (x / 2**20 for x in readings)
        assert abs(first - second) < 4, f"rank {r}: a cycle kept {first - second:.1f} MiB of device memory"
        assert before - first < 48, f"rank {r}: {before - first:.1f} MiB not given back after destroy()"


# ============================================================== the torch-free C++ API
def _native_api(rank, world):
    """Drive the binding directly (docs/cuda.md, csrc/cuda/cuda_api.h): blobs through the store."""
    import torch.distributed as dist

    from ringdp import _C

    _setup(rank)
    store = dist.distributed_c10d._get_default_store()
    o = _C.CudaOptions()
    o.kind, o.rank, o.world, o.device = "ipc", rank, world, 0
    o.slot_bytes, o.slots, o.channels = 65536, 2, 2
    c = _C.cuda_create(o)
    store.set(f"test-native/{rank}", c.local_blob())
    store.wait([f"test-native/{r}" for r in range(world)])
    c.connect([store.get(f"test-native/{r}") for r in range(world)])
    out = []
    for count in (1, 100_003):
        t = value(rank, count, torch.float32, "cuda", world=world)
        algo = 1 if 4 * count <= c.oneshot_bytes else 0  # the caller chooses: one-shot when it fits
        c.all_reduce(t.data_ptr(), t.numel(), 0, 0, torch.cuda.current_stream().cuda_stream, algo, 0.0)
        c.synchronize()
        out.append(torch.equal(t.cpu(), expected("SUM", world, count, torch.float32)))
    c.quiesce()
    dist.barrier()
    c.destroy()
    return out


@needs_cuda
def test_native_api_ipc():
    from ringdp import _C

    if not hasattr(_C, "cuda_create"):
        _skip("ringdp._C has no cuda_create binding (see docs/cuda.md)")
    for r, ok in enumerate(values(run_ranks(_native_api, 2, timeout=300))):
        assert all(ok), f"rank {r}: {ok}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
