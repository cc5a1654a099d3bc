"""Reference LayerNorm and RMSNorm over the last dimension, float32 math, optional FP8 output.

The backward passes are the closed forms, with xhat = normalized x and g = dy * gamma:
LayerNorm dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); RMSNorm drops the mean(g) term.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend.types import as_dtype
from .cast import check_float, fp8_output


def _check_norm_args(x: Tensor, params) -> int:
    """Hidden size of x; every (name, tensor) in params must be a float vector of that size."""
    check_float("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension (the normalized one is the last)")
    hidden = x.shape[-1]
    for name, p in params:
        check_float(name, p)
        if tuple(p.shape) != (hidden,):
            raise ValueError(f"{name} has shape {tuple(p.shape)}; expected ({hidden},), the last dimension of x")
    return hidden


def _check_grad(dy: Tensor, x: Tensor) -> None:
    check_float("dy", dy)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)}; it must match x {tuple(x.shape)}")


def _check_stat(name: str, stat: Tensor, x: Tensor) -> Tensor:
    if tuple(stat.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name} has shape {tuple(stat.shape)}; expected x.shape[:-1] = {tuple(x.shape[:-1])}")
    return stat.float().unsqueeze(-1)


def _gamma(weight: Tensor, zero_centered_gamma: bool) -> Tensor:
    w = weight.float()
    return w + 1.0 if zero_centered_gamma else w


def _rows_sum(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).sum(dim=0)


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
    _check_norm_args(x, [("weight", weight), ("bias", bias)])
    x32 = x.float()
    mean = x32.mean(dim=-1)
    centered = x32 - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centered.square().mean(dim=-1) + eps)
    y32 = centered * rstd.unsqueeze(-1) * _gamma(weight, zero_centered_gamma) + bias.float()
    y, amax = fp8_output(y32, x.dtype, fp8_scale, fp8_dtype, amax_out)
    return y, mean, rstd, amax


def layernorm_bwd(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor, Tensor]:
    return _layernorm_bwd(dy, x, mean, rstd, weight, None, zero_centered_gamma)


def layernorm_bwd_add(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, add: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor, Tensor]:
    return _layernorm_bwd(dy, x, mean, rstd, weight, _check_add(add, x), zero_centered_gamma)


def _check_add(add: Tensor, x: Tensor) -> Tensor:
    check_float("add", add)
    if add.shape != x.shape or add.dtype != x.dtype:
        raise ValueError(f"add is {add.dtype} {tuple(add.shape)}; it must match x ({x.dtype} {tuple(x.shape)})")
    return add


def _plus(dx32: Tensor, add: Optional[Tensor]) -> Tensor:
    return dx32 if add is None else dx32 + add.float()


def _layernorm_bwd(dy, x, mean, rstd, weight, add, zero_centered_gamma):
    _check_norm_args(x, [("weight", weight)])
    _check_grad(dy, x)
    rstd32 = _check_stat("rstd", rstd, x)
    xhat = (x.float() - _check_stat("mean", mean, x)) * rstd32
    dy32 = dy.float()
    g = dy32 * _gamma(weight, zero_centered_gamma)
    dx = rstd32 * (g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dweight = as_dtype(_rows_sum(dy32 * xhat), weight.dtype)
    dbias = as_dtype(_rows_sum(dy32), weight.dtype)
    return as_dtype(_plus(dx, add), x.dtype), dweight, dbias


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
    _check_norm_args(x, [("weight", weight)])
    x32 = x.float()
    rstd = torch.rsqrt(x32.square().mean(dim=-1) + eps)
    y32 = x32 * rstd.unsqueeze(-1) * _gamma(weight, zero_centered_gamma)
    y, amax = fp8_output(y32, x.dtype, fp8_scale, fp8_dtype, amax_out)
    return y, rstd, amax


def rmsnorm_bwd(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor]:
    return _rmsnorm_bwd(dy, x, rstd, weight, None, zero_centered_gamma)


def rmsnorm_bwd_add(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, add: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor]:
    return _rmsnorm_bwd(dy, x, rstd, weight, _check_add(add, x), zero_centered_gamma)


def _rmsnorm_bwd(dy, x, rstd, weight, add, zero_centered_gamma):
    _check_norm_args(x, [("weight", weight)])
    _check_grad(dy, x)
    rstd32 = _check_stat("rstd", rstd, x)
    xhat = x.float() * rstd32
    dy32 = dy.float()
    g = dy32 * _gamma(weight, zero_centered_gamma)
    dx = rstd32 * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    return as_dtype(_plus(dx, add), x.dtype), as_dtype(_rows_sum(dy32 * xhat), weight.dtype)
