"""Reference casts between high precision and FP8: tensor-wise, block-wise (128) and MXFP8 (32).

Also the FP8 building blocks the other reference families reuse (norm, activation, gemm):
`check_*` argument checks, `saturating_cast`, `amax_of`, `scale_from_amax` and `fp8_output`.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._torch_fixes import pad_end
from ..backend.types import FP8_FORMATS, as_dtype, fp8_max

BLOCK = 128  # elements per block of quantize_blockwise
MX_BLOCK = 32  # elements per block of quantize_mxfp8
E8M0_BIAS = 127
E8M0_NAN = 255  # the E8M0 encoding of NaN, stored for a block whose amax is NaN
FLOAT32_MAX = torch.finfo(torch.float32).max
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---------------------------------------------------------------- argument checks


def check_float(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HP_DTYPES:
        allowed = ", ".join(str(d) for d in HP_DTYPES)
        raise TypeError(f"{name} has dtype {x.dtype}; expected a high-precision float dtype ({allowed})")


def check_ndim(name: str, x: Tensor, ndim: int) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)} ({x.dim()}-D)")


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


def check_fp8_dtype(name: str, dtype) -> float:
    """The format's largest finite value; ValueError naming `name` if dtype is not FP8."""
    if dtype not in FP8_FORMATS:
        allowed = ", ".join(str(d) for d in FP8_FORMATS)
        raise ValueError(f"{name}={dtype} is not an FP8 dtype; allowed values: {allowed}")
    return fp8_max(dtype)


def check_fp8_tensor(name: str, x: Tensor) -> float:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return check_fp8_dtype(f"{name}.dtype", x.dtype)


def check_one_element(name: str, t: Tensor) -> Tensor:
    """t as a 0-dim float32 tensor (so it broadcasts against any shape, 0-dim included)."""
    if not isinstance(t, Tensor) or t.numel() != 1:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-element tensor, got {shape}")
    return t.reshape(()).float()


# ---------------------------------------------------------------- shared FP8 math


def saturating_cast(x32: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """Round-to-nearest-even cast with +-max saturation; clamp keeps NaN as NaN."""
    fmax = fp8_max(fp8_dtype)
    return torch.clamp(x32, -fmax, fmax).to(fp8_dtype)


def amax_of(x: Tensor) -> Tensor:
    """max|x| as a 0-dim float32 tensor; NaN propagates; 0 for an empty tensor."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def exact_pow2(e: Tensor) -> Tensor:
    """2^e as float32 for an integer tensor e in [-149, 127], built from its bits (pow may round)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=0) << 23  # biased exponent field, zero mantissa
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)  # 2^-149 .. 2^-127: mantissa bit only
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def scale_from_amax(amax: Tensor, fmax: float, amax_epsilon: float, force_pow2: bool) -> Tensor:
    """Current-scaling scale, elementwise over a float32 amax tensor (see ops.quantize_fp8_current)."""
    amax_eff = torch.clamp_min(amax, amax_epsilon)
    # A tensor divisor, not `fmax / amax_eff`: Python's scalar / tensor is reciprocal-then-multiply
    # in torch, which can differ in the last bit from the correctly rounded quotient.
    scale = torch.div(torch.full_like(amax_eff, fmax), amax_eff)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    keep_one = (amax_eff == 0) | ~torch.isfinite(amax)
    scale = torch.where(keep_one, torch.ones_like(scale), scale)
    if force_pow2:
        # frexp gives scale = m * 2^e with m in [0.5, 1): 2^(e-1) is the power of two below, exactly.
        _, exponent = torch.frexp(scale)
        scale = exact_pow2(exponent - 1)
    return scale


