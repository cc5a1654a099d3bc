"""RMSNorm through muDNN: aten::_fused_rmsnorm_forward / _fused_rmsnorm_backward.

torch_musa csrc/aten/ops/RMSNorm.cpp: forward(input, normalized_shape, eps, weight) ->
(out in input's dtype, invvar float32 of shape input.shape[:-len(normalized_shape)]), with
input float32/float16/bfloat16 and weight of the same dtype; backward(grad_out, invvar, input,
normalized_shape, eps, weight) -> (grad_input, grad_weight). invvar is the contract's rstd
(MT-TransformerEngine passes its rsigma as invvar). FP8 output: the norm in float32, then a cast.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .fp8_cast import cast_with_amax
from .gemm import HIGH_PRECISION, Verdict

# The contract's backward carries no eps. The kernel is handed the saved rstd; should it
# also read eps, this is the value Transformer Engine (and MT-TransformerEngine, which calls
# this op the same way) uses by default.
BACKWARD_EPS = 1e-5


def _forward_kernel():
    return torch.ops.aten._fused_rmsnorm_forward


def _backward_kernel():
    return torch.ops.aten._fused_rmsnorm_backward


def _gamma(weight: Tensor, zero_centered_gamma: bool) -> Tensor:
    return weight + 1 if zero_centered_gamma else weight


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
    gamma = _gamma(weight, zero_centered_gamma)
    if fp8_dtype is not None and x.dtype != torch.float32:
        # FP8 out: the norm in float32, cast once, as the contract computes it (a 16-bit result
        # cast again to FP8 rounds twice); muDNN takes gamma in x's dtype
        x, gamma = x.float(), gamma.float()
    y, rstd = _forward_kernel()(x, [x.shape[-1]], eps, gamma)
    if fp8_dtype is None:
        return y, rstd, None
    data, amax = cast_with_amax(y, fp8_scale, fp8_dtype, amax_out)
    return data, rstd, amax


def rmsnorm_bwd(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, *, zero_centered_gamma: bool = False
) -> Tuple[Tensor, Tensor]:
    # d(1 + w)/dw = 1: the gradient of the shifted gamma is the weight's gradient.
    dx, dgamma = _backward_kernel()(dy, rstd, x, [x.shape[-1]], BACKWARD_EPS, _gamma(weight, zero_centered_gamma))
    return dx, dgamma


def _dtype_verdict(x: Tensor, weight: Tensor) -> Verdict:
    if x.dtype not in HIGH_PRECISION:
        return False, f"x is {x.dtype}; muDNN RMSNorm takes float32, float16 or bfloat16"
    if weight.dtype != x.dtype:
        return False, f"weight {weight.dtype} differs from x {x.dtype}; muDNN RMSNorm needs them equal"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return False, f"weight {tuple(weight.shape)} does not match the last dimension of x {tuple(x.shape)}"
    return True, ""


def _gamma_verdict(weight: Tensor, zero_centered_gamma: bool) -> Verdict:
    if zero_centered_gamma and weight.dtype != torch.float32:
        return False, (
            f"zero_centered_gamma with {weight.dtype} weights: muDNN takes gamma in x's dtype, and "
            "rounding 1 + weight to 16 bits is less precise than the contract's float32 math"
        )
    return True, ""


def rmsnorm_fwd_supports(x, weight, eps, *, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None,
                         amax_out=None) -> Verdict:
    if fp8_dtype is not None and fp8_scale is None:
        return False, "fp8_dtype given without fp8_scale"
    if amax_out is not None and fp8_dtype is None:
        return False, "amax_out given without FP8 output"
    verdict = _dtype_verdict(x, weight)
    return _gamma_verdict(weight, zero_centered_gamma) if verdict[0] else verdict


def rmsnorm_bwd_supports(dy, x, rstd, weight, *, zero_centered_gamma=False) -> Verdict:
    if dy.dtype != x.dtype:
        return False, f"dy {dy.dtype} differs from x {x.dtype}"
    verdict = _dtype_verdict(x, weight)
    return _gamma_verdict(weight, zero_centered_gamma) if verdict[0] else verdict
