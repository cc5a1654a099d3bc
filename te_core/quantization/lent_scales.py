"""Scale tensors lent to several quantized tensors that are not aliases of one another.

A delayed-scaling cast hands its Float8Tensor the scaling group's scale_inv snapshot of the step
(one reciprocal per group per step, not one per cast), so every tensor a quantizer casts in one
step holds the same scale_inv tensor. Such a tensor is marked lent, once, when the snapshot is
taken. A write that changes a holder's scale must not go into it (every other holder, and the
step's later casts, would silently read the new scale with their own bytes): the holder takes a
tensor of its own instead (QuantizedTensor._take_payload, float8_views' copy_). A holder gets
its own copy before it gets an alias that must see its writes (a detached twin, a view, `.data`
of another tensor): from then on its writes go in place into the one tensor they all share, as a
captured graph reading those buffers needs.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

_LENT = "_te_core_lent"


def lend(scale: Tensor) -> Tensor:
    """Mark `scale` as lent (see the module docstring); returns it."""
    setattr(scale, _LENT, True)
    return scale


def is_lent(scale: Optional[Tensor]) -> bool:
    """Whether `scale` is a lent scale tensor, which no write may change."""
    return getattr(scale, _LENT, False)
