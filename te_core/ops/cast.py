"""Contract: casts between high precision and FP8 (tensor-wise, block-wise, MXFP8).

Conventions shared by every cast op:
- `scale` multiplies: data = saturate(x * scale) cast with round-to-nearest-even; values beyond
  the format's max become +-max (never inf/NaN); NaN stays NaN. `scale_inv` = 1 / scale
  multiplies back: x ~= data * scale_inv. Scales and amaxes are float32.
- `amax` = max(|x|) over the whole input as a 0-dim float32 tensor, NaN if x holds a NaN.
  Delayed-scaling casts also take `amax_out`: a 1-element float32 tensor (typically the slot
  of an amax history row) into which max(amax_out, amax) is written in place (NaN wins); the
  op then returns amax_out itself as its amax, so no separate buffer or max is needed. Never
  overwrite it with amax alone: the slot may already hold a larger amax of the same step (a
  layer run twice in one autocast, two micro-batches), which the next scale must see.
  te-core's own slots carry `te_slot_column` = c: the slot is `amax_out._base[0, c:c+1]`, row 0
  of its history's column c. A compiled (traced) implementation may write the history through
  the base instead (column 0: the base's first element), as a compiler copies a view of a graph
  input that a kernel writes; a slot without the attribute is only a 1-element tensor.
- 2-D ops take (M, K) tensors; `*_t` outputs are the transposed (K, M) tensors, contiguous,
  quantized so that data_t == data.T element for element where the scales allow it.
- Inputs may be float32, bfloat16 or float16; math is done in float32.
- Tensor inputs may have any strides and a storage offset: callers pass what they hold (a
  quantizer casts the tensor it is given as it is, a column slice or a weight's transposed view
  included; master weights cast a 1-D range of a flat buffer; an amax_out slot and a delayed
  scale are views into their scaling state). An implementation reads them through their
  strides, makes a contiguous copy itself, or declines the call in `supports()` (the dispatcher
  then runs the reference); it never walks an input's memory as dense row-major from its data
  pointer unless `is_contiguous()` says so. The conformance kit passes strided inputs to every
  cast op and checks the output of every call `supports()` accepts.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend.types import Capabilities
from ._spec import contract_op


def _scaled_cast_caps(caps: Capabilities, x, scale, fp8_dtype, **_):
    return caps.check_fp8(fp8_dtype)


def _self_scaled_cast_caps(caps: Capabilities, x, fp8_dtype, **_):
    return caps.check_fp8(fp8_dtype)


@contract_op("cast", _scaled_cast_caps)
def quantize_fp8(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """Delayed-scaling cast: (data, amax). x has any number of dimensions (1-D included: master
    weights cast a flat range of a weight this way); data has x's shape and `fp8_dtype`; amax
    is of x (before scaling). `scale` is a 1-element float32 tensor."""


@contract_op("cast", _scaled_cast_caps)
def cast_transpose_fp8(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor]:
    """quantize_fp8 of a 2-D x plus its transpose in one pass: (data (M,K), data_t (K,M), amax)."""


@contract_op("cast", _self_scaled_cast_caps)
def quantize_fp8_current(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    with_transpose: bool = False,
    force_pow2_scales: bool = False,
    amax_epsilon: float = 0.0,
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    """Current scaling: amax of x, then scale, then cast, in one op.

    Returns (data, data_t or None, scale, scale_inv, amax). amax_eff = max(amax, amax_epsilon);
    scale = fp8_max / amax_eff, 1.0 where amax_eff == 0, float32 max where that overflows,
    and 1.0 where amax is NaN/inf (the data then shows the NaN/inf saturation, visibly);
    with force_pow2_scales the scale is rounded down to a power of two. x has any number of
    dimensions; `with_transpose` needs a 2-D x. scale and scale_inv are 1-element float32 tensors."""


@contract_op("cast", _self_scaled_cast_caps)
def quantize_blockwise(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    block_2d: bool = False,
    with_transpose: bool = False,
    force_pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Block-scaled cast of a 2-D x (M, K) with 128-element blocks.

    1-D blocks (block_2d=False): each 1x128 run of a row shares a scale; scale_inv has shape
    (M, ceil(K/128)). 2-D blocks: each 128x128 tile shares one; scale_inv (ceil(M/128),
    ceil(K/128)). A block's scale is computed from its amax exactly as quantize_fp8_current
    does (epsilon, power of two when asked). Partial edge blocks use their own elements.

    Returns (data, scale_inv, data_t, scale_inv_t); the last two are None unless
    with_transpose, in which case they quantize x.T (K, M) with the same block shape (for 1-D
    blocks: 1x128 runs along M, scale_inv_t (K, ceil(M/128)); for 2-D: scale_inv_t = scale_inv.T).
    scale_inv tensors are float32. A 1x128 grid (rows, ceil(cols/128)) is laid out column by
    column (strides (1, rows)), as block-scaled FP8 GEMMs read it (cuBLASLt's layout), so a GEMM
    takes it without a copy; a 128x128 grid is row-major (contiguous). Under torch.compile an
    implementation's outputs must have these strides (the compiler checks them against the
    reference's)."""


@contract_op("cast", _self_scaled_cast_caps)
def quantize_mxfp8(
    x: Tensor, fp8_dtype: torch.dtype, *, with_transpose: bool = False
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """MXFP8 cast of a 2-D x (M, K), K and (with_transpose) M multiples of 32.

    Each 1x32 run of a row shares a power-of-two scale 2^e stored as E8M0: a uint8 holding
    e + 127. e is the smallest integer with amax_block / 2^e <= fp8_max (so nothing
    saturates), clamped to [-127, 127]; a zero block has e = -127. data = x / 2^e cast.
    Returns (data, scales (M, K/32) uint8, data_t, scales_t) where the transposed pair
    quantizes x.T (K, M) along M (None unless with_transpose)."""


def _transpose_caps(caps: Capabilities, data, **_):
    return caps.check_fp8(getattr(data, "dtype", None))


@contract_op("cast", _transpose_caps)
def transpose_fp8(data: Tensor) -> Tensor:
    """The transpose of a 2-D FP8 tensor (M, K) as a contiguous (K, M) tensor of the same
    dtype, bit for bit: the column-wise copy of data that was cast without one (e.g. a
    norm's or an activation's FP8 output)."""


@contract_op("cast")
def dequantize_fp8(data: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """data.float() * scale_inv, cast to out_dtype. scale_inv is 1 element."""


@contract_op("cast")
def dequantize_blockwise(data: Tensor, scale_inv: Tensor, block_2d: bool, out_dtype: torch.dtype) -> Tensor:
    """Inverse of quantize_blockwise for a 2-D data tensor with its scale_inv."""


@contract_op("cast")
def dequantize_mxfp8(data: Tensor, scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Inverse of quantize_mxfp8: data.float() * 2^(scales - 127) per 1x32 run of a row."""
