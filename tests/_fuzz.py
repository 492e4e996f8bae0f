"""Random programs of collectives, checked against closed forms: a differential fuzzer.

A program is a list of calls drawn from a seed, the same on every rank (as every real
program's calls must be): all-reduce (every op with a closed form), reduce-scatter and
all-gather (tensor and list forms), broadcast from any root, the coalesced forms, barriers,
and a delegated collective, through torch.distributed's API on a ringdp group or through
ringdp's own functions, on the whole group or a subgroup, synchronous or asynchronous.
Asynchronous works pile up and are waited for at random points in an order of each rank's
own; ranks also sleep a little at random, so that they reach each call at different times.
Tensors come plain, as views into a larger buffer whose other bytes must stay untouched, as
strided views, or from ringdp's registered memory.

Every input is tests/_closed_form.py's v(r, i) (small integers: every reduction is exact in
every dtype used, whatever the order of the arithmetic), so each result is checked bitwise
against what it must be, on every rank, which also shows that the ranks agree.

With --mismatches N, N calls of each program (among those ringdp's engine runs) have one
rank, the victim, call with another count, op or root than its peers: every member must
raise a RingError for it, and every call after it must still be right (README "Failures":
a mismatch leaves the communicator usable). With --symmetric (and --hosts) the victims are
the members with one local rank on every host of the call's group, so that ranks of a host
disagree while each group across hosts agrees (a,a,b,b: members 1 and 3 alike).

With --kill, each program has one rank SIGKILL itself before a call of its second half: the
others must end the program (a RingError; gloo's error for what runs on the inner group)
within twice the timeout, with no wrong result on the way, then exit with 0 and leave no
/dev/shm name behind.

With --interrupt, one rank of each program gets a SIGINT (Ctrl-C, Python's own handler) a
drawn 0-30 ms after it starts a call of its second half, so that the KeyboardInterrupt comes
wherever that rank is then: inside a transport's wait, in Work.wait(), in a step across
hosts, between calls, in the program's own code. Its program ends there; the others end
theirs as after a kill (a RingError, or gloo's error), with no wrong result; every rank,
the interrupted one too, exits with 0 (never std::terminate) and no /dev/shm name is left.
The summary counts where the interrupts came.

    python tests/_fuzz.py --world 3 --seeds 0:200            # a campaign (fresh ranks per batch)
    python tests/_fuzz.py --world 4 --hosts a,a,b,b --seeds 0:50 --mismatches 2
    python tests/_fuzz.py --world 4 --hosts a,a,b,b --seeds 0:50 --mismatches 1 --symmetric
    python tests/_fuzz.py --world 4 --hosts a,a,a,b --seeds 0:20 --kill
    python tests/_fuzz.py --world 3 --seeds 0:40 --interrupt
    python tests/_fuzz.py --world 2 --seeds 17 --show         # print one program

tests/test_fuzz.py runs a few seeds of each set-up in the test suite.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _closed_form import value  # noqa: E402

SIZES = (0, 1, 2, 3, 7, 13, 64, 257, 1001, 4099, 10007, 65537)  # elements per rank (a block, for the halves)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)
GUARD = 3  # a view's buffer holds GUARD elements of sentinel before and after it
SENTINEL = 77  # (v(r, i) is at most 12 + 2 (n - 1) < 77 for n <= 32)

# The set-ups a campaign runs in: (backend of the default group, environment). Small slots
# and pieces make the multi-slice and pipelined paths run with small tensors.
SETUPS = {
    "backend": ("cpu:ringdp", {}),
    "backend-small-slots": ("cpu:ringdp", {"RINGDP_SLOT_BYTES": "4096", "RINGDP_FIFO_SLOTS": "2",
                                           "RINGDP_ONESHOT_BYTES": "4096"}),
    "gloo-default": ("gloo", {}),  # ringdp's functions on a gloo group; dist.* on a ringdp subgroup
    # the settings that pick other paths: small async calls inline, one algorithm forced,
    # tensors adopted into registered memory, pipelines of small pieces across hosts (with
    # --hosts), gloo on the whole group across hosts, the trace (an observer) on
    "inline-async": ("cpu:ringdp", {"RINGDP_INLINE_ASYNC_MAX_BYTES": "65536"}),
    "oneshot": ("cpu:ringdp", {"RINGDP_ALGO": "oneshot"}),
    "ring": ("cpu:ringdp", {"RINGDP_ALGO": "ring"}),
    "adopt": ("cpu:ringdp", {"RINGDP_BACKEND_ADOPT_MIN_BYTES": "0"}),
    "small-pieces": ("cpu:ringdp", {"RINGDP_HIER_PIECE_BYTES": "4096"}),
    "flat": ("cpu:ringdp", {"RINGDP_HIERARCHY": "0"}),
    "trace": ("cpu:ringdp", {"RINGDP_TRACE": "/tmp/ringdp-fuzz-trace/{rank}"}),
}


# ==================================================================== the program
def _reductions(dtype):
    """The ops a call of `dtype` may draw, with a closed form over small integers."""
    ops = ["SUM", "MIN", "MAX"]
    if dtype.is_floating_point:
        ops += ["AVG", "PREMUL_SUM"]
    if dtype in (torch.int32, torch.int64, torch.float64):
        ops.append("PRODUCT")  # 18^4 fits; not fp16/bf16 (inexact), nor uint8
    if not dtype.is_floating_point:
        ops += ["BAND", "BOR", "BXOR"]
    return ops


def make_program(seed: int, world: int, subgroups: list[list[int]], length: int = 40, hosts=None,
                 mismatches: int = 0, kill: bool = False, flat: bool = False, symmetric: bool = False,
                 interrupt: bool = False) -> list[dict]:
    """The calls of program `seed` (identical on every rank). `hosts`: each rank's host id
    (None: one host); a group with one rank per host, or across hosts with `flat`
    (RINGDP_HIERARCHY=0), has no registered memory (its calls have no in-host step:
    ringdp.empty refuses it). `mismatches`: calls where one rank (the
    "victim") calls with another count, op or root than its peers (_twist): every member
    must raise a RingError for that call, and every later call must be right (README
    "Failures": a mismatch leaves the communicator usable). `kill`: one rank SIGKILLs itself
    before one call of the second half (that call's "kill": its rank; ended_by). `symmetric`
    (with `hosts`): the victims ("victims") are the members with one drawn local rank on
    every host of the call's group, where that is not every member (_symmetric_victims).
    `interrupt`: one rank gets a SIGINT a drawn 0-30 ms after it starts one call of the
    second half, not of the last 8 (that call's "interrupt": (its rank, the delay); ended_by)."""
    rng = random.Random(seed)
    groups = [list(range(world))] + subgroups
    calls = []
    for _ in range(length):
        members = rng.choice(groups)
        kind = rng.choices(["all_reduce", "reduce_scatter", "all_gather", "broadcast", "coalesced", "barrier",
                            "delegated"], weights=[8, 4, 4, 3, 2, 1, 1])[0]
        dtype = rng.choice(DTYPES)
        op = rng.choice(_reductions(dtype))
        api = rng.choice(["dist", "ringdp"])
        if kind in ("coalesced", "barrier", "delegated") or op not in ("SUM", "MIN", "MAX", "AVG") \
                or dtype == torch.uint8:
            api = "dist"  # ringdp's own functions take SUM, AVG, MIN and MAX, and no uint8
        if kind == "reduce_scatter" and op in ("PRODUCT", "BAND", "BOR", "BXOR"):
            op = "SUM"  # torch's reduce-scatter has no bitwise ops on gloo either
        form = rng.choice(["plain", "view", "strided", "registered"])
        if form == "registered" and hosts and (len({hosts[r] for r in members}) == len(members) > 1
                                               or (flat and len({hosts[r] for r in members}) > 1)):
            form = "view"  # (no in-host step: ringdp.empty refuses it)
        if (api == "ringdp" and form == "strided") or (form == "registered" and dtype == torch.uint8):
            form = "plain"  # ringdp's functions take contiguous tensors (the backend copies); no uint8 arena
        calls.append({
            "kind": kind, "members": members, "dtype": dtype, "op": op, "api": api, "form": form,
            "count": rng.choice(SIZES), "root": rng.randrange(len(members)),
            "list": rng.random() < 0.3,  # reduce_scatter / all_gather: the list forms
            "factor": rng.choice([0.5, 0.25, 2.0]),
            "async": rng.random() < 0.5,
            "wait_after": rng.random() < 0.3,  # then wait for some of the pending works
        })
    eligible = [k for k, c in enumerate(calls) if _twistable(c)]
    for k in rng.sample(eligible, min(mismatches, len(eligible))):
        c = calls[k]
        c["victim"] = rng.randrange(len(c["members"]))
        if symmetric and hosts:
            c["victims"] = _symmetric_victims(c["members"], hosts, c["victim"])
            c["victim"] = c["victims"][0]
        # (not PREMUL_SUM's op: it is SUM of premultiplied inputs, so SUM beside it is each
        # rank scaling its own input, not a mismatch)
        c["twist"] = rng.choice(["count", "root"] if c["kind"] == "broadcast" and len(c["members"]) > 1 else
                                ["count", "op"] if c["kind"] in ("all_reduce", "reduce_scatter")
                                and c["op"] != "PREMUL_SUM" else ["count"])
        if c["twist"] == "op":  # (an op of the same family, native on every rank)
            c["twisted_op"] = {"SUM": "MAX", "MAX": "MIN", "MIN": "SUM", "AVG": "SUM"}[c["op"]]
    if kill:
        calls[rng.randrange(length // 2, length)]["kill"] = rng.randrange(world)
    if interrupt:  # (drawn after everything else: the calls are the uninterrupted program's)
        calls[rng.randrange(length // 2, max(length // 2 + 1, length - 8))]["interrupt"] = (rng.randrange(world),
                                                                                          rng.uniform(0.0, 0.03))
    return calls


def ended_by(calls: list[dict]) -> int | None:
    """The rank whose end (SIGKILL, or a SIGINT: its program stops there) ends the program
    for the others (None: none)."""
    return next((c["kill"] if "kill" in c else c["interrupt"][0] for c in calls
                 if "kill" in c or "interrupt" in c), None)


def _twistable(call) -> bool:
    """Whether a call runs on ringdp's own engine whatever one rank changes in it (a
    mismatch there is ringdp's to catch: one on the inner gloo group may end the process,
    as gloo does on a size mismatch)."""
    if call["kind"] not in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        return False
    if call["dtype"] == torch.uint8 or call["op"] not in ("SUM", "MIN", "MAX", "AVG", "PREMUL_SUM"):
        return call["kind"] in ("all_gather", "broadcast") and call["dtype"] != torch.uint8
    return True


def _symmetric_victims(members: list[int], hosts, pick: int) -> list[int]:
    """The members (indices into `members`) with the local rank in the group of member `pick`
    on every host; [pick] alone where that would be every member (one per host)."""
    where = [hosts[m] for m in members]
    local = [where[:i].count(h) for i, h in enumerate(where)]
    same = [i for i in range(len(members)) if local[i] == local[pick]]
    return same if len(same) < len(members) else [pick]


def _twist(call, me: int, n: int) -> dict:
    """The call as this rank makes it: its own unless it is one of the call's victims."""
    if me not in call.get("victims", (call.get("victim"),)):
        return call
    c = dict(call)
    if c["twist"] == "count":
        c["count"] = c["count"] + 1
    elif c["twist"] == "op":
        c["op"] = c["twisted_op"]
    else:
        c["root"] = (c["root"] + 1) % n
    return c


def describe(call: dict) -> str:
    c = dict(call)
    c["dtype"] = str(c["dtype"]).replace("torch.", "")
    keys = ("kind", "members", "dtype", "op", "api", "form", "count", "root", "list", "async")
    text = " ".join(f"{k}={c[k]}" for k in keys)
    if "victim" in c:
        who = (f"members {c['victims']} change" if len(c.get("victims", ())) > 1
               else f"member {c['victim']} changes")
        text += f" MISMATCH: {who} the {c['twist']}"
    if "kill" in c:
        text += f" (rank {c['kill']} is SIGKILLed before it)"
    if "interrupt" in c:
        text += f" (rank {c['interrupt'][0]} gets a SIGINT {c['interrupt'][1] * 1000:.0f} ms after it starts it)"
    return text


# ==================================================================== closed forms
def _inputs(count, dtype, n):
    return [value(r, count, torch.float64, world=n) for r in range(n)]


def expected(op: str, n: int, count: int, dtype, factor: float = 1.0) -> torch.Tensor:
    """`op` over the n ranks' v(r, i), i < count, computed exactly, as `dtype`."""
    xs = _inputs(count, dtype, n)
    if op in ("BAND", "BOR", "BXOR"):
        ints = [x.to(torch.int64) for x in xs]
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        e = ints[0]
        for x in ints[1:]:
            e = fn(e, x)
        return e.to(dtype)
    stack = torch.stack(xs) if count else torch.zeros(n, 0, dtype=torch.float64)
    e = {"SUM": lambda: stack.sum(0), "AVG": lambda: stack.sum(0) / n, "MIN": lambda: stack.min(0).values,
         "MAX": lambda: stack.max(0).values, "PRODUCT": lambda: stack.prod(0),
         "PREMUL_SUM": lambda: (stack * factor).sum(0)}[op]()
    return e.to(dtype)


def _op(name: str, factor: float):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, name)


# ==================================================================== running a program
class _Tensor:
    """A tensor of `count` elements in one of the forms, and the check that the bytes
    around it (a view's guards, a strided view's other column) were left alone."""

    def __init__(self, form, count, dtype, group):
        self.form = form
        if form == "view":
            self.base = torch.full((count + 2 * GUARD,), SENTINEL, dtype=dtype)
            self.t = self.base[GUARD:GUARD + count]
        elif form == "strided":
            self.base = torch.full((count, 2), SENTINEL, dtype=dtype)
            self.t = self.base[:, 1]
        elif form == "registered":
            import ringdp

            self.base = None
            self.t = ringdp.empty(count, dtype=dtype, group=group)
        else:
            self.base = None
            self.t = torch.empty(count, dtype=dtype)

    def fill(self, src):
        self.t.copy_(src)
        return self

    def untouched(self) -> str | None:
        if self.form == "view":
            around = torch.cat([self.base[:GUARD], self.base[-GUARD:]])
        elif self.form == "strided":
            around = self.base[:, 0]
        else:
            return None
        if not bool((around == SENTINEL).all()):
            return f"bytes around the {self.form} tensor were written: {around.tolist()[:8]}"
        return None


def _run_call(call, me, n, groups):
    """Issue one call; `groups`: (the group for torch.distributed's API, the group for
    ringdp's functions). Returns (work or None, check: () -> error or None)."""
    import ringdp

    g = groups[1] if call["api"] == "ringdp" else groups[0]
    kind, dtype, count = call["kind"], call["dtype"], call["count"]
    op, api, asy = call["op"], call["api"], call["async"]
    red = _op(op, call["factor"])
    v = lambda r, k: value(r, k, dtype, world=n)  # noqa: E731

    def compare(got, want, what="result"):
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{what}: {got.dtype} {tuple(got.shape)} where {want.dtype} {tuple(want.shape)} was due"
        if not torch.equal(got, want):
            bad = (got.double() - want.double()).abs()
            i = int(bad.argmax())
            return f"{what}: wrong at {int((bad > 0).sum())} of {got.numel()} elements, e.g. [{i}] {got[i].item()} " \
                   f"where {want[i].item()} was due"
        return None

    if kind == "barrier":
        return dist.barrier(group=g, async_op=asy), lambda: None
    if kind == "delegated":  # what ringdp leaves to its inner gloo group, between native calls
        out = torch.empty(n, dtype=torch.int64)
        w = dist.all_to_all_single(out, torch.arange(n, dtype=torch.int64) + 100 * me, group=g, async_op=asy)
        return w, lambda: compare(out, torch.arange(n, dtype=torch.int64) * 100 + me)
    if kind == "all_reduce":
        t = _Tensor(call["form"], count, dtype, g).fill(v(me, count))
        if api == "ringdp":
            w = ringdp.all_reduce(t.t, op=red, group=g, async_op=asy)
        else:
            w = dist.all_reduce(t.t, op=red, group=g, async_op=asy)
        return w, lambda: compare(t.t, expected(op, n, count, dtype, call["factor"])) or t.untouched()
    if kind == "coalesced":
        sizes = [count, (count * 7 + 3) % 5000, 1]
        ts = [v(me, k) for k in sizes]
        want = [expected(op, n, k, dtype, call["factor"]) for k in sizes]
        if op in ("SUM", "MIN", "MAX") and call["list"]:
            w = dist.all_reduce_coalesced(ts, op=red, group=g, async_op=asy)
        else:  # the coalescing manager, as DDP's and FSDP's code reach it
            with dist._coalescing_manager(group=g, async_ops=True) as cm:
                for t in ts:
                    dist.all_reduce(t, op=red, group=g)
            w = cm if asy else cm.wait()
        return w, lambda: next((e for e in (compare(a, b, f"tensor {j}") for j, (a, b) in enumerate(zip(ts, want)))
                                if e), None)
    if kind == "reduce_scatter":
        inp = v(me, n * count)
        out = _Tensor(call["form"], count, dtype, g).fill(torch.full((count,), SENTINEL, dtype=dtype))
        want = expected(op, n, n * count, dtype, call["factor"])[me * count:(me + 1) * count]
        if api == "ringdp":
            w = ringdp.reduce_scatter_tensor(out.t, inp, op=red, group=g, async_op=asy)
        elif call["list"]:
            w = dist.reduce_scatter(out.t, list(inp.split(count)) if count else [torch.empty(0, dtype=dtype)] * n,
                                    op=red, group=g, async_op=asy)
        else:
            w = dist.reduce_scatter_tensor(out.t, inp, op=red, group=g, async_op=asy)
        keep = inp.clone()
        return w, lambda: compare(out.t, want) or out.untouched() or compare(inp, keep, "input (must not change)")
    if kind == "all_gather":
        inp = _Tensor(call["form"], count, dtype, g).fill(v(me, count))
        want = torch.cat([v(q, count) for q in range(n)])
        if call["list"] and api == "dist":
            outs = [torch.full((count,), SENTINEL, dtype=dtype) for _ in range(n)]
            w = dist.all_gather(outs, inp.t, group=g, async_op=asy)
            return w, lambda: compare(torch.cat(outs), want) or inp.untouched()
        out = _Tensor(call["form"], n * count, dtype, g).fill(torch.full((n * count,), SENTINEL, dtype=dtype))
        if api == "ringdp":
            w = ringdp.all_gather_into_tensor(out.t, inp.t, group=g, async_op=asy)
        else:
            w = dist.all_gather_into_tensor(out.t, inp.t, group=g, async_op=asy)
        return w, lambda: compare(out.t, want) or out.untouched() or inp.untouched()
    if kind == "broadcast":
        root = call["root"]
        src = root if g is None else dist.get_global_rank(g, root)
        t = _Tensor(call["form"], count, dtype, g).fill(v(me, count) + 1 if me == root else
                                                      torch.full((count,), SENTINEL - 1, dtype=dtype))
        if api == "ringdp":
            w = ringdp.broadcast(t.t, src, group=g, async_op=asy)
        else:
            w = dist.broadcast(t.t, src, group=g, async_op=asy)
        return w, lambda: compare(t.t, v(root, count) + 1) or t.untouched()
    raise ValueError(f"unknown call kind {kind!r}")


def _raised(e: BaseException) -> str:
    """What a call raised, and where in ringdp (the innermost frame of the package)."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/ringdp/" in f.filename]
    where = f" (at ringdp/{frames[-1].filename.rsplit('/ringdp/', 1)[1]}:{frames[-1].lineno})" if frames else ""
    return f"raised {type(e).__name__}: {str(e).splitlines()[0][:300]}{where}"


def _after_a_death(call, e: BaseException) -> bool:
    """Whether `e` is what a call may raise once a peer died: ringdp's RingError; for what
    runs on the inner gloo group (or gloo's part of a barrier), whatever gloo raises."""
    if type(e).__name__ == "RingError":
        return True
    return call["kind"] in ("delegated", "barrier", "coalesced") or call["dtype"] == torch.uint8 \
        or call["op"] not in ("SUM", "MIN", "MAX", "AVG", "PREMUL_SUM")


def run_program(rank: int, seed: int, calls: list[dict], groups: dict, report: dict | None = None) -> list[str]:
    """Run the calls on this rank; returns what went wrong ("call k (...): why"). A program
    that kills a rank (make_program's `kill`): that rank SIGKILLs itself before its call;
    any call of the others may then raise (_after_a_death: a rank behind the victim sees the
    death in an earlier call), and the first that does ends the program there; no call may
    give a wrong result. `report` gets "ended_by", what ended it, and "after_kill_s", the
    seconds from when this rank passed the killing call (or ended before it) to the end."""
    rng_wait = random.Random(seed * 1000 + rank)  # this rank's own wait order and timing
    pending, errors = [], []
    report = {} if report is None else report
    if ended_by(calls) is not None:
        report["kills"] = True

    def settle(item):
        k, w, check = item
        try:
            if w is not None:
                w.wait()
            err = check()
            if "victim" in calls[k]:
                err = "no error for a mismatched call" + (f" (and: {err})" if err else "")
        except Exception as e:  # a RingError or torch's: the call failed
            if "kills" in report and _after_a_death(calls[k], e):
                report["ended_by"] = f"call {k}: {_raised(e)}"
                raise _Ended() from None
            err = None if "victim" in calls[k] and type(e).__name__ == "RingError" else _raised(e)
        if err:
            errors.append(f"call {k} ({describe(calls[k])}): {err}")

    try:
        _run_calls(rank, calls, groups, rng_wait, pending, errors, settle, report)
    except _Ended:  # (the works still pending end too, each within its timeout, as a program's should)
        for _k, w, _check in pending:
            try:
                if w is not None:
                    w.wait()
            except Exception:  # noqa: BLE001 -- a peer died: their failure is expected
                pass
    if "kills" in report:
        report["after_kill_s"] = time.monotonic() - report.pop("killed_at", time.monotonic())
    return errors


class _Ended(Exception):
    """A call failed after a peer died, as it may: the program ends there (run_program)."""


def _run_calls(rank, calls, groups, rng_wait, pending, errors, settle, report):
    """run_program's loop: issue each call this rank takes part in, settle works as drawn."""
    for k, call in enumerate(calls):
        if "kill" in call:
            if call["kill"] == rank:
                sys.stdout.flush()
                os.kill(os.getpid(), 9)  # SIGKILL: no handler, no cleanup
            report["killed_at"] = time.monotonic()
        if "interrupt" in call:
            who, delay = call["interrupt"]
            if who == rank:  # (case_campaign installed Python's SIGINT handler)
                report["timer"] = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
                report["timer"].start()
            report["killed_at"] = time.monotonic()
        members = call["members"]
        if rank in members:
            me, n = members.index(rank), len(members)
            if rng_wait.random() < 0.2:
                time.sleep(rng_wait.random() * 0.003)
            try:
                w, check = _run_call(_twist(call, me, n), me, n, groups[tuple(members)])
            except Exception as e:
                if "victim" in call and type(e).__name__ == "RingError":
                    continue  # (the mismatch, caught at once: the program goes on)
                if "kills" in report and _after_a_death(call, e):
                    report["ended_by"] = f"call {k}: {_raised(e)}"
                    raise _Ended() from None
                errors.append(f"call {k} ({describe(call)}): {_raised(e)}")
                break  # the ranks are out of step now: what follows would only repeat it
            item = (k, w if call["async"] else None, check)
            if call["async"]:
                pending.append(item)
            else:
                settle(item)
        if call["wait_after"] and pending:
            rng_wait.shuffle(pending)
            cut = rng_wait.randrange(len(pending) + 1)
            for item in pending[:cut]:
                settle(item)
            del pending[:cut]
    rng_wait.shuffle(pending)
    for item in pending:
        settle(item)


def _flat() -> bool:
    """Whether this rank runs groups across hosts flat (RINGDP_HIERARCHY=0)."""
    return os.environ.get("RINGDP_HIERARCHY") == "0"


def subgroups_for(world: int) -> list[list[int]]:
    """The subgroups a program of `world` ranks draws from besides the whole group."""
    if world >= 4:
        return [[1, 2, 3], [0, world - 1]]
    if world == 3:
        return [[0, 2]]
    return []


def case_campaign(rank, world, seeds, length=40, mismatches=0, kill=False, interrupt=False, hosts=None,
                  symmetric=False):
    """Every seed's program on this rank (one process group for all of them, so that
    communicators live across programs, as in a long job). Returns {seed: errors}. `kill`:
    one seed, whose program kills a rank; the others return at its end, with "_kill": what
    ended it and how long after the killing call (run_program). `interrupt`: one seed, whose
    program interrupts a rank (SIGINT); that rank's "_kill" says where the
    KeyboardInterrupt came ("interrupted_in"; None: after its program)."""
    import ringdp  # noqa: F401 -- registers the backend

    from datetime import timedelta

    limit = timedelta(seconds=float(os.environ.get("RINGDP_TIMEOUT_S", "20")))  # every group's: a hang is an error
    if "ringdp" in str(dist.get_backend()):
        dist.distributed_c10d._set_pg_timeout(limit)
    subs = subgroups_for(world)
    # members -> (the group of torch.distributed's calls, the group of ringdp's functions).
    # A gloo default group: dist.* on a ringdp group of every rank, ringdp's functions on the
    # gloo group (two communicators of the same ranks, their calls interleaved).
    whole = None if "ringdp" in str(dist.get_backend()) else dist.new_group(backend="cpu:ringdp", timeout=limit)
    groups = {tuple(range(world)): (whole, None)}
    for members in subs:  # every rank makes every group, in the same order
        sub = dist.new_group(members, backend="cpu:ringdp", timeout=limit)
        groups[tuple(members)] = (sub, sub)
    # where the ranks agree to go on, apart from what is tested
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=3 * limit.total_seconds()))
    if interrupt:
        (seed,), report = seeds, {}
        calls = make_program(seed, world, subs, length, hosts, mismatches, flat=_flat(), symmetric=symmetric,
                             interrupt=True)
        if ended_by(calls) == rank:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                errors = run_program(rank, seed, calls, groups, report)
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the program ended first)
                report["interrupted_in"] = None
            except KeyboardInterrupt as e:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                errors, report["interrupted_in"] = [], _landed(e)
            report.pop("timer").cancel()
            report.pop("after_kill_s", None)
            return {seed: errors, "_kill": report}
        return {seed: _within_bound(run_program(rank, seed, calls, groups, report), report, limit), "_kill": report}
    if kill:
        (seed,), report = seeds, {}
        errors = run_program(rank, seed, make_program(seed, world, subs, length, hosts, mismatches, kill=True,
                                                      flat=_flat(), symmetric=symmetric), groups, report)
        return {seed: _within_bound(errors, report, limit), "_kill": report}
    results = {}
    for seed in seeds:
        errors = run_program(rank, seed, make_program(seed, world, subs, length, hosts, mismatches, flat=_flat(),
                                                      symmetric=symmetric), groups)
        results[seed] = errors
        failed = torch.tensor([len(errors)])
        dist.all_reduce(failed, group=control)
        if failed.item():
            break  # a failed program may leave the ranks out of step: every rank stops at the first
    return results


def _within_bound(errors: list, report: dict, limit) -> list:
    """`errors`, and one more if the program went on for longer than twice the timeout and
    5 s after the rank that ended it passed its killing (or interrupting) call."""
    bound = 2 * limit.total_seconds() + 5
    if report.get("after_kill_s", 0) > bound:
        errors.append(f"the program went on {report['after_kill_s']:.1f} s after the killing call "
                      f"(bound: {bound:g} s, twice the timeout and 5 s)")
    return errors


def _landed(e: BaseException) -> str:
    """Where a KeyboardInterrupt came: the innermost frame of its traceback, as
    "file.py:function", and, if that is outside ringdp and this program (the standard
    library's, torch's), the innermost of theirs after it: "threading.py:wait in work.py:wait"."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"
    name = lambda f: f"{os.path.basename(f.filename)}:{f.name}"  # noqa: E731
    ours = [f for f in frames if f"{os.sep}ringdp{os.sep}" in f.filename or f"{os.sep}tests{os.sep}" in f.filename]
    inner = name(frames[-1])
    return inner if not ours or ours[-1] is frames[-1] else f"{inner} in {name(ours[-1])}"


def host_env(hosts: str | None, world: int) -> dict | None:
    """RINGDP_HOST_ID per rank for a layout such as "a,a,b,b" (None: one host)."""
    if not hosts:
        return None
    ids = hosts.split(",")
    if len(ids) != world:
        raise ValueError(f"--hosts names {len(ids)} hosts for {world} ranks")
    return ids


def run_campaign(world: int, seeds, setup: str = "backend", hosts: str | None = None, length: int = 40,
                 timeout: float = 600, mismatches: int = 0, kill: bool = False, symmetric: bool = False,
                 interrupt: bool = False) -> dict:
    """Run the seeds' programs on `world` fresh ranks; returns {rank: {seed: errors}}.
    `kill`: fresh ranks for each seed, whose program kills a rank (make_program); the others
    must end the program (and exit, with 0) without a wrong result or a hang, and leave no
    shared-memory name behind; each rank's "_kill" lists its run_program reports.
    `interrupt`: the same with a rank interrupted (SIGINT) instead, which exits with 0 too."""
    from _dist import run_ranks

    backend, env = SETUPS[setup]
    env = {"RINGDP_TIMEOUT_S": "10" if kill or interrupt else "20", **env}
    ids = host_env(hosts, world)
    fn = case_campaign if ids is None else _HostCampaign(ids, backend, symmetric)
    if not (kill or interrupt):
        return _outcomes(run_ranks(fn, world, list(seeds), length, mismatches, False, timeout=timeout, env=env,
                                   backend=backend))
    out = {r: {} for r in range(world)}
    for seed in seeds:
        victim = ended_by(make_program(seed, world, subgroups_for(world), length, ids, mismatches, kill=kill,
                                       flat=env.get("RINGDP_HIERARCHY") == "0", symmetric=symmetric,
                                       interrupt=interrupt))
        before = _shm_names()
        codes = []
        res = run_ranks(fn, world, [seed], length, mismatches, kill, interrupt, timeout=timeout, env=env,
                        backend=backend, allow_missing=(victim,) if kill else (), exitcodes=codes)
        if kill:
            res[victim] = ("ok", {seed: []})
        for r, per in _outcomes(res).items():
            report = per.pop("_kill", None)
            out[r].update(per)
            if report is not None:
                out[r].setdefault("_kill", []).append(report)
        left = sorted(_shm_names() - before)
        if left:
            out[victim].setdefault(seed, []).append(f"shared-memory names left: {left}")
        for r, code in enumerate(codes):
            if (r != victim or interrupt) and code != 0:
                where = [k.get("interrupted_in") for k in out[r].get("_kill", [])[-1:] if "interrupted_in" in k]
                out[r].setdefault(seed, []).append(f"exit code {code} (None: still running 10 s after its report)"
                                                   + (f"; interrupted in {where[0] or 'after its program'}"
                                                      if where else ""))
    return out


def _outcomes(res) -> dict:
    """run_ranks' results as {rank: {seed: errors}}."""
    out = {}
    for r, item in enumerate(res):
        if item is None:
            out[r] = {"?": [f"rank {r} never reported"]}
        elif item[0] != "ok":
            out[r] = {"?": [f"rank {r} failed outside a call: {item[1]}"]}
        else:
            out[r] = item[1]
    return out


def _shm_names() -> set:
    """ringdp's names in /dev/shm now."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("ringdp")}
    except OSError:
        return set()


class _HostCampaign:
    """case_campaign with RINGDP_HOST_ID set per rank (simulated hosts): the default group is
    made again on run_ranks' store once it is set, so that every group sees the hosts."""

    def __init__(self, ids, backend, symmetric=False):
        self.ids, self.backend, self.symmetric = ids, backend, symmetric
        self.__name__ = "case_campaign_hosts"

    def __call__(self, rank, world, seeds, length, mismatches, kill, interrupt=False):
        from datetime import timedelta

        os.environ["RINGDP_HOST_ID"] = self.ids[rank]
        store = dist.distributed_c10d._get_default_store()  # (rank 0 serves it while it is held)
        dist.destroy_process_group()
        dist.init_process_group(self.backend, store=dist.PrefixStore("fuzz-hosts/", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        out = case_campaign(rank, world, seeds, length, mismatches, kill, interrupt, self.ids, self.symmetric)
        del store
        return out


def failures(out: dict) -> list[str]:
    return [f"rank {r} seed {s}: {e}" for r, per in out.items() for s, errs in per.items()
            if not str(s).startswith("_") for e in errs]


def _seeds(text: str):
    if ":" in text:
        a, b = text.split(":")
        return range(int(a), int(b))
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seeds", default="0:20", help="A:B (a range) or a comma list")
    ap.add_argument("--setup", default="backend", choices=sorted(SETUPS))
    ap.add_argument("--hosts", help="simulated hosts, one id per rank: a,a,b,b")
    ap.add_argument("--length", type=int, default=40, help="calls per program")
    ap.add_argument("--batch", type=int, default=25, help="programs per set of fresh ranks")
    ap.add_argument("--mismatches", type=int, default=0,
                    help="calls per program where one rank calls with another count, op or root")
    ap.add_argument("--symmetric", action="store_true",
                    help="with --hosts: the mismatching ranks are one local rank on every host")
    ap.add_argument("--kill", action="store_true",
                    help="each program SIGKILLs one rank in its second half (fresh ranks per program)")
    ap.add_argument("--interrupt", action="store_true",
                    help="each program sends one rank a SIGINT in its second half (fresh ranks per program)")
    ap.add_argument("--show", action="store_true", help="print the programs instead of running them")
    a = ap.parse_args(argv)
    seeds = list(_seeds(a.seeds))
    import _fuzz  # the ranks import this module by name (not as __main__)

    if a.show:
        for s in seeds:
            for k, c in enumerate(_fuzz.make_program(s, a.world, subgroups_for(a.world), a.length,
                                                     _fuzz.host_env(a.hosts, a.world), a.mismatches, a.kill,
                                                     SETUPS[a.setup][1].get("RINGDP_HIERARCHY") == "0", a.symmetric,
                                                     a.interrupt)):
                print(f"seed {s} call {k}: {describe(c)}")
        return 0
    bad, t0, landed = [], time.monotonic(), {}
    for i in range(0, len(seeds), a.batch):
        batch = seeds[i:i + a.batch]
        out = _fuzz.run_campaign(a.world, batch, a.setup, a.hosts, a.length, mismatches=a.mismatches, kill=a.kill,
                                 symmetric=a.symmetric, interrupt=a.interrupt)
        ran = min(len([s for s in per if not str(s).startswith("_")]) for per in out.values())
        bad += _fuzz.failures(out)
        after = [k.get("after_kill_s", 0.0) for per in out.values() for k in per.get("_kill", [])]
        for per in out.values():
            for k in per.get("_kill", []):
                if "interrupted_in" in k:
                    where = k["interrupted_in"] or "after its program"
                    landed[where] = landed.get(where, 0) + 1
        print(f"seeds {batch[0]}..{batch[-1]}: {ran} programs ran, {len(_fuzz.failures(out))} failures "
              f"({time.monotonic() - t0:.0f} s)" + (f"; the survivors ended at most {max(after):.1f} s after the "
                                                    f"killing call" if after else ""), flush=True)
    if landed:
        print("the interrupts came in: " + ", ".join(f"{w} x{n}" for w, n in sorted(landed.items(), key=lambda x: -x[1])))
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
