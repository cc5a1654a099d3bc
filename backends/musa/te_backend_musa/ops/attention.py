"""Attention through SDPA, which torch_musa backs with muDNN's math and flash kernels.

Flash on MUSA needs fp16/bf16 and head dims <= 128 (plus (192, 128) and (160, 160) on arch
>= 2.2); calls outside that decline, so the reference runs rather than SDPA's slow math path.
Masks are passed as explicit boolean masks (SDPA: True = attend) except plain causal with
sq == sk, the only case where every SDPA kernel agrees on the diagonal. A query row whose
keys are all masked is unmasked for the kernel (so softmax stays finite and its gradient
zero) and its output zeroed afterwards, as the contract asks.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from te_core.ops import ATTN_MASK_TYPES
from torch import Tensor

from ..runtime import arch_of
from .activation import MUDNN_FUSED_MIN_ARCH
from .gemm import Verdict

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 128
FLASH_EXTRA_HEAD_DIMS = ((192, 128), (160, 160))  # (d_qk, d_v), arch >= 2.2


def masked_out(attn_mask_type: str, attention_mask: Optional[Tensor], sq: int, sk: int, device) -> Optional[Tensor]:
    """Boolean mask broadcastable to (b, h, sq, sk), True where a key is masked out."""
    if attn_mask_type == "no_mask":
        return None
    if attn_mask_type == "arbitrary":
        return attention_mask.bool()
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if attn_mask_type == "causal_bottom_right":
        return ones.triu(sk - sq + 1)
    causal = ones.triu(1)
    if attn_mask_type == "causal":
        return causal
    padding = attention_mask.bool()
    return padding if attn_mask_type == "padding" else padding | causal


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
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # explicit GQA: SDPA's enable_gqa is not known to reach MUSA's flash kernel
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    if attn_mask_type == "causal" and sq == sk:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=softmax_scale)
    masked = masked_out(attn_mask_type, attention_mask, sq, sk, q.device)
    if masked is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=softmax_scale)
    dead_rows = masked.all(dim=-1, keepdim=True)
    keep = ~(masked & ~dead_rows)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=softmax_scale)
    return out.masked_fill(dead_rows, 0.0)


def attention_supports(q, k, v, *, attn_mask_type="no_mask", attention_mask=None, softmax_scale=None, dropout_p=0.0,
                       **extensions) -> Verdict:
    if attn_mask_type not in ATTN_MASK_TYPES:
        return False, f"attn_mask_type {attn_mask_type!r} is not one of {ATTN_MASK_TYPES}"
    if attn_mask_type == "padding_causal_bottom_right":
        return False, f"attn_mask_type {attn_mask_type!r} is not implemented by the MUSA backend"
    given = sorted(name for name, value in extensions.items() if value not in (None, "no_bias"))
    if given:  # sliding window, query padding and attention bias are not implemented here
        return False, f"{', '.join(given)} not implemented by the MUSA backend"
    if attn_mask_type in ("padding", "padding_causal", "arbitrary") and attention_mask is None:
        return False, f"attn_mask_type {attn_mask_type!r} needs attention_mask"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False, "q, k, v must be 4-D (b, h, s, d)"
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False, f"{q.dtype}/{k.dtype}/{v.dtype}: MUSA flash attention needs float16 or bfloat16 q, k, v"
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        return False, f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}"
    dims = (q.shape[-1], v.shape[-1])
    if dims[0] != dims[1] or dims[0] > FLASH_MAX_HEAD_DIM:
        if dims not in FLASH_EXTRA_HEAD_DIMS or arch_of(q.device) < MUDNN_FUSED_MIN_ARCH:
            return False, f"head dims (qk, v) = {dims}: MUSA flash attention takes equal dims <= {FLASH_MAX_HEAD_DIM}"
    return True, ""
