"""te-core's capture of forward and backward graphs: what torch's make_graphed_callables does,
in an order the caller gives (te_core._graph_order), with Transformer Engine's capture options.

Each callable's forward is captured on its sample inputs, its backward from fresh output
gradient buffers to the inputs and parameters that require grad; the callable's forward then
becomes a replay inside one autograd node, as with torch's function: it copies the call's
inputs into the captured ones, replays the forward graph, and in the backward copies the
output gradients in and replays the backward graph. Outputs that did not require grad at
capture are marked non-differentiable, so a loss reaching only them is an error rather than a
gradient silently dropped. All graphs share one memory pool, so they must be replayed in the
order they were captured.

Nothing here names a device: the graph type, the capture context and the pool handle come from
the device's torch module (`torch.<device type>`: `<TYPE>Graph`, `graph`, `graph_pool_handle`).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from ._graph_order import BACKWARD, FORWARD, HOOKS_OF, Step, default_schedule
from ._graph_warmup import check_unused


class DeviceGraphs(NamedTuple):
    """A device's graph capture: its torch module and graph type."""

    api: object
    graph_type: type

    @classmethod
    def of(cls, device_type: str) -> Optional["DeviceGraphs"]:
        """The device's graph capture, or None where its torch module has none."""
        api = getattr(torch, device_type, None)
        graph_type = getattr(api, device_type.upper() + "Graph", None)
        if graph_type is None or not all(hasattr(api, name) for name in ("graph", "graph_pool_handle", "synchronize")):
            return None
        return cls(api, graph_type)


def make_graphed(device: DeviceGraphs, callables: Sequence[torch.nn.Module], sample_args: Sequence[tuple],
                 num_warmup_iters: int = 0, allow_unused_input: bool = False, *, pool=None,
                 steps: Optional[Sequence[Step]] = None, retain_graph: bool = False,
                 hook: Optional[Callable[[str, int], None]] = None, share_grad_outputs: bool = False,
                 wgrad: Optional[Callable[[int], list]] = None):
    """Capture each callable (a module) in `steps` order (default: forwards in order, then
    backwards in reverse) and replace its forward with the replay; returns the callables.
    `hook(point, index)` runs outside the capture before and after each pass (capture-time
    hooks); `retain_graph` keeps the autograd graph of the backward capture (Transformer Engine's
    retain_graph_in_backward); `share_grad_outputs` gives backward graphs whose outputs match in
    shape, dtype and layout one set of output gradient buffers (they are only read inside the
    backward replay). A weight-gradient step captures `wgrad(index)`, which computes the deferred
    weight gradients and returns (parameter, gradient or None) pairs; the callable then gets
    `replay_wgrad()`, which replays that graph and returns the pairs (the gradients in the
    graph's buffers); every callable gets `reset_graphs()`, which frees its graphs. The new
    forward takes the keywords `stream` and `event` (_replayed). Warm-up is the caller's
    (te_core._graph_warmup)."""
    if num_warmup_iters:
        raise ValueError("te-core warms up before capture (te_core._graph_warmup); capture with num_warmup_iters=0")
    n = len(callables)
    steps = default_schedule(n).steps if steps is None else steps
    api = device.api
    pool = api.graph_pool_handle() if pool is None else pool
    surfaces = [tuple(args) + tuple(c.parameters()) for c, args in zip(callables, sample_args)]
    forward_graphs = [device.graph_type() for _ in range(n)]
    backward_graphs = [device.graph_type() for _ in range(n)]
    outputs, specs, grad_outputs, grad_inputs = [None] * n, [None] * n, [None] * n, [None] * n
    captured_backward = [False] * n
    wgrads = {}  # index -> (its graph, its (parameter, gradient) pairs)
    shared = {}
    api.synchronize()
    for kind, i in steps:
        points = HOOKS_OF.get(kind) if hook is not None else None
        if points:
            hook(points[0], i)
        if kind == FORWARD:
            with api.graph(forward_graphs[i], pool=pool):
                out = callables[i](*sample_args[i])
            outputs[i], specs[i] = pytree.tree_flatten(out)
        elif kind == BACKWARD:
            needing = [o for o in outputs[i] if isinstance(o, torch.Tensor) and o.requires_grad]
            key = tuple((o.shape, o.dtype, o.layout, o.device) for o in needing)
            if share_grad_outputs and key in shared:
                buffers = shared[key]
            else:
                buffers = shared[key] = tuple(torch.empty_like(o) for o in needing)
            grad_outputs[i] = buffers
            inputs = [t for t in surfaces[i] if t.requires_grad]
            grads = ()
            if needing and inputs:
                # a parameter may get no gradient (a deferred weight gradient); a sample input that
                # gets none is an error unless allowed
                with api.graph(backward_graphs[i], pool=pool):
                    grads = torch.autograd.grad(needing, inputs, grad_outputs=buffers, only_inputs=True,
                                                allow_unused=True, retain_graph=retain_graph)
                check_unused(grads[:sum(t.requires_grad for t in sample_args[i])], allow_unused_input)
                captured_backward[i] = True
            it = iter(grads)
            grad_inputs[i] = tuple(next(it) if t.requires_grad and grads else None for t in surfaces[i])
        else:
            graph = device.graph_type()
            with api.graph(graph, pool=pool):
                pairs = wgrad(i)
            wgrads[i] = (graph, pairs)
        if points:
            hook(points[1], i)
    missing = [i for i in range(n) if outputs[i] is None or grad_inputs[i] is None]
    if missing:
        raise ValueError(f"make_graphed_callables: the capture order runs no forward or no backward pass of "
                         f"callable(s) {missing}; each needs one of each")
    for i, c in enumerate(callables):
        tensors = tuple(o for o in outputs[i] if isinstance(o, torch.Tensor))
        replay = _Replay(api, forward_graphs[i], backward_graphs[i] if captured_backward[i] else None, surfaces[i],
                         len(sample_args[i]), outputs[i], tensors, tuple(o.requires_grad for o in tensors),
                         grad_outputs[i], grad_inputs[i])
        c.forward = functools.partial(_replayed, replay, specs[i], tuple(c.parameters()))
        graphs = [forward_graphs[i]] + [backward_graphs[i]] * captured_backward[i]  # (one never captured: no reset)
        if i in wgrads:
            c.replay_wgrad = functools.partial(_replayed_wgrad, *wgrads[i])
            graphs.append(wgrads[i][0])
        c.reset_graphs = functools.partial(_reset, graphs)
    return tuple(callables)


