"""The gloo collectives ringdp handed out and has not yet seen end, kept from gloo's own thread
at interpreter exit.

Why. A gloo group (torch 2.13's ProcessGroupGloo) runs each collective on a thread of its own,
which holds the collective's Work until it ends and then drops that reference. At interpreter
exit two things go wrong with a collective still in flight (a program that ends, or is
interrupted with Ctrl-C, with an async gloo call it never waited for):
- the group is destroyed while Python finalizes (module globals cleared), and its destructor
  waits for the collective: the exit hangs until the peers call it, leave, or gloo's timeout
  ends it (30 minutes by default);
- when it ends there, gloo's thread drops the last reference to the Work, whose tensors' Python
  objects then take the GIL, and a finalizing interpreter ends any thread that asks for it:
  std::terminate, "terminate called without an active exception", exit -6 (found by
  tests/_fuzz.py --interrupt; stock gloo groups do the same).

What. ringdp's backend (ringdp/backend.py) hands every Work of its inner gloo group here
(hold), a group across hosts (ringdp/hosts.py) the gloo works an abort or a failed call left in
flight when it closes, and RingDDP (ringdp/ddp.py) its Join notice on a gloo group (with the
group only where a failed forward leaves it in flight); once a Work is seen to have ended
(settle: its wait(), is_completed(), its wrapper dropped; or this module's thread, which looks
while anything is held) it is let go policy.GLOO_LET_GO_S later, by when gloo's thread has
dropped its own references. A group is held with its Works in flight only (so ringdp's
shutdown() of a group no longer waits for them in the group's destructor). At exit (at_exit,
from comm._close_at_exit, while threads still run) the collectives still in flight get a
bounded wait to end; then every Work still held, and the groups of those in flight, are kept
for the rest of the process (never destroyed: nothing waits for them, and gloo's thread never
drops the last reference), and a warning names the calls left in flight. A script that ends
right after a synchronous gloo call meets the second hazard too (gloo's thread, slow to drop
its reference, drops it as Python finalizes): the Works that ended in the last GLOO_LET_GO_S
are kept at exit for that. A Python callback on such a collective's future (get_future().then)
still runs on gloo's thread when it ends: one that ends while the interpreter finalizes can
still end the process so (README, Failures).
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time

from . import policy

log = logging.getLogger("ringdp")

# how often at_exit looks whether the collectives left have ended
POLL_S = 0.01


class GlooInFlight:
    """The gloo Works handed out (hold), until a while after they are seen to have ended.
    Entries: id(work): [work, its group (or None: kept only while it is in flight, and at
    exit), the call's name, when it was first seen to have ended (None before)]. A thread of
    its own looks while anything is held; holding a Work again replaces its entry."""

    def __init__(self):
        self._cond = threading.Condition()
        self._works: dict[int, list] = {}
        self._thread = None
        self._exited = False

    def hold(self, work, group, name: str) -> None:
        """Keep `work` (a Work of gloo group `group`, the call `name`) until a while after it
        ends."""
        with self._cond:
            if self._exited:  # (a call made after at_exit: kept for good, as at_exit keeps them)
                _keep_for_good(work)
                if not self._ended(work):
                    _keep_for_good(group)
                return
            self._works[id(work)] = [work, group, name, None]
            if self._thread is None and threading.main_thread().is_alive():
                thread = threading.Thread(target=self._look, name="ringdp-gloo-held")
                try:
                    thread.start()
                except RuntimeError:  # (Python 3.12+ at shutdown: "can't create new thread"; at_exit keeps it)
                    return
                self._thread = thread

    def settle(self, work) -> None:
        """Note that `work` has ended, if it has: it is let go policy.GLOO_LET_GO_S later.
        (Runs in a wrapper's __del__, while Python finalizes too: it needs no module global
        once at_exit has run, and holds nothing then.)"""
        entry = self._works.get(id(work))
        if entry is not None and entry[3] is None and self._ended(work):
            with self._cond:
                self._mark(entry, time.monotonic())

    def held(self) -> list:
        """The calls held (their names), the ones that ended a moment ago included."""
        with self._cond:
            return [e[2] for e in self._works.values()]

    def _mark(self, entry, now) -> None:
        """`entry` ended (seen at `now`). Its group goes with it, LET_GO_S later, on this
        module's thread (_look): a settle() may run on gloo's own thread (a wrapper dropped in a
        future's callback), where a group's destructor, which joins gloo's threads, must not."""
        entry[3] = now

    def _look(self) -> None:
        """This module's thread: every policy.GLOO_LET_GO_S while anything is held, it marks
        what has ended and lets go what ended that long ago; it ends when nothing is held
        (hold() starts another) or once the main thread has ended. Not a daemon: it drops
        gloo Works and groups, whose destructors release the GIL and take it back, and a
        daemon thread that takes it back as Python finalizes ends the process in
        std::terminate; Python's exit waits for it instead (at most GLOO_LET_GO_S), before
        at_exit."""
        main = threading.main_thread()
        while True:
            with self._cond:
                if self._exited or not self._works or not main.is_alive():
                    self._thread = None
                    return
                self._cond.wait(policy.GLOO_LET_GO_S)
                gone = self._sweep(time.monotonic())
            del gone  # (dropped outside the lock)

    def _sweep(self, now) -> list:
        """Mark what has ended; take out and return what ended GLOO_LET_GO_S before `now`."""
        gone = []
        for k, entry in list(self._works.items()):
            if entry[3] is None and self._ended(entry[0]):
                self._mark(entry, now)
            elif entry[3] is not None and now - entry[3] >= policy.GLOO_LET_GO_S:
                gone.append(self._works.pop(k))
        return gone

    def at_exit(self, limit: float, interrupted: bool = False, note_after: float = 1.0) -> list:
        """At interpreter exit: wait up to `limit` seconds (none after a Ctrl-C: `interrupted`,
        or one in this wait) for the collectives still in flight, saying so after `note_after`
        seconds, then keep every Work still held, and the groups of those in flight, for good
        (one that ended a moment ago may still be on gloo's thread, about to drop its
        reference). Returns the calls left in flight."""
        start = time.monotonic()
        deadline = start + (0.0 if interrupted else limit)
        noted = False
        try:
            while time.monotonic() < deadline:
                left = self._in_flight()
                if not left:
                    break
                if not noted and time.monotonic() - start >= note_after:
                    noted = True
                    log.warning("ringdp rank %s: the exit waits for %s still in flight (%s: they wait for their "
                                "peers to make them too), at most %.0f s more; Ctrl-C leaves %s", _rank(left),
                                _count(left), ", ".join(e[2] for e in left), deadline - time.monotonic(),
                                "them" if len(left) > 1 else "it")
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            pass  # (the exit goes on: the ones in flight are kept)
        with self._cond:
            held, self._works, self._exited = list(self._works.values()), {}, True
            self._cond.notify()
        left = [e for e in held if e[3] is None and not self._ended(e[0])]
        for entry in held:
            _keep_for_good(entry[0])
        for entry in left:
            _keep_for_good(entry[1])
        if left:
            log.warning("ringdp rank %s: %s still in flight at exit after %.1f s (%s): left to gloo's thread for "
                        "the rest of the process (gloo cannot end a collective in flight; its peers meet this "
                        "process's exit)", _rank(left), _count(left), time.monotonic() - start,
                        ", ".join(e[2] for e in left))
        return [e[2] for e in left]

    def _in_flight(self) -> list:
        with self._cond:
            return [e for e in self._works.values() if e[3] is None and not self._ended(e[0])]

    @staticmethod
    def _ended(work) -> bool:
        try:
            return bool(work.is_completed())
        except Exception:  # noqa: BLE001 -- a Work that cannot say: taken as ended
            return True


def is_gloo(group, device) -> bool:
    """Whether `group`'s calls on `device` run on a gloo group (torch's gloo backend, wrapped
    or not by TORCH_DISTRIBUTED_DEBUG=DETAIL's checks; not ringdp's backend, which hands its
    gloo calls here itself)."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo, _ProcessGroupWrapper
    try:
        backend = group._get_backend(device)
        while isinstance(backend, _ProcessGroupWrapper):
            backend = backend.wrapped_pg
        return isinstance(backend, ProcessGroupGloo)
    except Exception:  # noqa: BLE001 -- a group without that backend
        return False


def _count(entries) -> str:
    return f"{len(entries)} gloo collective{'s' if len(entries) > 1 else ''}"


def _rank(entries):
    """The rank of the process (its gloo group's, where torch.distributed has no default group)."""
    try:
        import torch.distributed as dist
        return dist.get_rank()
    except Exception:  # noqa: BLE001
        rank = getattr(entries[0][1], "rank", None) if entries else None  # (CrossHost.close: a tuple)
        return rank() if callable(rank) else "?"


def _keep_for_good(obj) -> None:
    """One more reference to `obj` that is never dropped: finalization never frees it."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


# ringdp's one registry (the backend's inner gloo groups, the gloo groups across hosts, RingDDP's Join)
GLOO = GlooInFlight()
