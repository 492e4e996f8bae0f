"""The Reducer: RingDDP's gradient buckets and their reductions, one backward at a time.

RingDDP (ringdp/ddp.py) is the Module: arguments, model checks, forward, no_sync, comm hooks,
join. The Reducer owns everything between a parameter's gradient and its averaged value,
as torch's c10d Reducer does, through named lifecycle methods:

    prepare_for_forward()                before forward: raise if the previous backward
                                         started reductions and died before its end
    prepare_for_backward(outputs, sync)  after forward: will the next backward synchronise,
                                         and which parameters did this forward not use
    mark_ready(i, param)                 per parameter, from its gradient accumulator's hook:
                                         its gradient is final; fills its bucket and, once a
                                         bucket is complete and every lower bucket started,
                                         starts that bucket's reduction
    finalize()                           end of backward (an autograd callback, queued when
                                         the backward reaches the forward's outputs): wait for
                                         the buckets in index order, write each one back as
                                         soon as it is done
    rebuild(src)                         once, after the first synchronised backward: adopt
                                         rank src's gradient-ready order (same buckets on
                                         every rank)
    abandon()                            a backward died before its end (an exception)
    shadow_backward()                    join: a rank without data matches one backward
                                         with zero gradients

Buckets and their storage, the hook-facing GradBucket and the Observer protocol are in
ringdp/buckets.py.

Reductions. Each bucket's reduction is one future (a ``torch.futures.Future`` whose value
holds the reduced tensor): a comm hook returns one (a Work's ``get_future()`` is accepted),
and without a hook the Reducer makes one from ``ringdp.all_reduce(..., async_op=True)``
with ReduceOp.AVG (the division fused into the reduction). Buckets start strictly in index
order on every rank. Every reduction is tagged "RingDDP step S bucket B" (S counts
synchronised backwards, join shadows included; a comm hook's collectives get the tag too,
through ``collective_tag``), so ranks whose steps got out of line fail at once with a
RingError that names both sides instead of averaging gradients of different steps.

Sparse gradients. The weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules built with
``sparse=True`` (the caller says which, as torch DDP decides it) are in no bucket: their
gradients are reduced by :class:`SparseGrads` as torch DDP's reducer does it, divided by the
divisor and then summed by the process group's sparse all-reduce (gloo's), started at the end
of backward in parameter-index order on every rank (a rank without such a gradient takes
part with an empty one) and finished after the buckets. They are given to no comm hook and
no observer (the trace shows the buckets only; the sparse reductions fall inside its finalize
span and count in ``last_exposed_comm_ms``). A sparse gradient for any other parameter is an
error, as in torch DDP.

Observers (ringdp/buckets.py :class:`Observer`) are told what happens; they never change
what the Reducer does (ringdp.trace.DDPTrace writes the Chrome trace).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ._autograd import enclosing_function_node, grad_accumulator, graph_task_id, outer_node
from ._outputs import output_tensors
from .buckets import (ALIGN_BYTES, Bucket, GradBucket, Observer, as_future, as_grad_of, assign_buckets, future_tensor,
                      now_us, stored, stored_dtype, stored_shape, stored_strides)
from .comm import collective_tag, get_communicator

__all__ = ["Reducer", "SparseGrads"]

class SparseGrads:
    """The parameters whose gradients are sparse (module doc, "Sparse gradients"): kept out
    of the buckets and reduced at the end of backward through the process group, one
    all-reduce each, in index order on every rank.

    A rank where such a parameter has no gradient takes part with an empty one, and gets
    ``.grad`` only if the sum has entries (a parameter no rank used keeps ``.grad`` None).
    A dense gradient (the weight is also used densely, e.g. tied to an output projection)
    is reduced as a sparse one too, so that the collective is the same on every rank
    whatever layout autograd gave each, and stays dense in ``.grad``."""

    def __init__(self, params: list[nn.Parameter], names: list[str], indices: list[int], group):
        self.params = params
        self.names = names
        self.indices = sorted(indices)
        self._set = set(self.indices)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # (index, local gradient or None, tensor reduced, its future) per started reduction
        self._pending: list[tuple[int, torch.Tensor | None, torch.Tensor, torch.futures.Future]] = []
        self._shadow = False

    def __contains__(self, i: int) -> bool:
        return i in self._set

    def check(self, i: int, grad: torch.Tensor | None) -> None:
        """Parameter i's gradient arrived (during backward): a layout this class reduces."""
        if grad is not None and grad.layout not in (torch.strided, torch.sparse_coo):
            raise RuntimeError(f"RingDDP on rank {self.rank}: parameter {self.names[i]!r} received a gradient of "
                               f"layout {grad.layout}; a sparse gradient must be a sparse COO tensor")

    @torch.no_grad()
    def launch(self, divisor: int, shadow: bool = False) -> None:
        """Start every reduction, in index order: gradient / divisor, then summed (shadow: a
        joined rank, contributing nothing and keeping nothing)."""
        if self.world == 1 or not self.indices:
            return
        self.abandon()  # left over from a backward whose end raised
        self._shadow = shadow
        for i in self.indices:
            g = None if shadow else self.params[i].grad
            if g is None:
                t = _empty_sparse(self.params[i])
            elif g.layout == torch.sparse_coo:
                t = g.div_(divisor)  # as torch DDP: divided in .grad, then summed into it
            else:
                t = g.div(divisor).to_sparse(1)
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._pending.append((i, g, t, work.get_future()))

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the reductions in order; write each result back into ``.grad``."""
        pending, self._pending = self._pending, []
        for i, g, t, fut in pending:
            res = future_tensor(fut, t)
            if res is not t:  # gloo writes the sum into t; another backend may return it
                t.copy_(res)
            if self._shadow:
                continue
            if g is None:
                if t._nnz() > 0:
                    self.params[i].grad = t
            elif g is not t:  # a dense gradient stays dense
                g.copy_(t.to_dense())
            # else the sparse .grad itself was reduced

    def abandon(self) -> None:
        """A backward died: let the started reductions finish."""
        pending, self._pending = self._pending, []
        for _i, _g, _t, fut in pending:
            with contextlib.suppress(Exception):
                fut.wait()


def _empty_sparse(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of `p` without entries (the layout nn.Embedding's gradients have)."""
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long, device=p.device),
                                   torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                   p.shape, is_coalesced=True, check_invariants=False)


