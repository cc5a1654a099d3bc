"""Reference scaled, masked softmax of attention scores, and the causal masks attention shares.

`masked_softmax` is written so that rows with every position masked give zeros, with no NaN
in the forward or in the autograd backward (attention differentiates through it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..backend.types import as_dtype
from .cast import check_float, check_ndim


def causal_mask(sq: int, sk: int, device, bottom_right: bool) -> Tensor:
    """(sq, sk) bool, True where key j is masked for query i: j > i (+ sk - sq when bottom-right)."""
    offset = sk - sq if bottom_right else 0
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=offset + 1)


def check_bool_mask(name: str, mask: Tensor, shape) -> None:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a bool tensor (True = masked out), got {got}")
    try:
        ok = torch.broadcast_shapes(mask.shape, shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}")


def masked_softmax(scores32: Tensor, masked: Optional[Tensor]) -> Tensor:
    """softmax over the last dim of float32 scores, excluding positions where `masked` is True."""
    if scores32.shape[-1] == 0:  # no keys (an empty sequence): empty rows, as fully masked ones are zero
        return scores32.clone()
    if masked is not None:
        scores32 = scores32.masked_fill(masked, float("-inf"))
    row_max = scores32.detach().amax(dim=-1, keepdim=True)
    # Fully masked rows have max -inf: shift by 0 instead so exp gives exact zeros, not NaN.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores32 - row_max)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def softmax_fwd(x: Tensor, scale: float, *, mask: Optional[Tensor] = None, causal: bool = False) -> Tensor:
    check_float("x", x)
    check_ndim("x", x, 4)
    masked = None
    if mask is not None:
        check_bool_mask("mask", mask, x.shape)
        masked = mask
    if causal:
        tri = causal_mask(x.shape[-2], x.shape[-1], x.device, bottom_right=True)
        masked = tri if masked is None else masked | tri
    return as_dtype(masked_softmax(x.float() * scale, masked), x.dtype)


def softmax_bwd(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    check_float("dy", dy)
    check_float("y", y)
    if dy.shape != y.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)}; it must match y {tuple(y.shape)}")
    dy32, y32 = dy.float(), y.float()
    dx = scale * y32 * (dy32 - (dy32 * y32).sum(dim=-1, keepdim=True))
    return as_dtype(dx, dy.dtype)
