"""Cases for ops.activation: every activation kind forward and backward, FP8 outputs, dbias
and the fused backward epilogues (dbias + cast + transpose). Every op taking amax_out has a case
whose slot starts below the op's amax and one whose slot starts above it (maxing keeps it there;
an op that overwrites the slot loses an earlier amax of the step)."""
from __future__ import annotations

import torch

from ...ops.activation import ACTIVATIONS, GATED_ACTIVATIONS
from ..inputs import E4M3, E5M2, amax_slot, case, dims, pow2, randn, short, to_cast, uniform

_SHAPES = [(33, 64), (7, 48), (2, 9, 40), (5, 30), (64, 16), (3, 3, 24), (17, 8), (11, 66), (9, 34), (4, 2, 20),
           (13, 56), (6, 2, 28)]


def _out_shape(shape, kind):
    return (*shape[:-1], shape[-1] // 2) if kind in GATED_ACTIVATIONS else tuple(shape)


def _fwd(kind, shape, dtype, fp8=None, amax_start=None, name_extra=""):
    name = f"{kind}-{short(dtype)}-{dims(shape)}" + (f"-fp8-{short(fp8)}" if fp8 else "") + name_extra

    @case("activation_fwd", name, exact_fp8=False)
    def make(gen):
        kwargs = {} if fp8 is None else dict(fp8_scale=pow2(3), fp8_dtype=fp8)
        if amax_start is not None:
            kwargs["amax_out"] = amax_slot(amax_start)
        return (randn(gen, *shape, dtype=dtype, std=2.0), kind), kwargs


def _bwd(kind, shape, dtype):
    @case("activation_bwd", f"{kind}-{short(dtype)}-{dims(shape)}")
    def make(gen):
        x = randn(gen, *shape, dtype=dtype, std=2.0)
        return (randn(gen, *_out_shape(shape, kind), dtype=dtype), x, kind), {}


for _kind, _shape in zip(ACTIVATIONS, _SHAPES):
    _fwd(_kind, _shape, torch.float32)
    _bwd(_kind, _shape, torch.float32)
_fwd("gelu", (13, 40), torch.bfloat16)
_fwd("swiglu", (13, 40), torch.bfloat16)
_fwd("gelu", (16, 48), torch.float32, fp8=E4M3)
_fwd("swiglu", (9, 64), torch.bfloat16, fp8=E5M2)
_fwd("gelu", (8, 32), torch.bfloat16, fp8=E4M3, amax_start=0.25, name_extra="-amax-out")
_fwd("swiglu", (6, 40), torch.float32, fp8=E4M3, amax_start=1e4, name_extra="-amax-out-above")
_bwd("geglu", (13, 40), torch.bfloat16)
_bwd("srelu", (5, 31), torch.float16)


@case("dbias", "fp32-33x65")
def _(gen):
    return (randn(gen, 33, 65),), {}


@case("dbias", "bf16-4x5x48")
def _(gen):
    return (randn(gen, 4, 5, 48, dtype=torch.bfloat16),), {}


@case("dbias", "fp16-17x31")
def _(gen):
    return (randn(gen, 17, 31, dtype=torch.float16),), {}


@case("dbias_cast_transpose", "bf16-e5m2-64x32")
def _(gen):
    scale = pow2(-1)
    return (to_cast(gen, (64, 32), torch.bfloat16, E5M2, scale), scale, E5M2), {}


@case("dbias_cast_transpose", "fp32-e4m3-17x33")
def _(gen):
    scale = pow2(3)
    return (to_cast(gen, (17, 33), torch.float32, E4M3, scale, specials=False), scale, E4M3), {}


@case("dbias_cast_transpose", "bf16-e4m3-amax-out-48x32")
def _(gen):
    scale = pow2(0)
    x = to_cast(gen, (48, 32), torch.bfloat16, E4M3, scale, specials=False)
    return (x, scale, E4M3), dict(amax_out=amax_slot(uniform(gen, 1, low=0.5, high=1.0).item()))


@case("dbias_cast_transpose", "fp32-e5m2-amax-out-above-16x24")
def _(gen):
    scale = pow2(-2)
    x = to_cast(gen, (16, 24), torch.float32, E5M2, scale, specials=False)
    return (x, scale, E5M2), dict(amax_out=amax_slot(uniform(gen, 1, low=1e30, high=2e30).item()))


def _parts(widths, rows, dtype, fp8, exponent, amax_start=None, name_extra=""):
    """Column blocks of one gradient; the first block carries the format's special values."""
    name = f"{short(dtype)}-{short(fp8)}{name_extra}-{rows}x" + "+".join(map(str, widths))

    @case("dbias_cast_transpose_parts", name)
    def make(gen):
        scale = pow2(exponent)
        parts = tuple(to_cast(gen, (rows, w), dtype, fp8, scale, specials=i == 0) for i, w in enumerate(widths))
        kwargs = {} if amax_start is None else dict(amax_out=amax_slot(amax_start))
        return (parts, scale, fp8), kwargs


_parts((128, 64, 64), 48, torch.bfloat16, E4M3, 0)  # QKV-like: each block a whole number of tiles
_parts((5, 12), 17, torch.float32, E5M2, -1)  # ragged widths: no block aligns with a tile
_parts((32,), 16, torch.float16, E4M3, 2)
_parts((32, 64), 40, torch.bfloat16, E4M3, 1, amax_start=0.5, name_extra="-amax-out")
_parts((24, 40), 16, torch.float32, E5M2, -2, amax_start=1e30, name_extra="-amax-out-above")


def _self_scaled(op, widths, rows, dtype, fp8, std, **kwargs):
    """Column blocks of one gradient, of magnitude `std`, for an epilogue whose scales come from
    the gradient itself (`op`: current scaling's, or block scaling's 1x128 casts both ways)."""
    extra = "".join(f"-{k.split('_')[-1]}" for k in kwargs)
    name = f"{short(dtype)}-{short(fp8)}{extra}-{rows}x" + "+".join(map(str, widths))

    @case(op, name)
    def make(gen):
        return (tuple(randn(gen, rows, w, dtype=dtype, std=std) for w in widths), fp8), dict(kwargs)


_CURRENT, _BLOCKWISE = "dbias_cast_transpose_current", "dbias_cast_transpose_blockwise"
_self_scaled(_CURRENT, (32,), 64, torch.bfloat16, E5M2, 3.0)
_self_scaled(_CURRENT, (128, 64, 64), 48, torch.bfloat16, E4M3, 0.02)  # QKV-like: each block a whole number of tiles
_self_scaled(_CURRENT, (5, 12), 17, torch.float32, E4M3, 50.0, force_pow2_scales=True)  # ragged widths
_self_scaled(_CURRENT, (40,), 9, torch.float16, E4M3, 0.01, force_pow2_scales=True, amax_epsilon=0.5)
_self_scaled(_BLOCKWISE, (384,), 200, torch.bfloat16, E4M3, 3.0)  # a partial row block
_self_scaled(_BLOCKWISE, (256, 128, 128), 130, torch.bfloat16, E4M3, 0.02)  # QKV-like: whole 1x128 runs per part
_self_scaled(_BLOCKWISE, (128, 72), 33, torch.float32, E5M2, 1.0)  # the last part a partial run
_self_scaled(_BLOCKWISE, (200, 40), 9, torch.float16, E4M3, 0.01, force_pow2_scales=False,
             amax_epsilon=0.5)  # a run across parts


def _bwd_epilogue(kind, m, h, dtype, fp8):
    cols = 2 * h if kind in GATED_ACTIVATIONS else h

    @case("activation_bwd_dbias_cast_transpose", f"{kind}-{short(dtype)}-{m}x{cols}", exact_fp8=False)
    def make(gen):
        x = randn(gen, m, cols, dtype=dtype, std=2.0)
        return (randn(gen, m, h, dtype=dtype), x, kind, pow2(2), fp8), {}


@case("activation_bwd_dbias_cast_transpose", "gelu-bf16-amax-out-16x32", exact_fp8=False)
def _(gen):
    x = randn(gen, 16, 32, dtype=torch.bfloat16, std=2.0)
    return (randn(gen, 16, 32, dtype=torch.bfloat16), x, "gelu", pow2(2), E5M2), dict(amax_out=amax_slot(0.125))


@case("activation_bwd_dbias_cast_transpose", "srelu-fp32-amax-out-above-24x40", exact_fp8=False)
def _(gen):
    x = randn(gen, 24, 40, std=2.0)
    return (randn(gen, 24, 40), x, "srelu", pow2(1), E4M3), dict(amax_out=amax_slot(1e4))


_bwd_epilogue("gelu", 32, 48, torch.float32, E4M3)
_bwd_epilogue("swiglu", 16, 32, torch.bfloat16, E5M2)
_bwd_epilogue("relu", 9, 20, torch.float32, E4M3)
