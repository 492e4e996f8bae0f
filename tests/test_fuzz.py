"""Random programs of collectives against closed forms (tests/_fuzz.py): a few seeds of each
set-up per run, some with mismatched calls (every member must raise, and the calls after
must be right). `python tests/_fuzz.py` runs longer campaigns; the seeds here are fixed so
that a failure reproduces (`python tests/_fuzz.py --world W --seeds S [--hosts ...]`).
Random training runs (tests/_fuzz_ddp.py): RingDDP and stock DDP on cpu:ringdp against
torch's DDP on gloo, step by step (`python tests/_fuzz_ddp.py --world W --seeds S`), and
with one rank killed (`... --kill`) or interrupted (`... --interrupt`); programs with one
rank interrupted (`_fuzz.py --interrupt`)."""
import pytest

import _fuzz
import _fuzz_ddp

# (world, set-up, simulated hosts, seeds, mismatched calls per program): fresh ranks each
# (the seeds here fit CI's 90 minutes: 2026-12-07 halved the first three, and chose 6 training
# kills on one host that still cover test_training_kills_cover_the_points; `python
# tests/_fuzz.py` / `_fuzz_ddp.py` run the campaigns at length)
CAMPAIGNS = [
    (2, "backend", None, range(0, 6), 0),
    (3, "backend", None, range(100, 104), 0),
    (3, "backend-small-slots", None, range(200, 204), 0),
    (3, "gloo-default", None, range(300, 306), 0),
    (4, "backend", "a,a,b,b", range(400, 406), 0),
    (4, "backend", "a,a,a,b", range(500, 506), 0),
    (4, "gloo-default", "a,a,b,b", range(600, 606), 0),
    (3, "backend", None, range(700, 706), 2),
    (4, "backend", "a,a,b,b", range(800, 804), 2),
    (3, "inline-async", None, range(1100, 1104), 0),
    (3, "adopt", None, range(1200, 1204), 1),
    (4, "small-pieces", "a,a,b,b", range(1300, 1304), 0),
    (4, "flat", "a,a,a,b", range(1400, 1404), 0),
    # an all-reduce in pieces on uneven hosts (subgroup [1, 2, 3] of a,a,b,b; a,a,a,b) whose
    # counts differ by one between ranks of a host (the whole call in the steps' headers:
    # CrossHost._announce)
    (4, "small-pieces", "a,a,b,b", [8300], 1),
    (4, "small-pieces", "a,a,a,b", [8307], 1),
]
# (world, set-up, simulated hosts, seeds): one mismatch per program by one local rank on
# every host (--symmetric: each cross-host group agrees, the host's ranks do not; 9004 and
# 9031 returned before CrossHost._announce: a reduce_scatter's AVG beside SUM, an
# all_reduce's count that pads to the same blocks)
SYMMETRIC = [(4, "backend", "a,a,b,b", [9004, 9031, 9100, 9101, 9102, 9103]),
             (4, "small-pieces", "a,a,a,b", range(9100, 9104))]
# (world, simulated hosts, seeds): programs that SIGKILL one rank, fresh ranks for each
# (8548: an asynchronous barrier whose gloo part a failure left in flight, 1 run in 10)
KILLS = [(3, None, [900, 901, 902, 8548]), (4, "a,a,b,b", range(950, 952))]


def _id(world, setup, hosts, seeds, mismatches):
    return f"w{world}-{setup}-{hosts.replace(',', '') if hosts else 'onehost'}" + ("-mismatch" if mismatches else "")


@pytest.mark.parametrize("world,setup,hosts,seeds,mismatches", CAMPAIGNS, ids=[_id(*c) for c in CAMPAIGNS])
def test_random_programs(world, setup, hosts, seeds, mismatches):
    out = _fuzz.run_campaign(world, seeds, setup, hosts, length=40, timeout=300, mismatches=mismatches)
    bad = _fuzz.failures(out)
    assert not bad, "\n".join(bad[:20])
    ran = [len(per) for per in out.values()]
    assert ran == [len(seeds)] * world, f"programs run per rank: {ran}"


