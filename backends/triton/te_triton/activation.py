"""Activations: forward (optionally FP8 out + amax) and backward. The fused backward epilogues
(activation backward + dbias + cast-transpose) are in dbias.py.

Elementwise kernels work on a 2-D view (rows, cols) of x with the last dimension as cols, in
(block_m, block_n) tiles; gated kinds read a = x[:, :h] and b = x[:, h:] of a (rows, 2h) view.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, MAX_NUMEL, Config, abs_bits, amax_from_buffer, answered, as_float32, cdiv,
                      check_device, check_hp_input, fp8_max, fp8_out_args, grid_size, max_into, new_amax_buffer,
                      saturating_cast)
from .launch import launcher

ELEMENTWISE_DEFAULT = Config(block_m=16, block_n=256, num_warps=8, max_programs=0)
KIND_IDS = {"gelu": 0, "relu": 1, "silu": 2, "qgelu": 3, "srelu": 4, "geglu": 0, "reglu": 1, "swiglu": 2}
GATED = ("swiglu", "geglu", "reglu")
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
# gelu(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3); as a
# power of two: exp(-2u) = 2^(x (GELU_K1 + GELU_K3 x^2))
GELU_K1 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634)
GELU_K3 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715)
NEG_LOG2E = tl.constexpr(-1.4426950408889634)
QGELU_K = tl.constexpr(-1.702 * 1.4426950408889634)


@triton.jit
def _act(x, KIND: tl.constexpr):
    """Forward activations written as x / (1 + 2^(...)): one exp2 and one (non-IEEE, 2 ulp)
    division per element, which keeps the FP8-out forward kernels memory-bound."""
    if KIND == 0:
        return tl.fdiv(x, 1.0 + tl.exp2(x * (GELU_K1 + GELU_K3 * x * x)))
    elif KIND == 1:
        return tl.maximum(x, 0.0)
    elif KIND == 2:
        return tl.fdiv(x, 1.0 + tl.exp2(x * NEG_LOG2E))
    elif KIND == 3:
        return tl.fdiv(x, 1.0 + tl.exp2(x * QGELU_K))
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


@launcher
@triton.jit
def _act_fwd_kernel(x_ptr, y_ptr, scale_ptr, amax_ptr, R, H, fmax, KIND: tl.constexpr, GATED: tl.constexpr,
                    FP8_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CLAMP: tl.constexpr):
    """y (R, H) = act(a) [* b]; x is (R, H) or, gated, (R, 2H). fmax as float32 (as_float32: a
    launch from compiled code passes it as float64)."""
    fmax = as_float32(fmax)
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
            tl.store(out, saturating_cast(y * scale, fmax, y_ptr.dtype.element_ty, CLAMP), mask=mask)
        else:
            tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)
    if FP8_OUT:
        max_into(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@launcher
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


def _check(x: torch.Tensor, kind: str):
    if kind not in KIND_IDS:
        raise ValueError(f"unknown activation kind {kind!r}; use one of {', '.join(KIND_IDS)}")
    check_hp_input(x)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call .contiguous() first")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x has {x.numel()} elements; these kernels index with int32 (at most {MAX_NUMEL})")
    gated = kind in GATED
    cols = x.shape[-1] if x.dim() else 1
    if gated and cols % 2:
        raise ValueError(f"gated activation {kind!r} needs an even last dimension, got {cols}")
    return gated, x.numel() // max(cols, 1), cols // 2 if gated else cols


def _check_float(x: torch.Tensor, kind: str):
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    return _check(x, kind)


def _check_dy(dy: torch.Tensor, x: torch.Tensor, kind: str) -> None:
    _, _, h = _check_float(x, kind)
    if dy.shape != (*x.shape[:-1], h) or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with shape {(*x.shape[:-1], h)}, got {tuple(dy.shape)}")
    check_device(dy, x, "dy")


def _no_params(kind: str, params: dict) -> None:
    if params:  # (clamped_swiglu's limit and alpha: a kind these kernels do not have)
        raise ValueError(f"activation {kind!r} with parameters {sorted(params)} has no kernel here")


# For backends that bind the launchers generically (the launcher's own checks, answered instead
# of raised, so that the reference takes what these kernels do not: other kinds, strided inputs).
def activation_fwd_supports(x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None, **params):
    def check():
        _no_params(kind, params)
        _check_float(x, kind)

    return answered(check)


def activation_bwd_supports(dy, x, kind, **params):
    def check():
        _no_params(kind, params)
        _check_dy(dy, x, kind)

    return answered(check)


def _grid(R, H, cfg):
    return (grid_size(cdiv(R, cfg.block_m) * cdiv(H, cfg.block_n), cfg),)


def activation_fwd(x, kind, *, fp8_scale=None, fp8_dtype=None, cfg: Config = ELEMENTWISE_DEFAULT, amax_out=None):
    """(y, amax or None) as te_core.ops.activation_fwd."""
    gated, R, H = _check(x, kind)
    fp8_out = fp8_out_args(x, fp8_scale, fp8_dtype)
    if amax_out is not None and not fp8_out:
        raise ValueError("amax_out records the amax of an FP8 output: pass fp8_scale and fp8_dtype too")
    fmax = fp8_max(fp8_dtype) if fp8_out else 1.0
    y = torch.empty((*x.shape[:-1], H), dtype=fp8_dtype if fp8_out else x.dtype, device=x.device)
    # without FP8 out the kernel only reads a scale it then ignores: x stands in, no buffer is zeroed
    amax_buf = new_amax_buffer(x.device, amax_out) if fp8_out else x
    if y.numel():
        _act_fwd_kernel[_grid(R, H, cfg)](
            x, y, fp8_scale if fp8_out else amax_buf, amax_buf, R, H, fmax, KIND=KIND_IDS[kind], GATED=gated,
            FP8_OUT=fp8_out, BM=cfg.block_m, BN=cfg.block_n, CLAMP=not cfg.hw_saturate, num_warps=cfg.num_warps)
    return y, amax_from_buffer(amax_buf, amax_out) if fp8_out else None


def activation_bwd(dy, x, kind, cfg: Config = ELEMENTWISE_DEFAULT):
    """dx as te_core.ops.activation_bwd."""
    gated, R, H = _check(x, kind)
    if dy.shape != (*x.shape[:-1], H) or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with shape {(*x.shape[:-1], H)}, got {tuple(dy.shape)}")
    check_device(dy, x, "dy")
    dx = torch.empty_like(x)
    if dy.numel():
        _act_bwd_kernel[_grid(R, H, cfg)](dy, x, dx, R, H, KIND=KIND_IDS[kind], GATED=gated, BM=cfg.block_m,
                                          BN=cfg.block_n, num_warps=cfg.num_warps)
    return dx
