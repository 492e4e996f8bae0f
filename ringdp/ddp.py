"""RingDDP: a drop-in replacement for torch's DistributedDataParallel whose gradient
all-reduce runs on ringdp, bucketed and overlapped with the backward pass.

    model = ringdp.RingDDP(net)            # instead of DistributedDataParallel(net)
    loss = loss_fn(model(x), y)
    loss.backward()                         # gradients are averaged when this returns
    opt.step()

This module is the Module side, as torch's distributed.py: arguments, the check that every
rank holds the same model, rank 0's state broadcast, forward, no_sync, comm hooks and join
(its JoinHook). The buckets and their reductions are the Reducer's (ringdp/reducer.py); the
Chrome trace is an observer of the Reducer (ringdp/trace.py, RINGDP_TRACE). Which parameters
have sparse gradients is decided here, as torch DDP does it.
"""
from __future__ import annotations

import contextlib
import hashlib
import pickle
import warnings
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook, Joinable, _JoinConfig

from . import inflight, policy
from .comm import _SUPPORTED_DTYPES, RingError, _group_key, _is_world, get_communicator, init
from .config import Config, trace_path
from .buckets import GradBucket, Observer, assign_buckets, now_us
from .reducer import Reducer

__all__ = ["RingDDP", "GradBucket", "assign_buckets"]

_MiB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_MB = 1
BROADCAST_CHUNK_BYTES = 256 * _MiB  # start-up broadcast: one flat tensor per dtype, at most this


