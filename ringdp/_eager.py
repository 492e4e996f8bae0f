"""ringdp under torch.compile: its entry points always run eagerly, never in a graph.

Dynamo looks at every Python frame that starts while a compiled region runs, and traces the
functions that traced code calls. Both reach ringdp: a user's ringdp.all_reduce inside a
compiled function, and the methods of ringdp's process group and Work that c10d's C++ calls
there (DDP's reducer rebuilding its buckets in a compiled forward, the functional
collectives, Work.wait). Traced, they fail: torch 2.13 treats a ProcessGroup as an opaque
object and stops at the first attribute read; and a collective that waits on its peers has
no place in a graph anyway.

eager(fn) marks `fn` twice, as torch.compiler.disable would, without importing
torch._dynamo (1.2 s, and imported after init_process_group it keeps the group alive past
destroy_process_group: README "Failures"):
  * `fn._torchdynamo_disable`: a call to it in traced code is a graph break, and the call
    runs as it is;
  * its code's frame strategy (torch._C._dynamo, skip this frame and every frame it calls):
    a frame of it that starts under the hook (from C++, or after that graph break) runs
    untouched, and so does everything it calls.
A torch without the frame strategy gets torch.compiler.disable itself."""
from __future__ import annotations

import torch

try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
except ImportError:  # (a torch without per-code frame strategies)
    set_code_exec_strategy = None


def eager(fn):
    """`fn`, run eagerly under torch.compile (module doc)."""
    if set_code_exec_strategy is None:
        return torch.compiler.disable(fn)
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    fn._torchdynamo_disable = True
    return fn


def eager_methods(cls, base=object) -> None:
    """The methods of `cls` that others call run eagerly under torch.compile: the public
    ones, and the private names `base` has (c10d's _allgather_base, _get_backend, ...).
    Private helpers are left alone: they run inside those calls."""
    for name, member in list(vars(cls).items()):
        if name.startswith("__") or isinstance(member, (type, staticmethod, classmethod)) or not callable(member):
            continue
        if not name.startswith("_") or hasattr(base, name):
            setattr(cls, name, eager(member))
