"""No silent divergence: every collective is fingerprinted (call number, kind, caller's tag)
across ranks; RingDDP refuses to go on after a backward that died mid-reduction; a stalled
collective reports which ranks are late and where every rank is, and leaves a flight record."""
import json
import logging
import os
import time

import torch
from torch import nn

from _dist import run_ranks, values

SLACK_S = 5.0


# ============================================================== engine fingerprint
def _tag_mismatch(rank, world):
    import ringdp

    errors = []
    for rep in range(2):  # each collective twice: the communicator survives a mismatch
        t = torch.arange(100, dtype=torch.float32) + rank
        # rank 1 is one step behind: same size, dtype and op, different tag
        tag = f"RingDDP step {3 if rank != 1 else 2} bucket {rep}"
        t0 = time.monotonic()
        try:
            ringdp.all_reduce(t, tag=tag, timeout=30)
            errors.append((None, 0.0))
        except ringdp.RingError as e:
            errors.append((str(e), time.monotonic() - t0))
        u = torch.full((7,), float(rank + 1))
        ringdp.all_reduce(u, tag=f"ok {rep}")  # matching tags: runs
        errors.append(u.tolist())
    with ringdp.collective_tag(f"block {rank}"):  # the thread's tag, for calls without tag=
        try:
            ringdp.all_reduce(torch.ones(3))
            errors.append(None)
        except ringdp.RingError as e:
            errors.append(str(e))
    ringdp.all_reduce(torch.ones(3))  # outside the block: the empty tag again, on every rank
    return errors


def test_calls_with_different_tags_fail_on_every_rank_naming_both():
    res = values(run_ranks(_tag_mismatch, 3))
    for rank, errs in enumerate(res):
        for rep in range(2):
            msg, took = errs[2 * rep]
            assert msg is not None, f"rank {rank} averaged calls of different steps"
            assert f"rank {rank}:" in msg and "different collectives" in msg
            assert f"tag 'RingDDP step 3 bucket {rep}'" in msg and f"tag 'RingDDP step 2 bucket {rep}'" in msg
            assert "rank 1: all_reduce" in msg and "100 x float32" in msg
            assert took < SLACK_S
            assert errs[2 * rep + 1] == [6.0] * 7
        assert "tag 'block 0'" in errs[4] and "tag 'block 2'" in errs[4]


def _bad_tags(rank, world):
    import ringdp

    out = []
    for tag in ["x" * 64, 5]:
        try:
            ringdp.all_reduce(torch.ones(4), tag=tag)
            out.append(None)
        except (TypeError, ValueError, ringdp.RingError) as e:
            out.append((type(e).__name__, str(e)))
    ringdp.all_reduce(torch.ones(4), tag="x" * 63)  # the longest tag there is
    return out


def test_bad_tags_are_clear_errors_on_every_rank():
    for out in values(run_ranks(_bad_tags, 2)):
        assert out[0][0] in ("ValueError", "RingError") and "63 bytes" in out[0][1]
        assert out[1][0] in ("TypeError", "RingError") and "must be a str" in out[1][1]


# ============================================================== RingDDP after a failed backward
class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises on the chosen rank and step (an OOM, say)."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.fail:
            raise RuntimeError("simulated out of memory in backward")
        return g, None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 2)

    def forward(self, x, fail=False):
        h = torch.tanh(self.a(x))
        h = _FailOnce.apply(h, fail)  # gradients of b and c exist (their buckets start) before it raises
        return self.c(torch.tanh(self.b(h)))


def _skip_batch_on_one_rank(rank, world):
    import ringdp

    torch.manual_seed(0)
    model = ringdp.RingDDP(_Net(), bucket_cap_mb=1e-5)  # a bucket per parameter
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []
    for step in range(4):
        x = torch.randn(5, 6) + rank + step
        try:
            loss = model(x, fail=(rank == 1 and step == 1)).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            events.append(("ok", step))
        except ringdp.RingError as e:  # the peers: the late rank never comes
            events.append(("RingError", str(e)))
            break
        except RuntimeError as e:  # "skip the batch on OOM"
            events.append(("RuntimeError", str(e)))
            opt.zero_grad()
            if "finished reduction" in str(e):
                time.sleep(6)  # alive past the peers' timeout: they must report it as late
                break
    return events


