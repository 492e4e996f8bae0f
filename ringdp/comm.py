"""The communicator: rendezvous through torch.distributed's store, the shared-memory
transport, and an ordered background worker for async collectives."""
from __future__ import annotations

import atexit
import json
import os
import queue
import socket
import threading
import uuid
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _types, cuda_comm, policy

try:
    from . import _C
except ImportError as e:  # pragma: no cover - a broken install should say how to fix it
    raise ImportError(
        "ringdp's native extension ringdp._C is missing; build it with "
        "`pip install --no-build-isolation -e .` in the ringdp checkout"
    ) from e

RingError = _C.RingError
_DTYPES = tuple(_C.supported_dtypes())  # the one dtype table is in csrc/bindings.cpp


def _check_dtype(dtype):
    if dtype not in _DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
        raise TypeError(f"ringdp.all_reduce does not support dtype {dtype}; supported: {names}")


class Work:
    """Handle of an async collective, like torch.distributed's Work."""

    def __init__(self, future: Future, outputs: list, on_wait=None):
        self._future = future
        self._outputs = outputs  # the tensors the collective writes
        self._on_wait = on_wait
        self._torch_future: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def wait(self, timeout=None) -> bool:
        """Block until the collective finished; re-raises its error (a RingError)."""
        self._future.result(timeout=timeout)
        if self._on_wait is not None:
            self._on_wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self):
        return self._future.exception() if self._future.done() else None

    def get_future(self) -> torch.futures.Future:
        """A torch.futures.Future that completes (on ringdp's worker thread) with the list of
        output tensors when the collective finished, or with its error; as
        torch.distributed's Work.get_future() (what DDP comm hooks return)."""
        with self._lock:
            if self._torch_future is None:
                tf: torch.futures.Future = torch.futures.Future()
                self._torch_future = tf

                def done(f: Future):
                    exc = f.exception()
                    if exc is None and self._on_wait is not None:
                        try:
                            self._on_wait()
                        except BaseException as e:  # noqa: BLE001 -- handed to the waiter
                            exc = e
                    if exc is not None:
                        tf.set_exception(exc)
                    else:
                        tf.set_result(list(self._outputs))

                self._future.add_done_callback(done)
            return self._torch_future


