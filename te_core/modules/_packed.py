"""qkv_format="thd": packed variable-length sequences (Transformer Engine's layout), given to
ops.attention_varlen as they are, with their cu_seqlens: a backend with a variable-length
kernel computes no padding; the reference pads (te_core.ops.packed_sequences).

Sequence i holds tokens cu_seqlens[i] .. cu_seqlens[i + 1] - 1 of the packed (t, h, d) tensor.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..ops.packed_sequences import check_cu_seqlens, checked_offsets, host_readable, token_positions

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


def unpadded_rows(cu_seqlens, cu_seqlens_padded, total: int, name: str, module: str) -> Tensor:
    """Transformer Engine's pad_between_seqs layout: sequence i holds cu_seqlens' i-th length of
    tokens from row cu_seqlens_padded[i] of a (total, ...) tensor, and padding after them up to
    the next sequence (after the last one, up to `total`). Returns the rows of the sequences'
    tokens, in order (int64, on the offsets' device); reading the offsets waits for the device,
    as checking cu_seqlens does."""
    padded = f"{name}_padded"
    if isinstance(cu_seqlens_padded, Tensor) and not host_readable(cu_seqlens_padded):
        raise ValueError(f"{module}: padding between packed sequences ({padded}) cannot run under torch.compile or "
                         "graph capture: how many of the rows are tokens is read from the offsets on the host. Pack "
                         f"the sequences without padding between them (cu_seqlens only), or run {module} eagerly "
                         "(torch.compiler.disable)")
    starts_host = checked_offsets(cu_seqlens_padded, total, padded, module, tail=True)
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"{module}: {name} must be a 1-D integer tensor of b + 1 offsets, got {cu_seqlens!r}")
    cu_host = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu_host, cu_host[1:])]
    room = [b - a for a, b in zip(starts_host, starts_host[1:])]
    if len(cu_host) < 2 or len(cu_host) != len(starts_host) or cu_host[0] != 0 \
            or any(n < 0 or n > r for n, r in zip(lengths, room)):
        raise ValueError(f"{module}: {name} (the sequences' lengths) and {padded} (where they start) must describe "
                         f"the same sequences, each no longer than the room {padded} leaves it; got {cu_host} and "
                         f"{starts_host}")
    sequence, position = token_positions(cu_seqlens, cu_host[-1])
    starts = cu_seqlens_padded.to(device=cu_seqlens.device, dtype=torch.long)
    return starts[:-1][sequence] + position


def tail_padding(cu_seqlens_q, cu_seqlens_kv, q, k):
    """(cu_seqlens_q_padded, cu_seqlens_kv_padded) for thd tensors with rows after their last
    sequence (Transformer Engine's tail padding, which its attention accepts and leaves zero in
    the output): each sequence starts where cu_seqlens says, the rest of the rows are padding.
    (None, None) where every row is a token, or where the offsets cannot be read on the host now
    (they are then checked on the device, which wants them to end at the number of rows)."""
    cu = (cu_seqlens_q, cu_seqlens_kv)
    if not all(isinstance(c, Tensor) and c.dim() == 1 and c.numel() >= 2 and host_readable(c) for c in cu) \
            or not all(isinstance(t, Tensor) and t.dim() == 3 for t in (q, k)):
        return None, None
    ends = torch.stack([cu_seqlens_q[-1], cu_seqlens_kv[-1].to(cu_seqlens_q.device)]).tolist()  # (one wait)
    if ends[0] < q.shape[0] or ends[1] < k.shape[0]:
        return cu
    return None, None
