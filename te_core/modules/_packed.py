"""qkv_format="thd": packed variable-length sequences (Transformer Engine's layout), given to
ops.attention_varlen as they are, with their cu_seqlens: a backend with a variable-length
kernel computes no padding; the reference pads (te_core.ops.packed_sequences).

Sequence i holds tokens cu_seqlens[i] .. cu_seqlens[i + 1] - 1 of the packed (t, h, d) tensor.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor

from ..ops.packed_sequences import check_cu_seqlens

# Transformer Engine's thd attention is always a padding type: the plain types map onto them
PADDED_MASK_TYPE = {"no_mask": "padding", "causal": "padding_causal",
                    "causal_bottom_right": "padding_causal_bottom_right", "padding": "padding",
                    "padding_causal": "padding_causal", "padding_causal_bottom_right": "padding_causal_bottom_right"}


class Packing(NamedTuple):
    cu_seqlens: Tensor  # (b + 1,) offsets, as the caller gave them
    s_max: int  # the bound on the sequence lengths (max_seqlen)


def packing(cu_seqlens, max_seqlen: Optional[int], total: int, name: str, module: str) -> Packing:
    """`total` packed tokens as cu_seqlens describes them, checked."""
    return Packing(cu_seqlens, check_cu_seqlens(cu_seqlens, max_seqlen, total, name, module))