@pytest.mark.parametrize("world,setup,hosts,seeds", SYMMETRIC,
                         ids=[f"w{w}-{s}-{h.replace(',', '')}" for w, s, h, _ in SYMMETRIC])
def test_random_programs_with_host_symmetric_mismatches(world, setup, hosts, seeds):
    out = _fuzz.run_campaign(world, seeds, setup, hosts, length=40, timeout=300, mismatches=1, symmetric=True)
    bad = _fuzz.failures(out)
    assert not bad, "\n".join(bad[:20])
    ran = [len(per) for per in out.values()]
    assert ran == [len(seeds)] * world, f"programs run per rank: {ran}"


@pytest.mark.parametrize("world,hosts,seeds", KILLS,
                         ids=[f"w{w}-{h.replace(',', '') if h else 'onehost'}" for w, h, _ in KILLS])
def test_random_programs_with_a_rank_killed(world, hosts, seeds):
    """The survivors end the program (a RingError, or gloo's error on the inner group)
    within twice the timeout, with no wrong result, exit with 0, and leave no /dev/shm name."""
    out = _fuzz.run_campaign(world, seeds, "backend", hosts, length=40, timeout=300, kill=True)
    bad = _fuzz.failures(out)
    assert not bad, "\n".join(bad[:20])
    reports = [k for per in out.values() for k in per.get("_kill", [])]
    assert len(reports) == (world - 1) * len(seeds), reports  # (every survivor of every program)


# (world, simulated hosts, seeds): programs in which one rank gets a SIGINT (tests/_fuzz.py
# --interrupt), fresh ranks for each; seeds whose interrupted rank has no collective on the
# inner gloo group from the interrupt on (README "Failures": one in flight at exit may end
# the process in std::terminate, as gloo's thread completes it while Python finalizes)
INTERRUPTS = [(3, None, [100, 113, 142]), (4, "a,a,b,b", [125, 139])]


@pytest.mark.parametrize("world,hosts,seeds", INTERRUPTS,
                         ids=[f"w{w}-{h.replace(',', '') if h else 'onehost'}" for w, h, _ in INTERRUPTS])
def test_random_programs_with_a_rank_interrupted(world, hosts, seeds):
    """Ctrl-C at a random point of a random program: the others end it (a RingError, or
    gloo's error) within twice the timeout with no wrong result, every rank exits with 0
    (the interrupted one too), and no /dev/shm name is left."""
    out = _fuzz.run_campaign(world, seeds, "backend", hosts, length=40, timeout=300, interrupt=True)
    bad = _fuzz.failures(out)
    assert not bad, "\n".join(bad[:20])
    reports = [k for per in out.values() for k in per.get("_kill", [])]
    assert len(reports) == world * len(seeds), reports
    assert sum("interrupted_in" in k for k in reports) == len(seeds), reports  # (one interrupted rank each)


