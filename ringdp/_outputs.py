"""The tensors in a module's forward outputs, found as torch's DistributedDataParallel finds
them: inside lists, tuples, dicts (subclasses too: a model's output class) and dataclasses.
torch.utils._pytree.tree_leaves treats an unregistered dataclass or dict subclass as one
leaf, so RingDDP would have judged every parameter unused for such a model."""
from __future__ import annotations

import dataclasses

import torch


def output_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in `obj`, depth first, in order."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(reversed([getattr(x, f.name) for f in dataclasses.fields(x)]))
    return found
