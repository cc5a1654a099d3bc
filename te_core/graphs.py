"""make_graphed_callables: capture te_core modules' forward and backward as device graphs
(Transformer Engine's te.make_graphed_callables), so a step costs one graph launch per direction
instead of dozens of kernel launches: what small layers need, whose steps are host-bound.

Capture uses the device's own torch module (`torch.<device type>.make_graphed_callables`), so
there is no vendor code here. Delayed scaling works because its state lives in fixed
device buffers: inside the graphs, casts read the live scales and max their amaxes into the live
histories, and scale_inv is recomputed from the scale on every replay. The scale updates themselves
are not captured: after each replay the graphed callable schedules them like an eager step does
(forward groups at the exit of the enclosing te_core.autocast, backward groups at the end of the
backward pass).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from .modules._base import QuantizedModule
from .quantization.autocast import _check_recipe, autocast, get_autocast_context
from .quantization.roles import Role
from .quantization.scaling import ScalingGroup, graph_capture, schedule_backward_update


def _graph_api(device: torch.device):
    """The device's make_graphed_callables, or None where torch has no graph capture for it."""
    return getattr(getattr(torch, device.type, None), "make_graphed_callables", None)


def _scaling_groups(module: nn.Module) -> Tuple[List[ScalingGroup], List[ScalingGroup]]:
    """(forward groups, backward groups) of every delayed-scaling state inside `module`."""
    forward, backward = [], []
    for child in module.modules():
        state = getattr(child, "_recipe_state", None) if isinstance(child, QuantizedModule) else None
        for role, group in getattr(state, "groups", {}).items():
            (backward if role is Role.GRAD_OUTPUT else forward).append(group)
    return forward, backward


def _save_scaling_state(module: nn.Module) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    forward, backward = _scaling_groups(module)
    return {id(g): (g.amax_history.clone(), g.scale.clone()) for g in forward + backward}


def _restore_scaling_state(module: nn.Module, saved: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undo what warm-up and capture did to the scaling state (their backward passes run on
    uninitialized gradients), in place: the graphs keep pointing at these buffers. State the
    warm-up created starts fresh (zero history, unit scale), as an eager module's would."""
    forward, backward = _scaling_groups(module)
    with torch.no_grad():
        for group in forward + backward:
            history, scale = saved.get(id(group), (None, None))
            if history is None:
                group.amax_history.zero_()
                group.scale.fill_(1.0)
            else:
                group.amax_history.copy_(history)
                group.scale.copy_(scale)


class _BackwardUpdates(torch.autograd.Function):
    """Identity on the outputs whose backward queues the backward groups' scale updates, which
    then run at the end of the backward pass, after the backward graph's replay."""

    @staticmethod
    def forward(ctx, groups, process_group, *outputs):
        ctx.groups, ctx.process_group = groups, process_group
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        for group in ctx.groups:
            schedule_backward_update(group, ctx.process_group)
        return (None, None, *grads)


def _wrap(graphed_forward, module: nn.Module, fp8_enabled: bool, recipe):
    forward_groups, backward_groups = _scaling_groups(module) if fp8_enabled else ([], [])
    name = type(module).__name__

    def forward(*args, **kwargs):
        if kwargs:
            raise TypeError(f"graphed {name} replays positional inputs only; got keyword arguments "
                            f"{', '.join(sorted(kwargs))} (is_first_microbatch and other options are not graphed)")
        context = get_autocast_context()
        if fp8_enabled and (context is None or not context.enabled):
            raise RuntimeError(f"graphed {name} was captured with fp8_enabled=True: call it inside "
                               "te_core.autocast(enabled=True, recipe=...) so its scales keep updating")
        if fp8_enabled and context.recipe is not recipe and context.recipe != recipe:
            raise RuntimeError(f"graphed {name} was captured with {recipe} but is called under {context.recipe}: "
                               "the graphs bake in the captured recipe; capture again with the new one")
        if not fp8_enabled and context is not None and context.enabled:
            raise RuntimeError(f"graphed {name} was captured in high precision (fp8_enabled=False) but is called "
                               "under te_core.autocast(enabled=True); capture it with fp8_enabled=True")
        out = graphed_forward(*args)
        for group in forward_groups:
            context.schedule_forward_update(group)
        if backward_groups and torch.is_grad_enabled():
            outs = out if isinstance(out, tuple) else (out,)
            if any(o.requires_grad for o in outs):
                return _BackwardUpdates.apply(backward_groups, context.amax_reduction_group, *outs)
        return out

    return forward


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    *,
    fp8_enabled: bool = False,
    fp8_recipe=None,
    fp8_group=None,
    **unsupported,
):
    """Capture each module's forward and backward as graphs; returns the module(s) with forward
    replaced by the replay (as torch's own make_graphed_callables does), in TE's signature.

    `sample_args` are the positional inputs of one call (a tuple per module when `modules` is a
    tuple); replays must get tensors of the same shapes, dtypes and requires_grad. With
    fp8_enabled=True the capture runs under te_core.autocast(recipe=fp8_recipe) and every call
    must run under an enabled te_core.autocast: the graphs bake in FP8, the scales keep
    updating. Each module's warm-up iterations run real forward and backward steps (they also
    update its delayed-scaling state).
    """
    if unsupported:
        raise NotImplementedError(f"make_graphed_callables: {', '.join(sorted(unsupported))} not supported by "
                                  "te-core yet (no weight caching, calibration or userbuffers in graphs)")
    single = not isinstance(modules, (tuple, list))
    mods: Sequence = (modules,) if single else tuple(modules)
    args: Sequence = (tuple(sample_args),) if single else tuple(tuple(a) for a in sample_args)
    if len(args) != len(mods):
        raise ValueError(f"make_graphed_callables: {len(mods)} modules but {len(args)} sets of sample_args")
    for module, sample in zip(mods, args):
        if not isinstance(module, nn.Module):
            raise TypeError(f"make_graphed_callables takes torch.nn.Module objects, got {type(module).__name__}")
        if not sample or not all(isinstance(a, torch.Tensor) for a in sample):
            raise TypeError("make_graphed_callables: sample_args must be tensors (the positional inputs of one call)")
        for param in module.parameters():
            if param.device != sample[0].device:
                raise ValueError(f"make_graphed_callables: {type(module).__name__} has a parameter on {param.device} "
                                 f"but its sample input is on {sample[0].device}; move one of them")
    device = args[0][0].device
    graph_api = _graph_api(device)
    if graph_api is None:
        raise NotImplementedError(f"make_graphed_callables: torch has no graph capture for device type "
                                  f"{device.type!r}; run the modules eagerly")
    saved = [_save_scaling_state(module) for module in mods]
    recipe = _check_recipe(fp8_recipe, "make_graphed_callables")
    with autocast(enabled=fp8_enabled, recipe=recipe, amax_reduction_group=fp8_group), graph_capture():
        graphed = graph_api(tuple(mods), tuple(args), num_warmup_iters=num_warmup_iters,
                            allow_unused_input=allow_unused_input)
    for module, before in zip(mods, saved):
        _restore_scaling_state(module, before)
    for module, graphed_module in zip(mods, graphed):
        graphed_module.forward = _wrap(graphed_module.forward, module, fp8_enabled, recipe)
    return graphed[0] if single else tuple(graphed)