class Reducer:
    """Buckets of one RingDDP's gradients and their reductions (module doc).

    params/names: the parameters that require gradients and their names, the same on every
    rank. group: the process group (None: default). cap_bytes/first_cap_bytes: bucket caps.
    in_grad_min_bytes: see the module doc (-1: never). find_unused/static_graph: as torch
    DDP's find_unused_parameters/static_graph. overlap: start reductions during backward
    (else all at its end). sparse: per parameter, whether its gradient is sparse (in no
    bucket; module doc)."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group, *, cap_bytes: int,
                 first_cap_bytes: int, in_grad_min_bytes: int, gradient_as_bucket_view: bool,
                 find_unused: bool, static_graph: bool, overlap: bool, observer: Observer | None = None,
                 sparse: list[bool] | None = None):
        self.params = params
        self.names = names
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = params[0].device
        self.cap_bytes = cap_bytes
        self.first_cap_bytes = first_cap_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused = find_unused
        self.static_graph = static_graph
        self.overlap = overlap
        self.observer = observer if observer is not None else Observer()
        self.in_grad_bytes = (None if gradient_as_bucket_view or in_grad_min_bytes < 0 or self.world == 1
                              else in_grad_min_bytes)
        self._nbytes = [p.numel() * p.element_size() for p in params]
        self._keys = [(p.dtype, p.device) for p in params]
        self._warned_alloc = False
        self._sparse = SparseGrads(params, names, [i for i, s in enumerate(sparse or []) if s], group)

        self.buckets: list[Bucket] = []
        self._loc: list[tuple[Bucket, int] | None] = []  # parameter index -> (bucket, slot); None: sparse
        self._arenas: list[torch.Tensor] = []
        self._build([i for i in reversed(range(len(params))) if i not in self._sparse])
        self.rebuilt = False
        self.ready_order: list[int] = []  # this backward's ready order, until the rebuild

        # per backward
        self._ready = [False] * len(params)
        self._next_launch = 0
        self._in_backward = False
        self._broken: str | None = None  # why this rank can no longer take part (unfinished step)
        self._sync = False  # a synchronising forward since the last backward
        self._queued = False  # a finalize callback is queued on a running backward (_finalize_pending)
        self._queued_task = -1  # on that graph task
        self._handed_to_hooks = False  # a nested backward ended: the next gradient hook may queue finalize
        self._handovers: list = []  # its post hooks on the outer backward's nodes (_finalize_callback)
        self._hook_task = -1  # the graph task of the latest gradient hook (_grad_hook)
        self._unfired: set[int] = set()  # hooks that never fired in the last synchronised backward, until a forward
        self._output_hooks: list = []  # on the synchronising forwards' outputs' autograd nodes (_watch_outputs)
        self.step = 0
        self.last_exposed_comm_ms: float | None = None

        # how gradients are averaged (join may change the divisor and the authoritative rank)
        self.divisor = self.world
        self.auth_rank = 0
        self._hook: Callable | None = None
        self._hook_state = None
        self._use_avg = True
        self._scale = 1.0
        self._set_scale()

        # unused parameters
        self._unused: list[int] = []  # locally unused since the last synchronised backward
        self._unused_now: list[int] = []  # not reached by the latest forward's graph (no hook fires)
        self._used_since_sync: set[int] = set()  # used by forwards under no_sync since then
        self._carried: set[int] = set()  # those, at the synchronising forward (_unused_at_the_end)
        self._static_unused: set[int] | None = None  # globally unused, for static_graph
        self._fires = [0] * len(params)  # each parameter's hook calls in this backward
        self._expected_fires: list[int] | None = None  # static_graph: those of its first backward
        self._fire_order: list[int] = []  # static_graph's first backward: the hooks' calls, in order
        self._static_unused_local: list[int] = []  # locally unused, for static_graph
        self._usage: torch.Tensor | None = None
        self._usage_future: torch.futures.Future | None = None

        # each parameter's hook on its gradient accumulator (the autograd node that writes .grad),
        # as torch's reducer: it runs after the node, so after every post-accumulate-grad hook,
        # those added after wrapping included. torch keeps the node only weakly: held here.
        self._accumulators: list = [None] * len(params)
        self._hook_handles: list = [None] * len(params)
        for i in range(len(params)):
            self._hook_accumulator(i, grad_accumulator(params[i]))

    # ------------------------------------------------------------------ settings
    @property
    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in bucket (= reduction) order; parameters with sparse
        gradients are in no bucket (sparse_names)."""
        return [[self.names[i] for i in b.params] for b in self.buckets]

    @property
    def sparse_names(self) -> list[str]:
        """Names of the parameters whose gradients are sparse, in reduction order."""
        return [self.names[i] for i in self._sparse.indices]

    def bucket_of(self, i: int) -> tuple[Bucket, int] | None:
        """(bucket, slot) of parameter i (None for a parameter with sparse gradients)."""
        return self._loc[i]

    def set_comm_hook(self, state, hook: Callable) -> None:
        self._hook, self._hook_state = hook, state
        self._set_scale()

    def set_divisor(self, divisor: int, auth_rank: int) -> None:
        """Divide by `divisor` this iteration; `auth_rank` is the rank whose ready order a
        pending rebuild adopts (join: a rank that still trains)."""
        self.divisor, self.auth_rank = divisor, auth_rank
        self._set_scale()

    def _set_scale(self) -> None:
        """By ringdp's AVG (the division fused into the reduction) when dividing by the group
        size without a hook, else by a scale folded into the copy into the bucket (join
        with a smaller divisor); a comm hook gets the raw sums and divides itself."""
        self._use_avg = self._hook is None and self.divisor == self.world
        self._scale = 1.0 if (self._hook is not None or self._use_avg) else 1.0 / self.divisor

    @property
    def tracks_unused(self) -> bool:
        """Whether this iteration finds and all-reduces parameter usage (under static_graph its
        first backward only, find_unused_parameters or not, as torch's DDP: the walk of the
        graph cannot see into a reentrant checkpoint, the hooks can)."""
        return self._learning_fires if self.static_graph else self.find_unused

    # ------------------------------------------------------------------ storage
    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor in ringdp's registered memory (plain memory when there is no
        communication or the device has no registered memory)."""
        if self.world > 1:
            try:
                return get_communicator(self.group).empty((numel,), dtype, device)
            except ValueError as e:
                if not self._warned_alloc:
                    warnings.warn(f"RingDDP: no registered memory ({e}); buckets use ordinary memory", stacklevel=3)
                    self._warned_alloc = True
        return torch.empty(numel, dtype=dtype, device=device)

    @torch.no_grad()
    def _build(self, order: list[int]) -> None:
        assignment = assign_buckets(order, self._nbytes, self._keys, self.cap_bytes, self.first_cap_bytes,
                                    self.in_grad_bytes)
        in_grad = [self.in_grad_bytes is not None and len(m) == 1 and self._nbytes[m[0]] >= self.in_grad_bytes
                   for m in assignment]
        # one arena per (dtype, device), buckets at aligned offsets inside it; in-grad
        # buckets get storage of their own, and only when they need it
        starts: dict[int, int] = {}
        totals: dict[tuple, int] = {}
        for bi, members in enumerate(assignment):
            if in_grad[bi]:
                continue
            key = self._keys[members[0]]
            esize = stored_dtype(key[0]).itemsize
            align = max(1, ALIGN_BYTES // esize)
            starts[bi] = totals.get(key, 0)
            n = sum(stored_shape(self.params[i]).numel() for i in members)
            totals[key] = starts[bi] + (n + align - 1) // align * align
        # no zeroing: every slot is written (gradient or zeros) before each reduction
        arenas = {key: self.alloc(total, stored_dtype(key[0]), key[1]) for key, total in totals.items() if total}
        buckets = []
        me = weakref.ref(self)  # (a bucket holding the Reducer would keep it, and its arenas, until a GC pass)
        for bi, members in enumerate(assignment):
            key = self._keys[members[0]]
            dtype, device = stored_dtype(key[0]), key[1]
            shapes = [stored_shape(self.params[i]) for i in members]
            strides = [stored_strides(self.params[i]) for i in members]  # (the parameters' layouts)
            n = sum(s.numel() for s in shapes)
            if in_grad[bi]:
                b = Bucket(bi, members, shapes, dtype, device, in_grad=True, strides=strides,
                           alloc=lambda n=n, dtype=dtype, device=device: me().alloc(n, dtype, device))
            else:
                b = Bucket(bi, members, shapes, dtype, device, storage=arenas[key][starts[bi]:starts[bi] + n],
                           strides=strides)
            buckets.append(b)
        loc: list = [None] * len(self.params)
        for b in buckets:
            for slot, i in enumerate(b.params):
                loc[i] = (b, slot)
        if self.gradient_as_bucket_view:  # move this step's .grad into the new buckets
            for ob in self.buckets:
                for oslot, i in enumerate(ob.params):
                    p = self.params[i]
                    if p.grad is not None and _is_view_of(p.grad, ob.views[oslot]):
                        nb, nslot = loc[i]
                        nb.views[nslot].copy_(stored(p.grad))
                        p.grad = as_grad_of(nb.views[nslot], p)
        self.buckets = buckets
        self._loc = loc
        self._arenas = list(arenas.values())

    def rebuild(self, src: int) -> None:
        """Adopt rank `src`'s gradient-ready order of the first synchronised backward, so
        that every rank has the same buckets, filled in the order gradients arrive."""
        self.rebuilt = True
        # src's order, parameter index + 1 per position (0: no more), on ringdp's communicator
        # (its failure guarantees, ordered with the reductions) as an all-reduce that the
        # others join with zeros: the collective the buckets and the unused map use already.
        mine = self.ready_order[:len(self.params)] if self.rank == src else []
        got = torch.zeros(len(self.params), dtype=torch.int32)
        got[:len(mine)] = torch.tensor(mine, dtype=torch.int32) + 1
        if self.world > 1:
            t = got.to(self.device)
            self._all_reduce(t, dist.ReduceOp.SUM, self._tag("bucket order")).wait()
            got = t.cpu()
        seen: set[int] = set(self._sparse.indices)  # in no bucket
        order = [i for i in (int(x) - 1 for x in got.tolist() if x > 0)
                 if 0 <= i < len(self.params) and not (i in seen or seen.add(i))]
        order += [i for i in reversed(range(len(self.params))) if i not in seen]
        new = assign_buckets(order, self._nbytes, self._keys, self.cap_bytes, self.first_cap_bytes,
                             self.in_grad_bytes)
        if new != [b.params for b in self.buckets]:
            self._build(order)

    # ------------------------------------------------------------------ one backward
    def prepare_for_forward(self) -> None:
        """Before forward. A backward that died before its end (an exception) is forgiven
        when it had started no reduction. One that had cannot be: the other ranks wait for
        its remaining reductions, and this rank's next ones would be paired with theirs of
        the older step. Then this and every later forward raise, as torch DDP's "Expected to
        have finished reduction in the prior iteration". So do they after a backward whose end
        was handed over from a nested backward and never taken up (_finalize_callback): its
        gradients may have been used unaveraged, and nothing says whether it died."""
        self._queued = False  # (one queued on a backward that died is never called)
        self._unfired = set()
        if self._in_backward and self._handed_to_hooks:  # (_finalize_callback: nothing queued it after)
            names = self._names(self._missing())
            self.abandon()
            self._broken = (
                f"RingDDP on rank {self.rank}: expected to have finished reduction in the prior iteration before "
                f"starting a new one. In the backward of step {self.step}, a nested backward (one started from a "
                f"hook) ended inside it, and RingDDP handed the end of backward over to the backward around it, "
                f"which never reached the point that takes it up (the end of the hook's node, or a later gradient "
                f"hook), so its gradients were not averaged. Either that backward stopped with an exception, or "
                f"no gradient came after the nested one, and these parameter(s) received none: {names or 'none'}. "
                f"As under torch's DistributedDataParallel, this rank cannot go on: restart from a checkpoint. "
                f"(A nested backward started from a module's backward hook can hand over only to a later gradient "
                f"hook: start it from a tensor hook, tensor.register_hook, instead.)")
        if self._in_backward:
            launched, usage = self._next_launch, self._usage_future is not None
            self.abandon()  # the started reductions complete: the peers made them too
            if launched or usage:
                self._broken = (
                    f"RingDDP on rank {self.rank}: expected to have finished reduction in the prior iteration "
                    f"before starting a new one. The backward of step {self.step} stopped before its end (an "
                    f"exception on this rank) after starting {launched} of {len(self.buckets)} bucket "
                    f"reductions{' and the unused-parameter map' if usage else ''}; "
                    f"the other ranks wait for the rest, and this rank's next reductions would be paired with "
                    f"theirs of the older step. A rank cannot skip a step alone: decide on every rank together "
                    f"(e.g. all_reduce a 'skip this batch' flag before backward and skip on all ranks), or stop "
                    f"and restart from a checkpoint (torchrun --max-restarts).")
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def prepare_for_backward(self, outputs, sync: bool) -> None:
        """After forward: whether the coming backward synchronises gradients, and (when
        unused parameters are tracked) which parameters `outputs` do not depend on. A forward
        without autograd (an evaluation or logging pass between a forward and its backward)
        changes nothing, as torch DDP prepares no backward for it: it used to turn the next
        backward's synchronisation off, silently."""
        if not torch.is_grad_enabled():
            return
        if self.params and grad_accumulator(self.params[0]) not in (None, self._accumulators[0]):
            self.refresh_hooks(range(len(self.params)))  # (the whole model converted, say; a part: finalize)
        armed = self._sync  # a synchronising forward since the last backward: it still syncs (as torch)
        self._sync = armed or sync
        if self._sync:
            self._watch_outputs(outputs, keep=armed)
        if self.tracks_unused:
            # static_graph's first backward learns what is used from the hooks themselves (those
            # that never fire: finalize): the walk cannot see inside a reentrant checkpoint
            now = [] if self.static_graph else self._find_unused(outputs)  # (else find_unused: tracks_unused)
            if armed:  # another forward before the backward: a parameter either used is used
                now = set(now)
                self._unused_now = [i for i in self._unused_now if i in now]
                self._unused = [i for i in self._unused if i in now]
            elif sync:  # a parameter used under no_sync since the last sync counts as used (as torch)
                self._unused_now = now
                self._unused = [i for i in now if i not in self._used_since_sync]
                self._carried, self._used_since_sync = self._used_since_sync, set()
            elif not self.static_graph:  # (static_graph's first backward: its hooks say it, _grad_hook)
                unused = set(now)
                self._used_since_sync.update(i for i in range(len(self.params)) if i not in unused)

    def _find_unused(self, outputs) -> list[int]:
        """Indices of parameters not reachable from the outputs' autograd graph."""
        used: set[int] = set()
        seen = set()
        stack = []
        for t in output_tensors(outputs):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if t.grad_fn is None:
                    used.add(id(t))
                else:
                    stack.append(t.grad_fn)
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None:
                used.add(id(var))
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    stack.append(nxt)
        return [i for i, p in enumerate(self.params) if id(p) not in used]

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._next_launch = 0
        for b in self.buckets:
            b.reset()
        self._ready = [False] * len(self.params)
        self._fires = [0] * len(self.params)
        self._fire_order = []
        if not self.rebuilt:  # the order of the backward that rebuilds (not of one that failed)
            self.ready_order = []
        self._usage_future = None
        self._handed_to_hooks = False
        self._hook_task = graph_task_id()
        if not self._finalize_pending():  # (queued by _watch_outputs' hook: the usual case)
            self._queue_finalize()
        self.observer.on_backward(self.step, now_us())
        if self.tracks_unused:
            self._mark_unreached(self._unused_now)
        elif self._static_unused_local:
            self._mark_unreached(self._static_unused_local)

    def _queue_finalize(self) -> None:
        """finalize() at the end of the backward running now (an autograd callback). Queued
        when the backward reaches the autograd node of an output of a synchronising forward
        (_watch_outputs): that graph task computes every gradient that comes from the outputs,
        and ends after them. Otherwise (a loss not made from the outputs) by the first gradient
        hook, on its graph task, and again by the first hook of another graph task where none
        is queued (_grad_hook). A callback that runs at the end of a backward inside another
        one (a reentrant checkpoint's, a nested one started from a hook) with gradients still
        to come hands over to the outer one (_finalize_callback)."""
        self._queued, self._queued_task = True, graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(_finalize_callback(weakref.ref(self)))

    def _finalize_pending(self) -> bool:
        """Whether a finalize callback is queued on the backward running now: on its graph task,
        or on an outer one (this runs inside a reentrant checkpoint's backward). One queued on a
        backward that failed (before any gradient hook) is not: a retry queues its own."""
        return self._queued and (self._queued_task == graph_task_id() or enclosing_function_node() is not None)

    def _watch_outputs(self, outputs, keep: bool) -> None:
        """A pre-hook on the autograd node of each output of a synchronising forward: the
        backward reaches those first, on its outermost graph task, where it queues finalize
        (one that computes no parameter's gradient, torch.autograd.grad of a penalty say, then
        finalizes nothing). `keep`: those of an earlier forward of this step stay."""
        if not keep:
            self._unwatch_outputs()
        else:  # (forwards without a backward, a loop of evaluations with autograd on: keep those alive)
            self._output_hooks = [h for h in self._output_hooks if h.hooks_dict_ref() is not None]
        hook = _output_hook(weakref.ref(self))
        nodes = {id(t.grad_fn): t.grad_fn for t in output_tensors(outputs) if t.grad_fn is not None}
        self._output_hooks += [node.register_prehook(hook) for node in nodes.values()]

    def _unwatch_outputs(self) -> None:
        """Drop the output pre-hooks and the hand-over post hooks (at the end of a backward: a
        node may outlive it, a parameter's gradient accumulator does)."""
        for h in self._output_hooks + self._handovers:
            h.remove()
        self._output_hooks, self._handovers = [], []

    @property
    def _learning_fires(self) -> bool:
        """static_graph's first synchronised backward: it counts each parameter's hook calls."""
        return self.static_graph and self._static_unused is None

    def fired(self, i: int) -> bool:
        """Parameter i's hook was called in a synchronised backward: whether its gradient is
        final. Under static_graph it may come in several parts (a parameter used in several
        reentrant checkpoints, use_reentrant=True: each one's backward accumulates its part),
        as torch's DDP allows: the first backward counts the parts and reduces every bucket at
        its end (torch's delayed all-reduce); later ones take the last part as final."""
        self._fires[i] += 1
        if self._expected_fires is not None:
            if self._fires[i] > self._expected_fires[i]:
                raise RuntimeError(self._graph_changed_message([i]))
            return self._fires[i] >= self._expected_fires[i]
        if self._learning_fires:
            self._fire_order.append(i)
            return False
        return True

    def all_ready(self) -> bool:
        """Whether every bucket of this backward is complete and every sparse gradient came."""
        return all(b.pending == 0 for b in self.buckets) and all(self._ready[i] for i in self._sparse.indices)

    def _unused_at_the_end(self) -> None:
        """End of a backward that tracks unused parameters: those whose hook never fired (an
        output the loss ignored: reachable, no gradient; on static_graph's first backward,
        every unused one) are unused here, as in torch DDP; then the usage map is all-reduced,
        after the buckets on every rank (shadow_backward too), as torch does."""
        missing = [i for i in range(len(self.params)) if not self._ready[i] and i not in self._sparse]
        self._mark_unreached(missing)
        self._unused_now = sorted(set(self._unused_now) | set(missing))
        unused = set(self._unused) | {i for i in missing if i not in self._carried}
        n = len(self.params)
        self._usage_map().fill_(1)
        if unused:
            self._usage[torch.tensor(sorted(unused), dtype=torch.long, device=self._usage.device)] = 0
        if self.static_graph:  # (its first backward: each gradient's parts too, and whether it had any)
            fires = torch.tensor(self._fires, dtype=torch.int32)
            self._usage[n:].copy_(torch.cat([fires, (fires > 0).int()]))
        self._launch_ready()
        if self.world > 1:
            self._usage_future = self._all_reduce(self._usage, dist.ReduceOp.SUM, self._tag("unused map"))

    def _usage_map(self) -> torch.Tensor:
        """This rank's parameter usage (1 used, 0 not), all-reduced at the end of backward; under
        static_graph followed by each parameter's gradient parts and a 1 where it had any (a
        join shadow sends zeros), so that a rank joined in the first backward learns the parts
        of the others (_read_usage)."""
        if self._usage is None:
            n = len(self.params)
            self._usage = self.alloc(n * (3 if self.static_graph else 1), torch.int32, self.device)
        return self._usage

    def _read_usage(self) -> tuple[set[int], list[int] | None]:
        """The all-reduced usage map: the globally unused parameters, and under static_graph
        each parameter's gradient parts on the ranks that had any (the graph is the same there)."""
        n = len(self.params)
        vals = self._usage.tolist()
        unused = {i for i, v in enumerate(vals[:n]) if v == 0}
        if not self.static_graph:
            return unused, None
        return unused, [round(total / had) if had else 0 for total, had in zip(vals[n:2 * n], vals[2 * n:])]

    def _mark_unreached(self, indices: list[int]) -> None:
        """Parameters whose hooks will not fire in this backward are ready at once, with the
        gradient they hold (accumulated under no_sync, say) or zeros, as in torch DDP."""
        for i in indices:
            p = self.params[i]
            self.mark_ready(i, p if p.grad is not None else None)

    @torch.no_grad()
    def mark_ready(self, i: int, param: nn.Parameter | None) -> None:
        """Parameter i's gradient is final for this backward (param None: unused)."""
        if self._ready[i]:
            raise RuntimeError(
                f"RingDDP: parameter {self.names[i]!r} received its gradient twice in one backward "
                f"pass (a parameter used in two reentrant checkpoints, use_reentrant=True, or inside one with "
                f"find_unused_parameters=True, whose walk of the graph cannot see into it: static_graph=True "
                f"allows both, as torch's DDP, or use use_reentrant=False; a parameter shared between several RingDDP "
                f"models; or a backward run again after one died on this rank without a new forward)")
        self._ready[i] = True
        if i in self._sparse:  # in no bucket: reduced at the end of backward
            self._sparse.check(i, None if param is None else param.grad)
            return
        if not self.rebuilt:
            self.ready_order.append(i)
        b, slot = self._loc[i]
        grad = None if param is None else param.grad
        dtype, device = self._keys[i]
        if grad is not None and grad.layout != torch.strided:
            raise RuntimeError(
                f"RingDDP on rank {self.rank}: parameter {self.names[i]!r} received a gradient of layout "
                f"{grad.layout}, but it is reduced in a dense bucket. Only the weights of nn.Embedding / "
                f"nn.EmbeddingBag modules built with sparse=True are expected to have sparse gradients (as in "
                f"torch's DistributedDataParallel): do the lookup through such a module, or make it dense")
        if grad is not None and (grad.dtype != dtype or grad.device != device):
            raise RuntimeError(self._changed_message([i], f"received a gradient of {grad.dtype} on {grad.device}"))
        if grad is not None and grad.is_conj():  # (autograd may keep a complex gradient as a lazy conjugate)
            param.grad = grad = grad.resolve_conj()
        if grad is not None:
            grad = stored(grad)  # (a complex gradient as its real view, the bucket's dtype)
        scale = self._scale
        # (a gradient's layout, dtype and device are the bucket's here: checked above)
        if b.in_grad and grad is not None and self._hook is None and grad.is_contiguous():
            if scale != 1.0:
                grad.mul_(scale)
            b.grad = grad  # reduced in .grad: nothing to copy in or back
        else:
            view = b.views[slot]
            if grad is None:
                view.zero_()
            elif self.gradient_as_bucket_view and _same_view(grad, view):
                if scale != 1.0:
                    view.mul_(scale)
            else:
                if scale != 1.0:
                    torch.mul(grad, scale, out=view)
                else:
                    view.copy_(grad)
                if self.gradient_as_bucket_view:
                    param.grad = as_grad_of(view, param)
        b.pending -= 1
        if b.pending == 0:
            self.observer.on_ready(self.step, b, now_us())
            if self.overlap:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Start every complete bucket whose predecessors all started (index order)."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            b = self.buckets[self._next_launch]
            self._next_launch += 1
            self._launch(b)

    def _tag(self, what: str) -> str:
        """The fingerprint of this step's reduction `what` (module doc)."""
        return f"RingDDP step {self.step} {what}"

    def _launch(self, b: Bucket) -> None:
        step = self.step
        tag = self._tag(f"bucket {b.index}")
        self.observer.on_launch(step, b, now_us())
        if self._hook is not None:
            b.target = b.buffer
            with collective_tag(tag):
                bucket = GradBucket(b, b.index == len(self.buckets) - 1, self.params, self.group, self.alloc)
                result = self._hook(self._hook_state, bucket)
            b.future = as_future(result, b.target)
        else:
            b.target = b.grad if b.grad is not None else b.buffer
            op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
            b.future = self._all_reduce(b.target, op, tag) if self.world > 1 else as_future(None, b.target)
        observer = self.observer
        if type(observer).on_done is not Observer.on_done:  # (a no-op's callback only opens a window)
            # A torch future's done-callback swallows what it raises (torch logs it): a SIGINT
            # landing in one run on the main thread (a future already done runs it there) was
            # a lost KeyboardInterrupt. So: at once when done, else on the completing thread.
            if b.future.done():
                observer.on_done(step, b, now_us())
            else:
                b.future.add_done_callback(lambda _f: observer.on_done(step, b, now_us()))

    def _all_reduce(self, t: torch.Tensor, op, tag: str) -> torch.futures.Future:
        return get_communicator(self.group).all_reduce(t, op=op, async_op=True, tag=tag).get_future()

    def _wait(self, b: Bucket) -> None:
        fut, b.future = b.future, None
        res = future_tensor(fut, b.target)
        if res is not b.target:
            if res.numel() != b.target.numel():
                raise RuntimeError(
                    f"RingDDP on rank {self.rank}: the comm hook's future for bucket {b.index} (step {self.step}) "
                    f"holds {res.numel()} elements; the bucket has {b.target.numel()}: a hook must return the "
                    f"reduced bucket, every element of it")
            b.target.copy_(res.reshape(b.target.shape))

    def finalize(self) -> None:
        """End of backward (autograd callback): wait for the buckets in order and write each
        one's averaged gradients back as soon as it is done (while the next ones are still
        being reduced); rebuild the buckets after the first synchronised backward."""
        t_bwd_end = now_us()
        try:
            learning = self._learning_fires
            if learning:  # static_graph's first backward: every gradient is final now
                for i in list(dict.fromkeys(reversed(self._fire_order)))[::-1]:  # (in order of their last parts)
                    self.mark_ready(i, self.params[i])
            if not self.all_ready():  # (a hook on a replaced accumulator is silent: not unused, not missing)
                unready = [i for i in range(len(self.params)) if not self._ready[i]]
                for i in self.refresh_hooks(unready):  # (its gradient of this backward is in .grad)
                    self.mark_ready(i, self.params[i])
                if self._expected_fires is not None:
                    short = [i for i in unready if 0 < self._fires[i] < self._expected_fires[i]]
                    if short:
                        raise RuntimeError(self._graph_changed_message(short))
            if self.tracks_unused:
                self._unused_at_the_end()
            self._launch_ready()  # without overlap nothing was launched yet
            if self._next_launch < len(self.buckets):
                missing = self._missing()
                self.abandon()
                raise RuntimeError(self._unused_message(missing))
            self._sparse.launch(self.divisor)  # beside the buckets' reductions, finished after them
            wait_us = wb_us = 0.0
            globally_unused: set[int] = set()
            if self.tracks_unused:
                if self._usage_future is not None:  # submitted first, so done first
                    t0 = now_us()
                    self._usage_future.wait()
                    wait_us += now_us() - t0
                    self._usage_future = None
                globally_unused, _ = self._read_usage()
            elif self._static_unused:
                globally_unused = self._static_unused
            for b in self.buckets:
                t0 = now_us()
                self._wait(b)
                t1 = now_us()
                self._write_back(b, globally_unused)
                t2 = now_us()
                wait_us += t1 - t0
                wb_us += t2 - t1
                self.observer.on_wait(self.step, b, t0, t1, t2)
            t0 = now_us()
            self._sparse.finish()
            sparse_us = now_us() - t0
            if learning:
                self._static_unused = globally_unused
                self._static_unused_local = list(self._unused_now)
                self._expected_fires = list(self._fires)  # (this rank's own: a parameter some ranks do not use)
            self._unfired = {i for i, n in enumerate(self._fires) if n == 0 and self.params[i].requires_grad}
            self.last_exposed_comm_ms = (wait_us + sparse_us) / 1e3
            self.observer.on_finalize(self.step, self.buckets, t_bwd_end, now_us(), wait_us, wb_us)
            if not self.rebuilt:
                self.rebuild(self.auth_rank)
        except BaseException:
            # (a bucket that failed, say its hook's result: the later ones are still being
            # reduced, and the next backward would reuse their memory meanwhile)
            self.abandon()
            raise
        finally:
            self._in_backward = self._sync = False  # (the next backward syncs after a synchronising forward)
            self._unwatch_outputs()
            self.step += 1

    def abandon(self) -> None:
        """The backward died before its end: let the started reductions finish."""
        for b in self.buckets[:self._next_launch]:
            if b.future is not None:
                with contextlib.suppress(Exception):
                    self._wait(b)
        if self._usage_future is not None:
            with contextlib.suppress(Exception):
                self._usage_future.wait()
        self._usage_future = None
        self._sparse.abandon()
        self._in_backward = False

    @torch.no_grad()
    def _write_back(self, b: Bucket, globally_unused: set[int]) -> None:
        if b.grad is not None:  # the reduction ran on .grad itself
            b.grad = None
            return
        for slot, i in enumerate(b.params):
            if i in globally_unused:
                continue
            p = self.params[i]
            view = b.views[slot]
            if self.gradient_as_bucket_view:
                if p.grad is None or not _is_view_of(p.grad, view):
                    p.grad = as_grad_of(view, p)
            elif p.grad is None:
                p.grad = as_grad_of(view.clone(), p)
            else:
                p.grad.copy_(as_grad_of(view, p))

    def _hook_accumulator(self, i: int, acc) -> None:
        if self._hook_handles[i] is not None:
            self._hook_handles[i].remove()
        self._accumulators[i] = acc
        self._hook_handles[i] = acc.register_hook(_grad_hook(weakref.ref(self), i, self.params[i]))

    def refresh_hooks(self, indices) -> list[int]:
        """Parameters (of `indices`) whose gradient accumulator torch replaced since they were
        hooked: it does so when a parameter's data changes dtype or device (model.double(),
        .to(...); back again too) or is set anew (p.set_(), a parametrization). The hook on the
        old accumulator never fires again: hook the new one, and return those. A parameter whose
        dtype or device is not its bucket's any more raises, now and at every later forward."""
        changed = [i for i in indices if (self.params[i].dtype, self.params[i].device) != self._keys[i]]
        if changed:
            p = self.params[changed[0]]
            self._broken = self._changed_message(changed, f"is {p.dtype} on {p.device}")
            raise RuntimeError(self._broken)
        moved = []
        for i in indices:
            acc = grad_accumulator(self.params[i])
            if acc is not None and acc is not self._accumulators[i]:
                self._hook_accumulator(i, acc)
                moved.append(i)
        return moved

    def _graph_changed_message(self, changed: list[int]) -> str:
        i = changed[0]
        more = f" (and {len(changed) - 1} more parameter(s))" if len(changed) > 1 else ""
        return (f"RingDDP on rank {self.rank}: static_graph=True, but parameter {self.names[i]!r}{more} received "
                f"{self._fires[i]} gradient part(s) in this backward, and {self._expected_fires[i]} in the first one "
                f"(a parameter's gradient comes in parts when it is used in several reentrant checkpoints): the "
                f"training graph changed, which static_graph does not allow (as torch's DDP). Drop static_graph")

    def _changed_message(self, changed: list[int], now: str) -> str:
        i = changed[0]
        dtype, device = self._keys[i]
        more = f" (and {len(changed) - 1} more parameter(s))" if len(changed) > 1 else ""
        return (f"RingDDP on rank {self.rank}: parameter {self.names[i]!r}{more} {now}, but it was {dtype} on "
                f"{device} when RingDDP wrapped it (its bucket and gradient hook were made for that): the model's "
                f"parameters changed dtype or device after it was wrapped (model.double(), .half(), .to(...)). "
                f"Convert the model first, then wrap it in RingDDP (as torch's DistributedDataParallel expects)")

    def _late_gradient_message(self, i: int) -> str:
        return (f"RingDDP on rank {self.rank}: parameter {self.names[i]!r} received a gradient in a backward after "
                f"the synchronised backward of the same forward had ended without it (its gradient was averaged "
                f"as unused there, so this one would stay local to this rank). RingDDP averages the gradients "
                f"of one backward per forward: when the loss is in parts (aux_loss.backward(); loss.backward()), "
                f"sum them and call backward once, or run a forward before each backward")

    def _missing(self) -> list[int]:
        """The parameters in buckets whose gradient has not come in this backward."""
        return [i for i in range(len(self.params)) if not self._ready[i] and i not in self._sparse]

    def _names(self, indices: list[int]) -> str:
        """The first 20 of these parameters' names, and how many more."""
        more = f" and {len(indices) - 20} more" if len(indices) > 20 else ""
        return ", ".join(self.names[i] for i in indices[:20]) + more

    def _unused_message(self, missing: list[int]) -> str:
        if self.find_unused or self.static_graph:
            why = ("These parameters were reachable from the forward outputs but received no gradient, "
                   "or were used without going through RingDDP's forward.")
        else:
            why = ("This usually means that your module has parameters that were not used in producing "
                   "the loss. Pass find_unused_parameters=True to RingDDP (as to torch's "
                   "DistributedDataParallel) to mark such parameters ready (their gradient then counts as "
                   "zero in the average), or make sure every parameter takes part in the loss. If the same "
                   "parameters are always unused, static_graph=True also works.")
        return (f"RingDDP on rank {self.rank}: backward finished but {len(missing)} parameter(s) received no "
                f"gradient, so their buckets (and every bucket after them) could not be reduced: "
                f"{self._names(missing)}. "
                f"{why} (RingDDP averages the gradients of one backward per forward: a loss in parts, "
                f"aux_loss.backward(); loss.backward(), is summed and backpropagated once.)")

    # ------------------------------------------------------------------ join
    @torch.no_grad()
    def shadow_backward(self) -> None:
        """On a rank without data (join): the collectives of one synchronised backward, with
        zero gradients, so that the ranks that still train can finish theirs. Counts as a
        step (the reductions' tags match those of the ranks that train)."""
        try:
            tracks = self.tracks_unused
            for b in self.buckets:
                b.reset()
                b.buffer.zero_()
                self._launch(b)
            if tracks:  # (after the buckets, as the ranks that train: _unused_at_the_end)
                self._usage_map().zero_()
                if self.world > 1:
                    self._all_reduce(self._usage, dist.ReduceOp.SUM, self._tag("unused map")).wait()
            self._sparse.launch(self.divisor, shadow=True)
            for b in self.buckets:
                self._wait(b)
            self._sparse.finish()
            if tracks and self.static_graph and self._static_unused is None:
                # (the graph is the same on every rank: its unused parameters and parts are the others')
                self._static_unused, self._expected_fires = self._read_usage()
                self._static_unused_local = sorted(self._static_unused)
            if not self.rebuilt:
                self.rebuild(self.auth_rank)
        finally:
            self.step += 1

    # ------------------------------------------------------------------ teardown
    def remove_hooks(self) -> None:
        for h in self._hook_handles:
            if h is not None:
                h.remove()
        self._hook_handles = []
        self._unwatch_outputs()
        self._accumulators = []

    def __del__(self):
        with contextlib.suppress(Exception):
            self.remove_hooks()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether a parameter's .grad is its bucket slot `view` (as stored: a complex one through
    its real view; a lazily conjugated one never is)."""
    return not grad.is_conj() and _same_view(stored(grad), view)


def _grad_hook(selfref, i: int, param: torch.Tensor):
    def hook(grad_inputs, grad_outputs):  # (a post hook of param's AccumulateGrad node)
        r = selfref()
        if r is None:
            return
        if not r._sync:
            if i in r._unfired:  # (a later backward of the same forward: it was averaged as unused)
                raise RuntimeError(r._late_gradient_message(i))
            if r.tracks_unused:  # (used under no_sync: the next synchronised backward counts it used)
                r._used_since_sync.add(i)
            return
        if not r._in_backward:
            r._begin_backward()
        elif (task := graph_task_id()) != r._hook_task:  # the first hook of another graph task (inner or outer)
            r._hook_task = task
            if r._handed_to_hooks or not r._finalize_pending():  # (a nested backward ended, or died)
                r._handed_to_hooks = False
                r._queue_finalize()
        if r.fired(i):
            r.mark_ready(i, param)

    return hook


def _output_hook(selfref):
    def prehook(grad_outputs):  # (a pre-hook of the autograd node of an output: _watch_outputs)
        r = selfref()
        if r is not None and r._sync and not r._finalize_pending():
            r._queue_finalize()

    return prehook


def _finalize_callback(selfref):
    def finalize():
        r = selfref()
        if r is None:
            return
        r._queued = False
        if not r._in_backward:
            return
        node = None if r.all_ready() else outer_node()
        if node is None:  # (every gradient came, or this is the outermost backward)
            r.finalize()
            return
        # this backward ran inside an outer one, which has more gradients to come: a
        # reentrant checkpoint's (use_reentrant=True), or one started from a hook (through
        # the forward's outputs too: aux_output.sum().backward() in a hook). The end
        # goes over to the outer one: finalize is queued there when that node is done (its
        # post hook runs on the outer graph task), or by the next gradient hook, whichever
        # comes first: a post hook added while the node runs its own post hooks (a module's
        # backward hooks are those) is not called this time
        r._handovers.append(node.register_hook(_hand_over(selfref)))
        r._handed_to_hooks = True

    return finalize


def _hand_over(selfref):
    def post(grad_inputs, grad_outputs):
        r = selfref()
        if r is not None and r._in_backward and r._handed_to_hooks:
            r._handed_to_hooks = False
            r._queue_finalize()

    return post
