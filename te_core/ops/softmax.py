"""Contract: the softmax of unfused attention (scaled, masked, causal).

x is (b, h, sq, sk) scores. y = softmax(scale * x) over the last dimension, computed in
float32, with masked positions excluded: `mask` (bool, broadcastable to x) is True where a
position is masked out; `causal` masks key j > query i + (sk - sq) (bottom-right aligned, the
usual upper triangle when sq == sk). A row with every position masked is all zeros.
y has x's dtype.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ._spec import contract_op


@contract_op("softmax")
def softmax_fwd(x: Tensor, scale: float, *, mask: Optional[Tensor] = None, causal: bool = False) -> Tensor:
    """Returns y."""


@contract_op("softmax")
def softmax_bwd(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    """dx = scale * y * (dy - sum(dy * y, -1)), in dy's dtype (masked positions have y = 0)."""
