"""A collective's handle and its futures: ringdp's Work (as torch.distributed's), the torch
future it hands out (HelpingFuture: Work.get_future, the backend's RingWork), and how either is
completed, with a failure that both Python and torch's C++ readers see (fail_future).

A Work holds the concurrent future of its call (settled by whichever thread ran the call:
the caller inline, or ringdp's worker thread, ringdp/comm.py), the tensors the call writes,
for a CUDA call its record (cuda_comm.Enqueued: endpoint, end event, the transports' call
numbers), and for a queued call the context that waits for it (Communicator._caller_waits).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ._native import _C

if TYPE_CHECKING:
    from . import cuda_comm

__all__ = ["HelpingFuture", "Work", "fail_future", "set_outputs"]

def _join_stream(cuda: "cuda_comm.Enqueued") -> None:
    """A CUDA collective, enqueued: raise what the device reported so far, and make the
    current stream wait for the collective's end (its event on ringdp's stream)."""
    cuda.endpoint.check()
    torch.cuda.current_stream(cuda.endpoint.device).wait_event(cuda.done)


class Work:
    """Handle of an async collective, like torch.distributed's Work.

    CPU: wait() blocks until the collective finished. CUDA: wait() blocks until it is
    enqueued, raises any failure the device reported so far, and makes the current stream
    wait for the collective's end (no host synchronisation); is_completed() asks the GPU;
    is_success() and exception() also ask the transport whether a failure struck this
    collective (its end event completes all the same: an NCCL communicator the watchdog
    aborted, an IPC kernel that gave up on a dead peer), as torch's NCCL Work reports its
    watchdog's timeout."""

    def __init__(self, future: Future, outputs: list, cuda=None, waiting=None):
        self._future = future
        self._outputs = outputs  # the tensors the collective writes
        self._cuda = cuda  # CUDA: its cuda_comm.Enqueued (endpoint, end event, the transports' call numbers)
        self._waiting = waiting  # queued on the worker: Communicator._caller_waits(future) (None: ran inline)
        self._torch_future: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def waiting(self, timeout: float | None = None):
        """A context that returns once this collective ended (Communicator._caller_waits: on
        the worker thread itself, it runs the queued calls up to this one first), or raises
        a RingError: `timeout` s passed, or the call never started (the worker is stuck in
        a callback)."""
        return _wait_context(self._waiting, self._future, timeout)

    def wait(self, timeout=None) -> bool:
        """Wait for the collective (module doc); re-raises its error (a RingError), and
        raises one after `timeout` (seconds or a timedelta, as torch's Work.wait takes; None,
        0 or less: no limit, as torch's default timedelta(0))."""
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        if timeout is not None and timeout <= 0:
            timeout = None
        with self.waiting(timeout):
            self._future.result()
        if self._cuda is not None:
            _join_stream(self._cuda)
        return True

    def is_completed(self) -> bool:
        if not self._future.done():
            return False
        if self._cuda is None or self._future.exception() is not None:
            return True
        return self._cuda.done.query() or self._cuda.failure() is not None

    def is_success(self) -> bool:
        return self.exception() is None and self.is_completed()

    def exception(self):
        """The collective's failure: its call's error, or on CUDA a failure that struck it
        on the device (cuda_comm.Enqueued.failure); None while it has not failed."""
        if not self._future.done():
            return None
        exc = self._future.exception()
        if exc is None and self._cuda is not None:
            exc = self._cuda.failure()
        return exc

    def get_future(self) -> torch.futures.Future:
        """A torch.futures.Future that completes (on ringdp's worker thread) with the list of
        output tensors, or with the collective's error; as torch.distributed's
        Work.get_future(), which DDP comm hooks return. For CUDA tensors it is a CUDA-aware
        future: its wait() makes the waiter's stream wait for ringdp's stream."""
        with self._lock:
            if self._torch_future is None:
                outputs, cuda = self._outputs, self._cuda
                tf = HelpingFuture(functools.partial(_wait_context, self._waiting, self._future),
                                   devices=[cuda.endpoint.device] if cuda else None)
                self._torch_future = tf
                # the callback holds the outputs, not this Work: no reference cycle keeps the
                # tensors (a whole step's gradients) alive after the future is dropped
                self._future.add_done_callback(lambda f: _complete(tf, f, outputs, cuda))
            return self._torch_future


