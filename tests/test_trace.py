"""The tracer (single process): trace-file paths, step summaries, bounded event storage.
The trace RingDDP writes in a real run is checked in test_ddp.py (test_trace_file_and_summary,
and its cases for subgroups, a freed RingDDP and a parameter returned by forward)."""
import gc
import json
import threading

import pytest

from ringdp.config import Config
from ringdp.trace import Tracer, aggregate, load_summary, step_summary, trace_path


def test_trace_path_rules(tmp_path):
    assert str(trace_path("/x/t.json", 3)) == "/x/t.rank3.json"
    assert str(trace_path("/x/t-{rank}.json", 1)) == "/x/t-1.json"
    assert str(trace_path("/x/dir", 0)) == "/x/dir/ringdp_trace.rank0.json"
    s = step_summary({"step": 0, "t_bwd_start": 0, "t_bwd_end": 100, "t_end": 140, "exposed_us": 30,
                      "writeback_us": 10,
                      "buckets": [{"index": 0, "nbytes": 4, "t_launch": 10, "t_done": 50},
                                  {"index": 1, "nbytes": 4, "t_launch": 20, "t_done": 130}]})
    # bucket 1 waits for bucket 0 (one worker): 40 + 80 us of communication, 30 us exposed
    assert s["comm_ms"] == pytest.approx(0.12)
    assert s["exposed_comm_ms"] == pytest.approx(0.03)
    assert s["overlap_fraction"] == pytest.approx(0.75)
    assert s["writeback_ms"] == pytest.approx(0.01) and s["finalize_ms"] == pytest.approx(0.04)


def test_tracer_bounds_events_but_summarises_every_step(tmp_path):
    t = Tracer(tmp_path / "t.json", 0, 1, max_event_steps=2)
    step = {"t_bwd_start": 0, "t_bwd_end": 10, "t_end": 20, "exposed_us": 4, "writeback_us": 6,
            "buckets": [{"index": 0, "nbytes": 4, "params": 1, "t_ready": 1, "t_launch": 2, "t_done": 14,
                         "t_wait": (10, 14, 20)}]}
    for i in range(5):
        t.record_step(dict(step, step=i))
    path = t.flush()
    doc = json.loads(path.read_text())
    assert [e["name"] for e in doc["traceEvents"]].count("backward") == 2
    s = load_summary(path)
    assert s["steps"] == 5 and s["mean_exposed_comm_ms"] == pytest.approx(0.004)
    assert s["overlap_fraction"] == pytest.approx(1 - 4 / 12)
    # a second tracer of the same process does not overwrite the first one's file
    assert Tracer(tmp_path / "t.json", 0, 1).path.name == "t.rank0.ddp1.json"


def test_trace_path_names_global_rank_and_group():
    """Files are named by the global rank; a group other than the world adds its name, so that
    one process's files of two groups differ; the flight record follows the same rule."""
    assert str(trace_path("/x/t.json", 3, "g5")) == "/x/t.rank3.g5.json"
    assert str(trace_path("/x/t-{rank}.json", 1, "g2")) == "/x/t-1.g2.json"
    assert str(trace_path("/x/dir", 0, "g1")) == "/x/dir/ringdp_trace.rank0.g1.json"
    assert str(trace_path("/x/{rank:02d}/t.json", 4)) == "/x/04/t.json"
    assert str(trace_path("/x/dir", 2, kind="flight")) == "/x/dir/ringdp_flight.rank2.json"
    assert str(trace_path("/x/t.json", 2, "g1", kind="flight")) == "/x/ringdp_flight.rank2.g1.json"
    assert str(trace_path("/x/{rank}/t.json", 2, kind="flight")) == "/x/2/ringdp_flight.rank2.json"
    assert str(trace_path("/x/a{{b}}.json", 1)) == "/x/a{b}.rank1.json"  # literal braces, doubled


@pytest.mark.parametrize("bad, field", [("/x/{run}/t.json", "{run}"), ("/x/{}/t.json", "{}"),
                                        ("/x/{rank.real}.json", "{rank.real}"), ("/x/{/t.json", "lone brace"),
                                        ("/x/}.json", "lone brace"), ("/x/{rank:{x}}.json", "'x'"),
                                        ("/x/{rank:{0}}.json", "index 0")])
