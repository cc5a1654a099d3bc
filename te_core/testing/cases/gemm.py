"""Cases for ops.gemm and ops.gemm_fp8 (a @ b.T, "TN"), every scaling mode, `out` and
`accumulate`. FP8 GEMM outputs are compared with the FP8 tolerance of their operands."""
from __future__ import annotations

import math

import torch

from ..compare import fp8_tolerance
from ..inputs import E4M3, E5M2, case, fp8_data, randn, uniform

NAN = float("nan")


def _operands(gen, m, n, k, dtype):
    std = k**-0.25  # keeps a @ b.T of order one, so float32 atol stays meaningful
    return randn(gen, m, k, dtype=dtype, std=std), randn(gen, n, k, dtype=dtype, std=std)


@case("gemm", "fp32-33x17x65")
def _(gen):
    return _operands(gen, 33, 17, 65, torch.float32), {}


@case("gemm", "bf16-bias-64x48x32")
def _(gen):
    a, b = _operands(gen, 64, 48, 32, torch.bfloat16)
    return (a, b), dict(bias=randn(gen, 48, dtype=torch.bfloat16))


@case("gemm", "fp16-to-fp32-16x24x40")
def _(gen):
    return _operands(gen, 16, 24, 40, torch.float16), dict(out_dtype=torch.float32)


@case("gemm", "fp32-out-poisoned-bias-9x31x20", returns_out=True)
def _(gen):
    a, b = _operands(gen, 9, 31, 20, torch.float32)
    return (a, b), dict(bias=randn(gen, 31), out=torch.full((9, 31), NAN))


@case("gemm", "bf16-accumulate-fp32-main-grad-48x40x24", returns_out=True)
def _(gen):
    a, b = _operands(gen, 48, 40, 24, torch.bfloat16)
    return (a, b), dict(out=randn(gen, 48, 40), accumulate=True, out_dtype=torch.float32)


@case("gemm", "bf16-transposed-views-wgrad-40x24x48")
def _(gen):
    """dw = dy.T @ x as the modules call it: both operands are transposed views, not copies."""
    std = 48**-0.25
    dy, x = randn(gen, 48, 40, dtype=torch.bfloat16, std=std), randn(gen, 48, 24, dtype=torch.bfloat16, std=std)
    return (dy.t(), x.t()), {}


def _scale_inv_shapes(scaling, m, n, k):
    kb, k32 = math.ceil(k / 128), k // 32
    return {
        "tensorwise": ((1,), (1,)),
        "rowwise": ((m, 1), (n, 1)),
        "block_1x128_128x128": ((m, kb), (math.ceil(n / 128), kb)),
        "block_1x128_1x128": ((m, kb), (n, kb)),
        "mxfp8": ((m, k32), (n, k32)),
    }[scaling]


def _fp8_gemm_inputs(gen, m, n, k, a_dtype, b_dtype, scaling):
    a, b = fp8_data(gen, (m, k), a_dtype), fp8_data(gen, (n, k), b_dtype)
    a_shape, b_shape = _scale_inv_shapes(scaling, m, n, k)
    if scaling == "mxfp8":  # E8M0 exponents around 2^0
        a_si = torch.randint(122, 128, a_shape, generator=gen, dtype=torch.uint8)
        b_si = torch.randint(122, 128, b_shape, generator=gen, dtype=torch.uint8)
    else:
        a_si = uniform(gen, *a_shape, low=0.02, high=0.15)
        b_si = uniform(gen, *b_shape, low=0.02, high=0.15)
    return a, b, a_si, b_si


def _fp8_case(name, m, n, k, a_dtype=E4M3, b_dtype=E4M3, scaling="tensorwise", out_dtype=torch.bfloat16,
              bias=False, out=None, accumulate=False, fast=False):
    """Registers a gemm_fp8 case; `out` is None, "poisoned" (NaN) or "random" (accumulate into)."""

    @case("gemm_fp8", name, tol=fp8_tolerance(a_dtype, b_dtype), returns_out=out is not None)
    def make(gen):
        args = _fp8_gemm_inputs(gen, m, n, k, a_dtype, b_dtype, scaling)
        kwargs = dict(out_dtype=out_dtype, scaling=scaling)
        if fast:
            kwargs["fast_accumulation"] = True
        if bias:  # large enough that a dropped bias is far outside the FP8 tolerance
            kwargs["bias"] = randn(gen, n, dtype=out_dtype, std=8.0)
        if out == "poisoned":
            kwargs["out"] = torch.full((m, n), NAN, dtype=out_dtype)
        elif out == "random":
            kwargs.update(out=randn(gen, m, n, dtype=out_dtype), accumulate=accumulate)
        return args, kwargs


_fp8_case("tensorwise-e4m3-32x48x64", 32, 48, 64)
_fp8_case("tensorwise-e4m3xe5m2-bias-fp32-32x64x48", 32, 64, 48, b_dtype=E5M2, out_dtype=torch.float32, bias=True)
_fp8_case("tensorwise-e5m2xe4m3-fp16-16x32x32", 16, 32, 32, a_dtype=E5M2, out_dtype=torch.float16)
_fp8_case("rowwise-64x32x48", 64, 32, 48, scaling="rowwise", bias=True)
_fp8_case("block-1x128-128x128-64x144x256", 64, 144, 256, scaling="block_1x128_128x128")
_fp8_case("block-1x128-128x128-partial-48x144x272", 48, 144, 272, scaling="block_1x128_128x128")
_fp8_case("block-1x128-1x128-32x48x256", 32, 48, 256, scaling="block_1x128_1x128", out_dtype=torch.float32)
_fp8_case("block-1x128-1x128-partial-32x48x272", 32, 48, 272, scaling="block_1x128_1x128", bias=True)
_fp8_case("mxfp8-32x64x96", 32, 64, 96, scaling="mxfp8")
_fp8_case("tensorwise-odd-dims-33x40x24", 33, 40, 24)
_fp8_case("tensorwise-out-poisoned-bias-16x48x32", 16, 48, 32, bias=True, out="poisoned")
_fp8_case("tensorwise-accumulate-fp32-32x32x64", 32, 32, 64, out_dtype=torch.float32, out="random", accumulate=True)
# fast accumulation: within the FP8 tolerance at these K (its error grows with K); K = 512 for
# the 128x128 block case, which cuBLASLt takes with K/128 a multiple of 4
_fp8_case("tensorwise-fast-accumulation-bias-64x48x512", 64, 48, 512, bias=True, fast=True)
_fp8_case("rowwise-fast-accumulation-32x64x256", 32, 64, 256, scaling="rowwise", fast=True)
_fp8_case("block-1x128-128x128-fast-accumulation-64x144x512", 64, 144, 512, scaling="block_1x128_128x128", fast=True)
