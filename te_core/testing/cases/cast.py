"""Cases for ops.cast: tensor-wise, current, block-wise and MXFP8 casts, and dequantization.

Casts are checked bit-exact: scales are powers of two (or computed by the op from an amax,
which is order-independent), and the inputs include ties, saturating values and subnormals.
Every cast op also takes a strided input (a column slice or a transposed view: the contract
allows any layout), and quantize_fp8 a 1-D one (a master weight's flat range).
"""
from __future__ import annotations

import torch

from ..inputs import (E4M3, E5M2, amax_slot, case, column_slice, flat_range, fp8_data, pow2, randn, row_scaled,
                      to_cast, transposed_view, uniform)


@case("quantize_fp8", "fp32-e4m3-16x32")
def _(gen):
    scale = pow2(3)
    return (to_cast(gen, (16, 32), torch.float32, E4M3, scale), scale, E4M3), {}


@case("quantize_fp8", "bf16-e5m2-7x13")
def _(gen):
    scale = pow2(-2)
    return (to_cast(gen, (7, 13), torch.bfloat16, E5M2, scale), scale, E5M2), {}


@case("quantize_fp8", "fp16-e4m3-3x5x17")
def _(gen):
    scale = pow2(0)
    return (to_cast(gen, (3, 5, 17), torch.float16, E4M3, scale), scale, E4M3), {}


@case("quantize_fp8", "fp32-e4m3-nan-4x9")
def _(gen):
    scale = pow2(1)
    x = to_cast(gen, (4, 9), torch.float32, E4M3, scale)
    x[2, 5] = float("nan")  # amax must be NaN and the NaN must stay NaN
    return (x, scale, E4M3), {}


@case("cast_transpose_fp8", "fp32-e4m3-64x48")
def _(gen):
    scale = pow2(2)
    return (to_cast(gen, (64, 48), torch.float32, E4M3, scale), scale, E4M3), {}


@case("cast_transpose_fp8", "bf16-e5m2-33x17")
def _(gen):
    scale = pow2(-3)
    return (to_cast(gen, (33, 17), torch.bfloat16, E5M2, scale), scale, E5M2), {}


def _history_slot(gen, low: float, high: float) -> torch.Tensor:
    """An amax_out slot holding an earlier amax drawn from [low, high] (below or above x's)."""
    return amax_slot(uniform(gen, 1, low=low, high=high).item())


@case("quantize_fp8", "fp32-e4m3-amax-out-below-8x16")
def _(gen):
    scale = pow2(-4)
    x = to_cast(gen, (8, 16), torch.float32, E4M3, scale)
    return (x, scale, E4M3), dict(amax_out=_history_slot(gen, 0.1, 1.0))


@case("quantize_fp8", "bf16-e5m2-amax-out-above-6x10")
def _(gen):
    scale = pow2(-2)
    x = to_cast(gen, (6, 10), torch.bfloat16, E5M2, scale, specials=False)
    return (x, scale, E5M2), dict(amax_out=_history_slot(gen, 1e30, 2e30))


@case("cast_transpose_fp8", "fp32-e4m3-amax-out-32x48")
def _(gen):
    scale = pow2(1)
    x = to_cast(gen, (32, 48), torch.float32, E4M3, scale, specials=False)
    return (x, scale, E4M3), dict(amax_out=_history_slot(gen, 0.5, 2.0))


@case("cast_transpose_fp8", "bf16-e4m3-amax-out-above-24x40")
def _(gen):
    scale = pow2(-1)
    x = to_cast(gen, (24, 40), torch.bfloat16, E4M3, scale, specials=False)
    return (x, scale, E4M3), dict(amax_out=_history_slot(gen, 1e30, 2e30))


# Strided and 1-D inputs: the contract (te_core/ops/cast.py) lets callers pass any layout; a kernel
# that walks x's memory as dense row-major must make it contiguous or decline it in supports().


@case("quantize_fp8", "fp32-e4m3-column-slice-24x40")
def _(gen):
    scale = pow2(2)
    return (column_slice(gen, to_cast(gen, (24, 40), torch.float32, E4M3, scale)), scale, E4M3), {}