def _group_key(group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return "g" + "-".join(str(r) for r in dist.get_process_group_ranks(group))


_generation: dict[str, int] = {}


class Communicator:
    """ringdp's state for one process group in this process. Created by ringdp.init() or
    lazily by the first collective; every rank of the group must create it (collectively)."""

    def __init__(self, group=None, timeout=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ringdp needs torch.distributed to be initialised first: call "
                "torch.distributed.init_process_group(...) (torchrun sets the environment for it)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = policy.timeout_s(timeout)
        key = _group_key(group)
        gen = _generation.get(key, 0)
        _generation[key] = gen + 1
        self._store = dist.PrefixStore(f"ringdp/{key}/{gen}/", dist.distributed_c10d._get_default_store())
        self._lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._closed = False
        self.host = socket.gethostname()
        self.hosts: list[str] = [self.host]
        self._shm_error: str | None = None  # set when the group spans hosts
        self._cuda_native = None
        self._native = self._rendezvous()

    # ---- set-up -------------------------------------------------------------------------
    def _wait_keys(self, what: str, keys: list[str]):
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as e:  # torch raises DistStoreError / RuntimeError on timeout
            missing = [k for k in keys if not self._store.check([k])]
            raise RingError(
                f"rank {self.rank}: timed out after {self.timeout:g} s waiting for {what} of "
                f"{', '.join(missing) or 'peers'} ({e.__class__.__name__}); did every rank of the "
                f"group call ringdp with the same group?"
            ) from None

    def _rendezvous(self):
        st = self._store
        if self.rank == 0:
            st.set("uid", uuid.uuid4().hex[:12])
        self._wait_keys("the job id", ["uid"])
        uid = st.get("uid").decode()
        cfg = _C.ShmConfig()
        cfg.rank, cfg.world = self.rank, self.world
        cfg.name = f"/ringdp-{uid}-r{self.rank}"
        cfg.host = self.host
        cfg.fifo_slots = int(os.environ.get("RINGDP_FIFO_SLOTS", policy.FIFO_SLOTS))
        cfg.slot_bytes = int(os.environ.get("RINGDP_SLOT_BYTES", policy.SLOT_BYTES))
        cfg.oneshot_bytes = policy.oneshot_buffer_bytes()
        cfg.arena_bytes = int(float(os.environ.get("RINGDP_ARENA_GB", policy.ARENA_GB)) * (1 << 30))
        cfg.spin_ns = policy.spin_ns(self.world)
        native = _C.ShmComm(cfg)  # creates (and owns) this rank's segment
        names = [f"/ringdp-{uid}-r{r}" for r in range(self.world)]
        try:
            st.set(f"blob/{self.rank}", native.local_blob())
            st.set(f"seg/{self.rank}", json.dumps({"name": cfg.name, "host": self.host, "pid": os.getpid()}))
            self._wait_keys("the shared-memory segments",
                            [f"seg/{r}" for r in range(self.world)] + [f"blob/{r}" for r in range(self.world)])
            infos = [json.loads(st.get(f"seg/{r}")) for r in range(self.world)]
            self.hosts = [i["host"] for i in infos]
            if len(set(self.hosts)) > 1:
                # CUDA tensors still work (NCCL transport); CPU collectives raise this.
                where = ", ".join(f"rank {r} on {i['host']}" for r, i in enumerate(infos))
                self._shm_error = (
                    f"rank {self.rank}: ringdp's shared-memory transport joins ranks of one host, but "
                    f"the group spans {len(set(self.hosts))} hosts ({where}). CPU tensors across hosts are "
                    f"not supported; CUDA tensors across hosts use the NCCL transport."
                )
            else:
                native.connect([st.get(f"blob/{r}") for r in range(self.world)])
            st.set(f"mapped/{self.rank}", "1")
            self._wait_keys("peers to map the segments", [f"mapped/{r}" for r in range(self.world)])
            native.unlink_own()  # every peer has mapped it: nothing left to leak in /dev/shm
        except BaseException:
            native.unlink_all(names)
            raise
        return native

    # ---- execution ----------------------------------------------------------------------
    def _start_worker(self):
        self._queue = queue.Queue()
        self._worker = threading.Thread(target=self._run_worker, name=f"ringdp-worker-r{self.rank}", daemon=True)
        self._worker.start()

    def _run_worker(self):
        q = self._queue
        while True:
            item = q.get()
            if item is None:
                return
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    with self._lock:
                        fn()
                except BaseException as e:
                    fut.set_exception(e)
                else:
                    fut.set_result(None)
            with self._pending_lock:
                self._pending -= 1

    def _submit(self, fn, async_op: bool, outputs=(), on_wait=None) -> Work | None:
        """Run collectives in submission order: inline when nothing is queued, else behind
        the queued ones on the worker thread."""
        if self._closed:
            raise RingError(f"rank {self.rank}: this ringdp communicator was destroyed")
        with self._pending_lock:
            idle = self._pending == 0
            if not (idle and not async_op):
                self._pending += 1
        if idle and not async_op:
            with self._lock:
                fn()
            return None
        if self._worker is None:
            self._start_worker()
        fut: Future = Future()
        self._queue.put((fn, fut))
        work = Work(fut, list(outputs), on_wait)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False, timeout=None, algo=None):
        t = policy.timeout_s(timeout) if timeout is not None else self.timeout
        try:
            code, shm_algo = self._check(tensor, op, algo)
        except (TypeError, ValueError) as e:
            # Tell the peers, in order, so they fail at once instead of timing out.
            msg = str(e)
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda and _C.WITH_CUDA:
                native = self._cuda(tensor.device)  # the transport of the tensor's device
                self._submit(lambda: native.reject(msg), async_op=False)
            elif not self._shm_error:
                self._submit(lambda: self._native.reject(msg, t), async_op=False)
            raise
        if tensor.is_cuda:
            native = self._cuda(tensor.device)
            stream = torch.cuda.current_stream(tensor.device).cuda_stream  # the caller's stream
            nbytes = tensor.numel() * tensor.element_size()
            cuda_algo = cuda_comm.algo_code(nbytes, self.world, native.oneshot_bytes, algo)
            fn = lambda: native.all_reduce_tensor(tensor, code, stream, cuda_algo, t)  # noqa: E731
            work = self._submit(fn, async_op, outputs=[tensor], on_wait=native.synchronize)
        else:
            if self._shm_error:
                raise RingError(self._shm_error)
            fn = lambda: self._native.all_reduce(tensor, code, shm_algo, t)  # noqa: E731
            work = self._submit(fn, async_op, outputs=[tensor])
        if async_op:
            return work
        return None

    def algo_for(self, nbytes: int, device="cpu", algo=None) -> str:
        """The algorithm ("ring" or "oneshot") this communicator runs for an all-reduce of
        `nbytes` bytes on `device` with the given `algo` (None: RINGDP_ALGO, else auto)."""
        if torch.device(device).type == "cuda":
            cap = self._cuda_native.oneshot_bytes if self._cuda_native is not None else None
            return cuda_comm.algo_for(nbytes, self.world, algo, cap)
        return "oneshot" if policy.choose_algo(nbytes, self.world, algo) == policy.ALGO_ONESHOT else "ring"

    def _check(self, tensor, op, algo=None):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ringdp.all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
        code = _types.op_code(op)
        _check_dtype(tensor.dtype)
        if tensor.layout != torch.strided:
            raise ValueError(f"ringdp.all_reduce needs a dense (strided) tensor, got layout {tensor.layout}")
        if tensor.device.type not in ("cpu", "cuda") or (tensor.is_cuda and not _C.WITH_CUDA):
            raise ValueError(
                f"ringdp.all_reduce on rank {self.rank}: tensor is on {tensor.device}, which this ringdp "
                f"build does not reduce (build_info(): {build_info()})"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"ringdp.all_reduce needs a contiguous tensor (shape {tuple(tensor.shape)}, strides "
                f"{tensor.stride()}); reduce t.contiguous() and copy the result back"
            )
        if code == _types.AVG and not tensor.dtype.is_floating_point:
            raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        return code, policy.choose_algo(nbytes, self.world, algo)

    # ---- registered memory --------------------------------------------------------------
    def empty(self, size, dtype=torch.float32, device="cpu") -> torch.Tensor:
        _check_dtype(dtype)
        device = torch.device(device)
        if device.type == "cuda":
            try:
                return self._cuda(device).empty([int(s) for s in size], dtype)
            except RingError as e:  # arena exhausted: callers fall back to ordinary memory
                raise ValueError(str(e)) from None
        if device.type != "cpu":
            raise ValueError(f"ringdp.empty: device {device} is not supported")
        return self._native.empty([int(s) for s in size], dtype)

    def is_registered(self, tensor: torch.Tensor) -> bool:
        if tensor.is_cuda:
            return self._cuda_native is not None and bool(self._cuda_native.is_registered(tensor))
        return tensor.device.type == "cpu" and bool(self._native.is_registered(tensor))

    def _cuda(self, device):
        """The CUDA transport, created (collectively) on first use."""
        if self._cuda_native is None:
            self._cuda_native = cuda_comm.create(self, torch.device(device))
        return self._cuda_native

    def synchronize(self):
        """Wait for queued collectives (and, on CUDA, for ringdp's stream); raise failures."""
        self._submit(lambda: None, async_op=False)
        if self._cuda_native is not None:
            self._cuda_native.synchronize()

    # ---- teardown -----------------------------------------------------------------------
    def close(self):
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=self.timeout)
        if self._cuda_native is not None:
            native, self._cuda_native = self._cuda_native, None
            cuda_comm.close(self, native)
        # Registered tensors still alive keep the native object (and its mapping) alive.
        self._native = None


