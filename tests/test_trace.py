"""The tracer (single process): trace-file paths, step summaries, bounded event storage.
The trace RingDDP writes in a real run is checked in test_ddp.py (test_trace_file_and_summary)."""
import json

import pytest

from ringdp.trace import Tracer, load_summary, step_summary, trace_path


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
