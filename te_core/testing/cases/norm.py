"""Cases for ops.norm: LayerNorm and RMSNorm forward (optionally with FP8 output) and backward.

Backward cases take statistics computed here from x in float32, as a forward would give them.
FP8 outputs follow a float32 reduction, so they may differ by one FP8 step (not bit-exact).
Each forward with FP8 output has an amax_out slot starting below y's amax and one starting
above it (where maxing keeps the slot and overwriting it loses an earlier amax of the step).
"""
from __future__ import annotations

import torch

from ..inputs import E4M3, E5M2, amax_slot, case, pow2, randn

EPS = 1e-5


def _x_weight(gen, shape, dtype, zero_centered):
    x = randn(gen, *shape, dtype=dtype, std=2.0, mean=0.5)
    weight = randn(gen, shape[-1], dtype=dtype, std=0.1 if zero_centered else 0.5, mean=0.0 if zero_centered else 1.0)
    return x, weight


def _layernorm_stats(x):
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False) + EPS)
    return mean, rstd


def _rms_rstd(x):
    return torch.rsqrt(x.float().pow(2).mean(-1) + EPS)


def _layernorm_fwd(name, shape, dtype, zero_centered=False, fp8=None, amax_start=None):
    @case("layernorm_fwd", name, exact_fp8=False)
    def make(gen):
        x, weight = _x_weight(gen, shape, dtype, zero_centered)
        kwargs = dict(zero_centered_gamma=zero_centered)
        if fp8 is not None:
            kwargs.update(fp8_scale=pow2(2), fp8_dtype=fp8)
        if amax_start is not None:
            kwargs.update(amax_out=amax_slot(amax_start))
        return (x, weight, randn(gen, shape[-1], dtype=dtype, std=0.1), EPS), kwargs


def _rmsnorm_fwd(name, shape, dtype, zero_centered=False, fp8=None, amax_start=None):
    @case("rmsnorm_fwd", name, exact_fp8=False)
    def make(gen):
        x, weight = _x_weight(gen, shape, dtype, zero_centered)
        kwargs = dict(zero_centered_gamma=zero_centered)
        if fp8 is not None:
            kwargs.update(fp8_scale=pow2(-1), fp8_dtype=fp8)
        if amax_start is not None:
            kwargs.update(amax_out=amax_slot(amax_start))
        return (x, weight, EPS), kwargs


def _layernorm_bwd(name, shape, dtype, zero_centered=False, add=False):
    @case("layernorm_bwd_add" if add else "layernorm_bwd", name)
    def make(gen):
        x, weight = _x_weight(gen, shape, dtype, zero_centered)
        mean, rstd = _layernorm_stats(x)
        dy = randn(gen, *shape, dtype=dtype)
        extra = (randn(gen, *shape, dtype=dtype, std=3.0),) if add else ()
        return (dy, x, mean, rstd, weight, *extra), dict(zero_centered_gamma=zero_centered)


def _rmsnorm_bwd(name, shape, dtype, zero_centered=False, add=False):
    @case("rmsnorm_bwd_add" if add else "rmsnorm_bwd", name)
    def make(gen):
        x, weight = _x_weight(gen, shape, dtype, zero_centered)
        dy = randn(gen, *shape, dtype=dtype)
        extra = (randn(gen, *shape, dtype=dtype, std=3.0),) if add else ()
        return (dy, x, _rms_rstd(x), weight, *extra), dict(zero_centered_gamma=zero_centered)


_layernorm_fwd("fp32-4x7x96", (4, 7, 96), torch.float32)
_layernorm_fwd("bf16-zero-centered-33x128", (33, 128), torch.bfloat16, zero_centered=True)
_layernorm_fwd("fp32-fp8-e4m3-16x64", (16, 64), torch.float32, fp8=E4M3)
_layernorm_fwd("fp16-fp8-e5m2-5x40", (5, 40), torch.float16, fp8=E5M2)
_rmsnorm_fwd("fp32-3x5x80", (3, 5, 80), torch.float32)
_rmsnorm_fwd("bf16-zero-centered-fp8-e4m3-33x64", (33, 64), torch.bfloat16, zero_centered=True, fp8=E4M3)
_rmsnorm_fwd("fp16-17x48", (17, 48), torch.float16)
_layernorm_fwd("bf16-fp8-e4m3-amax-out-12x64", (12, 64), torch.bfloat16, fp8=E4M3, amax_start=0.5)
_rmsnorm_fwd("fp32-fp8-e4m3-amax-out-above-8x32", (8, 32), torch.float32, fp8=E4M3, amax_start=1e4)
_rmsnorm_fwd("bf16-fp8-e5m2-amax-out-below-16x48", (16, 48), torch.bfloat16, fp8=E5M2, amax_start=0.25)
_layernorm_fwd("fp32-fp8-e5m2-amax-out-above-6x48", (6, 48), torch.float32, fp8=E5M2, amax_start=1e4)
_layernorm_bwd("fp32-6x5x48", (6, 5, 48), torch.float32)
_layernorm_bwd("bf16-zero-centered-33x64", (33, 64), torch.bfloat16, zero_centered=True)
_layernorm_bwd("fp16-17x40", (17, 40), torch.float16)
_rmsnorm_bwd("fp32-6x5x48", (6, 5, 48), torch.float32)
_rmsnorm_bwd("bf16-zero-centered-33x64", (33, 64), torch.bfloat16, zero_centered=True)
_layernorm_bwd("fp32-6x5x48", (6, 5, 48), torch.float32, add=True)
_layernorm_bwd("bf16-33x64", (33, 64), torch.bfloat16, add=True)
_rmsnorm_bwd("bf16-zero-centered-17x40", (17, 40), torch.bfloat16, zero_centered=True, add=True)
_rmsnorm_bwd("fp16-4x96", (4, 96), torch.float16, add=True)
