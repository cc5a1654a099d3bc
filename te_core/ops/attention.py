"""Contract: scaled dot-product attention, differentiable (forward and backward).

q is (b, hq, sq, d), k and v (b, hkv, sk, d) / (b, hkv, sk, dv) with hq % hkv == 0 (GQA/MQA:
query head i reads kv head i // (hq // hkv)). out is (b, hq, sq, dv) in q's dtype.
softmax_scale defaults to 1/sqrt(d). attn_mask_type:
  "no_mask"; "causal" (key j > query i masked, top-left aligned); "causal_bottom_right"
  (j > i + sk - sq masked); "padding" (attention_mask (b, 1, 1, sk) bool, True = masked out);
  "padding_causal" (both); "arbitrary" (attention_mask broadcastable to (b, hq, sq, sk)).
A query row with every key masked gives zeros. Implementations must support autograd
(gradients for q, k, v); dropout_p > 0 draws from the backend's device RNG.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ._spec import contract_op

ATTN_MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "arbitrary")


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
) -> Tensor:
    """Returns out."""
