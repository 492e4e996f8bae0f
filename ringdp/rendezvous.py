"""Rendezvous: what the ranks of one communicator tell each other while they set up, through
torch.distributed's store (never a network connection of ringdp's own).

Every transport has the same lifecycle: create this rank's endpoint, publish its
``local_blob()``, ``connect()`` with everyone's blobs, and (where peers map each other's
memory) a barrier before anything is released. ``exchange`` and ``barrier`` are those two
steps; a rank that never arrives is a RingError naming the missing ranks, after the
communicator's timeout.
"""
from __future__ import annotations

import time
import uuid
import weakref

import torch.distributed as dist

from ._native import RingError


class LookupStore(dist.Store):
    """A torch.distributed Store for torch objects that keep the store they are given (the
    ProcessGroupGloo groups ringdp makes across hosts: ringdp/hosts.py): each call goes to
    the store that `base()` returns at that moment (a communicator's `_store`, held weakly),
    so that such an object holds no store, and no communicator, itself. Holding the store
    would keep rank 0's TCPStore server listening after
    torch.distributed.destroy_process_group() (Rendezvous's doc); once the group is gone a
    call raises the communicator's RingError. The Python object must be kept as long as the
    torch object that holds it lives: once it is collected, torch's calls of its methods fail
    ("Not implemented")."""

    def __init__(self, base):
        super().__init__()
        self._base = weakref.WeakMethod(base) if hasattr(base, "__self__") else base

    def _store(self) -> dist.Store:
        base = self._base() if isinstance(self._base, weakref.WeakMethod) else self._base
        if base is None:
            raise RingError("ringdp: the communicator whose store this was is gone")
        return base()

    def set(self, key, value):
        return self._store().set(key, value)

    def get(self, key):
        return self._store().get(key)

    def add(self, key, value):
        return self._store().add(key, value)

    def compare_set(self, key, expected, desired):
        return self._store().compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._store().delete_key(key)

    def num_keys(self):
        return self._store().num_keys()

    def check(self, keys):
        return self._store().check(keys)

    def wait(self, keys, timeout=None):
        store = self._store()
        return store.wait(keys) if timeout is None else store.wait(keys, timeout)


