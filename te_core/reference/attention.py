"""Reference scaled dot-product attention: float32 math, differentiable through autograd.

GQA/MQA repeats each kv head for its group of query heads; which keys a query sees (mask
types, padding, sliding window) and the ALiBi bias come from te_core.ops.attention_masks;
fully-masked rows are handled by softmax.masked_softmax; dropout draws from the default
generator of q's device. attention_varlen pads the packed sequences, runs attention with the
padding masks their lengths give, and packs the result (te_core.ops.packed_sequences).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend.types import as_dtype
from ..ops.attention_masks import attention_logits, check_softmax_offset
from ..ops.attention import PADDING_MASK_TYPES
from ..ops.packed_sequences import check_cu_seqlens, padded_layout, to_packed, to_padded
from .cast import check_float, check_ndim
from .softmax import check_bool_mask, masked_softmax


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


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask_type: str = "no_mask",
    attention_mask: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
    query_padding_mask: Optional[Tensor] = None,
    window_size: Optional[Tuple[int, int]] = None,
    bottom_right_diagonal: Optional[bool] = None,
    core_attention_bias_type: str = "no_bias",
    core_attention_bias: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    softmax_offset: Optional[Tensor] = None,
) -> Tensor:
    group = _check_qkv(q, k, v)
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    if attn_mask_type == "arbitrary":
        check_bool_mask("attention_mask", attention_mask, (b, hq, sq, sk))
    check_softmax_offset(softmax_offset, hq)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    scores, masked = attention_logits(
        q, k, attn_mask_type=attn_mask_type, attention_mask=attention_mask, softmax_scale=softmax_scale,
        query_padding_mask=query_padding_mask, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
        core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
        alibi_slopes=alibi_slopes)
    v32 = v.float().repeat_interleave(group, dim=1)
    if softmax_offset is None:
        probs = masked_softmax(scores, masked)
    else:  # the sink: one more logit per row that no mask hides, whose probability is dropped
        sink = softmax_offset.view(1, hq, 1, 1).expand(b, hq, sq, 1)
        if masked is not None:
            masked = torch.cat([masked.expand(b, hq, sq, sk), masked.new_zeros(b, hq, sq, 1)], dim=-1)
        probs = masked_softmax(torch.cat([scores, sink], dim=-1), masked)[..., :sk]
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return as_dtype(probs @ v32, q.dtype)


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    attn_mask_type: str = "padding",
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
    window_size: Optional[Tuple[int, int]] = None,
    bottom_right_diagonal: Optional[bool] = None,
    core_attention_bias_type: str = "no_bias",
    core_attention_bias: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    softmax_offset: Optional[Tensor] = None,
) -> Tensor:
    """The contract's definition itself: `attention` on the padded batch, packed again."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        check_ndim(name, t, 3)
    if attn_mask_type not in PADDING_MASK_TYPES:
        raise ValueError(f"attention_varlen: attn_mask_type={attn_mask_type!r} must be a padding type "
                         f"({', '.join(PADDING_MASK_TYPES)}); packed sequences are always padded")
    s_q = check_cu_seqlens(cu_seqlens_q, max_seqlen_q, q.shape[0], "cu_seqlens_q", "attention_varlen")
    s_kv = check_cu_seqlens(cu_seqlens_kv, max_seqlen_kv, k.shape[0], "cu_seqlens_kv", "attention_varlen")
    if cu_seqlens_q.numel() != cu_seqlens_kv.numel():
        raise ValueError("attention_varlen: cu_seqlens_q and cu_seqlens_kv describe different numbers of sequences "
                         f"({cu_seqlens_q.numel() - 1} and {cu_seqlens_kv.numel() - 1})")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"attention_varlen: k {tuple(k.shape)} and v {tuple(v.shape)} hold different token counts")
    where_q = padded_layout(cu_seqlens_q, s_q, q.shape[0])
    where_kv = padded_layout(cu_seqlens_kv, s_kv, k.shape[0])
    out = attention(
        to_padded(q, where_q), to_padded(k, where_kv), to_padded(v, where_kv), attn_mask_type=attn_mask_type,
        attention_mask=where_kv.padding, query_padding_mask=where_q.padding, softmax_scale=softmax_scale,
        dropout_p=dropout_p, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
        core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
        alibi_slopes=alibi_slopes, softmax_offset=softmax_offset)
    return to_packed(out, where_q)
