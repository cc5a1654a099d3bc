"""Reference rotary position embedding: both layouts, interleaved (GPT-J) or not (GPT-NeoX).

The backward is the forward's transpose: each channel's own cosine, and its partner's term
with the partner's angle. Where a pair's two angles are equal (freqs built as TE builds them)
that is the rotation by the negated angle; freqs of any other values get the exact gradient too.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..backend.types import as_dtype
from .cast import check_choice, check_float, check_ndim

TENSOR_FORMATS = ("sbhd", "bshd")


def _angles(x: Tensor, freqs: Tensor, tensor_format: str) -> Tensor:
    """freqs as float32, checked and shaped to broadcast against x's first r channels."""
    check_choice("tensor_format", tensor_format, TENSOR_FORMATS)
    check_ndim("x", x, 4)
    check_float("freqs", freqs)
    check_ndim("freqs", freqs, 4)
    seq = x.shape[0] if tensor_format == "sbhd" else x.shape[1]
    s, one_b, one_h, r = freqs.shape
    if one_b != 1 or one_h != 1 or s < seq:
        raise ValueError(
            f"freqs has shape {tuple(freqs.shape)}; expected (s, 1, 1, r) with s >= {seq}, "
            f"the sequence length of x {tuple(x.shape)} in {tensor_format!r} format"
        )
    if r % 2 != 0 or r > x.shape[-1]:
        raise ValueError(f"freqs rotates r={r} channels; r must be even and <= the head dim {x.shape[-1]}")
    angles = freqs[:seq].float()
    return angles if tensor_format == "sbhd" else angles.transpose(0, 1)


def _rotate(x: Tensor, angles: Tensor, backward: bool, interleaved: bool) -> Tensor:
    """Forward: y[c] = x[c] cos(a[c]) + s[c] x[p(c)] sin(a[c]), with p(c) the channel paired with c
    and s[c] = -1 for a pair's first channel, +1 for its second. Backward, its transpose:
    dx[c] = dy[c] cos(a[c]) - s[c] dy[p(c)] sin(a[p(c)])."""
    r = angles.shape[-1]
    x32 = x.float()
    rot, rest = x32[..., :r], x32[..., r:]
    sign = -1.0 if backward else 1.0
    if interleaved:
        # each channel reads its own angle (TE builds them [f0, f0, f1, f1, ...])
        theta_even, theta_odd = angles[..., 0::2], angles[..., 1::2]
        sin_even, sin_odd = (theta_odd, theta_even) if backward else (theta_even, theta_odd)
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack(
            [even * torch.cos(theta_even) - odd * (sign * torch.sin(sin_even)),
             odd * torch.cos(theta_odd) + even * (sign * torch.sin(sin_odd))], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        sin_angles = torch.cat([angles[..., r // 2:], angles[..., : r // 2]], dim=-1) if backward else angles
        rotated = rot * torch.cos(angles) + torch.cat([-x2, x1], dim=-1) * (sign * torch.sin(sin_angles))
    return as_dtype(torch.cat([rotated, rest], dim=-1), x.dtype)


def rope_fwd(x: Tensor, freqs: Tensor, *, tensor_format: str = "sbhd", interleaved: bool = False) -> Tensor:
    check_float("x", x)
    return _rotate(x, _angles(x, freqs, tensor_format), False, interleaved)


def rope_bwd(dy: Tensor, freqs: Tensor, *, tensor_format: str = "sbhd", interleaved: bool = False) -> Tensor:
    check_float("dy", dy)
    return _rotate(dy, _angles(dy, freqs, tensor_format), True, interleaved)
