"""Timeline of RingDDP's backward passes: a Chrome-trace JSON per rank and a summary.

Enable with ``RINGDP_TRACE=path`` (or ``RingDDP(..., trace=path)``): a :class:`DDPTrace`
observes the RingDDP's Reducer (ringdp/reducer.py) and feeds a :class:`Tracer`. The path may contain
``{rank}``; otherwise ``.rank<r>`` is inserted before a ``.json`` suffix, and a path without
that suffix is taken as a directory. Open the file in chrome://tracing or
https://ui.perfetto.dev. Each rank is one process with two rows:

* ``autograd``: forward, backward (from the gradient of the output until autograd
  finished), then ``finalize`` (the end-of-backward callback), made of ``wait bucket i``
  (exposed communication: waiting for bucket i's all-reduce) and ``write back bucket i``
  (its averaged gradients copied into ``.grad``); an instant event marks the moment each
  bucket's last gradient arrived (``bucket i ready``).
* ``ringdp comm``: one span per bucket from when its all-reduce could start (submitted and
  the previous bucket's all-reduce finished, since one worker runs them in order) until
  it finished; the submission time is in the event's args.

Events are kept for the first ``RINGDP_TRACE_STEPS`` (default 1000) backward passes; later
ones only enter the summary. The summary (``RingDDP.trace_summary()``, the ``ringdp_summary`` key of the file, or
``python -m ringdp.trace FILE...``) gives per step and on average: backward time,
communication time, exposed communication (time backward() waited after autograd was
done) and the overlap fraction, 1 - exposed / communication.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import weakref
from pathlib import Path

import torch

from ._outputs import output_tensors
from .config import trace_path
from .buckets import Bucket, Observer, now_us

TID_AUTOGRAD = 0
TID_COMM = 1


def step_summary(step: dict) -> dict:
    """Derived figures of one traced step (times in ms).

    `step` holds microsecond timestamps: t_bwd_start, t_bwd_end (autograd done), t_end
    (backward() about to return), exposed_us (time spent waiting for reductions after
    t_bwd_end), writeback_us (copying averaged gradients into .grad) and per bucket
    t_ready, t_launch (submitted) and t_done (reduction finished)."""
    buckets = step.get("buckets", [])
    comm_us = 0.0
    prev_end = None
    for b in sorted(buckets, key=lambda b: b["index"]):
        if b.get("t_launch") is None or b.get("t_done") is None:
            continue
        start = b["t_launch"] if prev_end is None else max(b["t_launch"], prev_end)
        comm_us += max(0.0, b["t_done"] - start)
        prev_end = b["t_done"]
    exposed_us = max(0.0, step["exposed_us"])
    bwd_us = max(0.0, step["t_bwd_end"] - step["t_bwd_start"])
    overlap = 1.0 - min(exposed_us, comm_us) / comm_us if comm_us > 0 else None
    return {
        "step": step["step"],
        "backward_ms": bwd_us / 1e3,
        "comm_ms": comm_us / 1e3,
        "exposed_comm_ms": exposed_us / 1e3,
        "writeback_ms": max(0.0, step["writeback_us"]) / 1e3,
        "finalize_ms": max(0.0, step["t_end"] - step["t_bwd_end"]) / 1e3,
        "overlap_fraction": overlap,
        "buckets": len(buckets),
        "bytes": sum(b.get("nbytes", 0) for b in buckets),
    }


def aggregate(steps: list[dict], skip_first: int = 1) -> dict:
    """Mean over steps of step_summary() figures; the first `skip_first` steps (bucket
    rebuild, first touch of memory) are left out when there are more steps than that."""
    rows = steps[skip_first:] if len(steps) > skip_first else steps
    out: dict = {"steps": len(steps), "steps_averaged": len(rows)}
    if not rows:
        return out
    for k in ("backward_ms", "comm_ms", "exposed_comm_ms", "writeback_ms", "finalize_ms"):
        out[f"mean_{k}"] = sum(r[k] for r in rows) / len(rows)
    comm = out["mean_comm_ms"]
    out["overlap_fraction"] = (1.0 - min(out["mean_exposed_comm_ms"], comm) / comm) if comm > 0 else None
    return out


_claimed: set[Path] = set()  # trace files of this process's tracers


class Tracer:
    """Collects one rank's events; writes them (and the summary) on flush() and at exit.
    A second RingDDP of the same process given the same path writes `<name>.ddp1.json`
    (then ddp2, ...) instead of overwriting the first one's file."""

    def __init__(self, path, rank: int, world: int, max_event_steps: int = 1000):
        self.rank = rank
        self.max_event_steps = max_event_steps
        self.world = world
        p = trace_path(path, rank)
        k = 0
        while p in _claimed:
            k += 1
            base = trace_path(path, rank)
            p = base.with_name(f"{base.stem}.ddp{k}{base.suffix}")
        _claimed.add(p)
        self.path = p
        self.events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_AUTOGRAD, "args": {"name": "autograd"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_COMM, "args": {"name": "ringdp comm"}},
        ]
        self.steps: list[dict] = []
        self._lock = threading.Lock()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().flush())

    # ---- events -----------------------------------------------------------------------
    def span(self, name: str, tid: int, t0: float, t1: float, args: dict | None = None, cat: str = "ringdp"):
        ev = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid, "ts": t0, "dur": max(0.0, t1 - t0)}
        if args:
            ev["args"] = args
        with self._lock:
            self.events.append(ev)

    def instant(self, name: str, tid: int, t: float, args: dict | None = None, cat: str = "ringdp"):
        ev = {"name": name, "cat": cat, "ph": "i", "s": "t", "pid": self.rank, "tid": tid, "ts": t}
        if args:
            ev["args"] = args
        with self._lock:
            self.events.append(ev)

    def record_step(self, step: dict) -> dict:
        """Turn one backward's timestamps (see step_summary) into events; returns its
        summary."""
        s = step_summary(step)
        n = step["step"]
        if len(self.steps) >= self.max_event_steps:  # keep the file bounded: summary only
            with self._lock:
                self.steps.append(s)
            return s
        if step.get("t_fwd_start") is not None and step.get("t_fwd_end") is not None:
            self.span("forward", TID_AUTOGRAD, step["t_fwd_start"], step["t_fwd_end"], {"step": n})
        self.span("backward", TID_AUTOGRAD, step["t_bwd_start"], step["t_bwd_end"], {"step": n})
        self.span("finalize", TID_AUTOGRAD, step["t_bwd_end"], step["t_end"],
                  {"step": n, "exposed_comm_ms": s["exposed_comm_ms"], "writeback_ms": s["writeback_ms"],
                   "overlap_fraction": s["overlap_fraction"]})
        prev_end = None
        for b in sorted(step["buckets"], key=lambda b: b["index"]):
            args = {"bucket": b["index"], "bytes": b["nbytes"], "params": b["params"]}
            if b.get("t_ready") is not None:
                self.instant(f"bucket {b['index']} ready", TID_AUTOGRAD, b["t_ready"], args)
            if b.get("t_wait") is not None:
                t0, t1, t2 = b["t_wait"]
                if t1 > t0:
                    self.span(f"wait bucket {b['index']}", TID_AUTOGRAD, t0, t1, args, cat="exposed comm")
                self.span(f"write back bucket {b['index']}", TID_AUTOGRAD, t1, t2, args)
            if b.get("t_launch") is None or b.get("t_done") is None:
                continue
            start = b["t_launch"] if prev_end is None else max(b["t_launch"], prev_end)
            self.span(f"all_reduce bucket {b['index']}", TID_COMM, start, b["t_done"],
                      dict(args, submitted_us=b["t_launch"], queued_us=start - b["t_launch"]))
            prev_end = b["t_done"]
        with self._lock:
            self.steps.append(s)
        return s

    def summary(self) -> dict:
        with self._lock:
            steps = list(self.steps)
        out = aggregate(steps)
        out["rank"] = self.rank
        out["world"] = self.world
        out["per_step"] = steps
        return out

    def flush(self) -> Path:
        with self._lock:
            events = list(self.events)
        doc = {"traceEvents": events, "displayTimeUnit": "ms", "ringdp_summary": self.summary()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)
        return self.path


