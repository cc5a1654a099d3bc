"""MXFP8 casts: one power-of-two E8M0 scale per 32 consecutive elements (te_core.ops.quantize_mxfp8).

A program owns a (BM, BK) tile, both multiples of 32. Row-wise, each row of the tile holds
BK / 32 blocks; column-wise (the copy of x.T), each column holds BM / 32 blocks of consecutive
rows, so one read of the tile gives both layouts. A block's exponent comes from the bits of
its amax (the max of |x| as integer bits, so NaN wins), exactly as the contract defines it:
the smallest e with amax / 2^e <= fmax, clamped to [-127, 127]; zero blocks take -127 and
inf/NaN blocks 127 (stored as 254, or 255 for NaN). The data is x * 2^-e, an exact product,
then the saturating cast.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import Config, abs_bits, cdiv, check_2d_input, check_device, fp8_max, saturating_cast
from .cast import check_dequantize_args, transpose_clamps
from .launch import launcher

MX = 32  # elements per scale
MXFP8_DEFAULT = Config(block_m=64, block_n=64, num_warps=4)


@triton.jit
def _exponent(amax_bits, FMAX_EXP: tl.constexpr):
    """The block exponent e of a float32 amax given as its bits. For a normal amax (exponent
    field E, mantissa M) frexp gives 2^(E - 126) times (1 + M / 2^23) / 2; both FP8 maxes have
    frexp mantissa 0.875, so e = (E - 126) - FMAX_EXP + (M > 0.75 * 2^23). A subnormal amax
    lands below -127 either way, where e is clamped."""
    field = (amax_bits >> 23) & 0xFF
    e = field - 126 - FMAX_EXP + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(amax_bits == 0, -127, e)
    e = tl.where(field == 0xFF, 127, e)  # inf or NaN
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _pow2(n):
    """2^n as float32 from its bits, for integers n in [-127, 127] (2^-127 is subnormal)."""
    normal = ((n + 127) << 23).to(tl.float32, bitcast=True)
    subnormal = (tl.full(n.shape, 1, tl.int32) << tl.maximum(n + 149, 0)).to(tl.float32, bitcast=True)
    return tl.where(n >= -126, normal, subnormal)


@triton.jit
def _stored(e, amax_bits):
    """The E8M0 byte: e + 127, or 255 for a NaN block."""
    return tl.where(amax_bits > 0x7F800000, 255, e + 127).to(tl.uint8)


@launcher
@triton.jit
def _mxfp8_kernel(x_ptr, y_ptr, s_ptr, yt_ptr, st_ptr, M, K, fmax, FMAX_EXP: tl.constexpr, BM: tl.constexpr,
                  BK: tl.constexpr, TRANSPOSE: tl.constexpr, CLAMP: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = abs_bits(v)
    # row-wise: (BM, BK / 32) blocks of 32 columns
    amax = tl.max(tl.reshape(bits, (BM, BK // 32, 32)), axis=2)
    e = _exponent(amax, FMAX_EXP)
    scaled = tl.reshape(tl.reshape(v, (BM, BK // 32, 32)) * _pow2(-e)[:, :, None], (BM, BK))
    tl.store(y_ptr + rows[:, None] * K + cols[None, :], saturating_cast(scaled, fmax, y_ptr.dtype.element_ty, CLAMP),
             mask=mask)
    kb = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    tl.store(s_ptr + rows[:, None] * (K // 32) + kb[None, :], _stored(e, amax),
             mask=(rows[:, None] < M) & (kb[None, :] < K // 32))
    if TRANSPOSE:
        # column-wise: (BM / 32, BK) blocks of 32 rows, written to x.T's copy (K, M)
        amax_t = tl.max(tl.reshape(bits, (BM // 32, 32, BK)), axis=1)
        e_t = _exponent(amax_t, FMAX_EXP)
        scaled_t = tl.reshape(tl.reshape(v, (BM // 32, 32, BK)) * _pow2(-e_t)[:, None, :], (BM, BK))
        q_t = saturating_cast(scaled_t, fmax, yt_ptr.dtype.element_ty, CLAMP)
        tl.store(yt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q_t),
                 mask=(cols[:, None] < K) & (rows[None, :] < M))
        mb = tl.program_id(0) * (BM // 32) + tl.arange(0, BM // 32)
        tl.store(st_ptr + cols[:, None] * (M // 32) + mb[None, :], tl.trans(_stored(e_t, amax_t)),
                 mask=(cols[:, None] < K) & (mb[None, :] < M // 32))


def _check_tile(cfg: Config) -> None:
    if cfg.block_m % MX or cfg.block_n % MX:
        raise ValueError(f"cfg.block_m and cfg.block_n must be multiples of {MX}, got {cfg.block_m}, {cfg.block_n}")


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype, *, with_transpose: bool = False,
                   cfg: Config = MXFP8_DEFAULT):
    """(data (M, K), scales (M, K/32) uint8, data_t (K, M) or None, scales_t (K, M/32) or None),
    as te_core.ops.quantize_mxfp8: K (and M with the transpose) must be multiples of 32.
    cfg.block_m and cfg.block_n (the tile) must be multiples of 32 and powers of two."""
    fmax = fp8_max(fp8_dtype)
    check_2d_input(x)
    M, K = x.shape
    if K % MX or (with_transpose and M % MX):
        raise ValueError(f"MXFP8 needs K{' and M' if with_transpose else ''} to be multiples of {MX}, "
                         f"got shape {(M, K)}")
    _check_tile(cfg)
    fmax_mantissa, fmax_exp = math.frexp(fmax)
    if fmax_mantissa != 0.875:  # (E4M3's 448 and E5M2's 57344 both are 0.875 * 2^n)
        raise ValueError(f"the block exponent rule here assumes an FP8 max of 0.875 * 2^n, got {fmax}")
    dev = x.device
    data = torch.empty((M, K), dtype=fp8_dtype, device=dev)
    scales = torch.empty((M, K // MX), dtype=torch.uint8, device=dev)
    data_t = torch.empty((K, M), dtype=fp8_dtype, device=dev) if with_transpose else None
    scales_t = torch.empty((K, M // MX), dtype=torch.uint8, device=dev) if with_transpose else None
    if x.numel():
        _mxfp8_kernel[(cdiv(M, cfg.block_m), cdiv(K, cfg.block_n))](
            x, data, scales, data if data_t is None else data_t, scales if scales_t is None else scales_t,
            M, K, fmax, FMAX_EXP=fmax_exp, BM=cfg.block_m, BK=cfg.block_n,
            TRANSPOSE=bool(with_transpose), num_warps=cfg.num_warps,
            CLAMP=transpose_clamps(cfg, x, with_transpose))
    return data, scales, data_t, scales_t


@launcher
@triton.jit
def _dequantize_mxfp8_kernel(x_ptr, s_ptr, y_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    kb = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    stored = tl.load(s_ptr + rows[:, None] * (K // 32) + kb[None, :],
                     mask=(rows[:, None] < M) & (kb[None, :] < K // 32), other=127).to(tl.int32)
    scale = tl.where(stored == 255, float("nan"), _pow2(stored - 127))
    v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.reshape(tl.reshape(v, (BM, BK // 32, 32)) * scale[:, :, None], (BM, BK))
    tl.store(y_ptr + rows[:, None] * K + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype,
                     cfg: Config = MXFP8_DEFAULT) -> torch.Tensor:
    """data (M, K) FP8 times 2^(scales - 127) per 1x32 run of a row (NaN where a scale is 255),
    as te_core.ops.dequantize_mxfp8."""
    if data.dim() != 2 or not data.is_contiguous():
        raise ValueError(f"data must be a contiguous 2-D tensor, got shape {tuple(data.shape)}")
    check_dequantize_args(data, out_dtype)  # (uint8 bytes or floats would be read as numbers, not FP8 codes)
    M, K = data.shape
    if K % MX or scales.dtype != torch.uint8 or tuple(scales.shape) != (M, K // MX) or not scales.is_contiguous():
        raise ValueError(f"data (M, K) needs K a multiple of {MX} and contiguous uint8 scales of shape "
                         f"{(M, K // MX)}; got data {(M, K)}, scales {scales.dtype} {tuple(scales.shape)}")
    check_device(scales, data, "scales", "data")
    _check_tile(cfg)
    out = torch.empty((M, K), dtype=out_dtype, device=data.device)
    if data.numel():
        _dequantize_mxfp8_kernel[(cdiv(M, cfg.block_m), cdiv(K, cfg.block_n))](
            data, scales, out, M, K, BM=cfg.block_m, BK=cfg.block_n, num_warps=cfg.num_warps)
    return out
