"""The Python policy and the one configuration parser: which algorithm for which size and
world, RINGDP_* overrides, strict errors for malformed values."""
import os

import pytest
import torch

from ringdp import policy
from ringdp.config import Config


def shm_algo(nbytes, world, cfg):
    """What a shared-memory communicator of `world` ranks decides (Communicator.algo_for)."""
    cap = cfg.oneshot_bytes
    return policy.choose_algo(nbytes, cfg.algo, policy.oneshot_threshold("shm", world, cfg, cap), cap)


def test_threshold_depends_on_world():
    cfg = Config.from_env({})
    assert shm_algo(4096, 2, cfg) == policy.RING  # measured: ring wins at world 2
    assert shm_algo(4096, 4, cfg) == policy.ONESHOT
    assert shm_algo(policy.ONESHOT_MAX_BYTES, 4, cfg) == policy.ONESHOT
    assert shm_algo(policy.ONESHOT_MAX_BYTES + 1, 4, cfg) == policy.RING


def test_env_overrides():
    cfg = Config.from_env({"RINGDP_ONESHOT_MAX_BYTES": "100"})
    assert shm_algo(100, 2, cfg) == policy.ONESHOT
    assert shm_algo(101, 4, cfg) == policy.RING
    cfg = Config.from_env({"RINGDP_ONESHOT_MAX_BYTES": "100", "RINGDP_ALGO": "ring"})
    assert shm_algo(1, 4, cfg) == policy.RING
    cfg = Config.from_env({"RINGDP_ALGO": "oneshot"})
    assert shm_algo(cfg.oneshot_bytes, 2, cfg) == policy.ONESHOT
    assert shm_algo(cfg.oneshot_bytes + 1, 2, cfg) == policy.RING  # falls back
    with pytest.raises(ValueError, match="RINGDP_ALGO"):
        Config.from_env({"RINGDP_ALGO": "fast"})
    with pytest.raises(ValueError, match="not an integer"):
        Config.from_env({"RINGDP_ALGO": "auto", "RINGDP_ONESHOT_MAX_BYTES": "lots"})


def test_backend_adopt_setting():
    assert Config.from_env({}).backend_adopt_min_bytes == -1  # off unless asked for
    assert Config.from_env({"RINGDP_BACKEND_ADOPT_MIN_BYTES": "1048576"}).backend_adopt_min_bytes == 1 << 20
    with pytest.raises(ValueError, match="RINGDP_BACKEND_ADOPT_MIN_BYTES"):
        Config.from_env({"RINGDP_BACKEND_ADOPT_MIN_BYTES": "-5"})


def test_inline_async():
    off = Config.from_env({})  # off unless asked for: an inline call blocks until its peers arrive
    assert off.inline_async_max_bytes == policy.INLINE_ASYNC_MAX_BYTES == 0
    assert not policy.inline_async(0, off) and not policy.inline_async(4, off)
    cfg = Config.from_env({"RINGDP_INLINE_ASYNC_MAX_BYTES": "262144"})
    assert policy.inline_async(0, cfg) and policy.inline_async(256 << 10, cfg)
    assert not policy.inline_async((256 << 10) + 1, cfg)
    with pytest.raises(ValueError, match="RINGDP_INLINE_ASYNC_MAX_BYTES"):
        Config.from_env({"RINGDP_INLINE_ASYNC_MAX_BYTES": "-1"})


def test_cuda_threshold_is_the_transports_own():
    cfg = Config.from_env({})
    assert policy.oneshot_threshold("ipc", 4, cfg, 256 << 10) == 256 << 10  # the whole buffer
    assert policy.oneshot_threshold("nccl", 2, cfg, 0) == 0  # no one-shot on NCCL
    cfg = Config.from_env({"RINGDP_CUDA_ONESHOT_MAX_BYTES": "4096"})
    assert policy.oneshot_threshold("ipc", 2, cfg, 256 << 10) == 4096
    assert policy.choose_algo(8192, "oneshot", 4096, 0) == policy.RING  # no capacity: ring