class RingDDP(nn.Module, Joinable):
    """DistributedDataParallel on ringdp. Arguments mean what they mean for
    :class:`torch.nn.parallel.DistributedDataParallel`.

    Sparse gradients: the weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules built
    with ``sparse=True`` keep sparse gradients (``torch.optim.SparseAdam`` works), reduced
    as torch DDP reduces them (divided, then the process group's sparse all-reduce), outside
    the buckets (see :mod:`ringdp.reducer`); a sparse gradient for any other parameter
    raises a RuntimeError naming it.

    Args (torch's, in torch's order, positional as there; then RingDDP's own, keyword-only):
        module: the model (already on its device); the same model on every rank.
        device_ids: for a single-device CUDA module, ``[device]`` (inputs are moved there);
            None for CPU modules.
        output_device: accepted for compatibility (single-device modules only).
        dim: accepted for compatibility (torch DDP uses it only in its scatter()/gather()).
        broadcast_buffers: as torch's (None, the default, is True): True broadcasts the
            module's buffers from rank 0 at construction and before each forward; False does
            neither (rank-local buffers stay as they are).
        init_sync: check that every rank holds the same model and broadcast rank 0's
            parameters (and buffers, per broadcast_buffers / forward_sync_buffers) at
            construction (default True); False does neither: the ranks must already agree.
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: bucket size in MiB; None means 25 MiB with a 1 MiB first bucket, a
            number means that cap for every bucket.
        find_unused_parameters: find, after each forward, the parameters that do not take
            part in the loss, and mark them ready (their gradient is zero in the average;
            a parameter unused on every rank keeps ``.grad`` None).
        check_reduction: deprecated in torch and ignored there (a FutureWarning), as here.
        gradient_as_bucket_view: make ``.grad`` views into the buckets (saves a copy in and
            a copy out per step and the gradients' memory).
        static_graph: the set of used parameters is the same every iteration: it is found
            once, in the first iteration, and reused.
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
            device_mesh, skip_all_reduce_unused_params, bucket_cap_mb_list: not supported:
            anything but the default raises NotImplementedError naming the argument.
        batched_grad_copy: accepted (a kernel-count optimisation of torch's reducer; the
            result is the same).
        forward_sync_buffers: as torch's: broadcast the buffers before each forward (None:
            broadcast_buffers decides); given, buffers are broadcast at construction too.
        trace: a path for a Chrome trace of this rank's backward passes (default: the
            ``RINGDP_TRACE`` environment variable); see :mod:`ringdp.trace`.
        overlap: start each bucket's all-reduce as soon as it is complete (default; else
            all of them at the end of backward, to measure what overlap brings). The
            environment variable ``RINGDP_DDP_OVERLAP=0`` sets the default to False.

    Parameters and buffers named in ``module._ddp_params_and_buffers_to_ignore`` (set by
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``) are left alone
    as torch DDP leaves them: not in the model check, not broadcast, not averaged (their
    gradients stay local).
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                 device_mesh=None, skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list=None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None, *, trace=None,
                 overlap: bool | None = None):
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("RingDDP needs torch.distributed to be initialised first: call "
                               "torch.distributed.init_process_group(...) (torchrun sets its environment)")
        for name, value, default in (("delay_all_reduce_named_params", delay_all_reduce_named_params, None),
                                     ("param_to_hook_all_reduce", param_to_hook_all_reduce, None),
                                     ("mixed_precision", mixed_precision, None), ("device_mesh", device_mesh, None),
                                     ("skip_all_reduce_unused_params", skip_all_reduce_unused_params, False),
                                     ("bucket_cap_mb_list", bucket_cap_mb_list, None)):
            if (value is not None) if default is None else bool(value):
                raise NotImplementedError(
                    f"RingDDP does not support {name} (got {value!r}); leave it at its default ({default!r})"
                    + ("; pass process_group=device_mesh.get_group(0) instead" if name == "device_mesh" else ""))
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if check_reduction:
            warnings.warn("The `check_reduction` argument of DistributedDataParallel (and RingDDP) is deprecated "
                          "and has no effect", FutureWarning, stacklevel=2)
        if broadcast_buffers is not None and forward_sync_buffers is not None:
            warnings.warn("RingDDP: both broadcast_buffers and forward_sync_buffers given: forward_sync_buffers "
                          "decides (as in torch's DistributedDataParallel)", FutureWarning, stacklevel=2)
        # as torch DDP: forward_sync_buffers, when given, decides the forward sync and buffers
        # are synchronised at construction; else broadcast_buffers (None: True) decides both
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = bool(forward_sync_buffers), True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is None or bool(broadcast_buffers)
        cfg = Config.from_env()
        trace = cfg.trace if trace is None else trace
        if trace:
            trace_path(trace, 0)  # a bad pattern fails here, before any collective
        self.module = module
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.dim = dim
        self.init_sync = bool(init_sync)
        self.batched_grad_copy = batched_grad_copy
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        # as torch DDP: names (named_parameters / named_buffers) that it leaves alone
        self.parameters_to_ignore: set[str] = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))

        named = self._reduced_parameters()
        if not named:
            raise RuntimeError("RingDDP: the module has no parameter that requires a gradient"
                               + (" (other than those in module._ddp_params_and_buffers_to_ignore)"
                                  if self.parameters_to_ignore else ""))
        self._sparse_ids = _sparse_grad_params(module)
        devices = {p.device for _, p in named}
        if len(devices) > 1 and device_ids:
            raise ValueError(f"RingDDP: device_ids is for single-device modules; the module spans {sorted(map(str, devices))}")
        if device_ids is not None and len(device_ids) == 0:
            device_ids = None  # (as torch DDP: [] is no device)
        in_backward = [n for n, p in named if getattr(p, "_in_backward_optimizers", None)]
        if in_backward:
            raise NotImplementedError(
                f"RingDDP: {len(in_backward)} parameter(s) ({', '.join(in_backward[:3])}) carry an optimizer "
                f"applied in backward (_apply_optimizer_in_backward): it would step on local gradients before "
                f"they are averaged; run the optimizer after backward")
        if device_ids is not None:
            if len(device_ids) != 1:
                raise ValueError("RingDDP supports single-device modules: device_ids must be None or [device]")
            if next(iter(devices)).type == "cpu":
                raise ValueError("RingDDP: device_ids must be None for CPU modules (as for torch DDP)")
        self.device_ids = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
                           for d in device_ids] if device_ids else None
        self.output_device = output_device
        self._device = next(iter(devices))

        # start-up: ringdp communicator (collective), same model everywhere, rank 0's state
        if self.world_size > 1:
            init(process_group)
        if self.init_sync:
            self._verify_same_model()
            self._broadcast_state(src=0, buffers=init_sync_buffers)

        self._trace = None
        if trace:
            from .trace import DDPTrace

            # files are named by the global rank (and a group other than the world): config.trace_path
            group = None if _is_world(process_group) else _group_key(process_group)
            self._trace = DDPTrace(trace, dist.get_rank(), self.world_size, max_event_steps=cfg.trace_steps,
                                   group=group)
        if bucket_cap_mb is None:
            cap, first = DEFAULT_BUCKET_CAP_MB * _MiB, DEFAULT_FIRST_BUCKET_MB * _MiB
        else:
            cap = first = max(1, int(bucket_cap_mb * _MiB))
        self.overlap = cfg.ddp_overlap if overlap is None else bool(overlap)
        self._caps = (cap, first, cfg.ddp_in_grad_min_bytes)
        self._make_reducer()
        self._comm_hook: Callable | None = None
        self._join_hook: _RingJoinHook | None = None

    def _reduced_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of those RingDDP averages: requiring a gradient, not ignored."""
        return [(n, p) for n, p in self.module.named_parameters()
                if p.requires_grad and n not in self.parameters_to_ignore]

    def _make_reducer(self) -> None:
        """The Reducer of the module's parameters (at construction; again in a copy: __setstate__)."""
        named = self._reduced_parameters()
        cap, first, in_grad = self._caps
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named], self.process_group, cap_bytes=cap,
                               first_cap_bytes=first, in_grad_min_bytes=in_grad,
                               gradient_as_bucket_view=self.gradient_as_bucket_view,
                               find_unused=self.find_unused_parameters, static_graph=self.static_graph,
                               overlap=self.overlap, observer=self._trace,
                               sparse=[id(p) in self._sparse_ids for _, p in named])
        self._observer: Observer = self.reducer.observer

    # ------------------------------------------------------------------ copies
    def __getstate__(self):
        """A copy (copy.deepcopy, pickle, torch.save of the wrapper) holds the module and the
        settings; its Reducer is made anew (as torch DDP's), on the default group only."""
        if not _is_world(self.process_group):
            raise RuntimeError("RingDDP can be copied or pickled only when it uses the default process group "
                               "(as torch's DistributedDataParallel); save model.module (or its state_dict) instead")
        state = self.__dict__.copy()
        for k in ("reducer", "_observer", "_trace", "_join_hook", "_comm_hook", "process_group"):
            state.pop(k, None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._trace, self._join_hook, self._comm_hook, self.process_group = None, None, None, None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # (this process's: not the saver's)
        self._sparse_ids = _sparse_grad_params(self.module)
        self._make_reducer()

    def _set_static_graph(self) -> None:
        """As torch DDP's: static_graph=True, set after construction, before the first backward."""
        if self.static_graph:
            warnings.warn("RingDDP: you've set static_graph to be True, no need to set it again", stacklevel=2)
            return
        if self.reducer.step > 0:
            raise RuntimeError("RingDDP: _set_static_graph() must be called before the first backward")
        self.static_graph = self.reducer.static_graph = True

    # ------------------------------------------------------------------ properties
    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast before each forward (torch's name; forward_sync_buffers)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in bucket (= reduction) order. Parameters with sparse
        gradients are in no bucket (they are reduced one by one at the end of backward):
        ``reducer.sparse_names`` lists them."""
        return self.reducer.bucket_layout

    @property
    def last_exposed_comm_ms(self) -> float | None:
        """Time the last synchronised backward waited for reductions after autograd ended.
        CUDA tensors: the host's wait until every reduction was enqueued; the caller's stream
        then waits for ringdp's on the GPU, which this figure does not see."""
        return self.reducer.last_exposed_comm_ms

    # ------------------------------------------------------------------ start-up
    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None or self.process_group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def _signature(self) -> list[tuple]:
        ignore = self.parameters_to_ignore
        sig = [("parameter", n, tuple(p.shape), str(p.dtype), bool(p.requires_grad), id(p) in self._sparse_ids)
               for n, p in self.module.named_parameters() if n not in ignore]
        sig += [("buffer", n, tuple(b.shape), str(b.dtype), False, False)
                for n, b in self.module.named_buffers() if n not in ignore]
        return sig

    def _verify_same_model(self) -> None:
        """Every rank must hold the same parameters and buffers (names, shapes, dtypes,
        whether the gradient is sparse, in order): compare a digest first, and the full lists only when digests differ.

        The records go through the communicator's rendezvous (the store, on this thread), not
        through torch.distributed collectives: every rank reads the same records, so every
        rank raises the same RingError or none does, and a failed check leaves no work in
        torch's gloo threads. (A gloo work that still holds tensors made in Python when the
        interpreter exits aborts the process: "terminate called without an active exception"
        after a script caught the RingError and ended.)"""
        if self.world_size == 1:
            return
        rdv = get_communicator(self.process_group).rendezvous
        key = rdv.next_round("ddp-model")
        sig = self._signature()
        digest = f"{len(sig)}:{hashlib.sha256(repr(sig).encode()).hexdigest()}"
        digests = rdv.exchange(f"{key}/digest", digest, "the RingDDP model digests")
        if all(d == digests[0] for d in digests):
            return
        sigs = [pickle.loads(b) for b in rdv.exchange(f"{key}/signature", pickle.dumps(sig),
                                                      "the RingDDP model signatures")]
        ref = sigs[0]
        for r in range(1, self.world_size):
            other = sigs[r]
            for i in range(max(len(ref), len(other))):
                a = ref[i] if i < len(ref) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    raise RingError(
                        f"RingDDP: the model on rank {r} differs from rank 0's at entry #{i}: "
                        f"rank 0 has {_describe(a)}, rank {r} has {_describe(b)}. Every rank must "
                        f"build the same model (same parameters and buffers, same shapes and dtypes, "
                        f"same sparse flags, same order) before wrapping it in RingDDP. (seen from rank {self.rank})")

    @torch.no_grad()
    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcast `tensors` from group rank `src`, coalesced into flat tensors per dtype
        and device (at most BROADCAST_CHUNK_BYTES each): CPU tensors of ringdp's dtypes on
        ringdp's communicator (its failure guarantees: a dead peer is a RingError naming it,
        within ringdp's timeout; on a gloo group, gloo's error named no rank; and ordered
        with the reductions), others through torch.distributed (CUDA tensors too: ringdp's
        CUDA broadcast has not run on a GPU yet, docs/cuda.md)."""
        if self.world_size == 1 or not tensors:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        gsrc = self._global_rank(src)
        comm = get_communicator(self.process_group)
        for (dtype, device), ts in groups.items():
            ours = device.type == "cpu" and dtype in _SUPPORTED_DTYPES
            chunk, size = [], 0
            for t in ts + [None]:
                if t is not None:
                    chunk.append(t)
                    size += t.numel() * t.element_size()
                if chunk and (t is None or size >= BROADCAST_CHUNK_BYTES):
                    flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                    if ours:
                        comm.broadcast(flat, src, tag="RingDDP broadcast")
                    else:
                        dist.broadcast(flat, src=gsrc, group=self.process_group)
                    if self.rank != src:
                        o = 0
                        for c in chunk:
                            c.copy_(flat[o:o + c.numel()].view_as(c))
                            o += c.numel()
                    chunk, size = [], 0

    def _broadcast_state(self, src: int, buffers: bool) -> None:
        """Rank `src`'s parameters (and buffers if `buffers`), but those to ignore."""
        params = [p for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        self._broadcast_tensors(params + (self._buffers_to_sync() if buffers else []), src)

    def will_sync_module_buffers(self) -> bool:
        """As torch's: whether the next forward (or a joined rank's shadow of it) broadcasts
        the module's buffers: a sync is due (_buffer_sync_due) and there are buffers."""
        return self._buffer_sync_due() and bool(self._buffers_to_sync())

    def _buffer_sync_due(self) -> bool:
        """broadcast_buffers is on and the previous forward's gradients were synchronised (what
        a forward checks: without buffers its sync does nothing, so it need not look them up)."""
        return bool(self.broadcast_buffers and self.require_forward_param_sync)

    def _sync_buffers(self, src: int) -> None:
        self._broadcast_tensors(self._buffers_to_sync(), src)

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        # looked up at each sync: a module may re-assign its buffers (as torch DDP does it)
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs, **kwargs):
        t0 = now_us()
        self.reducer.prepare_for_forward()
        if self._join_config.enable:
            self._join_hook.pre_forward()
        else:
            self.reducer.set_divisor(self.world_size, 0)
        if self._buffer_sync_due():
            self._sync_buffers(self.reducer.auth_rank)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), self.device_ids[0])
        out = self.module(*inputs, **kwargs)
        # as torch DDP: buffers are synchronised before a forward that follows a forward
        # whose gradients were synchronised
        self.require_forward_param_sync = sync
        self.reducer.prepare_for_backward(out, sync)
        self._observer.on_forward(t0, now_us(), out)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of backward passes whose forward ran inside accumulate locally."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """hook(state, bucket: GradBucket) -> torch.futures.Future of the reduced bucket (a
        Work with get_future() also does); see ringdp.comm_hooks. Call at most once, outside a
        backward (from the next backward on). Parameters with sparse gradients are not given to the hook
        (torch DDP gives it each one as a bucket of its own): they are reduced as without a
        hook, divided by the world size (or join's divisor) and summed."""
        if self._comm_hook is not None:
            raise RuntimeError("RingDDP: register_comm_hook can only be called once")
        if not callable(hook):
            raise TypeError("RingDDP.register_comm_hook: hook must be callable")
        if self.reducer._in_backward:
            raise RuntimeError("RingDDP: register_comm_hook cannot be called during a backward")
        self._comm_hook = hook
        self.reducer.set_comm_hook(state, hook)

    # ------------------------------------------------------------------ trace
    def trace_summary(self) -> dict | None:
        """Exposed communication and overlap per traced step and on average (None when
        tracing is off)."""
        return self._trace.tracer.summary() if self._trace is not None else None

    def flush_trace(self):
        """Write the trace file now (it is also written at exit); returns its path."""
        return self._trace.tracer.flush() if self._trace is not None else None

    # ------------------------------------------------------------------ join
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs, as torch DDP's join(): ranks that ran out of
        data shadow the collectives of the others until all are done; then every rank
        takes the parameters of a rank that joined last. Gradients are divided by the
        initial world size (default) or by the number of ranks still training."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        self._join_hook = _RingJoinHook(self, kwargs.get("divide_by_initial_world_size", True))
        return self._join_hook

    def __del__(self):
        with contextlib.suppress(Exception):
            self.reducer.remove_hooks()


class _RingJoinHook(JoinHook):
    """RingDDP's part in torch's Join: one small control all-reduce per iteration (who still
    trains, will they synchronise gradients), a shadow backward on ranks without data, and
    at the end rank-wide agreement on the model of a rank that joined last."""

    NOTICE = "RingDDP's Join notice (allreduce)"  # (its name in ringdp/inflight.py's lines)

    def __init__(self, ddp: RingDDP, divide_by_initial_world_size: bool):
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self._control: torch.Tensor | None = None
        self._on_gloo: bool | None = None  # whether torch's Join notice runs on gloo (pre_forward)

    def _control_allreduce(self, active: bool) -> bool:
        """Which ranks still train; sets the reducer's divisor and authoritative rank (a rank
        that still trains, as torch DDP); returns whether this iteration synchronises."""
        ddp, world = self.ddp, self.ddp.world_size
        if self._control is None:
            self._control = ddp.reducer.alloc(world + 1, torch.int32, ddp.join_device)
        c = self._control
        c.zero_()
        if active:
            c[0] = int(torch.is_grad_enabled() and ddp.require_backward_grad_sync)
            c[1 + ddp.rank] = 1
        if world > 1:
            get_communicator(ddp.process_group).all_reduce(c, tag="RingDDP join control")
        vals = c.tolist()
        alive = [r for r in range(world) if vals[1 + r] > 0]
        divisor = world if self.divide_by_initial_world_size else max(1, len(alive))
        ddp.reducer.set_divisor(divisor, max(alive) if alive else 0)
        return vals[0] > 0

    def pre_forward(self) -> None:
        """A rank that trains, before each forward inside join(). torch's Join all-reduces
        on the process group (`work`, started here): a failed control all-reduce (a peer
        died) still waits for it, at most policy.GLOO_DRAIN_S, before it raises: a gloo collective
        left in flight aborted the process at exit ("terminate called without an active
        exception", tests/_fuzz_ddp.py --kill, world 3 seed 69). On a gloo group the notice
        is held in ringdp/inflight.py from its start, and with its group once that wait
        leaves it in flight (a peer alive but elsewhere): destroy_process_group() waited for
        it in the group's destructor until the peer left or gloo's timeout ended it
        (tests/_exit_job.py join)."""
        ddp = self.ddp
        work = Join.notify_join_context(ddp)
        if self._on_gloo is None:  # (the group and device are the hook's for good)
            self._on_gloo = inflight.is_gloo(ddp.join_process_group, ddp.join_device)
        held = work is not None and self._on_gloo
        if held:
            inflight.GLOO.hold(work, None, self.NOTICE)
        try:
            self._control_allreduce(active=True)
        except BaseException:
            if work is not None:
                with contextlib.suppress(Exception):  # (its own failure: the peer is gone)
                    work.wait(timeout=timedelta(seconds=policy.GLOO_DRAIN_S))
                if held and not work.is_completed():
                    inflight.GLOO.hold(work, ddp.join_process_group, self.NOTICE)
            raise
        if work is not None:
            work.wait()
        if held:
            inflight.GLOO.settle(work)

    @torch.no_grad()
    def main_hook(self) -> None:
        """A rank without data: match one iteration of the others' collectives."""
        ddp = self.ddp
        sync = self._control_allreduce(active=False)
        if ddp._buffer_sync_due():
            ddp._sync_buffers(ddp.reducer.auth_rank)
        ddp.require_forward_param_sync = sync
        if sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """After all ranks joined: everyone takes the model of a rank that joined last."""
        ddp = self.ddp
        t = torch.tensor([ddp.rank if is_last_joiner else -1], dtype=torch.int64, device=ddp.join_device)
        get_communicator(ddp.process_group).all_reduce(t, op=dist.ReduceOp.MAX, tag="RingDDP join end")
        src = int(t.item())
        if src >= 0:
            ddp._broadcast_state(src, buffers=ddp.forward_sync_buffers)  # as torch's _sync_final_model
        ddp.reducer.set_divisor(ddp.world_size, 0)
        ddp._join_config = _JoinConfig.construct_disabled_join_config()


# ---------------------------------------------------------------------- helpers
def _describe(entry) -> str:
    if entry is None:
        return "nothing (fewer parameters/buffers)"
    kind, name, shape, dtype, req, sparse = entry
    extra = "" if kind == "buffer" else ("" if req else ", requires_grad=False")
    extra += ", sparse gradient" if sparse else ""
    return f"{kind} {name!r} of shape {tuple(shape)} and dtype {dtype}{extra}"


def _sparse_grad_params(module: nn.Module) -> set[int]:
    """ids of the parameters whose gradients are sparse, by torch DDP's rule: the weight of
    an nn.Embedding / nn.EmbeddingBag with sparse=True (a parameter shared by several
    modules counts for the first one that holds it, in named_modules() order)."""
    seen: set[int] = set()
    sparse: set[int] = set()
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                sparse.add(id(p))
    return sparse


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
