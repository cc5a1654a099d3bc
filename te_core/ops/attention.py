"""Contract: scaled dot-product attention, differentiable (forward and backward).

q is (b, hq, sq, d), k and v (b, hkv, sk, d) / (b, hkv, sk, dv) with hq % hkv == 0 (GQA/MQA:
query head i reads kv head i // (hq // hkv)). out is (b, hq, sq, dv) in q's dtype.
softmax_scale defaults to 1/sqrt(d). Masks are bool, True = masked out. attn_mask_type:
  "no_mask"; "causal" (key j > query i masked, top-left aligned); "causal_bottom_right"
  (j > i + sk - sq masked); "padding" (attention_mask (b, 1, 1, sk) marks padded keys and
  query_padding_mask (b, 1, 1, sq), if given, padded queries); "padding_causal" (both, causal
  top-left); "padding_causal_bottom_right" (both, causal aligned per sequence to the bottom
  right of its actual lengths: j > i + len_kv - len_q masked); "arbitrary" (attention_mask
  broadcastable to (b, hq, sq, sk)).
window_size (left, right), Transformer Engine's sliding window: query i sees keys j with
  i + shift - left <= j <= i + shift + right, -1 meaning unbounded; shift is 0 on a top-left
  diagonal, sk - sq on a bottom-right one (len_kv - len_q per sequence under padding masks).
  Causal types use right = 0. te_core.ops.attention_masks says which keys each query sees.
core_attention_bias_type: "no_bias"; "pre_scale_bias" ((q k^T + bias) * scale);
  "post_scale_bias" (q k^T * scale + bias); "alibi" (post-scale bias -slope_h * |i + shift - j|,
  slopes (hq,) or (b, hq) from alibi_slopes, else Transformer Engine's default slopes).
  core_attention_bias broadcasts to (b, hq, sq, sk) from (b|1, hq|1, sq|1, sk); it receives a
  gradient when it requires one.
softmax_offset (hq,) float32, Transformer Engine's attention sink (its softmax_type
  "off-by-one": zeros, "learnable": a parameter): each query row's softmax denominator also
  holds exp(softmax_offset[h]), as if every query saw one more key, never masked, whose scaled
  logit is that value and whose value vector is zero; it receives a gradient when it requires
  one. Backends without it decline it in `supports`.
A query row with every key masked gives zeros. Implementations must support autograd
(gradients for q, k, v and the bias); dropout_p > 0 draws from the backend's device RNG.
Backends that cannot run a window, a bias or a mask type natively decline it in `supports`.
attention_varlen (below) is the same over packed variable-length sequences (qkv_format "thd").
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from ._spec import contract_op

ATTN_MASK_TYPES = (
    "no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right",
    "arbitrary",
)
PADDING_MASK_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right")
CAUSAL_MASK_TYPES = ("causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


@contract_op("attention")
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
    """Returns out."""



@contract_op("attention")
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
    """Attention over packed variable-length sequences (qkv_format "thd"): q is (t_q, hq, d),
    k and v (t_kv, hkv, d) / (t_kv, hkv, dv); sequence i holds rows cu_seqlens_q[i] ..
    cu_seqlens_q[i + 1] - 1 of q and cu_seqlens_kv[i] .. cu_seqlens_kv[i + 1] - 1 of k and v
    (1-D integer offsets on q's device, b + 1 each, starting at 0 and ending at t). Each sequence
    attends only within itself, exactly as `attention` on the padded (b, h, max_seqlen, d)
    batch with padding masks from the lengths: attn_mask_type is a padding type ("padding",
    "padding_causal", "padding_causal_bottom_right"), window and diagonal per sequence's
    lengths; core_attention_bias is (b|1, hq|1, max_seqlen_q|1, max_seqlen_kv) in the padded
    coordinates. max_seqlen_* bound the lengths. Returns out (t_q, hq, dv) in q's dtype;
    no padding is computed by an implementation with a variable-length kernel."""
