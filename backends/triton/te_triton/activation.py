"""Activations: forward (optionally FP8 out + amax), backward, and the fused backward epilogues
(dbias + cast-transpose, activation backward + dbias + cast-transpose).

Elementwise kernels work on a 2-D view (rows, cols) of x with the last dimension as cols, in
(block_m, block_n) tiles; gated kinds read a = x[:, :h] and b = x[:, h:] of a (rows, 2h) view.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import MAX_NUMEL, Config, abs_bits, amax_from_buffer, fp8_max, grid_size, new_amax_buffer, saturating_cast
from .cast import CAST_TRANSPOSE_DEFAULT, _cast_transpose_tile

ELEMENTWISE_DEFAULT = Config(block_m=16, block_n=256, num_warps=8, max_programs=0)
KIND_IDS = {"gelu": 0, "relu": 1, "silu": 2, "qgelu": 3, "srelu": 4, "geglu": 0, "reglu": 1, "swiglu": 2}
GATED = ("swiglu", "geglu", "reglu")
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act(x, KIND: tl.constexpr):
    if KIND == 0:  # gelu, tanh approximation; tanh(u) = 2 sigmoid(2u) - 1
        u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * u) - 1.0))
    elif KIND == 1:
        return tl.maximum(x, 0.0)
    elif KIND == 2:
        return x * tl.sigmoid(x)
    elif KIND == 3:
        return x * tl.sigmoid(1.702 * x)
    else:
        r = tl.maximum(x, 0.0)
        return r * r


@triton.jit
def _dact(x, KIND: tl.constexpr):
    if KIND == 0:
        u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
    elif KIND == 1:
        return tl.where(x > 0.0, 1.0, 0.0)
    elif KIND == 2:
        s = tl.sigmoid(x)
        return s + x * s * (1.0 - s)
    elif KIND == 3:
        s = tl.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1.0 - s)
    else:
        return 2.0 * tl.maximum(x, 0.0)


@triton.jit
def _tile(t, R, C, BM: tl.constexpr, BN: tl.constexpr):
    n_tn = tl.cdiv(C, BN)
    rows = (t // n_tn) * BM + tl.arange(0, BM)
    cols = (t % n_tn) * BN + tl.arange(0, BN)
    return rows, cols, (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def _act_fwd_kernel(x_ptr, y_ptr, scale_ptr, amax_ptr, R, H, fmax, KIND: tl.constexpr, GATED: tl.constexpr,
                    FP8_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """y (R, H) = act(a) [* b]; x is (R, H) or, gated, (R, 2H)."""
    x_cols = 2 * H if GATED else H
    n_tiles = tl.cdiv(R, BM) * tl.cdiv(H, BN)
    scale = tl.load(scale_ptr)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, cols, mask = _tile(t, R, H, BM, BN)
        a_off = rows[:, None] * x_cols + cols[None, :]
        y = _act(tl.load(x_ptr + a_off, mask=mask, other=0.0).to(tl.float32), KIND)
        if GATED:
            y = y * tl.load(x_ptr + a_off + H, mask=mask, other=0.0).to(tl.float32)
        out = y_ptr + rows[:, None] * H + cols[None, :]
        if FP8_OUT:
            acc = tl.maximum(acc, abs_bits(y))
            tl.store(out, saturating_cast(y * scale, fmax, y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)
    if FP8_OUT:
        tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _act_bwd_kernel(dy_ptr, x_ptr, dx_ptr, R, H, KIND: tl.constexpr, GATED: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    x_cols = 2 * H if GATED else H
    n_tiles = tl.cdiv(R, BM) * tl.cdiv(H, BN)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, cols, mask = _tile(t, R, H, BM, BN)
        a_off = rows[:, None] * x_cols + cols[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + a_off, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            b = tl.load(x_ptr + a_off + H, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + a_off, (dy * b * _dact(a, KIND)).to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_ptr + a_off + H, (dy * _act(a, KIND)).to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dx_ptr + a_off, (dy * _dact(a, KIND)).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_dbias_ct_kernel(dy_ptr, x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, dbias_ptr, M, N, fmax,
                             KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Non-gated: dx = dy * act'(x), rounded to x's dtype, then cast-transposed with dbias partials."""
    n_tn = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, BM) * n_tn
    scale = tl.load(scale_ptr)
    acc = tl.zeros([], dtype=tl.int32)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, cols, mask = _tile(t, M, N, BM, BN)
        off = rows[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + off, mask=mask, other=0.0)
        # the contract's dx is in x's dtype; quantize that rounded value, as the unfused ops do
        dx = (dy * _dact(x.to(tl.float32), KIND)).to(x.dtype).to(tl.float32)
        tile_max = _cast_transpose_tile(x_ptr, y_ptr, yt_ptr, dbias_ptr, dx, t // n_tn, t % n_tn, M, N, scale, fmax,
                                        BM, BN, True)
        acc = tl.maximum(acc, tile_max)
    tl.atomic_max(amax_ptr, acc)