def test_programs_are_the_same_on_every_rank_and_cover_the_calls():
    """The generator is a pure function of the seed (every rank draws the same calls), and
    a few seeds draw every kind of call, API, tensor form and group."""
    a = _fuzz.make_program(7, 4, _fuzz.subgroups_for(4), 40)
    b = _fuzz.make_program(7, 4, _fuzz.subgroups_for(4), 40)
    assert a == b
    calls = [c for s in range(20) for c in _fuzz.make_program(s, 4, _fuzz.subgroups_for(4), 40)]
    for key, want in [("kind", {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "coalesced", "barrier",
                                "delegated"}),
                      ("api", {"dist", "ringdp"}), ("form", {"plain", "view", "strided", "registered"}),
                      ("async", {True, False})]:
        assert {c[key] for c in calls} == want, key
    assert {tuple(c["members"]) for c in calls} == {(0, 1, 2, 3), (1, 2, 3), (0, 3)}
    # a group with one rank per host has no registered memory (ringdp.empty refuses it)
    hosts = ["a", "a", "b", "b"]
    assert not any(c["form"] == "registered" and c["members"] == [0, 3]
                   for s in range(20) for c in _fuzz.make_program(s, 4, _fuzz.subgroups_for(4), 40, hosts))
    # mismatches: one member of a call that ringdp's engine runs changes its count, op or root
    twisted = [c for s in range(30) for c in _fuzz.make_program(s, 3, _fuzz.subgroups_for(3), 40, None, 2)
               if "victim" in c]
    assert len(twisted) == 60 and all(_fuzz._twistable(c) for c in twisted)
    assert {c["twist"] for c in twisted} == {"count", "op", "root"}
    c = next(c for c in twisted if c["twist"] == "count")
    assert _fuzz._twist(c, c["victim"], 3)["count"] == c["count"] + 1
    assert _fuzz._twist(c, (c["victim"] + 1) % 3, 3) is c
    # host-symmetric mismatches (a,a,b,b): one local rank on every host of the call's group;
    # one member where that would be all (a group with one rank per host)
    sym = [c for s in range(40) for c in _fuzz.make_program(s, 4, _fuzz.subgroups_for(4), 40, hosts, 1,
                                                            symmetric=True) if "victim" in c]
    assert len(sym) == 40
    for c in sym:
        want = {(0, 1, 2, 3): [[0, 2], [1, 3]], (1, 2, 3): [[0, 1], [2]], (0, 3): [[0], [1]]}[tuple(c["members"])]
        assert c["victims"] in want and c["victim"] == c["victims"][0], c
    whole = next(c for c in sym if c["members"] == [0, 1, 2, 3])
    mine = whole["victims"]
    assert all((_fuzz._twist(whole, m, 4) is whole) == (m not in mine) for m in range(4))
    # a killing program: the same calls, one of its second half marked with the rank to kill
    plain = _fuzz.make_program(5, 4, _fuzz.subgroups_for(4), 40)
    killing = _fuzz.make_program(5, 4, _fuzz.subgroups_for(4), 40, kill=True)
    marked = [k for k, c in enumerate(killing) if "kill" in c]
    assert len(marked) == 1 and marked[0] >= 20 and _fuzz.ended_by(killing) in range(4)
    assert [{k: v for k, v in c.items() if k != "kill"} for c in killing] == plain
    # an interrupting program: the same calls, one of the second half (not of the last 8)
    # marked with the rank that gets the SIGINT and its delay
    interrupting = _fuzz.make_program(5, 4, _fuzz.subgroups_for(4), 40, interrupt=True)
    marked = [k for k, c in enumerate(interrupting) if "interrupt" in c]
    assert len(marked) == 1 and 20 <= marked[0] < 32 and _fuzz.ended_by(interrupting) in range(4)
    assert 0 <= interrupting[marked[0]]["interrupt"][1] <= 0.03
    assert [{k: v for k, v in c.items() if k != "interrupt"} for c in interrupting] == plain


def test_closed_forms():
    """The closed forms the programs are checked against, by hand for 3 ranks."""
    import torch

    # v(r, i) = i % 13 + 2 ((r + i) % 3): at i = 0..2, ranks 0, 1, 2 hold [0, 3, 6], [2, 5, 2], [4, 1, 4]
    assert _fuzz.expected("SUM", 3, 3, torch.int64).tolist() == [6, 9, 12]
    assert _fuzz.expected("PRODUCT", 3, 3, torch.int64).tolist() == [0, 15, 48]
    assert _fuzz.expected("BXOR", 3, 3, torch.int64).tolist() == [0 ^ 2 ^ 4, 3 ^ 5 ^ 1, 6 ^ 2 ^ 4]
    assert _fuzz.expected("PREMUL_SUM", 3, 3, torch.float32, 0.5).tolist() == [3.0, 4.5, 6.0]
    assert _fuzz.expected("AVG", 3, 3, torch.bfloat16).tolist() == [2.0, 3.0, 4.0]


# (DDP or FSDP2 runs, world, simulated hosts, seeds): random training runs
# (tests/_fuzz_ddp.py), fresh ranks each
TRAININGS = [("ddp", 2, None, range(0, 20)), ("ddp", 3, None, range(10, 30)), ("ddp", 4, "a,a,b,b", range(0, 10)),
             ("ddp", 4, "a,a,a,b", range(10, 18)),
             ("fsdp", 2, None, range(8, 18)), ("fsdp", 3, None, range(0, 10)), ("fsdp", 4, "a,a,b,b", range(0, 8))]


