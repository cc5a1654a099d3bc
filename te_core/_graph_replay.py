"""What a graphed callable does on each call, around its graphs' replay (te_core.graphs
captures them): check the call against the capture (inputs, autocast, the weight cache's
order), replay the right graphs, schedule the scale updates the graphs do not hold, and
register the replay's autograd hooks (te_core._graph_hooks); plus Transformer Engine's
`backward_dw()` and `reset()` on the callable.
"""
from __future__ import annotations

import collections
import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ._graph_hooks import backward_hook, backward_updates_hook, copied_param_grads, tensors_in
from ._graph_inputs import InputSignature, KeywordInputs
from ._graph_options import GraphOptions
from .modules._base import QuantizedModule
from .modules._delayed_wgrad import accumulate
from .modules._microbatch import forced_first_microbatch
from .quantization.autocast import get_autocast_context
from .quantization.roles import Role
from .quantization.scaling import ScalingGroup


def scaling_groups(module: nn.Module) -> Tuple[List[ScalingGroup], List[ScalingGroup]]:
    """(forward groups, backward groups) of every delayed-scaling state inside `module`."""
    forward, backward = [], []
    for child in module.modules():
        state = getattr(child, "_recipe_state", None) if isinstance(child, QuantizedModule) else None
        for role, group in getattr(state, "groups", {}).items():
            (backward if role is Role.GRAD_OUTPUT else forward).append(group)
    return forward, backward


def _microbatch_flag(kwargs: dict, caching: bool, name: str) -> Optional[bool]:
    """The replay's is_first_microbatch (taken out of `kwargs`): required (a bool) with weight
    caching, refused without."""
    flag = kwargs.pop("is_first_microbatch", None)
    if caching and not isinstance(flag, bool):
        raise ValueError(f"graphed {name} was captured with cache_quantized_params=True: pass is_first_microbatch=True "
                         f"on the first microbatch of each step and False on the others (got {flag!r})")
    if not caching and flag is not None:
        raise TypeError(f"graphed {name} got is_first_microbatch={flag!r} but was captured without weight caching, so "
                        "every replay quantizes the weights afresh; capture with cache_quantized_params=True to cache "
                        "them across microbatches")
    return flag


def _check_autocast(name: str, enabled: bool, options: GraphOptions) -> None:
    """A replay must run in the precision (and recipe) its graphs were captured in. A
    high-precision module captured beside FP8 ones (enabled=(True, False, ...)) runs inside
    their autocast: its graphs hold no FP8. Graphs captured calibrating (high precision,
    amaxes recorded) run under te_core.autocast(enabled=False, calibrating=True)."""
    context, recipe = get_autocast_context(), options.recipe
    if enabled and (context is None or not context.enabled):
        raise RuntimeError(f"graphed {name} was captured with enabled=True: call it inside "
                           "te_core.autocast(enabled=True, recipe=...) so its scales keep updating")
    calibrating = options.calibrating and not enabled
    if calibrating and (context is None or context.enabled or not context.calibrating):
        raise RuntimeError(f"graphed {name} was captured calibrating (calibrating=True, enabled=False): call it "
                           "inside te_core.autocast(enabled=False, calibrating=True, recipe=...) so the amaxes it "
                           "records keep updating the scales")
    if (enabled or calibrating) and context.recipe is not recipe and context.recipe != recipe:
        raise RuntimeError(f"graphed {name} was captured with {recipe} but is called under {context.recipe}: "
                           "the graphs bake in the captured recipe; capture again with the new one")
    if not any(options.enabled) and context is not None and context.enabled:
        raise RuntimeError(f"graphed {name} was captured in high precision (enabled=False) but is called "
                           "under te_core.autocast(enabled=True); capture it with enabled=True")


def _replay_stream(kwargs: dict, name: str) -> dict:
    """Transformer Engine's replay keywords cuda_graph_stream / cuda_graph_event (taken out of
    `kwargs`) as the replay's stream and event (te_core._graph_capture._replayed)."""
    stream, event = kwargs.pop("cuda_graph_stream", None), kwargs.pop("cuda_graph_event", None)
    if stream is None and event is None:
        return {}
    if stream is None:
        raise ValueError(f"graphed {name}: cuda_graph_event is what the caller's stream waits for after a replay on "
                         "cuda_graph_stream; give that stream too")
    if not hasattr(stream, "wait_stream"):
        raise TypeError(f"graphed {name}: cuda_graph_stream must be a device stream, got {type(stream).__name__}")
    return {"stream": stream, "event": event}


