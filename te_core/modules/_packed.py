"""qkv_format="thd": packed variable-length sequences (Transformer Engine's layout), given to
the attention op as a padded batch with padding masks, and packed again afterwards.

Sequence i holds tokens cu_seqlens[i] .. cu_seqlens[i + 1] - 1 of the packed (t, h, d) tensor.
The padded form is what every backend's attention takes; a backend with a varlen kernel could
take the packed form directly, which the contract does not offer yet.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

# Transformer Engine's thd attention is always a padding type: the plain types map onto them
PADDED_MASK_TYPE = {"no_mask": "padding", "causal": "padding_causal",
                    "causal_bottom_right": "padding_causal_bottom_right", "padding": "padding",
                    "padding_causal": "padding_causal", "padding_causal_bottom_right": "padding_causal_bottom_right"}


class Packing(NamedTuple):
    batch: Tensor  # (t,): the sequence of each token
    position: Tensor  # (t,): its position in that sequence
    padding: Tensor  # (b, 1, 1, s_max) bool, True = padding
    s_max: int


def packing(cu_seqlens, max_seqlen: Optional[int], total: int, name: str, module: str) -> Packing:
    """Where each of `total` packed tokens sits in the padded batch that cu_seqlens describes."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"{module}: {name} must be a 1-D integer tensor of b + 1 offsets, got "
                         f"{cu_seqlens if not isinstance(cu_seqlens, Tensor) else tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.long)
    lengths = cu.diff()
    if int(cu[0]) != 0 or bool((lengths < 0).any()) or int(cu[-1]) != total:
        raise ValueError(f"{module}: {name} must start at 0, never decrease and end at the number of packed "
                         f"tokens ({total}); got {cu.tolist()}")
    longest = int(lengths.max())
    s_max = longest if max_seqlen is None else int(max_seqlen)
    if s_max < longest:
        raise ValueError(f"{module}: the max_seqlen for {name} is {s_max}, shorter than a sequence of {longest}")
    batch = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    position = torch.arange(total, device=cu.device) - cu[:-1][batch]
    padding = torch.arange(s_max, device=cu.device)[None, :] >= lengths[:, None]
    return Packing(batch, position, padding.view(-1, 1, 1, s_max), s_max)


def to_padded(x: Tensor, where: Packing) -> Tensor:
    """(t, h, d) packed -> (b, h, s_max, d), zeros where padded; differentiable."""
    b = where.padding.shape[0]
    padded = x.new_zeros(b, where.s_max, *x.shape[1:])
    return padded.index_put((where.batch, where.position), x).transpose(1, 2)


def to_packed(out: Tensor, where: Packing) -> Tensor:
    """(b, h, s_max, dv) -> (t, h * dv)."""
    return out.transpose(1, 2)[where.batch, where.position].flatten(1)