def test_spin():
    assert policy.spin_ns(2, Config.from_env({"RINGDP_SPIN_US": "7"})) == 7000
    assert policy.spin_ns(2, Config.from_env({"RINGDP_SPIN_US": "7"}), compute_threads=8) == 7000
    assert policy.spin_ns(10_000, Config.from_env({})) == policy.SPIN_NS_OVERSUBSCRIBED
    cores = len(os.sched_getaffinity(0))
    assert policy.spin_ns(cores, Config.from_env({})) == policy.SPIN_NS  # a core per rank
    # beside the caller's compute (the worker thread): each rank needs its threads + 1 cores
    assert policy.spin_ns(cores, Config.from_env({}), compute_threads=1) == policy.SPIN_NS_OVERSUBSCRIBED
    assert policy.spin_ns(1, Config.from_env({}), compute_threads=cores - 1) == policy.SPIN_NS
    assert policy.spin_ns(1, Config.from_env({}), compute_threads=cores) == policy.SPIN_NS_OVERSUBSCRIBED


def test_check_payload_bytes():
    # one slot per member of a gloo group across hosts, the group's total bounded, 64-byte multiples
    assert policy.check_payload_bytes(2) == policy.CHECK_PAYLOAD_TOTAL_BYTES // 2
    for members in (1, 2, 3, 7, 16, 128, 1000):
        slot = policy.check_payload_bytes(members)
        assert slot % 64 == 0 and slot * members <= policy.CHECK_PAYLOAD_TOTAL_BYTES, (members, slot)
    assert policy.check_payload_bytes(10 ** 6) == 0  # (no slot: every all-reduce by gloo)


def case_spin_by_thread(rank, world):
    """The endpoint's spin after each call: inline (synchronous), on the worker while the
    caller goes on (polled with is_completed()), and on the worker while the caller blocks
    in wait() (_caller_waits: the inline spin), for a large call and a small async one (on
    the worker by default: policy.inline_async). A wait() raises the spin only if it blocks:
    one rank arrives late (`late`) so that the other's wait() surely does; the late rank's
    spin is either, and recorded as such."""
    import time

    import ringdp
    from ringdp import policy
    from ringdp.config import Config

    c = ringdp.init()
    cfg = Config.from_env()
    spins = [policy.spin_ns(c.machine_ranks, cfg), policy.spin_ns(c.machine_ranks, cfg, torch.get_num_threads())]
    assert list(c._spins) == spins
    if spins[0] == spins[1]:  # (a box with a core for every thread: made to differ, or nothing shows)
        spins[0] += 1000
        c._spins = tuple(spins)
    seen = []
    big = policy.INLINE_ASYNC_MAX_BYTES // 4 + 1  # float32 elements: one more than runs inline
    steps = [("sync", 10, None), ("poll", big, None)]
    steps += [("wait", big, late) for late in range(world)] + [("poll", big, None)]
    steps += [("async", 10, late) for late in range(world)] + [("sync", 10, None)]
    for how, n, late in steps:
        if late == rank:
            time.sleep(0.3)
        w = ringdp.all_reduce(torch.ones(n), async_op=how != "sync")
        if how == "poll":
            while not w.is_completed():
                time.sleep(0.0005)
        elif w is not None:
            w.wait()
        seen.append(("late" if late == rank else how, c.shm.spin_ns))
    return seen, spins


def test_spin_follows_the_thread(pool):
    for rank, (seen, (inline, worker)) in enumerate(pool.run(case_spin_by_thread)):
        peers = (len(seen) - 4) // 2  # (the world: one "wait" and one "async" step per rank)
        want = [("sync", inline), ("poll", worker)]
        want += [("late", None) if late == rank else ("wait", inline) for late in range(peers)] + [("poll", worker)]
        want += [("late", None) if late == rank else ("async", inline) for late in range(peers)] + [("sync", inline)]
        got = [(how, None if how == "late" and spin in (inline, worker) else spin) for how, spin in seen]
        assert got == want, (rank, seen, inline, worker)


@pytest.mark.parametrize("env,match", [
    ({"RINGDP_TIMEOUT_S": "0"}, "RINGDP_TIMEOUT_S='0': must be positive"),
    ({"RINGDP_TIMEOUT_S": "soon"}, "not a number"),
    ({"RINGDP_DDP_OVERLAP": "maybe"}, "RINGDP_DDP_OVERLAP='maybe': expected 1/0"),
    ({"RINGDP_TRANSPORT": "tcp"}, "expected one of auto, ipc, nccl"),
    ({"RINGDP_FIFO_SLOTS": "-2"}, "must be >= 2"),
    ({"RINGDP_FIFO_SLOTS": "3"}, "RINGDP_FIFO_SLOTS='3': must be a power of two"),
    ({"RINGDP_TIMEOUT_S": "nan"}, "RINGDP_TIMEOUT_S='nan': not a number"),
    ({"RINGDP_DDP_IN_GRAD_MIN_BYTES": "-5"}, "-1 for never"),
])
def test_strict_parser(env, match):
    with pytest.raises(ValueError, match=match):
        Config.from_env(env)