def graphed_forward(module: nn.Module, eager_forward, variants: Dict, enabled: bool, options: GraphOptions,
                     keywords: KeywordInputs, signature: InputSignature, delaying: List[nn.Module]):
    """The module's new forward (a replay of `variants[is_first_microbatch]`): checks (the inputs
    against the sample, the autocast, the weight cache's order), the replay of the right graph,
    the scale updates the graphs do not hold, and the replay's autograd hooks
    (te_core._graph_hooks). In the other training mode than captured it runs eagerly (torch's
    rule). It carries Transformer Engine's `backward_dw()` (the replays of the deferred weight
    gradients of `delaying` modules) and `reset()` (frees the graphs)."""
    # the scaling state the graphs record into: FP8's, or calibration's
    forward_groups, backward_groups = scaling_groups(module) if enabled or options.calibrating else ([], [])
    name, captured_training = type(module).__name__, module.training
    cache_filled = [False]  # by a first-microbatch replay: capture only recorded the casts
    # the replay's last results are the parameters' gradients: which of them autograd gets copies of
    copied_params = copied_param_grads(tuple(module.parameters()), options.clone_param_grads)
    calls = [0]  # forward replays so far, of either graph pair (with weight caching): they share memory
    pending = collections.deque()  # the weight-gradient replays of the backward passes run, oldest first
    reset = [False]

    def forward(*args, **kwargs):
        if reset[0]:
            raise RuntimeError(f"graphed {name}: its graphs were freed by reset(); capture it again")
        first = _microbatch_flag(kwargs, options.cache_quantized_params, name)
        on = _replay_stream(kwargs, name)
        if module.training != captured_training:
            with forced_first_microbatch(first):
                return eager_forward(*args, **kwargs)
        keyword_tensors = keywords.tensors_of(kwargs) if (kwargs or keywords.keys) else ()
        signature.check((*args, *keyword_tensors))
        _check_autocast(name, enabled, options)
        if first is False and not cache_filled[0]:
            raise RuntimeError(f"graphed {name}: call it with is_first_microbatch=True before any later microbatch; "
                               "that replay fills the weight cache the later ones read")
        cache_filled[0] = cache_filled[0] or first is True
        out = variants[first].forward(*args, *keyword_tensors, **on)
        calls[0] = call = calls[0] + 1
        context = get_autocast_context()
        for group in forward_groups:  # a later microbatch's weight columns recorded nothing: kept as they are
            context.schedule_forward_update(group)
        if torch.is_grad_enabled():
            tensors = (out,) if isinstance(out, torch.Tensor) else tensors_in(out)
            hook = None
            for o in tensors if backward_groups else ():
                if o.requires_grad:  # whichever output the loss reaches
                    hook = hook or backward_updates_hook(backward_groups, context.amax_reduction_group)
                    o.register_hook(hook)
            node = next((o.grad_fn for o in tensors if o.grad_fn is not None), None)
            if node is not None:  # (one node per replay: the hook goes with it)
                wgrad = getattr(variants[first], "replay_wgrad", None)
                node.register_hook(backward_hook(name, calls, call, copied_params,
                                                 None if wgrad is None else functools.partial(pending.append, wgrad)))
        return out

    def reset_graphs():
        reset[0] = True
        for variant in variants.values():
            variant.reset_graphs()

    forward.te_eager_forward = eager_forward
    forward.backward_dw = _backward_dw(name, pending, delaying)
    forward.reset = reset_graphs
    return forward


def _backward_dw(name: str, pending, delaying):
    """The graphed callable's backward_dw: the weight-gradient graph of the oldest replayed
    backward not yet processed (one call per backward, as the modules' own), its gradients
    accumulated into .grad as the eager backward_dw does, then the modules' wgrad hooks."""
    def backward_dw():
        if not delaying:
            return
        if not pending:
            raise RuntimeError(f"graphed {name}.backward_dw(): no weight gradient is pending; call it once after each "
                               "backward of the graphed callable")
        accumulate(pending.popleft()(), copy=True)
        for module in delaying:
            module.run_wgrad_hooks()

    return backward_dw
