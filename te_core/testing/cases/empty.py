"""Cases with zero tokens (an empty batch) for every op a module runs over its tokens: each must
return empty results of the right shapes and dtypes, an amax of 0 (nothing seen), reductions over
no rows of 0, and leave an amax_out slot as it was. A kernel launched over an empty grid, or a
reduction over an empty dimension, is where backends fail on them."""
from __future__ import annotations

import torch

from ..inputs import E4M3, E5M2, amax_slot, case, pow2, randn

ROWS0 = (0, 32)


def _empty(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@case("quantize_fp8", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0), pow2(1), E4M3), dict(amax_out=amax_slot(3.0))


@case("cast_transpose_fp8", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0, dtype=torch.bfloat16), pow2(0), E5M2), {}


@case("quantize_fp8_current", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0), E4M3), {}


@case("quantize_blockwise", "empty-0x128")
def _(gen):
    return (_empty(0, 128), E4M3), {}


@case("quantize_mxfp8", "empty-0x64")
def _(gen):
    return (_empty(0, 64), E4M3), {}


@case("gemm", "empty-m0-0x16x32")
def _(gen):
    return (_empty(*ROWS0, dtype=torch.bfloat16), randn(gen, 16, 32, dtype=torch.bfloat16)), {}


@case("gemm", "empty-k0-wgrad-16x32x0")
def _(gen):
    """dw = dy.T @ x over no tokens: zeros, or `out` unchanged when accumulating."""
    return (_empty(16, 0), _empty(32, 0)), dict(out=randn(gen, 16, 32), accumulate=True)


@case("gemm_fp8", "empty-m0-0x16x32")
def _(gen):
    return (_empty(*ROWS0).to(E4M3), randn(gen, 16, 32).to(E4M3), pow2(-1), pow2(-2)), dict(out_dtype=torch.bfloat16)


@case("layernorm_fwd", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0), randn(gen, 32), randn(gen, 32), 1e-5), dict(fp8_scale=pow2(0), fp8_dtype=E4M3)


@case("rmsnorm_fwd", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0, dtype=torch.bfloat16), randn(gen, 32, dtype=torch.bfloat16), 1e-5), {}


@case("layernorm_bwd", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0), _empty(*ROWS0), _empty(0), _empty(0), randn(gen, 32)), {}


@case("activation_fwd", "empty-swiglu-0x64")
def _(gen):
    return (_empty(0, 64), "swiglu"), dict(fp8_scale=pow2(0), fp8_dtype=E4M3)


@case("activation_bwd", "empty-gelu-0x32")
def _(gen):
    return (_empty(*ROWS0), _empty(*ROWS0), "gelu"), {}


@case("dbias", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0, dtype=torch.bfloat16),), {}


@case("dbias_cast_transpose", "empty-0x32")
def _(gen):
    return (_empty(*ROWS0), pow2(0), E5M2), dict(amax_out=amax_slot(2.0))


@case("softmax_fwd", "empty-batch-0x2x4x4")
def _(gen):
    return (_empty(0, 2, 4, 4), 0.5), {}


@case("attention", "empty-sequence-2x2x0x8")
def _(gen):
    return tuple(_empty(2, 2, 0, 8) for _ in range(3)), {}


@case("cross_entropy", "empty-0x40")
def _(gen):
    return (_empty(0, 40), torch.zeros(0, dtype=torch.long)), dict(reduction="none")