def _check(x: torch.Tensor, kind: str):
    if kind not in KIND_IDS:
        raise ValueError(f"unknown activation kind {kind!r}; use one of {', '.join(KIND_IDS)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call .contiguous() first")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x has {x.numel()} elements; these kernels index with int32 (at most {MAX_NUMEL})")
    gated = kind in GATED
    cols = x.shape[-1] if x.dim() else 1
    if gated and cols % 2:
        raise ValueError(f"gated activation {kind!r} needs an even last dimension, got {cols}")
    return gated, x.numel() // max(cols, 1), cols // 2 if gated else cols


def _grid(R, H, cfg):
    return (grid_size(triton.cdiv(R, cfg.block_m) * triton.cdiv(H, cfg.block_n), cfg),)


def activation_fwd(x, kind, *, fp8_scale=None, fp8_dtype=None, cfg: Config = ELEMENTWISE_DEFAULT, amax_out=None):
    """(y, amax or None) as te_core.ops.activation_fwd."""
    gated, R, H = _check(x, kind)
    fp8_out = fp8_dtype is not None
    if amax_out is not None and not fp8_out:
        raise ValueError("amax_out records the amax of an FP8 output: pass fp8_scale and fp8_dtype too")
    fmax = fp8_max(fp8_dtype) if fp8_out else 1.0
    y = torch.empty((*x.shape[:-1], H), dtype=fp8_dtype if fp8_out else x.dtype, device=x.device)
    amax_buf = new_amax_buffer(x.device, amax_out)
    if y.numel():
        _act_fwd_kernel[_grid(R, H, cfg)](
            x, y, fp8_scale if fp8_out else amax_buf, amax_buf, R, H, fmax, KIND=KIND_IDS[kind], GATED=gated,
            FP8_OUT=fp8_out, BM=cfg.block_m, BN=cfg.block_n, num_warps=cfg.num_warps)
    return y, amax_from_buffer(amax_buf, amax_out) if fp8_out else None


def activation_bwd(dy, x, kind, cfg: Config = ELEMENTWISE_DEFAULT):
    """dx as te_core.ops.activation_bwd."""
    gated, R, H = _check(x, kind)
    if dy.shape != (*x.shape[:-1], H) or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with shape {(*x.shape[:-1], H)}, got {tuple(dy.shape)}")
    dx = torch.empty_like(x)
    if dy.numel():
        _act_bwd_kernel[_grid(R, H, cfg)](dy, x, dx, R, H, KIND=KIND_IDS[kind], GATED=gated, BM=cfg.block_m,
                                          BN=cfg.block_n, num_warps=cfg.num_warps)
    return dx


def dbias_cast_transpose(dy, scale, fp8_dtype, cfg: Config = CAST_TRANSPOSE_DEFAULT, *, amax_out=None):
    """(data, data_t, dbias, amax) as te_core.ops.dbias_cast_transpose."""
    from .cast import cast_transpose_fp8

    data, data_t, amax, dbias = cast_transpose_fp8(dy, scale, fp8_dtype, cfg, with_dbias=True, amax_out=amax_out)
    return data, data_t, dbias.to(dy.dtype), amax


def activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, cfg: Config = CAST_TRANSPOSE_DEFAULT,
                                        act_cfg: Config = ELEMENTWISE_DEFAULT, *, amax_out=None):
    """(data, data_t, dbias, amax) of dx = activation_bwd(dy, x, kind); one pass for
    non-gated kinds, activation_bwd then dbias_cast_transpose for gated ones."""
    gated, _, _ = _check(x, kind)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if gated:
        return dbias_cast_transpose(activation_bwd(dy, x, kind, act_cfg), scale, fp8_dtype, cfg, amax_out=amax_out)
    if dy.shape != x.shape or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    fmax = fp8_max(fp8_dtype)
    M, N = x.shape
    y = torch.empty((M, N), dtype=fp8_dtype, device=x.device)
    yt = torch.empty((N, M), dtype=fp8_dtype, device=x.device)
    amax_buf = new_amax_buffer(x.device, amax_out)
    partial = torch.empty((triton.cdiv(M, cfg.block_m), N), dtype=torch.float32, device=x.device)
    if x.numel():
        _act_bwd_dbias_ct_kernel[_grid(M, N, cfg)](
            dy, x, y, yt, scale, amax_buf, partial, M, N, fmax, KIND=KIND_IDS[kind], BM=cfg.block_m,
            BN=cfg.block_n, num_warps=cfg.num_warps)
    dbias = partial.sum(dim=0) if M else torch.zeros(N, dtype=torch.float32, device=x.device)
    return y, yt, dbias.to(x.dtype), amax_from_buffer(amax_buf, amax_out)
