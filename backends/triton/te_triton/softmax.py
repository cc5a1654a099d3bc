"""Scaled, masked, causal softmax of attention scores (b, h, sq, sk): forward and backward.

A program owns whole rows (BLOCK_N >= sk) and loops over rows. The mask is read through
broadcast strides (0 on broadcast dimensions), so a (b, 1, 1, sk) padding mask is never
expanded in memory. Rows with every position masked give zeros, as in the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import MAX_NUMEL, Config, check_device, check_hp_input, grid_size, next_power_of_2
from .launch import launcher

SOFTMAX_DEFAULT = Config(num_warps=4, max_programs=0)
MAX_SK = 32768


@launcher
@triton.jit
def _softmax_fwd_kernel(x_ptr, y_ptr, mask_ptr, R, H, SQ, SK, scale, msb, msh, msq, msk,
                        BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        q = row % SQ
        bh = row // SQ
        valid = cols < SK
        x = tl.load(x_ptr + row * SK + cols, mask=valid, other=0.0).to(tl.float32) * scale
        keep = valid
        if HAS_MASK:
            m = tl.load(mask_ptr + (bh // H) * msb + (bh % H) * msh + q * msq + cols * msk, mask=valid, other=1)
            keep = keep & (m == 0)
        if CAUSAL:
            keep = keep & (cols <= q + SK - SQ)
        x = tl.where(keep, x, float("-inf"))
        row_max = tl.max(x, axis=0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        e = tl.where(keep, tl.exp(x - row_max), 0.0)
        total = tl.sum(e, axis=0)
        y = e / tl.where(total > 0.0, total, 1.0)
        tl.store(y_ptr + row * SK + cols, y.to(y_ptr.dtype.element_ty), mask=valid)


@launcher
@triton.jit
def _softmax_bwd_kernel(dy_ptr, y_ptr, dx_ptr, R, SK, scale, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    valid = cols < SK
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        dy = tl.load(dy_ptr + row * SK + cols, mask=valid, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * SK + cols, mask=valid, other=0.0).to(tl.float32)
        dx = scale * y * (dy - tl.sum(dy * y, axis=0))
        tl.store(dx_ptr + row * SK + cols, dx.to(dx_ptr.dtype.element_ty), mask=valid)


def _check(x: torch.Tensor, name: str = "x"):
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D (b, h, sq, sk), got shape {tuple(x.shape)}")
    check_hp_input(x, name)
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    if x.shape[-1] > MAX_SK or x.numel() > MAX_NUMEL:
        raise ValueError(f"rows of {x.shape[-1]} keys (max {MAX_SK}) or {x.numel()} elements are too large here")


def softmax_fwd(x, scale: float, *, mask: Optional[torch.Tensor] = None, causal: bool = False,
                cfg: Config = SOFTMAX_DEFAULT):
    """y as te_core.ops.softmax_fwd."""
    _check(x)
    b, h, sq, sk = x.shape
    y = torch.empty_like(x)
    strides = (0, 0, 0, 0)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = masked out), got {mask.dtype}")
        check_device(mask, x, "mask")
        try:
            mask = mask.expand(b, h, sq, sk).view(torch.uint8)  # a view: broadcast dimensions get stride 0
        except RuntimeError:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape "
                             f"{(b, h, sq, sk)}") from None
        strides = mask.stride()
    R = b * h * sq
    if R:
        _softmax_fwd_kernel[(grid_size(R, cfg),)](
            x, y, y if mask is None else mask, R, h, sq, sk, float(scale), *strides,
            BLOCK_N=next_power_of_2(sk), HAS_MASK=mask is not None, CAUSAL=bool(causal), num_warps=cfg.num_warps)
    return y


def softmax_bwd(dy, y, scale: float, cfg: Config = SOFTMAX_DEFAULT):
    """dx as te_core.ops.softmax_bwd."""
    _check(dy, "dy")
    if y.shape != dy.shape or not y.is_contiguous():
        raise ValueError(f"y must be contiguous with dy's shape {tuple(dy.shape)}, got {tuple(y.shape)}")
    check_device(y, dy, "y", "dy")
    dx = torch.empty_like(dy)
    R = dy.numel() // max(dy.shape[-1], 1)
    if R:
        _softmax_bwd_kernel[(grid_size(R, cfg),)](dy, y, dx, R, dy.shape[-1], float(scale),
                                                  BLOCK_N=next_power_of_2(dy.shape[-1]), num_warps=cfg.num_warps)
    return dx
