"""The warm-up before make_graphed_callables captures, run by te-core in Transformer Engine's
order.

Warm-up steps run real forward and backward passes before capture, so that lazy initialization
(library handles, autotuning, allocator growth) happens outside the graphs. Transformer Engine
runs them on a side stream, in the order the graphs are then captured (by default every forward
in the given order and then every backward in reverse order), with the caller's
pre_warmup_hook before the first and post_warmup_hook after the last (what a pipeline schedule
uses to set up and tear down state around them), and the capture-time hooks around each pass.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ._graph_order import BACKWARD, FORWARD, HOOKS_OF, default_schedule


def check_iterations(num_warmup_iters) -> int:
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int):
        raise TypeError(f"make_graphed_callables: num_warmup_iters must be an int, got {num_warmup_iters!r}")
    if num_warmup_iters < 0:
        raise ValueError(f"make_graphed_callables: num_warmup_iters must be >= 0, got {num_warmup_iters}")
    return num_warmup_iters


def check_hook(name: str, hook) -> Optional[Callable[[], None]]:
    if hook is not None and not callable(hook):
        raise TypeError(f"make_graphed_callables: {name} must be a callable taking no arguments (or None), "
                        f"got {type(hook).__name__}")
    return hook


def _backward(callable_: nn.Module, inputs: tuple, outputs, allow_unused: bool) -> None:
    """One backward pass from `outputs` to the inputs and parameters that require grad, with
    uninitialized output gradients as torch's warm-up uses (values the restored scaling state
    forgets). A parameter may get no gradient (one whose weight gradient a delay_wgrad_compute
    module defers); an input that gets none is an error unless `allow_unused`."""
    needing = [o for o in tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not needing:
        return
    given = [t for t in inputs if t.requires_grad]
    surface = given + [p for p in callable_.parameters() if p.requires_grad]
    grads = torch.autograd.grad(needing, surface, grad_outputs=[torch.empty_like(o) for o in needing],
                                only_inputs=True, allow_unused=True)
    check_unused(grads[:len(given)], allow_unused)


def check_unused(input_grads, allow_unused: bool) -> None:
    if not allow_unused and any(g is None for g in input_grads):
        raise RuntimeError("make_graphed_callables: a sample input requires grad but got no gradient from the "
                           "backward pass (the module does not use it); pass allow_unused_input=True, or give it "
                           "requires_grad=False")


Hook = Optional[Callable[[], None]]


def warm_up(device: torch.device, callables: Sequence[nn.Module], inputs: Sequence[tuple], iterations: int,
            allow_unused: bool, pre_hook: Hook, post_hook: Hook, *, steps=None,
            hook: Optional[Callable[[str, int], None]] = None,
            wgrad: Optional[Callable[[int], None]] = None) -> None:
    """`iterations` warm-up steps of `callables` (each called with its `inputs`) on a side stream
    of `device`, between the two hooks, in the capture's order: `steps`, (pass, index) pairs
    (default: every forward in order, then every backward in reverse: Transformer Engine's).
    `hook(point, index)` runs the capture-time hooks around each pass; `wgrad(index)` runs a
    weight-gradient pass (the deferred weight gradients of delay_wgrad_compute modules)."""
    steps = default_schedule(len(callables)).steps if steps is None else steps
    api = getattr(torch, device.type)
    api.synchronize()
    with api.stream(api.Stream()):
        if pre_hook is not None:
            pre_hook()
        for _ in range(iterations):
            outputs = {}
            for kind, i in steps:
                points = HOOKS_OF.get(kind) if hook is not None else None
                if points:
                    hook(points[0], i)
                if kind == FORWARD:
                    outputs[i] = callables[i](*inputs[i])
                elif kind == BACKWARD:
                    _backward(callables[i], inputs[i], outputs.pop(i), allow_unused)
                else:
                    wgrad(i)
                if points:
                    hook(points[1], i)
        if post_hook is not None:
            post_hook()
    api.synchronize()