@case("quantize_fp8", "bf16-e5m2-transposed-view-32x20")
def _(gen):
    scale = pow2(-3)
    return (transposed_view(to_cast(gen, (32, 20), torch.bfloat16, E5M2, scale)), scale, E5M2), {}


@case("quantize_fp8", "fp32-e4m3-1d-range-amax-out-999")
def _(gen):
    """As master weights cast their range of a weight (1-D, at an offset), into the history slot."""
    scale = pow2(1)
    x = flat_range(gen, to_cast(gen, (999,), torch.float32, E4M3, scale))
    return (x, scale, E4M3), dict(amax_out=_history_slot(gen, 0.1, 1.0))


@case("cast_transpose_fp8", "bf16-e4m3-column-slice-48x64")
def _(gen):
    scale = pow2(0)
    return (column_slice(gen, to_cast(gen, (48, 64), torch.bfloat16, E4M3, scale)), scale, E4M3), {}


@case("quantize_fp8_current", "fp32-e4m3-column-slice-transpose-40x72")
def _(gen):
    return (column_slice(gen, randn(gen, 40, 72, std=3.0)), E4M3), dict(with_transpose=True)


@case("quantize_fp8_current", "bf16-e5m2-transposed-view-pow2-24x40")
def _(gen):
    x = transposed_view(randn(gen, 24, 40, dtype=torch.bfloat16, std=20.0))
    return (x, E5M2), dict(force_pow2_scales=True)


@case("quantize_blockwise", "fp32-e4m3-1d-column-slice-transpose-130x200", same_strides=True)
def _(gen):
    return (column_slice(gen, row_scaled(gen, 130, 200, torch.float32)), E4M3), dict(with_transpose=True)


@case("quantize_mxfp8", "bf16-e4m3-column-slice-transpose-64x96", same_strides=True)
def _(gen):
    return (column_slice(gen, row_scaled(gen, 64, 96, torch.bfloat16)), E4M3), dict(with_transpose=True)


@case("quantize_fp8_current", "fp32-e4m3-32x64")
def _(gen):
    return (randn(gen, 32, 64, std=3.0), E4M3), {}


@case("quantize_fp8_current", "bf16-e5m2-transpose-pow2-17x29")
def _(gen):
    x = randn(gen, 17, 29, dtype=torch.bfloat16, std=50.0)
    return (x, E5M2), dict(with_transpose=True, force_pow2_scales=True)


@case("quantize_fp8_current", "fp32-e4m3-epsilon-2x3x7")
def _(gen):
    return (randn(gen, 2, 3, 7), E4M3), dict(amax_epsilon=1000.0)


@case("quantize_fp8_current", "fp16-e4m3-transpose-epsilon-pow2-9x40")
def _(gen):
    x = randn(gen, 9, 40, dtype=torch.float16, std=0.01)
    return (x, E4M3), dict(with_transpose=True, force_pow2_scales=True, amax_epsilon=0.5)


@case("quantize_blockwise", "fp32-e4m3-1d-transpose-130x200", same_strides=True)
def _(gen):
    return (row_scaled(gen, 130, 200, torch.float32), E4M3), dict(with_transpose=True)


@case("quantize_blockwise", "bf16-e4m3-2d-transpose-200x130", same_strides=True)
def _(gen):
    return (row_scaled(gen, 200, 130, torch.bfloat16), E4M3), dict(block_2d=True, with_transpose=True)


@case("quantize_blockwise", "fp32-e5m2-1d-nonpow2-64x256", same_strides=True)
def _(gen):
    return (row_scaled(gen, 64, 256, torch.float32), E5M2), dict(force_pow2_scales=False)


@case("quantize_blockwise", "fp16-e4m3-2d-epsilon-33x129", same_strides=True)
def _(gen):
    x = row_scaled(gen, 33, 129, torch.float16)
    return (x, E4M3), dict(block_2d=True, force_pow2_scales=False, amax_epsilon=0.25)