def test_trace_path_unknown_field_is_a_value_error(bad, field):
    """{rank} is the only field: anything else is a ValueError naming RINGDP_TRACE and the
    field, when the variable is read and when a path is made from it (RingDDP(trace=))."""
    for make in (lambda: Config.from_env({"RINGDP_TRACE": bad}), lambda: trace_path(bad, 0)):
        with pytest.raises(ValueError) as e:
            make()
        assert "RINGDP_TRACE" in str(e.value) and field in str(e.value) and "{rank}" in str(e.value)
    # "0" is a path like any other (documented: README, config.py); unset or empty is off
    assert Config.from_env({"RINGDP_TRACE": "0"}).trace == "0"
    assert Config.from_env({"RINGDP_TRACE": ""}).trace is None


def _step(i):
    """A step whose figures vary with i (so that a wrong mean shows)."""
    return {"step": i, "t_fwd_start": 0.0, "t_fwd_end": 1.0, "t_bwd_start": 1.0, "t_bwd_end": 5.0 + i % 7,
            "t_end": 6.0 + i % 7 + i % 3, "exposed_us": float(i % 5), "writeback_us": 0.5 * (i % 4),
            "buckets": [{"index": b, "nbytes": 4, "params": 1, "t_ready": 2.0, "t_launch": 2.0,
                         "t_done": 3.0 + b + i % 11, "t_wait": (5.0, 5.5, 5.6)} for b in range(3)]}


def test_tracer_stays_bounded_over_many_steps(tmp_path):
    """After RINGDP_TRACE_STEPS steps only the means grow: the per-step rows and the file stay
    as they were, and the means are those of every step (the first left out)."""
    n_kept, n = 10, 5000
    t = Tracer(tmp_path / "t.json", 0, 2, max_event_steps=n_kept)
    for i in range(n_kept + 1):
        t.record_step(_step(i))
    size_early = t.flush().stat().st_size
    n_events = len(t.events)
    for i in range(n_kept + 1, n):
        t.record_step(_step(i))
    path = t.flush()
    assert len(t.steps) == n_kept and len(t.events) == n_events
    assert path.stat().st_size < size_early + 200  # a few digits more in the summary, no rows
    s = load_summary(path)
    assert s["steps"] == n and len(s["per_step"]) == n_kept
    assert [r["step"] for r in s["per_step"]] == list(range(n_kept))
    want = aggregate([step_summary(_step(i)) for i in range(n)])
    assert s["steps_averaged"] == want["steps_averaged"] == n - 1
    for k, v in want.items():
        assert s[k] == pytest.approx(v, rel=1e-9), k


def test_tracer_written_when_its_owner_goes(tmp_path):
    """A tracer with an owner (a DDPTrace gives itself) writes its file when the owner is
    freed, not only at exit: `def main(): model = RingDDP(...)` gets its trace."""

    class Owner:
        pass

    owner = Owner()
    t = Tracer(tmp_path / "t.json", 0, 1, owner=owner)
    t.record_step(_step(0))
    path = t.path
    del t
    assert not path.exists()
    del owner
    gc.collect()
    assert path.exists() and load_summary(path)["steps"] == 1


def test_concurrent_flushes_do_not_collide(tmp_path):
    """Flushes of one file from several threads at once (the exit handler and a user's flush)
    each complete: no shared temporary file taken from under another writer."""
    t = Tracer(tmp_path / "c.json", 0, 1)
    for i in range(50):
        t.record_step(_step(i))
    errors = []

    def flush_many():
        try:
            for _ in range(100):
                t.flush()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=flush_many) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert load_summary(t.path)["steps"] == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.rank0.json"]  # no temporary file left


def case_flight_record_subgroups(rank, world, tmpdir):
    """Each rank is rank 0 of a one-rank group: their flight records are named by the global
    rank and the group (config.trace_path), so neither overwrites the other's."""
    import torch.distributed as dist

    import ringdp
    from ringdp.comm import _group_key

    singles = [dist.new_group([r]) for r in range(world)]
    t = ringdp.empty(4, group=singles[rank]).fill_(rank)
    ringdp.all_reduce(t, group=singles[rank])
    path = ringdp.get_communicator(singles[rank]).dump_flight_record("test", f"from global rank {rank}")
    dist.barrier()
    with open(path) as f:
        doc = json.load(f)
    return {"path": path, "report": doc["report"], "group": _group_key(singles[rank])}


def test_flight_records_of_subgroups_named_by_global_rank(pool, tmp_path):
    res = pool.run(case_flight_record_subgroups, tmpdir=str(tmp_path), env={"RINGDP_TRACE": str(tmp_path)})
    for r, out in enumerate(res):
        assert out["path"].endswith(f"ringdp_flight.rank{r}.{out['group']}.json")
        assert out["report"] == f"from global rank {r}"