@pytest.mark.parametrize("mode,world,hosts,seeds", TRAININGS,
                         ids=[f"{m}-w{w}-{h.replace(',', '') if h else 'onehost'}" for m, w, h, _ in TRAININGS])
def test_random_training_runs(mode, world, hosts, seeds):
    """DDP: each step of RingDDP and of stock DDP on cpu:ringdp matches torch's DDP on gloo,
    and every rank ends with the same parameters. FSDP2: each step's shards on cpu:ringdp
    match those on gloo. torch refuses none of these runs."""
    out = _fuzz_ddp.run_seeds(world, seeds, timeout=300, hosts=hosts, fsdp=mode == "fsdp")
    bad = _fuzz_ddp.failures(out)
    assert not bad, "\n".join(bad[:20])
    assert [sorted(per) for per in out.values()] == [list(seeds)] * world
    skipped = [(s, e) for s, errs in out[0].items() for e in errs if e.startswith("skipped")]
    assert not skipped, skipped


# (DDP or FSDP2 runs, world, simulated hosts, seeds): random training runs in which one rank
# SIGKILLs itself (tests/_fuzz_ddp.py --kill), fresh ranks for each seed (world 3 seed 69:
# RingDDP inside Join on gloo, whose survivors aborted at exit in 10 of 25 runs before the
# Join hook waited for torch's Join all-reduce)
TRAINING_KILLS = [("ddp", 3, None, [0, 1, 3, 6, 11, 69]), ("ddp", 4, "a,a,b,b", range(0, 4)), ("fsdp", 3, None, range(0, 3)),
                  ("fsdp", 4, "a,a,b,b", range(0, 3))]


@pytest.mark.parametrize("mode,world,hosts,seeds", TRAINING_KILLS,
                         ids=[f"{m}-w{w}-{h.replace(',', '') if h else 'onehost'}" for m, w, h, _ in TRAINING_KILLS])
def test_random_training_runs_with_a_rank_killed(mode, world, hosts, seeds):
    """Every survivor raises within twice the timeout of its last point, naming the dead
    rank (or the cross-host step; gloo's errors, for what runs on gloo, name none), exits
    with 0, and no shared-memory name is left; it trains on to the end only when the
    victim died after its last collective."""
    out = _fuzz_ddp.run_kills(world, seeds, hosts=hosts, fsdp=mode == "fsdp")
    bad = _fuzz_ddp.failures(out)
    assert not bad, "\n".join(bad[:20])
    assert [sorted(per) for per in out.values()] == [list(seeds)] * world


# (DDP or FSDP2 runs, world, seeds): the same with a SIGINT (Ctrl-C) 0-10 ms after the point
# instead (tests/_fuzz_ddp.py --interrupt)
TRAINING_INTERRUPTS = [("ddp", 3, range(0, 4)), ("fsdp", 3, range(0, 2))]


@pytest.mark.parametrize("mode,world,seeds", TRAINING_INTERRUPTS,
                         ids=[f"{m}-w{w}" for m, w, _ in TRAINING_INTERRUPTS])
def test_random_training_runs_with_a_rank_interrupted(mode, world, seeds):
    """The interrupted rank catches its KeyboardInterrupt, and every rank exits with 0 (never
    std::terminate), the survivors within twice the timeout of their last point, naming the
    interrupted rank when they raise; no shared-memory name is left."""
    import collections

    landed = collections.Counter()
    out = _fuzz_ddp.run_kills(world, seeds, fsdp=mode == "fsdp", interrupt=True, landed=landed)
    bad = _fuzz_ddp.failures(out)
    assert not bad, "\n".join(bad[:20])
    assert [sorted(per) for per in out.values()] == [list(seeds)] * world
    assert sum(landed.values()) == len(seeds), landed