def test_parser_values_and_unknown_names():
    cfg = Config.from_env({"RINGDP_TIMEOUT_S": "2.5", "RINGDP_DDP_OVERLAP": "off", "RINGDP_ALGO": "Ring",
                           "RINGDP_CUDA_REGISTERED": "0", "RINGDP_DDP_IN_GRAD_MIN_BYTES": "-1", "RINGDP_TRACE": ""})
    assert (cfg.timeout_s, cfg.ddp_overlap, cfg.algo, cfg.cuda_registered) == (2.5, False, "ring", False)
    assert cfg.ddp_in_grad_min_bytes == -1 and cfg.trace is None  # empty means unset
    with pytest.warns(UserWarning, match="RINGDP_TIMEOUTS"):
        Config.from_env({"RINGDP_TIMEOUTS": "5"})  # a typo is reported, not silently ignored


MiB = 1 << 20


def test_two_level_piece_bytes_closed_forms():
    f, k = policy.two_level_piece_bytes, policy.HIER_MAX_PIECES
    mn = policy.HIER_PIECE_BYTES
    assert mn == 16 * MiB and k == 2 and Config.from_env({}).hier_piece_bytes == mn
    # small tensors: one piece (the minimum is at least the tensor)
    for n in (0, 1, 4096, mn - 1, mn):
        assert f(n, mn) == mn and -(-max(n, 1) // f(n, mn)) == 1
    # up to k x the minimum: pieces of the minimum, ceil(n / min) of them
    assert f(mn + 1, mn) == mn and f(k * mn, mn) == mn
    # large tensors: exactly k pieces of ceil(n / k)
    for n in (k * mn + 1, 64 * MiB, 256 * MiB + 3, 1 << 30):
        p = f(n, mn)
        assert p == -(-n // k) and p >= mn and -(-n // p) == k and (k - 1) * p < n
    assert f(1 << 30, mn) == 512 * MiB
    # the minimum honoured whatever the size; an explicit count
    assert f(100 * MiB, 64 * MiB) == 64 * MiB
    assert f(100 * MiB, 8 * MiB, max_pieces=4) == 25 * MiB
    assert f(10, 1, max_pieces=4) == 3
    assert f(10, 1, max_pieces=1) == 10
    # HIER_MAX_PIECES is read at each call (tests/test_hierarchy.py lifts it in a rank)
    old = policy.HIER_MAX_PIECES
    try:
        policy.HIER_MAX_PIECES = 8
        assert f(1 << 30, mn) == 128 * MiB
    finally:
        policy.HIER_MAX_PIECES = old
    for bad in ((-1, mn), (10, 0), (10, 1, 0)):
        with pytest.raises(ValueError):
            f(*bad)


def test_folds_outcome_up_to_the_cap():
    """The first step's outcome goes with the data for blocks up to FOLD_MAX_BLOCK_BYTES
    (1 MiB, what the box measured), above the call check's slot at 2 hosts (its lower end:
    CrossHost._overlaps)."""
    cap = policy.FOLD_MAX_BLOCK_BYTES
    assert cap == MiB and cap > policy.check_payload_bytes(2)
    assert policy.folds_outcome(policy.check_payload_bytes(2) + 1) and policy.folds_outcome(cap)
    assert not policy.folds_outcome(cap + 1) and not policy.folds_outcome(8 * MiB)


def test_cross_host_timeout_is_shorter_by_a_margin():
    """A cross-host step waits less than the call's in-host waits (a tenth less, at most
    CROSS_HOST_MARGIN_S), never longer than ringdp's timeout."""
    f, cap = policy.cross_host_timeout, policy.CROSS_HOST_MARGIN_S
    assert cap == 5.0
    assert f(8.0) == pytest.approx(7.2) and f(20.0) == pytest.approx(18.0) and f(50.0) == pytest.approx(45.0)
    assert f(300.0) == 295.0 and f(1800.0) == 1795.0  # ringdp's default; torch's gloo default
    for t in (0.01, 1.0, 8.0, 49.0, 51.0, 300.0, 1e6):
        assert 0 < f(t) < t and t - f(t) <= cap + 1e-9 and f(t) >= 0.9 * t - 1e-9


def test_hier_piece_bytes_env_is_the_minimum():
    cfg = Config.from_env({"RINGDP_HIER_PIECE_BYTES": str(4 * MiB)})
    assert policy.two_level_piece_bytes(6 * MiB, cfg.hier_piece_bytes) == 4 * MiB  # 2 pieces: 4 + 2 MiB
    assert policy.two_level_piece_bytes(64 * MiB, cfg.hier_piece_bytes) == 32 * MiB
    cfg = Config.from_env({"RINGDP_HIER_PIECE_BYTES": str(1 << 40)})  # one piece always
    assert policy.two_level_piece_bytes(1 << 30, cfg.hier_piece_bytes) == 1 << 40
    with pytest.raises(ValueError, match="RINGDP_HIER_PIECE_BYTES"):
        Config.from_env({"RINGDP_HIER_PIECE_BYTES": "0"})


def test_cpu_and_cuda_paths_across_hosts():
    """Which path a group across hosts takes: the CPU collectives' (cross_host_path), and
    whether a CUDA all-reduce takes that hierarchy (cuda_hierarchical: even or uneven hosts
    with more than one rank somewhere, hierarchy on, no forced transport; else the flat NCCL
    ring)."""
    on, off = Config(), Config(hierarchy=False)
    assert policy.cross_host_path([4], True) == policy.LOCAL
    assert policy.cross_host_path([2, 2], True) == policy.TWO_LEVEL
    assert policy.cross_host_path([3, 1], True) == policy.LEADERS
    assert policy.cross_host_path([1, 1], True) == policy.FLAT
    assert policy.cross_host_path([2, 2], False) == policy.FLAT
    for sizes, cfg, want in [([2, 2], on, True), ([3, 1], on, True), ([1, 1], on, False), ([2, 2], off, False),
                             ([2, 2], Config(transport="nccl"), False), ([2, 2], Config(transport="ipc"), False)]:
        got = policy.cuda_hierarchical(policy.cross_host_path(sizes, cfg.hierarchy), cfg)
        assert got == want, (sizes, cfg.hierarchy, cfg.transport)
    assert policy.cuda_hierarchical(None, on) is False  # one host: no CrossHost


def test_policy_is_torch_free():
    """bench/cost_model.py imports policy.py by path, without torch."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(policy.__file__).read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= {"os", "__future__"}, mods


def test_timeouts_above_the_bound_are_clamped():
    """Every timeout a user gives (RINGDP_TIMEOUT_S, a call's or init's timeout=, seconds or
    a timedelta) above policy.MAX_TIMEOUT_S is MAX_TIMEOUT_S, infinity included: no practical
    limit, yet a value every consumer of a timeout takes (threading waits, timedeltas,
    gloo's and the store's waits). Before, inf, 1e10 and 1e15 passed through and broke
    set-up or destroy() with an OverflowError. NaN, zero and negative values are refused."""
    import threading
    from datetime import timedelta

    cap = policy.MAX_TIMEOUT_S
    assert 30 * 86400 <= cap <= threading.TIMEOUT_MAX / 100  # over a month; far below every consumer's limit
    for big in (float("inf"), 1e300, 1e15, 1e10, cap, timedelta(days=999_999_999)):
        assert policy.timeout_s(big, 300.0) == cap, big
    assert policy.timeout_s(None, float("inf")) == cap  # a default (a Config made directly) too
    assert policy.timeout_s(2.5, 300.0) == 2.5 and policy.timeout_s(None, 7.0) == 7.0
    assert policy.timeout_s(timedelta(seconds=90), 300.0) == 90.0
    for bad in (0, -1.0, float("nan"), float("-inf"), timedelta(0)):
        with pytest.raises(ValueError, match="timeout must be positive"):
            policy.timeout_s(bad, 300.0)
    for raw in ("inf", "Infinity", "1e15", "1e10", str(cap)):
        assert Config.from_env({"RINGDP_TIMEOUT_S": raw}).timeout_s == cap, raw
    # what the consumers do with the bound: a timedelta (the store's waits, gloo), a
    # threading wait (destroy(): the worker's join, the lock), a cross-host step's share
    assert timedelta(seconds=cap).total_seconds() == cap
    assert timedelta(seconds=policy.cross_host_timeout(cap)) < timedelta(seconds=cap)
    lock = threading.Lock()
    assert lock.acquire(timeout=cap)
    lock.release()
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join(timeout=cap)


@pytest.mark.parametrize("name,raw,match", [
    # byte sizes whose arithmetic wrapped (SIGSEGV on every rank before)
    ("RINGDP_ONESHOT_BYTES", str(1 << 63), "must be at most"),
    ("RINGDP_SLOT_BYTES", str(1 << 61), "must be at most"),
    ("RINGDP_FIFO_SLOTS", str(1 << 62), "must be at most"),
    # the C++ side's own rule, now the parser's, naming the variable
    ("RINGDP_SLOT_BYTES", "1000", "must be at least 4096, a multiple of 64"),
    ("RINGDP_SLOT_BYTES", "4100", "must be a multiple of 64"),
    ("RINGDP_SLOT_BYTES", "0", "must be at least 4096"),
    # raw OverflowError / pybind TypeError before
    ("RINGDP_SPIN_US", "inf", "must be finite"),
    ("RINGDP_SPIN_US", "1e30", "must be at most"),
    ("RINGDP_ARENA_GB", "inf", "must be finite"),
    ("RINGDP_ARENA_GB", "1e12", "must be at most"),
    ("RINGDP_CUDA_ARENA_MB", "inf", "must be finite"),
    ("RINGDP_CUDA_SLOT_BYTES", str(1 << 61), "must be at most"),
    ("RINGDP_CUDA_ONESHOT_BYTES", str(1 << 64), "must be at most"),
    ("RINGDP_CUDA_SLOTS", str(1 << 40), "must be at most"),
    ("RINGDP_CUDA_CHANNELS", str(1 << 40), "must be at most"),
    ("RINGDP_STALL_WARN_S", "nan", "not a number"),
])
def test_sizes_are_bounded_by_the_parser(name, raw, match):
    """Sizes the shared-memory layout, the C++ fields or the machine cannot hold are refused
    when read, with the variable named (policy.py "Limits of the RINGDP_* values")."""
    with pytest.raises(ValueError, match=f"{name}={raw!r}: {match}"):
        Config.from_env({name: raw})


def test_size_limits_themselves_are_accepted():
    cfg = Config.from_env({
        "RINGDP_ONESHOT_BYTES": str(policy.MAX_BUFFER_BYTES), "RINGDP_SLOT_BYTES": str(policy.MAX_BUFFER_BYTES),
        "RINGDP_FIFO_SLOTS": str(policy.MAX_SLOTS), "RINGDP_ARENA_GB": str(policy.MAX_ARENA_GB),
        "RINGDP_SPIN_US": str(policy.MAX_SPIN_US), "RINGDP_CUDA_ARENA_MB": str(policy.MAX_ARENA_GB << 10),
        "RINGDP_STALL_WARN_S": "inf"})
    assert (cfg.oneshot_bytes, cfg.slot_bytes, cfg.fifo_slots) == (policy.MAX_BUFFER_BYTES,) * 2 + (policy.MAX_SLOTS,)
    assert cfg.arena_gb == policy.MAX_ARENA_GB and cfg.spin_us == policy.MAX_SPIN_US
    assert cfg.stall_warn_s == policy.MAX_TIMEOUT_S  # a stall report after the timeout: never
    assert Config.from_env({"RINGDP_SLOT_BYTES": str(policy.SLOT_MIN_BYTES)}).slot_bytes == 4096
    assert Config.from_env({"RINGDP_SLOT_BYTES": "4160"}).slot_bytes == 4160
    # the whole shared-memory segment at the limits still fits in 64 bits, and in the
    # x86-64 user address space (128 TiB): the layout's arithmetic cannot wrap
    fixed = 4096 + policy.MAX_SLOTS * policy.MAX_BUFFER_BYTES + 2 * policy.MAX_BUFFER_BYTES
    assert fixed + (policy.MAX_ARENA_GB << 30) < 1 << 47