class DDPTrace(Observer):
    """The observer of one RingDDP's Reducer: collects each synchronised backward's times
    and hands them to a Tracer (RingDDP(trace=path) or RINGDP_TRACE=path). It records; it
    never changes what the Reducer does."""

    def __init__(self, path, rank: int, world: int, max_event_steps: int = 1000):
        self.tracer = Tracer(path, rank, world, max_event_steps=max_event_steps)
        self._fwd: tuple[float | None, float | None] = (None, None)
        self._bwd_start: float | None = None
        self._records: dict[int, dict[int, dict]] = {}  # step -> bucket index -> times

    def on_forward(self, t_start, t_end, outputs) -> None:
        self._fwd = (t_start, t_end)
        if torch.is_grad_enabled():
            self._bwd_start = None  # the gradient of the output marks the start of backward
            ref = weakref.ref(self)
            for t in output_tensors(outputs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(_backward_start_hook(ref))

    @staticmethod
    def _blank(b: Bucket) -> dict:
        return {"index": b.index, "nbytes": b.nbytes, "params": len(b.params), "t_ready": None,
                "t_launch": None, "t_done": None, "t_wait": None}

    def _record(self, step: int, b: Bucket) -> dict:
        return self._records.setdefault(step, {}).setdefault(b.index, self._blank(b))

    def on_backward(self, step, t) -> None:
        self._records[step] = {}
        if self._bwd_start is None:
            self._bwd_start = t

    def on_ready(self, step, bucket, t) -> None:
        self._record(step, bucket)["t_ready"] = t

    def on_launch(self, step, bucket, t) -> None:
        self._record(step, bucket)["t_launch"] = t

    def on_done(self, step, bucket, t) -> None:  # ringdp's worker thread
        rec = self._records.get(step, {}).get(bucket.index)
        if rec is not None and rec["t_done"] is None:
            rec["t_done"] = t

    def on_wait(self, step, bucket, t_wait, t_done, t_written) -> None:
        self._record(step, bucket)["t_wait"] = (t_wait, t_done, t_written)

    def on_finalize(self, step, buckets, t_bwd_end, t_end, exposed_us, writeback_us) -> None:
        recs = self._records.pop(step, {})
        self._records = {k: v for k, v in self._records.items() if k > step}  # join shadows
        rows = []
        for b in buckets:
            rec = dict(recs.get(b.index) or self._blank(b))
            if rec["t_wait"] is not None:  # done at the latest when its wait returned
                end = rec["t_wait"][1]
                rec["t_done"] = end if rec["t_done"] is None else min(rec["t_done"], end)
            rows.append(rec)
        t_start = self._bwd_start if self._bwd_start is not None else t_bwd_end
        self.tracer.record_step({"step": step, "t_fwd_start": self._fwd[0], "t_fwd_end": self._fwd[1],
                                 "t_bwd_start": t_start, "t_bwd_end": t_bwd_end, "t_end": t_end,
                                 "exposed_us": exposed_us, "writeback_us": writeback_us, "buckets": rows})
        self._bwd_start = None


def _backward_start_hook(ref):
    def hook(grad):
        trace = ref()
        if trace is not None and trace._bwd_start is None:
            trace._bwd_start = now_us()

    return hook


def load_summary(path) -> dict:
    """The summary stored in a trace file written by Tracer.flush()."""
    with open(path) as f:
        return json.load(f)["ringdp_summary"]


def format_summary(s: dict) -> str:
    def ms(k):
        v = s.get(k)
        return "n/a" if v is None else f"{v:.2f} ms"

    ov = s.get("overlap_fraction")
    return (
        f"rank {s.get('rank')}: {s.get('steps')} steps ({s.get('steps_averaged')} averaged): "
        f"backward {ms('mean_backward_ms')}, comm {ms('mean_comm_ms')}, "
        f"exposed comm {ms('mean_exposed_comm_ms')}, write back {ms('mean_writeback_ms')}, "
        f"overlap {'n/a' if ov is None else f'{100 * ov:.0f}%'}"
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m ringdp.trace TRACE.json [TRACE.json ...]  (prints each rank's summary)")
        return 0 if argv else 2
    for p in argv:
        print(format_summary(load_summary(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
