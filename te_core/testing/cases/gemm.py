"""Cases for ops.gemm and ops.gemm_fp8 (a @ b.T, "TN"), every scaling mode, `out` and
`accumulate`.

An FP8 GEMM's operands are exact FP8 values: every product a_i * b_i is exact in float32, so
only the accumulation, the scale multiplications and the rounding to the output dtype err. Its
outputs are compared with that error model (fp8_gemm_bound), never with the tolerance of an
FP8 cast, which the GEMM does not do (a result 10% too large is within one E4M3 step)."""
from __future__ import annotations

import math

import torch

from ...reference.gemm import _dequantize_operand
from ..compare import ErrorBound
from ..inputs import E4M3, E5M2, Inputs, case, fp8_data, randn, uniform

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


ACCUMULATOR_ROUNDOFF = {False: 2.0**-14, True: 2.0**-12}
"""Unit roundoff allowed for the accumulation (by fast_accumulation). FP8 tensor cores add
products with fewer bits than float32 inside an instruction (about 14 reported for Hopper),
and with fast accumulation they keep those sums longer before promoting to float32; these
allowances cover that, and still leave a wrong result by 1% outside the norm bound."""
FLOAT32_ROUNDOFF = 2.0**-24


def fp8_gemm_bound(fast: bool):
    """The error model of gemm_fp8 on a case's inputs, for the case's `bound`:
    per element, 2 u_out (|result| + |a.b| + |bias| + |out before|) for the roundings to the
    output dtype (the reference's and the backend's, before and after adding bias or `out`)
    plus (K u_acc + 4 u_32) sum_i |a_i b_i| for the accumulation in any order and the scale
    multiplications: a rigorous bound, catching any element that is far off. Rounding errors
    of a sum add up like a random walk, so the error's norm must also stay within the norm of
    the rounding term plus 4 sqrt(K) u_acc ||sqrt(sum_i (a_i b_i)^2)||: a systematic error (a
    scaled result) shows there even where the worst case per element is loose."""
    u_acc = ACCUMULATOR_ROUNDOFF[fast]

    def bound(inputs: Inputs, expected: torch.Tensor) -> ErrorBound:
        (a, b, a_si, b_si), kwargs = inputs
        scaling = kwargs.get("scaling", "tensorwise")
        a64 = _dequantize_operand(a, a_si, scaling, "a").double()
        b64 = _dequantize_operand(b, b_si, scaling, "b").double()
        k = a.shape[1]
        around = (a64 @ b64.t()).abs() + expected.double().abs()
        if kwargs.get("bias") is not None:
            around = around + kwargs["bias"].double().abs()
        if kwargs.get("accumulate"):
            around = around + kwargs["out"].double().abs()
        rounding = torch.finfo(expected.dtype).eps * around  # eps = 2 u_out
        abs_sum = a64.abs() @ b64.abs().t()
        per_element = rounding + (k * u_acc + 4 * FLOAT32_ROUNDOFF) * abs_sum
        walk = torch.sqrt(a64.square() @ b64.square().t())
        norm = (torch.linalg.vector_norm(rounding) + 4 * math.sqrt(k) * u_acc * torch.linalg.vector_norm(walk)
                + 4 * FLOAT32_ROUNDOFF * torch.linalg.vector_norm(abs_sum))
        return ErrorBound(per_element, norm.item())

    return bound


def _fp8_case(name, m, n, k, a_dtype=E4M3, b_dtype=E4M3, scaling="tensorwise", out_dtype=torch.bfloat16,
              bias=False, out=None, accumulate=False, fast=False):
    """Registers a gemm_fp8 case; `out` is None, "poisoned" (NaN) or "random" (accumulate into)."""

    @case("gemm_fp8", name, bound=fp8_gemm_bound(fast), returns_out=out is not None)
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
# fast accumulation (its error grows with K); K = 512 for the 128x128 block case, which
# cuBLASLt takes with K/128 a multiple of 4
_fp8_case("tensorwise-fast-accumulation-bias-64x48x512", 64, 48, 512, bias=True, fast=True)
_fp8_case("rowwise-fast-accumulation-32x64x256", 32, 64, 256, scaling="rowwise", fast=True)
_fp8_case("block-1x128-128x128-fast-accumulation-64x144x512", 64, 144, 512, scaling="block_1x128_128x128", fast=True)