def fp8_output(
    y32: Tensor, hp_dtype: torch.dtype, fp8_scale: Optional[Tensor], fp8_dtype: Optional[torch.dtype],
    amax_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The (y, amax) pair of ops that may emit FP8 (norms, activations)."""
    if (fp8_scale is None) != (fp8_dtype is None):
        raise ValueError(
            "fp8_scale and fp8_dtype go together: pass both for FP8 output or neither for "
            f"high-precision output (got fp8_scale={'set' if fp8_scale is not None else None}, fp8_dtype={fp8_dtype})"
        )
    if fp8_dtype is None:
        if amax_out is not None:
            raise ValueError("amax_out records the amax of an FP8 output: pass fp8_scale and fp8_dtype too")
        return as_dtype(y32, hp_dtype), None
    check_fp8_dtype("fp8_dtype", fp8_dtype)
    scale = check_one_element("fp8_scale", fp8_scale)
    return saturating_cast(y32 * scale, fp8_dtype), merge_amax(amax_of(y32), amax_out)


def _check_cast_input(x: Tensor, fp8_dtype, ndim: Optional[int] = None) -> float:
    check_float("x", x)
    if ndim is not None:
        check_ndim("x", x, ndim)
    return check_fp8_dtype("fp8_dtype", fp8_dtype)


# ---------------------------------------------------------------- tensor-wise


def merge_amax(amax: Tensor, amax_out: Optional[Tensor]) -> Tensor:
    """amax, or (with amax_out) max(amax_out, amax) written into amax_out and returned."""
    if amax_out is None:
        return amax
    if not isinstance(amax_out, Tensor) or amax_out.dtype != torch.float32 or amax_out.numel() != 1:
        got = f"{amax_out.dtype} {tuple(amax_out.shape)}" if isinstance(amax_out, Tensor) else type(amax_out).__name__
        raise ValueError(f"amax_out must be a 1-element float32 tensor, got {got}")
    if amax_out.device != amax.device:
        raise ValueError(f"amax_out is on {amax_out.device} but x is on {amax.device}")
    torch.maximum(amax_out, amax.reshape(amax_out.shape), out=amax_out)
    return amax_out


def quantize_fp8(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    _check_cast_input(x, fp8_dtype)
    s = check_one_element("scale", scale)
    return saturating_cast(x.float() * s, fp8_dtype), merge_amax(amax_of(x), amax_out)


def cast_transpose_fp8(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor]:
    _check_cast_input(x, fp8_dtype, ndim=2)
    data, amax = quantize_fp8(x, scale, fp8_dtype, amax_out=amax_out)
    return data, data.t().contiguous(), amax


def quantize_fp8_current(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    with_transpose: bool = False,
    force_pow2_scales: bool = False,
    amax_epsilon: float = 0.0,
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    fmax = _check_cast_input(x, fp8_dtype, ndim=2 if with_transpose else None)
    amax = amax_of(x)
    scale = scale_from_amax(amax, fmax, amax_epsilon, force_pow2_scales)
    data = saturating_cast(x.float() * scale, fp8_dtype)
    data_t = data.t().contiguous() if with_transpose else None
    return data, data_t, scale.reshape(1), torch.reciprocal(scale).reshape(1), amax


def transpose_fp8(data: Tensor) -> Tensor:
    check_fp8_tensor("data", data)
    check_ndim("data", data, 2)
    return data.t().contiguous()


def dequantize_fp8(data: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    check_fp8_tensor("data", data)
    return as_dtype(data.float() * check_one_element("scale_inv", scale_inv), out_dtype)


# ---------------------------------------------------------------- block-wise (128)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to_blocks(x32: Tensor, rows_block: int) -> Tensor:
    """Zero-pad (M, K) so K (and M when rows_block > 1) are multiples of BLOCK; zeros leave amax alone."""
    m, k = x32.shape
    pad_m = _ceil_div(m, rows_block) * rows_block - m
    pad_k = _ceil_div(k, BLOCK) * BLOCK - k
    return pad_end(x32, pad_k, pad_m)


def _quantize_blocks(x: Tensor, fp8_dtype, block_2d: bool, pow2: bool, eps: float) -> Tuple[Tensor, Tensor]:
    m, k = x.shape
    rows_block = BLOCK if block_2d else 1
    xp = _pad_to_blocks(x.float(), rows_block)
    mb, kb = xp.shape[0] // rows_block, xp.shape[1] // BLOCK
    blocks = xp.reshape(mb, rows_block, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = scale_from_amax(amax, fp8_max(fp8_dtype), eps, pow2)
    data = saturating_cast(blocks * scale[:, None, :, None], fp8_dtype)
    data = data.reshape(xp.shape)[:m, :k].contiguous()
    return data, torch.reciprocal(scale)


def quantize_blockwise(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    block_2d: bool = False,
    with_transpose: bool = False,
    force_pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    _check_cast_input(x, fp8_dtype, ndim=2)
    data, scale_inv = _quantize_blocks(x, fp8_dtype, block_2d, force_pow2_scales, amax_epsilon)
    if not with_transpose:
        return data, scale_inv if block_2d else column_major(scale_inv), None, None
    if block_2d:  # a 128x128 tile of x.T is the transpose of a tile of x: same scale
        return data, scale_inv, data.t().contiguous(), scale_inv.t().contiguous()
    data_t, scale_inv_t = _quantize_blocks(x.t(), fp8_dtype, False, force_pow2_scales, amax_epsilon)
    return data, column_major(scale_inv), data_t, column_major(scale_inv_t)


def column_major(scales: Tensor) -> Tensor:
    """A 2-D grid laid out column by column (strides (1, rows)): the layout of 1x128 scale grids
    (see te_core.ops.quantize_blockwise); (1, rows) even where a dimension has size 1, as the
    backends allocate it."""
    out = scales.new_empty((scales.shape[1], scales.shape[0])).t()
    out.copy_(scales)
    return out


def blockwise_scale_shape(rows: int, cols: int, block_2d: bool) -> Tuple[int, int]:
    """Shape of the scale_inv of a (rows, cols) tensor quantized with 1x128 or 128x128 blocks."""
    return (_ceil_div(rows, BLOCK) if block_2d else rows, _ceil_div(cols, BLOCK))


def dequantize_blockwise(data: Tensor, scale_inv: Tensor, block_2d: bool, out_dtype: torch.dtype) -> Tensor:
    check_fp8_tensor("data", data)
    check_ndim("data", data, 2)
    m, k = data.shape
    expected = blockwise_scale_shape(m, k, block_2d)
    if tuple(scale_inv.shape) != expected:
        kind = "128x128" if block_2d else "1x128"
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)}; {kind} blocks of data {(m, k)} need {expected}"
        )
    s = scale_inv.float().repeat_interleave(BLOCK, dim=1)[:, :k]
    if block_2d:
        s = s.repeat_interleave(BLOCK, dim=0)[:m]
    return as_dtype(data.float() * s, out_dtype)


# ---------------------------------------------------------------- MXFP8 (32, E8M0)


def _check_mx_dim(name: str, size: int) -> None:
    if size % MX_BLOCK != 0:
        raise ValueError(
            f"MXFP8 needs {name} to be a multiple of {MX_BLOCK}, got {size}; pad the tensor "
            "or use block-wise (128) scaling, which handles partial blocks"
        )


def _e8m0_exponent(amax: Tensor, fmax: float) -> Tensor:
    """Smallest integer e with amax / 2^e <= fmax, computed exactly on mantissas and exponents."""
    mant, expo = torch.frexp(amax)  # amax = mant * 2^expo, mant in [0.5, 1)
    fmax_mant, fmax_expo = math.frexp(fmax)
    e = expo - fmax_expo + (mant > fmax_mant).to(expo.dtype)
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e)
    # inf/NaN blocks: the largest scale, so the data shows the saturation (their E8M0 is 254/255)
    e = torch.where(~torch.isfinite(amax), torch.full_like(e, E8M0_BIAS), e)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def _quantize_mx_rows(x: Tensor, fp8_dtype) -> Tuple[Tensor, Tensor]:
    m, k = x.shape
    # contiguous first: the blocks of a strided x (x.t() for data_t) would be views keeping its
    # strides, and so would the data; the contract's outputs are contiguous, as a kernel writes them
    blocks = x.float().contiguous().reshape(m, k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    e = _e8m0_exponent(amax, fp8_max(fp8_dtype))
    data = saturating_cast(blocks * exact_pow2(-e)[..., None], fp8_dtype).reshape(m, k)
    stored = torch.where(torch.isnan(amax), torch.full_like(e, E8M0_NAN), e + E8M0_BIAS)
    return data, stored.to(torch.uint8)


def quantize_mxfp8(
    x: Tensor, fp8_dtype: torch.dtype, *, with_transpose: bool = False
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    _check_cast_input(x, fp8_dtype, ndim=2)
    _check_mx_dim("K (x.shape[1])", x.shape[1])
    data, scales = _quantize_mx_rows(x, fp8_dtype)
    if not with_transpose:
        return data, scales, None, None
    _check_mx_dim("M (x.shape[0], since with_transpose=True)", x.shape[0])
    data_t, scales_t = _quantize_mx_rows(x.t(), fp8_dtype)
    return data, scales, data_t, scales_t


def dequantize_mxfp8(data: Tensor, scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    check_fp8_tensor("data", data)
    check_ndim("data", data, 2)
    m, k = data.shape
    _check_mx_dim("K (data.shape[1])", k)
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (m, k // MX_BLOCK):
        raise ValueError(
            f"scales must be uint8 E8M0 of shape {(m, k // MX_BLOCK)} for data {(m, k)}, "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )
    s = exact_pow2(scales.to(torch.int32) - E8M0_BIAS)
    s = torch.where(scales == E8M0_NAN, torch.full_like(s, float("nan")), s).repeat_interleave(MX_BLOCK, dim=1)
    return as_dtype(data.float() * s, out_dtype)