_comms: dict[str, Communicator] = {}
_comms_lock = threading.Lock()


def init(group=None, timeout=None) -> Communicator:
    """Set ringdp up for `group` (default: the default process group). Collective. Optional:
    every ringdp call initialises lazily."""
    key = _group_key(group)
    with _comms_lock:
        c = _comms.get(key)
        if c is None:
            c = Communicator(group, timeout)
            _comms[key] = c
        return c


def get_communicator(group=None) -> Communicator:
    c = _comms.get(_group_key(group)) if dist.is_initialized() else None
    return c if c is not None else init(group)


def destroy(group=None):
    """Release ringdp's resources for `group` (all groups when None)."""
    with _comms_lock:
        keys = list(_comms) if group is None else [_group_key(group)]
        for k in keys:
            c = _comms.pop(k, None)
            if c is not None:
                c.close()


atexit.register(destroy)


def build_info() -> dict:
    transports = ["shm"] + (["cuda_ipc", "nccl"] if _C.WITH_CUDA else [])
    extra = {"nccl": tuple(_C.cuda_nccl_info(cuda_comm.wheel_nccl()))} if _C.WITH_CUDA else {}
    return {
        **extra,
        "version": __import__("ringdp").__version__,
        "cuda": bool(_C.WITH_CUDA),
        "transports": transports,
        "torch": torch.__version__,
        "built_with_torch": _C.BUILT_WITH_TORCH,
        "compiler": _C.COMPILER,
        "torch_cuda": torch.version.cuda,
    }
