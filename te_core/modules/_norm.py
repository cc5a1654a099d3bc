"""LayerNorm / RMSNorm forward and backward on 2-D tensors through the registry ops.

Shared by the norm modules and by the fused norm+GEMM modules (LayerNormLinear, LayerNormMLP),
which call `norm_fwd` / `norm_bwd` inside their own autograd Functions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import backend, ops


def norm_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    eps: float,
    normalization: str,
    zero_centered_gamma: bool,
    *,
    fp8_scale: Optional[Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    amax_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tuple[Tensor, ...], Optional[Tensor]]:
    """Returns (y, stats to keep for backward, amax). y is FP8 data when fp8_dtype is given
    (its amax maxed into `amax_out` when given)."""
    fp8 = dict(zero_centered_gamma=zero_centered_gamma, fp8_scale=fp8_scale, fp8_dtype=fp8_dtype, amax_out=amax_out)
    if normalization == "LayerNorm":
        y, mean, rstd, amax = ops.layernorm_fwd(x, weight, bias, eps, **fp8)
        return y, (mean, rstd), amax
    y, rstd, amax = ops.rmsnorm_fwd(x, weight, eps, **fp8)
    return y, (rstd,), amax


def norm_bwd(
    dy: Tensor, x: Tensor, stats: Tuple[Tensor, ...], weight: Tensor, normalization: str, zero_centered_gamma: bool,
    add: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Returns (dx, dweight, dbias or None for RMSNorm). `add` (x's shape): a gradient that
    reaches x by another path (a residual connection), summed into dx — inside the norm's
    kernel where the backend has the fused op, else by one more add."""
    layernorm = normalization == "LayerNorm"
    fused = add is not None and backend.declares("layernorm_bwd_add" if layernorm else "rmsnorm_bwd_add")
    extra = (add.reshape(x.shape).to(x.dtype),) if fused else ()
    kwargs = dict(zero_centered_gamma=zero_centered_gamma)
    if layernorm:
        mean, rstd = stats
        op = ops.layernorm_bwd_add if fused else ops.layernorm_bwd
        dx, dw, db = op(dy, x, mean, rstd, weight, *extra, **kwargs)
    else:
        (rstd,) = stats
        op = ops.rmsnorm_bwd_add if fused else ops.rmsnorm_bwd
        (dx, dw), db = op(dy, x, rstd, weight, *extra, **kwargs), None
    if add is not None and not fused:
        dx = dx + add.reshape(x.shape)
    return dx, dw, db


class NormFunction(torch.autograd.Function):
    """High-precision norm of x (any shape; normalized over its last dimension), as 2-D rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, normalization, zero_centered_gamma):
        # contiguous rows: a strided input (a transpose) would otherwise be summed in another
        # order, and its result would depend on its memory layout
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        y, stats, _ = norm_fwd(x2d, weight, bias, eps, normalization, zero_centered_gamma)
        ctx.save_for_backward(x2d, weight, *stats)
        ctx.normalization = normalization
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        # the 2-D result itself, which the module views in x's shape: an output that is a view made
        # inside a Function cannot be modified in place (a model's `y *= scale` on a norm's output)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, *stats = ctx.saved_tensors
        dy2d = dy.reshape(x2d.shape).to(x2d.dtype)
        dx, dw, db = norm_bwd(dy2d, x2d, tuple(stats), weight, ctx.normalization, ctx.zero_centered_gamma)
        return dx.view(ctx.x_shape), dw, db if ctx.has_bias else None, None, None, None