def case_torch_ddp(rank, world, runs):
    """Train torch's DDP on gloo (the differential runs' reference copy) on each of `runs`
    ((seed, run)): what each raised, or None."""
    import torch.distributed as dist

    import ringdp  # noqa: F401 -- registers the backend

    ring_group = dist.new_group(backend="cpu:ringdp")  # (_train's argument; the copy trains on gloo)
    out = []
    for seed, run in runs:
        try:
            _fuzz_ddp._train("torch", run, seed, rank, world, ring_group)
            out.append(None)
        except Exception as e:  # noqa: BLE001 -- what torch's DDP raised
            out.append(f"{type(e).__name__}: {e}")
    dist.destroy_process_group(ring_group)
    return out


def test_kills_skip_the_runs_torch_refuses():
    """torch_ddp_refuses holds exactly for the runs torch's own DDP cannot train (a complex
    parameter with Adam, the reduced gradient copied into autograd's lazy conjugate), and
    make_kill draws no stock-DDP kill of such a run (world 3 seed 54 did: every rank raised
    torch's view_as_real error before its point)."""
    from _dist import run_ranks, values

    base = _fuzz_ddp.make_run(51, 2)  # (a complex parameter, Adam, gradient_as_bucket_view)
    variants = [{}, {"gradient_as_bucket_view": False}, {"gradient_as_bucket_view": False, "optimizer": "sgd"},
                {"gradient_as_bucket_view": False, "complex": False}]
    runs = [(51, {**base, **v}) for v in variants]
    assert [_fuzz_ddp.torch_ddp_refuses(run) for _, run in runs] == [False, True, False, False]
    for r, out in enumerate(values(run_ranks(case_torch_ddp, 2, runs, timeout=180))):
        for (_, run), err in zip(runs, out):
            assert (err is not None) == _fuzz_ddp.torch_ddp_refuses(run), (r, run, err)
            assert err is None or "view_as_real" in err, (r, err)
    assert _fuzz_ddp.torch_ddp_refuses(_fuzz_ddp.make_run(54, 3)) and _fuzz_ddp.make_kill(54, 3)["kind"] == "ring_pg"


def test_interrupt_run_verdicts():
    """kill_errors of an interrupt run: peers that trained to the end pass only when the victim
    stopped in its last micro-batch; a victim that raised something else, or nothing (its
    interrupt lost), fails, and so does torch's rewording of it; a peer's error must name the
    victim."""
    k = _fuzz_ddp.make_kill(3, 3, interrupt=True)
    assert k == {**_fuzz_ddp.make_kill(3, 3), "interrupt": k["interrupt"], "final": k["final"]}
    assert 0 <= k["interrupt"] < 0.01
    k = {**k, "victim": 1, "final": (2, 0), "gloo": False}
    ok = ("ok", (None, None, 0.1, (2, 0)))

    def verdict(victim, peer):
        res = [peer, victim, peer]
        return {r: e for r, e in _fuzz_ddp.kill_errors(k, 3, res, [0, 0, 0], set()).items() if e}

    interrupted = lambda at: ("ok", ("KeyboardInterrupt", "comm.py:wait", 0.1, at))  # noqa: E731
    assert verdict(interrupted((2, 0)), ok) == {}
    early = verdict(interrupted((1, 1)), ok)
    assert sorted(early) == [0, 2] and "trained on after rank 1 was interrupted" in early[0][0], early
    named = ("ok", ("RingError", "rank 1 was interrupted", 0.1, (1, 1)))
    assert verdict(interrupted((1, 1)), named) == {}
    unnamed = verdict(interrupted((1, 1)), ("ok", ("RingError", "a peer left", 0.1, (1, 1))))
    assert sorted(unnamed) == [0, 2] and "names neither rank 1" in unnamed[0][0], unnamed
    lost = verdict(("ok", (None, None, 0.1, (2, 0))), ok)
    assert list(lost) == [1] and "its interrupt was lost" in lost[1][0], lost
    other = verdict(("ok", ("RuntimeError", "boom", 0.1, (1, 1))), named)
    assert list(other) == [1] and "it raised RuntimeError: boom" in other[1][0], other
    reworded = "Cannot extract tensors from value: KeyboardInterrupt: <EMPTY MESSAGE>"  # (torch's, in backward)
    took = verdict(("ok", ("RuntimeError", reworded, 0.1, (1, 1))), named)
    assert list(took) == [1] and "torch reworded its KeyboardInterrupt" in took[1][0], took