def _replayed_wgrad(graph, pairs):
    graph.replay()
    return pairs


def _reset(graphs) -> None:
    """Free the graphs (Transformer Engine's reset())."""
    for graph in graphs:
        graph.reset()


class _Replay(NamedTuple):
    api: object  # torch.<device type>
    forward_graph: object
    backward_graph: object  # None where no output required grad at capture
    inputs: tuple  # the captured inputs, then the parameters
    n_args: int
    outputs: list  # the captured outputs' leaves (tensors and constants)
    tensors: tuple  # their tensors, which a replay returns
    differentiable: tuple  # per tensor, whether it required grad at capture
    grad_outputs: tuple  # buffers for the gradients of the outputs that required grad
    grad_inputs: tuple  # per input, its captured gradient or None


def _replayed(replay: _Replay, spec, params: tuple, *args, stream=None, event=None):
    """The replay as the callable's forward. `stream` (Transformer Engine's cuda_graph_stream):
    replay the graphs (both directions) on that stream, after the current stream's work, which
    then waits for `event` (cuda_graph_event: an event the graph records) or else the whole
    replay."""
    tensors = _Graphed.apply(replay, (stream, event), *args, *params)
    it = iter(tensors)
    leaves = [next(it) if isinstance(o, torch.Tensor) else o for o in replay.outputs]
    return pytree.tree_unflatten(leaves, spec)


def _replay_on(api, graph, stream, event) -> None:
    current = api.current_stream() if stream is not None else None
    if stream is None or stream == current:
        graph.replay()
        return
    stream.wait_stream(current)
    with api.stream(stream):
        graph.replay()
    if event is not None:
        current.wait_event(event)
    else:
        current.wait_stream(stream)


class _Graphed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, replay: _Replay, on, *inputs):
        for captured, given in zip(replay.inputs[:replay.n_args], inputs):
            if captured.data_ptr() != given.data_ptr():
                captured.copy_(given)
        _replay_on(replay.api, replay.forward_graph, *on)
        ctx.replay, ctx.on = replay, on
        outs = tuple(o.detach() for o in replay.tensors)
        fixed = [o for o, differentiable in zip(outs, replay.differentiable) if not differentiable]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        replay = ctx.replay
        wanted = [g for g, differentiable in zip(grads, replay.differentiable) if differentiable]
        for buffer, grad in zip(replay.grad_outputs, wanted):
            if buffer.data_ptr() != grad.data_ptr():
                buffer.copy_(grad)
        if replay.backward_graph is not None:
            _replay_on(replay.api, replay.backward_graph, *ctx.on)
        return (None, None, *(g.detach() if g is not None else None for g in replay.grad_inputs))