def test_rank_whose_backward_died_cannot_train_on():
    res = values(run_ranks(_skip_batch_on_one_rank, 3, env={"RINGDP_TIMEOUT_S": "4"}, timeout=120))
    late = res[1]
    assert late[0] == ("ok", 0)
    assert late[1][0] == "RuntimeError" and "simulated out of memory" in late[1][1]
    kind, msg = late[2]  # the next forward refuses
    assert kind == "RuntimeError" and "finished reduction in the prior iteration" in msg
    assert "rank 1" in msg and "step 1" in msg and "bucket reductions" in msg
    for r in (0, 2):
        assert res[r][0] == ("ok", 0)
        kind, msg = res[r][1]  # the peers fail (never average buckets of different steps)
        assert kind == "RingError", res[r]
        # the first to time out aborts; the other learns it from that rank; both give the report
        assert f"rank {r}:" in msg and "timed out after 4 s waiting for rank 1" in msg
        assert "Not entered by rank(s) 1." in msg and "tag 'RingDDP step 1 bucket" in msg


# ============================================================== stall report and flight record
def _late_rank(rank, world, trace_dir):
    import ringdp

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("ringdp").addHandler(Keep())
    t = torch.full((1000,), float(rank))
    ringdp.all_reduce(t, tag="warm-up")
    if rank == 2:
        time.sleep(2.5)  # alive, late
    u = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    ringdp.all_reduce(u, tag="late")
    ok = torch.equal(u, torch.arange(1000, dtype=torch.float32) * 6) and torch.equal(t, torch.full((1000,), 3.0))
    path = os.path.join(trace_dir, f"ringdp_flight.rank{rank}.json")
    flight = json.load(open(path)) if os.path.exists(path) else None
    return records, ok, flight, ringdp.get_communicator().flight_record()


def test_stall_report_names_the_late_rank_once(tmp_path):
    env = {"RINGDP_STALL_WARN_S": "0.5", "RINGDP_TRACE": str(tmp_path / "trace.json")}
    res = values(run_ranks(_late_rank, 3, str(tmp_path), env=env, timeout=120))
    for rank, (records, ok, flight, now) in enumerate(res):
        assert ok, f"rank {rank}: wrong result after the stall"
        assert [c["tag"] for c in now[-2:]] == ["warm-up", "late"] and all(c["status"] == "ok" for c in now[-2:])
        if rank == 2:
            assert records == [] and flight is None
            continue
        stalls = [m for m in records if "stall report" in m]
        assert len(stalls) == 1, records  # once per call
        m = stalls[0]
        assert f"from rank {rank}: all_reduce #2" in m and "Not entered by rank(s) 2." in m
        assert "rank 2: last finished all_reduce #1 (1000 x float32 SUM" in m and "tag 'warm-up'" in m
        assert "; in no collective" in m  # rank 2 is between calls
        assert f"rank {rank} (this rank): last finished all_reduce #1" in m and "in all_reduce #2 (1000 x float32" in m
        assert "tag 'late'" in m
        assert flight["reason"] == "stall" and flight["rank"] == rank and "Not entered" in flight["report"]
        assert [(c["seq"], c["tag"], c["status"]) for c in flight["calls"][-2:]] == [
            (1, "warm-up", "ok"), (2, "late", "running")]


def _never_arrives(rank, world, trace_dir):
    import ringdp

    ringdp.all_reduce(torch.ones(10), tag="first")
    if rank == 1:
        time.sleep(3)
        return None
    try:
        ringdp.all_reduce(torch.ones(20, dtype=torch.float64), tag="second", timeout=1.0)
    except ringdp.RingError as e:
        flight = json.load(open(os.path.join(trace_dir, f"ringdp_flight.rank{rank}.json")))
        return str(e), flight
    return None


def test_timeout_error_carries_the_stall_report_and_leaves_a_flight_record(tmp_path):
    res = values(run_ranks(_never_arrives, 2, str(tmp_path), env={"RINGDP_TRACE": str(tmp_path)}))
    msg, flight = res[0]
    assert "timed out after 1 s" in msg and "Not entered by rank(s) 1." in msg
    assert "rank 1: last finished all_reduce #1 (10 x float32 SUM ring, tag 'first'); in no collective" in msg
    assert "in all_reduce #2 (20 x float64 SUM" in msg
    assert flight["reason"] == "failed collective" and "timed out" in flight["report"]
    assert [(c["seq"], c["tag"], c["status"]) for c in flight["calls"]] == [(1, "first", "ok"), (2, "second", "failed")]