class Rendezvous:
    """Keys under a prefix unique to one communicator (group and generation), so that a
    re-created communicator of the same group never reads an old one's keys.

    `store`: a torch.distributed Store, or a function that returns one at each use, or None
    for the default group's store looked up at each use. A communicator passes a function:
    a rendezvous that held the store would keep it alive after
    torch.distributed.destroy_process_group(), and with it rank 0's TCPStore server, which
    the next init_process_group on the same port then reuses, old keys and all."""

    def __init__(self, prefix: str, rank: int, world: int, timeout_s: float, store=None):
        self._prefix = prefix
        self._base = store if store is not None else dist.distributed_c10d._get_default_store
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self._rounds: dict[str, int] = {}

    @property
    def store(self) -> dist.Store:
        base = self._base() if callable(self._base) else self._base
        return dist.PrefixStore(self._prefix, base)

    def next_round(self, name: str) -> str:
        """`name` numbered by how often this rank asked for it: a fresh key for each round of
        a step that the ranks repeat in the same order (e.g. one per RingDDP built)."""
        n = self._rounds.get(name, 0)
        self._rounds[name] = n + 1
        return f"{name}/{n}"

    _POLL_MAX_S = 0.02  # the longest pause between two looks at the store

    def _wait(self, what: str, keys: list[str]) -> None:
        """Return once every key in `keys` is set; a RingError naming the missing ones after
        the timeout. The store is polled (check), never waited on: a TCPStore client's wait
        holds its connection, which every thread of the process shares, so that two groups
        set up at once on two threads (in different orders on different ranks) would each
        wait for the other's timeout. (What a signal handler raises while this sleeps, e.g.
        on a SIGTERM during set-up, propagates as it is.)"""
        def missing(store):
            return ", ".join(k for k in keys if not store.check([k])) or "peers"

        self._poll(what, lambda store: self._check(store, keys, what), missing)

    def _poll(self, what: str, ready, missing) -> None:
        """Poll `ready(store)` until it is true, with growing pauses; after the timeout a
        RingError naming `missing(store)` (what is still not there)."""
        store = self.store
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0002
        while not ready(store):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for {what} of "
                    f"{missing(store)}; did every rank of the group call ringdp with the same group?")
            time.sleep(min(pause, left))
            pause = min(2 * pause, self._POLL_MAX_S)

    def _check(self, store, keys: list[str], what: str) -> bool:
        try:
            return store.check(keys)
        except dist.DistError as e:
            self._lost_store(what, e)

    def _lost_store(self, what: str, e: Exception):
        """The store is gone while waiting for `what`: its host (rank 0 under torchrun) died."""
        raise RingError(f"rank {self.rank}: lost the store while waiting for {what} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); the rank that hosts it may have died") from None

    def incarnation(self, key: str = "incarnation") -> int:
        """A number (1, 2, ...) that every rank of this set-up agrees on and that no earlier
        set-up under this prefix drew, even one whose processes died half-way: the store may
        outlive them with every key they wrote (torchrun's agent store keeps its keys across
        --max-restarts attempts), so neither a count per process nor a count of arrivals
        (which a rank that died before arriving skews) names a fresh set of keys.

        Rank 0 draws the number from a counter (store.add: never drawn before). Every other
        rank joins the counter's latest value with a nonce of its own, and joins again when
        the counter moves on (it read the value before rank 0 drew), until rank 0's member
        list for its number holds its nonce: an old attempt's list never does. Rank 0 lists
        the members once every rank joined its number."""
        store = self.store
        counter = f"{key}/drawn"
        what = "the set-up number"
        try:
            if self.rank == 0:
                n = store.add(counter, 1)
                joins = [f"{key}/{n}/join/{r}" for r in range(1, self.world)]
                self._poll(f"set-up {n}'s joins", lambda store: self._check(store, joins, what), lambda store: ", ".join(
                    f"rank {r}" for r, k in enumerate(joins, 1) if not store.check([k])))
                nonces = store.multi_get(joins) if joins else []
                store.set(f"{key}/{n}/members", ",".join(v.decode() for v in nonces))
                return n
            nonce, joined, not_mine = uuid.uuid4().hex, 0, 0

            def listed(store) -> bool:
                nonlocal joined, not_mine
                if joined > not_mine and store.check([f"{key}/{joined}/members"]):
                    members = store.get(f"{key}/{joined}/members").decode().split(",")
                    if len(members) == self.world - 1 and members[self.rank - 1] == nonce:
                        return True
                    not_mine = joined  # an earlier set-up's list (it never changes): not read again
                n = store.add(counter, 0)
                if n > joined:  # (rank 0 drew after this rank read the counter: join its number)
                    store.set(f"{key}/{n}/join/{self.rank}", nonce)
                    joined = n
                return False

            self._poll(what, listed, lambda store: (
                f"rank 0 (this rank joined set-up {joined}; rank 0 has not listed it)" if joined else
                "rank 0 (no set-up drawn yet)"))
            return joined
        except dist.DistError as e:
            self._lost_store(what, e)

    def exchange(self, key: str, value: bytes | str, what: str | None = None) -> list[bytes]:
        """Publish this rank's `value` under `key`; return every rank's, indexed by rank."""
        store = self.store
        store.set(f"{key}/{self.rank}", value)
        keys = [f"{key}/{r}" for r in range(self.world)]
        self._wait(what or key, keys)
        return [store.get(k) for k in keys]

    def publish(self, key: str, value: bytes | str) -> None:
        """Set a key every rank reads (e.g. rank 0's job id)."""
        self.store.set(key, value)

    def read(self, key: str, what: str | None = None) -> bytes:
        self._wait(what or key, [key])
        return self.store.get(key)

    def barrier(self, key: str, what: str | None = None) -> None:
        """Return once every rank reached the barrier `key`."""
        self.exchange(key, b"1", what)
