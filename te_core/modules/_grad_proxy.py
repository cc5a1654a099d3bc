"""Gradients of FP8 primary weights (te.quantized_model_init) through a torch.compile graph.

A compiled graph reads an FP8 primary weight through its data and scale tensors: the weight
itself is no tensor the graph computes with, so the graph gives it no gradient. Each such
weight therefore gets a stand-in while compiling: a leaf tensor of the weight's shape and
nominal dtype that holds one element (stride 0, so it costs no memory), passed to the module's
autograd Function beside the weight. The Function returns the weight's gradient for the
stand-in too, autograd accumulates it there, and a hook moves it onto the weight's `.grad`,
where an eager step would have put it. The optimizer then updates the FP8 weight as it does
eagerly (in place, requantized).
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._tracing import run_while_tracing
from ..quantization.tensor import QuantizedTensor
from ._base import _LIVE
from ._base import GRAD_PROXIES as PROXIES


def grad_proxies(module: nn.Module, names: Sequence[str]) -> Tuple[Optional[Tensor], ...]:
    """For each parameter name: its stand-in while torch.compile traces a step that trains it
    (an FP8 primary weight that requires grad, grad mode on), else None."""
    if not torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return (None,) * len(names)
    wanted = tuple(name for name in names if _trains_fp8(module._parameters.get(name)))
    if not wanted:
        return (None,) * len(names)
    _make_untraced(id(module), wanted)
    proxies: Dict[str, Tensor] = getattr(module, PROXIES)
    return tuple(proxies[name] if name in wanted else None for name in names)


def _trains_fp8(param) -> bool:
    return isinstance(param, QuantizedTensor) and param.requires_grad


@run_while_tracing
def _make_untraced(module_id: int, names: Tuple[str, ...]) -> bool:
    """Create the stand-ins of `names` (or new ones where the weight changed shape, dtype or
    device); torch.compile runs this at trace time, so the graph finds them as inputs."""
    module = _LIVE.get(module_id)
    if module is None:
        return False
    # (QuantizedModule.__getstate__ leaves these out of copies: a copy's would feed this module's weights)
    proxies = module.__dict__.setdefault(PROXIES, {})
    for name in names:
        param = module._parameters[name]
        proxy = proxies.get(name)
        if proxy is None or proxy.shape != param.shape or proxy.dtype != param.dtype or proxy.device != param.device:
            proxy = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape).detach()
            proxy.requires_grad_()
            proxy.register_post_accumulate_grad_hook(_to_weight(module, name))
            proxies[name] = proxy
    return True


def _to_weight(module: nn.Module, name: str):
    """The hook moving a stand-in's accumulated gradient onto the weight's .grad (added to a
    gradient already there, as autograd accumulates)."""
    ref = weakref.ref(module)

    def hook(proxy: Tensor) -> None:
        grad, proxy.grad = proxy.grad, None
        owner = ref()
        param = None if owner is None else owner._parameters.get(name)
        if param is None or grad is None:
            return
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)

    return hook