@case("quantize_mxfp8", "bf16-e4m3-33x64", same_strides=True)
def _(gen):
    return (row_scaled(gen, 33, 64, torch.bfloat16), E4M3), {}


@case("quantize_mxfp8", "fp32-e5m2-transpose-64x96", same_strides=True)
def _(gen):
    return (row_scaled(gen, 64, 96, torch.float32), E5M2), dict(with_transpose=True)


@case("quantize_mxfp8", "fp32-e4m3-transpose-zero-block-32x32", same_strides=True)
def _(gen):
    x = row_scaled(gen, 32, 32, torch.float32)
    x[3, :] = 0.0  # a zero block must get e = -127 (the only zeros in the kit, on purpose)
    return (x, E4M3), dict(with_transpose=True)


@case("dequantize_fp8", "e4m3-to-bf16-33x17")
def _(gen):
    return (fp8_data(gen, (33, 17), E4M3), torch.tensor([0.37]), torch.bfloat16), {}


@case("dequantize_fp8", "e5m2-to-fp32-4x5x6")
def _(gen):
    return (fp8_data(gen, (4, 5, 6), E5M2, std=300.0), torch.tensor([1.7e-3]), torch.float32), {}


@case("dequantize_fp8", "e4m3-to-fp16-8x8")
def _(gen):
    return (fp8_data(gen, (8, 8), E4M3), pow2(-5), torch.float16), {}


@case("dequantize_blockwise", "e4m3-1d-to-fp32-130x200")
def _(gen):
    scale_inv = uniform(gen, 130, 2, low=0.01, high=1.0)
    return (fp8_data(gen, (130, 200), E4M3), scale_inv, False, torch.float32), {}


@case("dequantize_blockwise", "e5m2-2d-to-bf16-200x130")
def _(gen):
    scale_inv = uniform(gen, 2, 2, low=0.01, high=1.0)
    return (fp8_data(gen, (200, 130), E5M2), scale_inv, True, torch.bfloat16), {}


@case("dequantize_mxfp8", "e4m3-to-fp32-33x64", same_strides=True)
def _(gen):
    scales = torch.randint(117, 138, (33, 2), generator=gen, dtype=torch.uint8)
    return (fp8_data(gen, (33, 64), E4M3), scales, torch.float32), {}


@case("dequantize_mxfp8", "e5m2-to-bf16-16x96", same_strides=True)
def _(gen):
    scales = torch.randint(120, 135, (16, 3), generator=gen, dtype=torch.uint8)
    return (fp8_data(gen, (16, 96), E5M2), scales, torch.bfloat16), {}


@case("transpose_fp8", "e4m3-64x48")
def _(gen):
    return (fp8_data(gen, (64, 48), E4M3),), {}


@case("transpose_fp8", "e5m2-odd-33x130")
def _(gen):
    return (fp8_data(gen, (33, 130), E5M2, std=300.0),), {}


@case("transpose_fp8", "e4m3-column-slice-40x48")
def _(gen):
    return (column_slice(gen, fp8_data(gen, (40, 48), E4M3)),), {}


@case("dequantize_fp8", "e5m2-to-fp32-column-slice-24x40")
def _(gen):
    return (column_slice(gen, fp8_data(gen, (24, 40), E5M2, std=300.0)), pow2(-4), torch.float32), {}


@case("dequantize_blockwise", "e4m3-1d-column-slice-to-fp32-130x200")
def _(gen):
    scale_inv = uniform(gen, 130, 2, low=0.01, high=1.0)
    return (column_slice(gen, fp8_data(gen, (130, 200), E4M3)), scale_inv, False, torch.float32), {}


@case("dequantize_mxfp8", "e4m3-column-slice-to-bf16-32x64", same_strides=True)
def _(gen):
    scales = torch.randint(117, 138, (32, 2), generator=gen, dtype=torch.uint8)
    return (column_slice(gen, fp8_data(gen, (32, 64), E4M3)), scales, torch.bfloat16), {}
