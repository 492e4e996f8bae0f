"""Timeline of RingDDP's backward passes: a Chrome-trace JSON per rank and a summary.

Enable with ``RINGDP_TRACE=path`` (or ``RingDDP(..., trace=path)``): a :class:`DDPTrace`
observes the RingDDP's Reducer (ringdp/reducer.py) and feeds a :class:`Tracer`. Files are
named by the global rank (``config.trace_path``, the one rule): the path may contain
``{rank}``; otherwise ``.rank<r>`` is inserted before a ``.json`` suffix, and a path without
that suffix is taken as a directory; a RingDDP over a process group other than the world adds
the group's name (``t.rank3.g1.json``). The file is written by ``RingDDP.flush_trace()``, when
the RingDDP is freed, and at exit. Open it in chrome://tracing or https://ui.perfetto.dev.
Each rank is one process with two rows:

* ``autograd``: forward, backward (from the gradient of the output until autograd
  finished), then ``finalize`` (the end-of-backward callback), made of ``wait bucket i``
  (exposed communication: waiting for bucket i's all-reduce) and ``write back bucket i``
  (its averaged gradients copied into ``.grad``); an instant event marks the moment each
  bucket's last gradient arrived (``bucket i ready``).
* ``ringdp comm``: one span per bucket from when its all-reduce could start (submitted and
  the previous bucket's all-reduce finished, since one worker runs them in order) until
  it finished; the submission time is in the event's args.

Events and per-step rows are kept for the first ``RINGDP_TRACE_STEPS`` (default 1000)
backward passes; later ones only enter the running means, so memory and the file stay
bounded however long the run. The summary (``RingDDP.trace_summary()``, the
``ringdp_summary`` key of the file, or ``python -m ringdp.trace FILE...``) gives per step
(``per_step``: those first steps) and on average over every step but the first (``steps``
counts them all): backward time, communication time, exposed communication (time backward()
waited after autograd was done) and the overlap fraction, 1 - exposed / communication.
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


_MEAN_KEYS = ("backward_ms", "comm_ms", "exposed_comm_ms", "writeback_ms", "finalize_ms")


class StepMeans:
    """Running means of step_summary() rows, in constant memory. The first `skip_first` rows
    (bucket rebuild, first touch of memory) are left out when there are more rows than that."""

    def __init__(self, skip_first: int = 1):
        self.skip_first = skip_first
        self.steps = 0
        self._head: list[dict] = []  # the first skip_first rows
        self._sums = dict.fromkeys(_MEAN_KEYS, 0.0)
        self._n = 0  # rows in _sums

    def add(self, row: dict) -> None:
        self.steps += 1
        if len(self._head) < self.skip_first:
            self._head.append(row)
            return
        for k in _MEAN_KEYS:
            self._sums[k] += row[k]
        self._n += 1

    def result(self) -> dict:
        if self._n:
            sums, n = self._sums, self._n
        else:
            sums, n = {k: sum(r[k] for r in self._head) for k in _MEAN_KEYS}, len(self._head)
        out: dict = {"steps": self.steps, "steps_averaged": n}
        if not n:
            return out
        for k in _MEAN_KEYS:
            out[f"mean_{k}"] = sums[k] / n
        comm = out["mean_comm_ms"]
        out["overlap_fraction"] = (1.0 - min(out["mean_exposed_comm_ms"], comm) / comm) if comm > 0 else None
        return out


def aggregate(steps: list[dict], skip_first: int = 1) -> dict:
    """Mean over steps of step_summary() figures (see StepMeans)."""
    means = StepMeans(skip_first)
    for s in steps:
        means.add(s)
    return means.result()


_claimed: set[Path] = set()  # trace files of this process's tracers


class Tracer:
    """Collects one rank's events; writes them (and the summary) on flush(), when `owner` is
    freed (a DDPTrace gives itself: the RingDDP's trace is written when the RingDDP goes away)
    and at exit. Without an owner it is written at exit if it is still alive.

    `rank` is the global rank (the events' process, the file's name), `world` the size of
    the group traced and `group` its name when it is not the world (config.trace_path).
    A second tracer of the same process given the same path writes `<name>.ddp1.json`
    (then ddp2, ...) instead of overwriting the first one's file."""

    def __init__(self, path, rank: int, world: int, max_event_steps: int = 1000, *, group: str | None = None,
                 owner: object | None = None):
        self.rank = rank
        self.max_event_steps = max_event_steps
        self.world = world
        self.group = group
        base = trace_path(path, rank, group)
        p, k = base, 0
        while p in _claimed:
            k += 1
            p = base.with_name(f"{base.stem}.ddp{k}{base.suffix}")
        _claimed.add(p)
        self.path = p
        self.events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_AUTOGRAD, "args": {"name": "autograd"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": TID_COMM, "args": {"name": "ringdp comm"}},
        ]
        self.steps: list[dict] = []  # step_summary() rows of the first max_event_steps steps
        self._means = StepMeans()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one flush at a time (they share the temporary file)
        if owner is not None:  # holds this tracer (not the owner) until the owner goes, or exit
            self._finalizer = weakref.finalize(owner, self.flush)
        else:
            atexit.register(_flush_at_exit, weakref.ref(self))

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
        with self._lock:
            traced = self._means.steps < self.max_event_steps  # later steps: the means only (bounded)
            self._means.add(s)
            if traced:
                self.steps.append(s)
        if not traced:
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
        return s

    def summary(self) -> dict:
        """The means over all steps (StepMeans), and `per_step`: the rows of the first
        max_event_steps steps."""
        with self._lock:
            out = self._means.result()
            steps = list(self.steps)
        out["rank"] = self.rank
        out["world"] = self.world
        out["group"] = self.group
        out["per_step"] = steps
        return out

    def flush(self) -> Path:
        with self._lock:
            events = list(self.events)
        doc = {"traceEvents": events, "displayTimeUnit": "ms", "ringdp_summary": self.summary()}
        with self._write_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")  # this process's own
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        return self.path


def _flush_at_exit(ref) -> None:
    tracer = ref()
    if tracer is not None:
        tracer.flush()


class DDPTrace(Observer):
    """The observer of one RingDDP's Reducer: collects each synchronised backward's times
    and hands them to a Tracer (RingDDP(trace=path) or RINGDP_TRACE=path). It records; it
    never changes what the Reducer does."""

    def __init__(self, path, rank: int, world: int, max_event_steps: int = 1000, group: str | None = None):
        # rank: the global rank; group: the group's name when it is not the world (Tracer)
        self.tracer = Tracer(path, rank, world, max_event_steps=max_event_steps, group=group, owner=self)
        self._fwd: tuple[float | None, float | None] = (None, None)
        self._bwd_start: float | None = None
        self._records: dict[int, dict[int, dict]] = {}  # step -> bucket index -> times

    def on_forward(self, t_start, t_end, outputs) -> None:
        self._fwd = (t_start, t_end)
        if torch.is_grad_enabled():
            self._bwd_start = None  # the gradient of the output marks the start of backward
            ref = weakref.ref(self)
            for t in output_tensors(outputs):
                # not on a leaf (a parameter the forward returns): its hooks outlive the step
                # and would pile up, one more per forward, all run by each backward
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
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