def test_training_kills_cover_the_points():
    """The seeds of TRAINING_KILLS kill in every phase, train every DDP copy (RingDDP, stock
    DDP and RingDDP on cpu:ringdp), kill inside Join and under no_sync (a micro-batch before
    the last), and some kill after the victim's last collective."""
    kills = [(m, _fuzz_ddp.make_kill(s, w, m == "fsdp"), s, w) for m, w, _, seeds in TRAINING_KILLS for s in seeds]
    assert {k["point"][2] for _, k, _, _ in kills} == set(_fuzz_ddp.KILL_PHASES)
    assert {k["kind"] for m, k, _, _ in kills if m == "ddp"} == {"ring", "stock", "ring_pg"}
    assert any(m == "ddp" and _fuzz_ddp.make_run(s, w)["uneven"] for m, _, s, w in kills)
    assert any(k["point"][1] < _fuzz_ddp._micro(_fuzz_ddp.make_run(s, w), k["point"][0]) - 1
               for m, k, s, w in kills if m == "ddp")
    assert any(k["last"] for _, k, _, _ in kills)
    assert _fuzz_ddp.make_kill(5, 3) == _fuzz_ddp.make_kill(5, 3)


def test_training_runs_cover_the_options():
    """The seeds of TRAININGS draw every extra, hook, optimizer and bucket size, uneven inputs
    (with a branch no rank that still trains uses), static graphs and no_sync steps; the
    draw is a pure function of the seed."""
    runs = [_fuzz_ddp.make_run(s, w) for m, w, _, seeds in TRAININGS if m == "ddp" for s in seeds]
    assert _fuzz_ddp.make_run(7, 3) == _fuzz_ddp.make_run(7, 3)
    assert {e for r in runs for e in r["extras"]} == {"tied", "frozen", "step_branch", "rank_branch", "batchnorm"}
    assert {r["hook"] for r in runs} == {None, "fp16", "bf16"}
    assert {r["optimizer"] for r in runs} == {"sgd", "adam"}
    assert any(r["sparse"] and r["uneven"] for r in runs) and any(r["sparse"] and r["micro"][0] > 1 for r in runs)
    assert {r["bucket_cap_mb"] for r in runs} == {1e-6, 1e-4, 2e-3, 25.0}
    for key in ("find_unused_parameters", "gradient_as_bucket_view", "static_graph", "broadcast_buffers", "set_to_none",
                "sparse"):
        assert {r[key] for r in runs} == {True, False}, key
    assert any(r["uneven"] and {"rank_branch", "step_branch"} & set(r["extras"]) for r in runs)
    assert any(r["uneven"] and "batchnorm" in r["extras"] and r["broadcast_buffers"] for r in runs)
    assert any(any(m > 1 for m in r["micro"][:r["steps"]]) for r in runs)
    # the tolerance: 1e-9 without a hook, looser through one (tolerance())
    assert [_fuzz_ddp.tolerance({"hook": h}) for h in (None, "fp16", "bf16")] == [1e-9, 1e-3, 1e-2]
    # FSDP2 runs: sharded per layer and at the root only, resharded after forward or not,
    # with and without the mixed-precision policy, both optimizers, gradient accumulation
    fsdp = [_fuzz_ddp.make_fsdp_run(s, w) for m, w, _, seeds in TRAININGS if m == "fsdp" for s in seeds]
    assert {r["shard"] for r in fsdp} == {"layers", "root"}
    assert {r["reshard_after_forward"] for r in fsdp} == {r["mixed"] for r in fsdp} == {True, False}
    assert {r["optimizer"] for r in fsdp} == {"sgd", "adam"}
    assert any(any(m > 1 for m in r["micro"][:r["steps"]]) for r in fsdp)
    assert {r["premul"] for r in fsdp} == {True, False}
    assert not any((r["mixed"] or r["premul"]) and r["optimizer"] == "adam" for r in fsdp)
