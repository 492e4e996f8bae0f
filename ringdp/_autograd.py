"""Where RingDDP meets torch's autograd engine: a parameter's gradient accumulator (the node
RingDDP hooks, as torch's reducer does), the custom Function whose backward this thread runs
inside (a reentrant checkpoint's), the outer node a backward ending now ran inside, and the
graph task running now."""
from __future__ import annotations

import sys

import torch


def grad_accumulator(p: torch.Tensor):
    """p's AccumulateGrad node (the autograd node that writes p.grad); None while p requires
    no gradient (frozen: its hook stays on the node it had)."""
    if not p.requires_grad:
        return None
    with torch.inference_mode(False), torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


_BACKWARD_APPLY = torch.autograd.function.BackwardCFunction.apply.__code__


def enclosing_function_node():
    """The autograd node of the custom Function whose backward this thread runs inside (a
    reentrant checkpoint's: a backward that goes on after this one), or None."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _BACKWARD_APPLY:
            return f.f_locals.get("self")
        f = f.f_back
    return None


def outer_node():
    """In an autograd callback (the end of a backward): the node that an outer backward was
    evaluating on this thread when this one ran inside it (a reentrant checkpoint's Function
    node, or the node whose hook started a nested backward), whose gradients are still to
    come; None at the end of an outermost backward. (The engine's node being evaluated on
    this thread; where torch does not say it, the enclosing Function's node.)"""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else enclosing_function_node()


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def graph_task_id() -> int:
    """The autograd engine's id of the graph task running on this thread (-1: none; called in
    every gradient hook, so torch's function is looked up once, here)."""
    return _GRAPH_TASK_ID()
