"""A torchrun job for tests/test_leftovers.py: ranks 0..n-2 call ringdp.init(); the last rank
fails in one of three ways while they are inside it, and torchrun then SIGTERMs the others.

    python -m torch.distributed.run --nproc-per-node 3 tests/_leftovers_job.py MODE OUTDIR

MODE (what the last rank does):
  fail-before-init     raises before calling ringdp at all, once the others are inside
                       ringdp.init() (the issue's case: a rank failing before its first
                       collective);
  fail-at-create       calls ringdp.init(), but its segment cannot be made (a RingError, as
                       when /dev/shm is full) once every other rank holds its own segment and
                       waits in the exchange;
  killed-after-create  creates its segment, then is SIGKILLed (as by the OOM killer) once
                       every other rank holds its own.

Every rank writes OUTDIR/pid-<rank> at start and OUTDIR/entered-<rank> just before
ringdp.init(); the last rank writes OUTDIR/job (the job's segment-name prefix, e.g.
"ringdp-<uid>") once it knows it. The failure is simulated in this script only (the last
rank's view of ringdp.comm._C is swapped for a wrapper): nothing in the library knows.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def _write(path, text=""):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _wait_for(pred, what, limit_s=30.0):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > limit_s:
            raise SystemExit(f"_leftovers_job: gave up waiting for {what}")
        time.sleep(0.01)


class _NativeWithFailingCreate:
    """ringdp's _C, except that ShmComm(cfg) waits until every other rank of the job holds a
    segment, then fails (mode fail-at-create) or creates the real one and SIGKILLs this
    process (mode killed-after-create)."""

    def __init__(self, native, mode, out, world):
        self._native, self._mode, self._out, self._world = native, mode, out, world

    def __getattr__(self, name):
        return getattr(self._native, name)

    def ShmComm(self, cfg):  # noqa: N802 -- the name it stands in for
        job = cfg.name.lstrip("/").split("-r")[0]  # "ringdp-<uid>": the job's prefix
        _write(os.path.join(self._out, "job"), job)
        peers = [f"{job}-r{r}" for r in range(self._world - 1)]

        def all_created():
            names = os.listdir("/dev/shm")
            return all(any(n == p or n.startswith(p + "-") for n in names) for p in peers)

        _wait_for(all_created, "the peers' segments")
        time.sleep(0.2)  # they are in the exchange, waiting for this rank's record
        if self._mode == "fail-at-create":
            raise self._native.RingError("simulated: cannot reserve shared memory; /dev/shm may be full")
        native = self._native.ShmComm(cfg)
        os.kill(os.getpid(), signal.SIGKILL)
        return native


def main():
    mode, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    last = world - 1
    _write(os.path.join(out, f"pid-{rank}"), str(os.getpid()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import ringdp
    import ringdp.comm

    if rank == last:
        if mode == "fail-before-init":
            _wait_for(lambda: all(os.path.exists(os.path.join(out, f"entered-{r}")) for r in range(last)),
                      "the others to enter ringdp.init")
            time.sleep(0.5)  # they wait inside ringdp.init for this rank
            raise RuntimeError("simulated failure before the first collective")
        ringdp.comm._C = _NativeWithFailingCreate(ringdp.comm._C, mode, out, world)
    _write(os.path.join(out, f"entered-{rank}"))
    ringdp.init(timeout=60)
    _write(os.path.join(out, f"done-{rank}"))  # never reached: the last rank fails
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
