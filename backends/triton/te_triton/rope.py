"""Rotary position embedding, forward (+angle) and backward (-angle), sbhd or bshd layout.

A program owns one (position, batch) slice of all heads, a (heads, head_dim) tile: the angles
of that position are loaded and their cos/sin computed once for every head. Each channel's
rotation partner (the other half, or the neighbour when interleaved) is a second load of
the same tile from cache. The backward is the forward's transpose: a channel's partner term
takes the partner's angle (equal to the channel's own where freqs is built as TE builds it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import MAX_NUMEL, Config, check_device, check_hp_input, grid_size, next_power_of_2
from .launch import launcher

ROPE_DEFAULT = Config(num_warps=4, max_programs=0)


@launcher
@triton.jit
def _rope_kernel(x_ptr, f_ptr, y_ptr, P, S, B, H, D, R, SBHD: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BACKWARD: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    heads = tl.arange(0, BH)
    cols = tl.arange(0, BD)
    rotated = cols < R
    angle_idx = cols  # every channel reads its own angle (interleaved: built [f0, f0, f1, f1, ...])
    if INTERLEAVED:
        partner = cols ^ 1
        partner_sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        half = R // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        partner_sign = tl.where(cols < half, -1.0, 1.0)
    mask = (heads[:, None] < H) & (cols[None, :] < D)
    pmask = mask & rotated[None, :]
    for p in range(tl.program_id(0), P, tl.num_programs(0)):
        seq = p // B if SBHD else p % S
        theta = tl.load(f_ptr + seq * R + angle_idx, mask=rotated, other=0.0)
        cos = tl.cos(theta)
        if BACKWARD:  # the transpose: the partner's term with the partner's angle, its sign flipped
            sin = -tl.sin(tl.load(f_ptr + seq * R + partner, mask=rotated, other=0.0)) * partner_sign
        else:
            sin = tl.sin(theta) * partner_sign
        base = p * H * D + heads[:, None] * D
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + base + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
        y = tl.where(rotated[None, :], x * cos[None, :] + xp * sin[None, :], x)
        tl.store(y_ptr + base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _rope(x, freqs, tensor_format, interleaved, backward, cfg):
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format must be 'sbhd' or 'bshd', got {tensor_format!r}")
    if x.dim() != 4 or not x.is_contiguous() or x.numel() > MAX_NUMEL:
        raise ValueError(f"x must be a contiguous 4-D tensor of under 2^31 elements, got shape {tuple(x.shape)}")
    check_hp_input(x)
    S, B = (x.shape[0], x.shape[1]) if tensor_format == "sbhd" else (x.shape[1], x.shape[0])
    H, D = x.shape[2], x.shape[3]
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1 or freqs.shape[0] < S:
        raise ValueError(f"freqs must be (s, 1, 1, r) with s >= {S}, got {tuple(freqs.shape)}")
    check_device(freqs, x, "freqs")
    R = freqs.shape[-1]
    if R % 2 or R > D:
        raise ValueError(f"freqs rotates r={R} channels; r must be even and <= the head dim {D}")
    f = freqs[:S].reshape(S, R).float().contiguous()
    y = torch.empty_like(x)
    P = S * B
    if x.numel():
        _rope_kernel[(grid_size(P, cfg),)](x, f, y, P, S, B, H, D, R, SBHD=tensor_format == "sbhd",
                                           INTERLEAVED=bool(interleaved), BACKWARD=backward,
                                           BH=next_power_of_2(H), BD=next_power_of_2(D), num_warps=cfg.num_warps)
    return y


def rope_fwd(x, freqs, *, tensor_format="sbhd", interleaved=False, cfg: Config = ROPE_DEFAULT):
    """y as te_core.ops.rope_fwd."""
    return _rope(x, freqs, tensor_format, interleaved, False, cfg)


def rope_bwd(dy, freqs, *, tensor_format="sbhd", interleaved=False, cfg: Config = ROPE_DEFAULT):
    """dx as te_core.ops.rope_bwd: the forward's transpose applied to dy."""
    return _rope(dy, freqs, tensor_format, interleaved, True, cfg)
