"""--capture: the demo GPT's transformer layers captured as device graphs after the first step
(te_core.make_graphed_callables); the embedding, the head, the loss and the optimizer stay eager.

A captured layer costs the host one graph launch per direction instead of dozens of kernel
launches and the Python around them, which is what steps bound by host time need (small
models, and FP8's extra casts at any size the GPU does not hide them). Graphs replay fixed
shapes, which the demo's batches have. The first step runs eagerly: delayed scaling's first
casts take their scales from their own tensors there, which a replay cannot do, and the capture
keeps the scaling state that step left.

The demo sets gradients to None before each backward and runs one backward per step, so it
takes the replays' gradient buffers as `.grad` themselves (clone_param_grads_on_return=False,
one copy less per parameter and step): the clip and the optimizer read them before the next
replay overwrites them. A loop that accumulates gradients over several backwards keeps the
default, which hands autograd copies.
"""
from __future__ import annotations

from functools import partial
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..graphs import make_graphed_callables


class LayerCalls:
    """Records, from one forward, the arguments each of `layers` is called with: sample inputs of
    the same shapes, dtypes and requires_grad, and the keyword arguments themselves (detached)."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.calls: List[Optional[Tuple[tuple, dict]]] = [None] * len(layers)
        self._hooks = [layer.register_forward_pre_hook(partial(self._record, i), with_kwargs=True)
                       for i, layer in enumerate(layers)]

    def _record(self, index: int, module, args, kwargs) -> None:
        samples = tuple(torch.randn_like(a).requires_grad_(a.requires_grad) for a in args)
        self.calls[index] = (samples, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    def remove(self) -> None:
        """Stop recording (a module with hooks cannot be captured)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def capture_layers(layers: Sequence[nn.Module], calls: LayerCalls, fp8_recipe, device: torch.device) -> None:
    """make_graphed_callables over `layers` with the calls `calls` recorded, in FP8 per
    `fp8_recipe` (None: high precision). The layers compute in bf16 under torch.autocast as in
    training; torch's capture refuses autocast's weight cache, so it is off while capturing."""
    calls.remove()
    missing = [i for i, call in enumerate(calls.calls) if call is None]
    if missing:
        raise RuntimeError(f"te-core demo --capture: layers {missing} were not called in the recorded step, so "
                           "there is nothing to capture them with")
    samples = tuple(args for args, _ in calls.calls)
    keywords = tuple(kwargs for _, kwargs in calls.calls)
    with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
        make_graphed_callables(tuple(layers), samples, sample_kwargs=keywords, enabled=fp8_recipe is not None,
                               recipe=fp8_recipe, clone_param_grads_on_return=False)
