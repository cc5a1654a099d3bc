"""What a graphed module's replay registers on autograd: the hooks that do, around the graphs'
backward replay, what the graphs themselves cannot (they run no Python).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch.utils._pytree import tree_leaves

from .quantization.scaling import ScalingGroup, schedule_backward_update


def backward_updates_hook(groups: List[ScalingGroup], process_group):
    """A hook on a replay's output whose call queues the backward groups' scale updates, which
    then run at the end of the backward pass, after the backward graph's replay. (A tensor hook
    costs the host less than an identity autograd Function around the outputs, on a path whose
    whole cost is host time.)"""

    def hook(grad):
        for group in groups:
            schedule_backward_update(group, process_group)

    return hook


def copied_param_grads(params, clone: bool) -> Tuple[bool, ...]:
    """Which parameters' gradients a replay hands autograd as copies: all of them with `clone`
    (clone_param_grads_on_return), except those marked `skip_backward_post_hook` (a module that
    delays its weight gradients: their lifetime is its business, and with fused accumulation the
    gradient returned is a stand-in), as Transformer Engine does; an empty tuple if none. Such a
    module's biases are marked `te_grad_from_backward` too: their gradients come from the backward
    graph itself, whose buffer the next replay overwrites, so they are copied as any other's."""
    copied = tuple(clone and (not getattr(p, "skip_backward_post_hook", False)
                              or getattr(p, "te_grad_from_backward", False)) for p in params)
    return copied if any(copied) else ()


def backward_hook(name: str, calls: List[int], call: int, copied_params: Tuple[bool, ...], after=None):
    """The hook on a replay's backward node, run after the backward graph's replay and before its
    gradients go anywhere:
    - it refuses a backward whose call is no longer the module's latest (`calls[0]` counts the
      forward replays; this one was number `call`): a later replay overwrote the activations this
      backward read and the outputs it returned, so its gradients are the later call's. With
      weight caching the two graph pairs share one memory pool, so either pair's forward counts;
    - it hands autograd copies of the parameters' gradients that `copied_params` marks (one flag
      per parameter, the node's last results) instead of the graph's own buffers, which the next replay
      overwrites: so `.grad` never aliases them, and gradients accumulated over several backward
      passes add up as in eager mode (Transformer Engine's clone_param_grads_on_return=True).
    - `after()`, where given, then runs (it queues the replay's weight-gradient graph for
      backward_dw).
    One hook for all: each registration costs the host time on every replay."""

    def hook(grad_inputs, grad_outputs):
        later = calls[0] - call
        if later:
            raise RuntimeError(f"graphed {name}: this backward belongs to a call whose saved activations and outputs "
                               f"the {later} later call(s) of the module overwrote, so its gradients would be wrong; "
                               "run each call's backward before the next forward (its graphs hold one call's "
                               "tensors), or capture a separate copy of the module per microbatch in flight")
        if after is not None:
            after()
        if copied_params:
            start = len(grad_inputs) - len(copied_params)
            return tuple(g.clone() if i >= start and g is not None and copied_params[i - start] else g
                         for i, g in enumerate(grad_inputs))
        return None

    return hook


def tensors_in(out) -> Tuple[torch.Tensor, ...]:
    """The tensors of a replay's output: a tuple, list or dict of them, nested, or a model's own
    output class (whatever torch's pytree flattens, as the capture did)."""
    return tuple(o for o in tree_leaves(out) if isinstance(o, torch.Tensor))
