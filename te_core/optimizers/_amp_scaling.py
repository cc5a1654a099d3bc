"""What torch.amp.GradScaler hands an optimizer that unscales within its own step.

An optimizer class with `_step_supports_amp_scaling = True` is stepped by GradScaler.step
without unscaling its gradients first (GradScaler's in-place unscale refuses float16 ones).
Instead GradScaler sets two attributes for the duration of step(): `grad_scale`, the scale the
gradients carry (None where the user called scaler.unscale_(optimizer) already), and
`found_inf`, nonzero where a gradient held an inf or NaN, so the step must change nothing.
(An optimizer whose step() declares a `grad_scaler` parameter is passed the scaler instead,
with a FutureWarning each step; `from_scaler` reads the same two values from a scaler handed
to step() by hand, as Transformer Engine's FusedAdam takes it.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch.amp.grad_scaler import OptState


@dataclass
class AmpScaling:
    """The reciprocal of the gradients' scale and the found-inf flag, each None when absent;
    `on(device)` gives both as 0-dim float32 tensors on a device, moved once per device."""

    inv_scale: Optional[torch.Tensor] = None
    found_inf: Optional[torch.Tensor] = None
    _moved: Dict[torch.device, tuple] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, optimizer, grad_scaler=None) -> "AmpScaling":
        """From `grad_scaler` when given, else from the attributes GradScaler.step sets."""
        if grad_scaler is not None:
            return cls.from_scaler(optimizer, grad_scaler)
        return cls.make(getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))

    @classmethod
    def make(cls, grad_scale, found_inf) -> "AmpScaling":
        # (GradScaler's found_inf is a sum over the gradients' devices: 0, a plain int, when
        # it checked no gradient)
        if not torch.is_tensor(found_inf):
            found_inf = None
        inv_scale = None
        if grad_scale is not None:  # in double first, as GradScaler's own unscale_
            inv_scale = grad_scale.double().reciprocal().float()
        return cls(inv_scale, found_inf)

    @classmethod
    def from_scaler(cls, optimizer, grad_scaler) -> "AmpScaling":
        """What GradScaler.step would set as attributes, read from the scaler itself."""
        if not grad_scaler.is_enabled():
            return cls()
        state = grad_scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            grad_scaler._check_inf_per_device(optimizer)
        scale = grad_scaler._get_scale_async()
        found_inf = sum(t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values())
        return cls.make(None if state["stage"] is OptState.UNSCALED else scale, found_inf)

    def skips_on_host(self) -> bool:
        """Whether found_inf is set, read back to the host (the non-capturable step may)."""
        return self.found_inf is not None and bool(self.found_inf.item())

    def on(self, device: torch.device):
        """(inv_scale, skip): 0-dim float32 / bool tensors on `device`, or None each."""
        if device not in self._moved:
            inv = None if self.inv_scale is None else self.inv_scale.to(device, non_blocking=True).reshape(())
            skip = None if self.found_inf is None else self.found_inf.to(device, non_blocking=True).reshape(()) != 0
            self._moved[device] = (inv, skip)
        return self._moved[device]

    def unscaled(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` divided by the scale, a new tensor (param.grad stays as it is): float32 for a
        float16 gradient, whose range would lose small values the scale kept, else its dtype
        (GradScaler's scales are powers of two, so the division is exact there)."""
        inv_scale, _ = self.on(grad.device)
        if inv_scale is None:
            return grad
        if grad.dtype == torch.float16:
            return grad.float().mul_(inv_scale)
        return grad * inv_scale

    def leave_unscaled(self, grads) -> None:
        """After the step: the gradients divided by the scale in place, as GradScaler's own
        unscale_ leaves them for an optimizer that does not unscale itself (and Transformer
        Engine's capturable kernel writes them), so code reading param.grad after step() sees
        the same values either way. The update itself read float32 copies (`unscaled`)."""
        if self.inv_scale is None:
            return
        for grad in grads:  # (a power-of-two scale: exact in any dtype, as GradScaler's)
            grad.mul_(self.on(grad.device)[0])

