"""te.optimizers.FusedSGD: SGD with momentum, dampening, Nesterov and weight decay.

No contract op covers SGD, so the update is plain torch, in float32 for low-precision
parameters. Momentum follows torch.optim.SGD (the buffer starts as the first gradient);
`wd_after_momentum=True` adds the weight decay term after the momentum instead of to the
gradient, as Transformer Engine's kernel does.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.optim.optimizer import required

from ._checks import check_group, check_loadable, check_param_dtype, listed_params, scalar
from ._grads import GradResetMixin, grad_of, run_closure
from ._state_dtypes import StateDtypesMixin

NAME = "FusedSGD"
RANGES = {"lr": (0.0, None, False), "momentum": (0.0, None, False), "dampening": (-math.inf, None, False),
          "weight_decay": (0.0, None, False)}
# (supported parameter dtypes, what to do instead): Transformer Engine's FusedSGD steps float16 and float32
# parameters and silently leaves any other unstepped; te-core steps bf16 ones too, in float32
PARAM_DTYPES = ((torch.float32, torch.float16, torch.bfloat16),
                "updated in float32 (Transformer Engine's FusedSGD steps float16 and float32 ones and leaves others "
                "unstepped); convert the model (e.g. model.float()) or step float64 parameters with torch.optim.SGD")


class FusedSGD(StateDtypesMixin, GradResetMixin, torch.optim.Optimizer):
    def state_dtype(self, name: str):
        """The dtype state `name` is kept in (and reloaded in: StateDtypesMixin)."""
        return torch.float32 if name == "momentum_buffer" else None

    def __init__(self, params, lr=required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: Optional[bool] = None):
        check_group(NAME, dict(params=[], lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay),
                    RANGES)
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError(f"{NAME}: nesterov=True needs momentum > 0 and dampening = 0")
        if not isinstance(materialize_master_grads, bool):
            raise TypeError(f"{NAME}: materialize_master_grads must be a bool, got {materialize_master_grads!r}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        # (Transformer Engine reads it only for apex amp's master parameters, which neither it nor
        # te-core has without apex: every value steps alike)
        self.materialize_master_grads = materialize_master_grads
        self._init_set_grad_none(set_grad_none)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the group's hyperparameters and parameters checked first (_checks)."""
        param_group = listed_params(param_group)
        check_group(NAME, {**self.defaults, **param_group}, RANGES, len(self.param_groups), PARAM_DTYPES)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """StateDtypesMixin's, refusing a state dict of another optimizer or other parameters first."""
        check_loadable(self, state_dict, allowed=("momentum_buffer",), required=(), shaped=("momentum_buffer",))
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        lives = [[(p, g) for p in group["params"] if (g := grad_of(p, False, NAME)) is not None]
                 for group in self.param_groups]
        for group, live in zip(self.param_groups, lives):  # (all checked before any is stepped)
            if group["lr"] is required:
                raise ValueError(f"{NAME}: parameter group without a learning rate; pass lr")
            for p, _ in live:  # (a model converted after the optimizer was made, e.g. by model.double())
                check_param_dtype(NAME, p, *PARAM_DTYPES)
        for group, live in zip(self.param_groups, lives):
            for p, g in live:
                self._update(p, g.float(), group)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        # (a one-element tensor hyperparameter as a 0-dim one, which torch's alpha= takes)
        lr, wd, momentum, dampening = (scalar(group[key]) for key in ("lr", "weight_decay", "momentum", "dampening"))
        p32 = p.float()
        if wd != 0.0 and not self.wd_after_momentum:
            g = g.add(p32, alpha=wd)
        if momentum != 0.0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.clone()
            else:
                buf.mul_(momentum).add_(g, alpha=1.0 - dampening)
            g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
        if wd != 0.0 and self.wd_after_momentum:
            g = g.add(p32, alpha=wd)
        p32.add_(g, alpha=-lr)
        if p32 is not p:
            p.copy_(p32)
