"""Rotary position embedding: te.RotaryPositionEmbedding (the angles) and apply_rotary_pos_emb."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from ._common import check_choice, reject_unsupported


class RotaryPositionEmbedding(nn.Module):
    """freqs for positions offset .. offset + max_seq_len - 1 as a float32 (s, 1, 1, r) tensor,
    r = dim * rotary_percent (non-interleaved layout: the angles repeated twice)."""

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ):
        super().__init__()
        rot_dim = int(dim * rotary_percent)
        if rot_dim <= 0 or rot_dim % 2:
            raise ValueError(
                f"RotaryPositionEmbedding: dim * rotary_percent = {rot_dim} must be a positive even number"
            )
        self.rotary_base = rotary_base
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved

    def forward(self, max_seq_len: int, offset: int = 0) -> Tensor:
        pos = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        # Transformer Engine interpolates positions only when both are set: by the factor up to
        # pretrained * factor positions, beyond that by max_seq_len / pretrained (dynamic)
        factor, pretrained = self.seq_len_interpolation_factor, self.pretrained_max_position_embeddings
        if factor is not None and pretrained is not None:
            pos = pos * (pretrained / max_seq_len) if max_seq_len > pretrained * factor else pos / factor
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(max_seq_len, 1, 1, -1)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, tensor_format, interleaved):
        ctx.save_for_backward(freqs)
        ctx.tensor_format, ctx.interleaved = tensor_format, interleaved
        return ops.rope_fwd(t, freqs, tensor_format=tensor_format, interleaved=interleaved)

    @staticmethod
    def backward(ctx, dy):
        (freqs,) = ctx.saved_tensors
        dx = ops.rope_bwd(dy.contiguous(), freqs, tensor_format=ctx.tensor_format, interleaved=ctx.interleaved)
        return dx, None, None, None


def apply_rotary_pos_emb(
    t: Tensor, freqs: Tensor, tensor_format: str = "sbhd", interleaved: bool = False, fused: bool = True, **kwargs
) -> Tensor:
    """Rotate t ((s, b, h, d) or (b, s, h, d)) by freqs ((s_max, 1, 1, r) float32, s_max >= s)."""
    if kwargs:  # start_positions, cu_seqlens, cp_size, cp_rank
        reject_unsupported("apply_rotary_pos_emb", **kwargs)
    check_choice(tensor_format, ("sbhd", "bshd"), name="tensor_format", module="apply_rotary_pos_emb")
    if t.dim() != 4:
        raise ValueError(f"apply_rotary_pos_emb: t must be 4-D ({tensor_format}), got shape {tuple(t.shape)}")
    seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    if freqs.dim() != 4 or freqs.shape[0] < seq or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(
            f"apply_rotary_pos_emb: freqs of shape {tuple(freqs.shape)} do not fit t of shape {tuple(t.shape)} "
            f"(need (>= {seq}, 1, 1, <= {t.shape[-1]}))"
        )
    freqs = freqs[:seq].float()
    if interleaved:  # the contract reads the first r/2 angles of an interleaved rotation
        freqs = freqs[..., 0::2]
        freqs = torch.cat((freqs, freqs), dim=-1)
    return _RopeFunction.apply(t.contiguous(), freqs.contiguous(), tensor_format, interleaved)
