"""Contract: LayerNorm and RMSNorm over the last dimension, optionally with FP8 output.

Math in float32. y = norm(x) * gamma (+ beta), where gamma = weight, or 1 + weight with
zero_centered_gamma. Statistics (mean, rstd) are float32 with shape x.shape[:-1];
rstd = 1 / sqrt(var + eps) (LayerNorm, biased variance) or 1 / sqrt(mean(x^2) + eps) (RMSNorm).
With fp8_scale (1-element float32) and fp8_dtype, y is returned as FP8 data of y * fp8_scale
(saturated as in ops.cast) and amax = max|y| before scaling, maxed into `amax_out` when given
(as in ops.cast; it is then returned as the amax); otherwise y has x's dtype and amax is None. Backward returns dx in x's dtype and parameter gradients in weight's dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend.types import Capabilities
from ._spec import contract_op


def _fp8_out_caps(caps: Capabilities, *args, fp8_dtype=None, **_):
    return None if fp8_dtype is None else caps.check_fp8(fp8_dtype)


@contract_op("norm", _fp8_out_caps)
def layernorm_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    *,
    zero_centered_gamma: bool = False,
    fp8_scale: Optional[Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    amax_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Returns (y, mean, rstd, amax)."""


@contract_op("norm")
def layernorm_bwd(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dweight, dbias). dy has x's shape and dtype (high precision)."""


@contract_op("norm")
def layernorm_bwd_add(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, add: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor, Tensor]:
    """layernorm_bwd with `add` (x's shape and dtype) added to dx in float32 before dx is
    rounded to x's dtype: the gradient that reaches x by another path, as through a residual
    connection, summed without another pass over dx."""


@contract_op("norm", _fp8_out_caps)
def rmsnorm_fwd(
    x: Tensor,
    weight: Tensor,
    eps: float,
    *,
    zero_centered_gamma: bool = False,
    fp8_scale: Optional[Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    amax_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Returns (y, rstd, amax)."""


@contract_op("norm")
def rmsnorm_bwd(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor]:
    """Returns (dx, dweight)."""


@contract_op("norm")
def rmsnorm_bwd_add(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, add: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor]:
    """rmsnorm_bwd with `add` added to dx, as layernorm_bwd_add."""
