"""Fakes of torch.cuda's streams and events for the CPU tests of ringdp's CUDA glue (the
Python that orders ringdp's calls on streams): every wait and record goes into a log, so a
test asserts the order without a GPU. What the GPU itself does is tested by tests/test_cuda.py
(bench/gpu_check.sh)."""
from __future__ import annotations

import contextlib
import threading


def fake_cuda(log: list, current: list, idle=lambda: True):
    """(Stream, Event): every wait and record goes into `log` as (what, names..., thread
    name); `current[0]` names the stream that is current. A Stream(name) has `cuda_stream`
    "<name>-handle". An Event's query() is `idle()`: whether the device has ended the work
    queued so far."""

    class Stream:
        made = 0

        def __init__(self, name=None, device="cuda:0"):
            if not isinstance(name, str):  # torch.cuda.Stream(device): a new stream
                Stream.made += 1
                name = f"stream{Stream.made}"
            self.name, self.device, self.cuda_stream = name, device, f"{name}-handle"

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.name, threading.current_thread().name))

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.name = f"event{Event.made}"

        def record(self, stream=None):
            log.append(("record", self.name, stream.name if stream is not None else current[0],
                        threading.current_thread().name))

        def query(self):
            return idle()

    return Stream, Event


def install(torch, log: list, current: list, idle=lambda: True):
    """Replace torch.cuda's Stream, ExternalStream, Event, current_stream and stream() by
    the fakes (in a rank's own process: nothing to restore). ExternalStream(handle) is the
    stream of that handle ("<name>-handle" -> name)."""
    Stream, Event = fake_cuda(log, current, idle)
    torch.cuda.Stream = Stream
    torch.cuda.ExternalStream = lambda handle, device=None: Stream(str(handle).removesuffix("-handle"), device)
    torch.cuda.Event = Event
    torch.cuda.current_stream = lambda device=None: Stream(current[0])
    torch.cuda.stream = on_stream(current)
    return Stream, Event


def on_stream(current: list):
    """A fake of torch.cuda.stream(s): makes `s` current (`current[0]`) inside the block."""
    @contextlib.contextmanager
    def on(stream):
        prev, current[0] = current[0], stream.name
        try:
            yield
        finally:
            current[0] = prev

    return on


def torch_future(log: list, current: list):
    """A fake of the CUDA-aware torch future ringdp makes (HelpingFuture with devices=,
    which needs real CUDA devices): set_result logs ("future", the stream current then),
    where the real one records its event; `value` holds the result or the error."""

    class TorchFuture:
        def __init__(self, waiting, devices=None):
            self.value = None

        def set_result(self, v):
            log.append(("future", current[0]))
            self.value = v

        def set_exception(self, e):
            self.value = e

    return TorchFuture


class Endpoint:
    """A fake cuda_comm.CudaEndpoint of one transport for the Work tests: `stream`, `device`,
    check(), and the transports' numbering (cuda_api.h calls, failure_of): `call()` counts a
    collective enqueued; `strike(why, first)` makes collective `first` and every later one
    failed, as the watchdog's abort or an IPC failure record does."""

    def __init__(self, stream, device="cuda:0"):
        self.stream, self.device = stream, device
        self.calls, self.first_struck, self.why = 0, None, ""

    def check(self):
        pass

    def call(self):
        self.calls += 1

    def strike(self, why, first):
        self.why, self.first_struck = why, first

    def marks(self):
        return ((self, self.calls),)

    def failure_of(self, call):  # (its marks name it as their native)
        return self.why if self.first_struck is not None and call >= self.first_struck else ""


def enqueued(ep, done):
    """A cuda_comm.Enqueued of `ep` (an Endpoint) and its `done` event, after a collective was
    counted on `ep`: what comm._run_cuda hands a CUDA Work."""
    from ringdp import cuda_comm

    ep.call()
    rec = cuda_comm.Enqueued(ep, done)
    rec.enqueued()
    return rec
