"""What FusedAdam and FusedSGD share: zero_grad with Transformer Engine's deprecated
`set_grad_none`, the gradient a parameter is stepped with, and step()'s closure."""
from __future__ import annotations

import warnings
from typing import Optional

import torch


class GradResetMixin:
    """zero_grad(set_to_none=None): None means set_grad_none's value if given, else True."""

    set_grad_none: Optional[bool] = None
    use_decoupled_grad: bool = False

    def _init_set_grad_none(self, set_grad_none: Optional[bool]) -> None:
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn(f"{type(self).__name__}(set_grad_none=...) is deprecated, as in Transformer Engine; "
                          "pass set_to_none to zero_grad instead", DeprecationWarning, stacklevel=3)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"zero_grad(set_to_none={set_to_none}) contradicts "
                                 f"{type(self).__name__}(set_grad_none={self.set_grad_none})")
            set_to_none = self.set_grad_none
        set_to_none = True if set_to_none is None else set_to_none
        attr = "decoupled_grad" if self.use_decoupled_grad else "grad"
        for group in self.param_groups:
            for p in group["params"]:
                g = getattr(p, attr, None)
                if set_to_none:
                    setattr(p, attr, None)
                elif g is not None:
                    g.detach_().zero_()


def grad_of(p: torch.Tensor, decoupled: bool, optimizer: str) -> Optional[torch.Tensor]:
    """p.grad (or p.decoupled_grad), None when absent; sparse gradients are an error."""
    g = getattr(p, "decoupled_grad", None) if decoupled else p.grad
    if g is not None and g.is_sparse:
        raise RuntimeError(f"{optimizer} does not support sparse gradients; use torch.optim.SparseAdam or dense ones")
    return g


def run_closure(closure):
    """The loss from step(closure): the closure re-evaluates the model with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
