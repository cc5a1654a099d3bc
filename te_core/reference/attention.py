"""Reference scaled dot-product attention: float32 math, differentiable through autograd.

GQA/MQA repeats each kv head for its group of query heads; masks and fully-masked rows are
handled by softmax.masked_softmax; dropout draws from the default generator of q's device.
"""
from __future__ import annotations

import math
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..ops.attention import ATTN_MASK_TYPES
from ..backend.types import as_dtype
from .cast import check_choice, check_float, check_ndim
from .softmax import causal_mask, check_bool_mask, masked_softmax

_NEEDS_MASK = ("padding", "padding_causal", "arbitrary")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> int:
    """The number of query heads per kv head."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        check_ndim(name, t, 4)
    b, hq, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"k head dim {k.shape[3]} != q head dim {d} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on heads and sequence length")
    hkv = k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv}) for GQA/MQA")
    return hq // hkv


def _build_mask(mask_type: str, attention_mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """Bool mask broadcastable to (b, hq, sq, sk), True = masked out; None for no mask."""
    check_choice("attn_mask_type", mask_type, ATTN_MASK_TYPES)
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    if mask_type in _NEEDS_MASK and attention_mask is None:
        raise ValueError(f"attn_mask_type={mask_type!r} needs attention_mask (bool, True = masked out)")
    if mask_type not in _NEEDS_MASK and attention_mask is not None:
        raise ValueError(
            f"attention_mask was given but attn_mask_type={mask_type!r} ignores it; "
            f"use one of {', '.join(map(repr, _NEEDS_MASK))}"
        )
    if attention_mask is not None:
        check_bool_mask("attention_mask", attention_mask, (b, hq, sq, sk))
    if mask_type in ("padding", "padding_causal"):
        if tuple(attention_mask.shape) != (b, 1, 1, sk):
            raise ValueError(
                f"attn_mask_type={mask_type!r} needs attention_mask of shape {(b, 1, 1, sk)}, "
                f"got {tuple(attention_mask.shape)}"
            )
    masked = attention_mask
    if mask_type in ("causal", "causal_bottom_right", "padding_causal"):
        tri = causal_mask(sq, sk, q.device, bottom_right=mask_type == "causal_bottom_right")
        masked = tri if masked is None else masked | tri
    return masked


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask_type: str = "no_mask",
    attention_mask: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> Tensor:
    group = _check_qkv(q, k, v)
    masked = _build_mask(attn_mask_type, attention_mask, q, k)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    probs = masked_softmax((q.float() @ k32.transpose(-2, -1)) * scale, masked)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return as_dtype(probs @ v32, q.dtype)
