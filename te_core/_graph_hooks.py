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


def latest_call_only(name: str, calls: List[int], call: int):
    """A pre-hook on a replay's backward node that refuses to run it once a later forward replay
    of the module has run (`calls[0]` counts them): that replay overwrote the activations this
    backward reads and the outputs it returned, so its gradients would be the later call's. With
    weight caching the two graph pairs share one memory pool, so either pair's forward counts."""

    def hook(grad_outputs):
        later = calls[0] - call
        if later:
            raise RuntimeError(f"graphed {name}: this backward belongs to a call whose saved activations and outputs "
                               f"the {later} later call(s) of the module overwrote, so its gradients would be wrong; "
                               "run each call's backward before the next forward (its graphs hold one call's "
                               "tensors), or capture a separate copy of the module per microbatch in flight")

    return hook


def param_grad_copies(n_params: int):
    """A hook on a replay's backward node that hands autograd copies of the parameters' gradients
    (its last n_params results) instead of the graph's own buffers, which the next replay
    overwrites: so `.grad` never aliases them, and gradients accumulated over several backward
    passes add up, as in eager mode (Transformer Engine's clone_param_grads_on_return=True)."""

    def hook(grad_inputs, grad_outputs):
        start = len(grad_inputs) - n_params
        return tuple(g.clone() if i >= start and g is not None else g for i, g in enumerate(grad_inputs))

    return hook


def tensors_in(out) -> Tuple[torch.Tensor, ...]:
    """The tensors of a replay's output: a tuple, list or dict of them, nested, or a model's own
    output class (whatever torch's pytree flattens, as the capture did)."""
    return tuple(o for o in tree_leaves(out) if isinstance(o, torch.Tensor))