def _wait_context(waiting, fut: Future, timeout: float | None = None):
    """Work.waiting(): `waiting(fut, timeout)` while `fut` is not done (None: the call ran inline)."""
    return waiting(fut, timeout=timeout) if waiting is not None and not fut.done() else contextlib.nullcontext()


class HelpingFuture(torch.futures.Future):
    """The torch future of a ringdp Work (Work.get_future, and the backend's): its wait()
    blocks inside the Work's waiting() context (Communicator._caller_waits), so that a
    callback on ringdp's worker thread that waits for a later queued call runs it instead
    of waiting for itself, as Work.wait() does. (Futures that torch derives from it, such
    as then()'s, wait as torch's do.)"""

    def __init__(self, waiting, devices=None):
        super().__init__(devices=devices)
        self._ringdp_waiting = waiting  # () -> a context manager; dropped on completion (_completed)

    def wait(self):
        waiting = self._ringdp_waiting
        if waiting is None or self.done():
            return super().wait()
        with waiting():
            return super().wait()


def _completed(tf: torch.futures.Future) -> torch.futures.Future:
    """`tf`, about to complete: it lets its waiting context go (through the Work's future, whose
    callbacks hold `tf`, it would keep a reference cycle for the GC)."""
    if isinstance(tf, HelpingFuture):
        tf._ringdp_waiting = None
    return tf


class _Failure:
    """A failed torch future's value, as torch's C++ code reads it (fail_future)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __reduce_ex__(self, protocol):
        # torch finds the tensors of a future's Python value by pickling it
        # (torch._jit_internal._extract_tensors): this one raises its failure instead
        raise self.exc


def _raise_failure(value: _Failure):
    raise value.exc


def fail_future(tf: torch.futures.Future, exc: BaseException) -> None:
    """Complete the torch future `tf` with the failure `exc`, so that both Python and torch's
    C++ code reading it fail. torch's Future.set_exception (Python) sets no error that C++
    sees: it completes the future with the exception as its value, and only Python's
    wait()/value() raise it (through the future's unwrap function). C++ readers take that
    value as a result: DDP's reducer without a comm hook asks it for its tensors, gets none
    and reads past the end of the list (every surviving rank segfaulted when a peer died
    during backward: tests/test_failures.py::test_peer_dies_in_training). Here the value
    is a _Failure, which refuses to give its tensors by raising `exc`: DDP's backward then
    raises a RuntimeError carrying exc's message (the rank and the problem); Python waiters
    get `exc` itself, as from set_exception (which does the same with the bare exception)."""
    tf._set_unwrap_func(_raise_failure)
    tf.set_result(_Failure(exc))


def set_outputs(tf: torch.futures.Future, outputs) -> None:
    """Complete the torch future `tf` with a collective's outputs. A list of tensors is set
    from C++ as a tensor list (_C.complete_future), which torch's C++ readers take as it is:
    set_result would hold a Python list, whose tensors DDP's reducer finds by running Python
    (torch._jit_internal._extract_tensors) at the end of backward, where a pending Ctrl-C
    lands and torch rewords the KeyboardInterrupt as "RuntimeError: Cannot extract tensors
    from value: KeyboardInterrupt". Python readers get a list of the same tensors either
    way. Anything else (all_gather's list of lists, one tensor): set_result."""
    if type(outputs) is list and all(isinstance(t, torch.Tensor) for t in outputs):
        _C.complete_future(tf, outputs)
    else:
        tf.set_result(outputs)


def _settle(fut: Future, error: BaseException | None) -> None:
    """A collective's future: its failure, or done."""
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(None)


def _complete(tf: torch.futures.Future, f: Future, outputs: list, cuda) -> None:
    """Complete Work.get_future()'s future from the collective's concurrent future."""
    exc = f.exception()
    _completed(tf)
    if exc is None and cuda is not None:
        try:
            cuda.endpoint.check()
        except BaseException as e:  # noqa: BLE001 -- handed to the waiter
            exc = e
    if exc is not None:
        fail_future(tf, exc)
    elif cuda is not None:
        # the future's event: on ringdp's stream, after it waited for the collective's end (its
        # `done` event: recorded on ringdp's stream, or, for a call made on the worker, on the
        # stream current there, which a hierarchical call's own stream joined, not ringdp's)
        stream = cuda.endpoint.stream
        stream.wait_event(cuda.done)
        with torch.cuda.stream(stream):
            set_outputs(tf, list(outputs))
    else:
        set_outputs(tf, list(outputs))
