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
    t: Tensor,
    freqs: Tensor,
    tensor_format: str = "sbhd",
    start_positions: Optional[Tensor] = None,
    interleaved: bool = False,
    fused: bool = True,
    **kwargs,
) -> Tensor:
    """Rotate t ((s, b, h, d) or (b, s, h, d)) by freqs ((s_max, 1, 1, r) float32, s_max >= s),
    Transformer Engine's arguments in its order. `start_positions` (b,): sequence i is rotated
    from position start_positions[i] on (a KV cache's next tokens), so s_max must reach the
    largest start plus s."""
    if kwargs:  # cu_seqlens, cp_size, cp_rank
        reject_unsupported("apply_rotary_pos_emb", **kwargs)
    check_choice(tensor_format, ("sbhd", "bshd"), name="tensor_format", module="apply_rotary_pos_emb")
    if t.dim() != 4:
        raise ValueError(f"apply_rotary_pos_emb: t must be 4-D ({tensor_format}), got shape {tuple(t.shape)}")
    seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    if start_positions is not None:
        return _rotate_from(t, freqs, tensor_format, start_positions, interleaved, seq)
    if freqs.dim() != 4 or freqs.shape[0] < seq or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(
            f"apply_rotary_pos_emb: freqs of shape {tuple(freqs.shape)} do not fit t of shape {tuple(t.shape)} "
            f"(need (>= {seq}, 1, 1, <= {t.shape[-1]}))"
        )
    # interleaved: the angles as Transformer Engine's RotaryPositionEmbedding lays them out,
    # [f0, f0, f1, f1, ...], which the op contract reads as they are
    freqs = freqs[:seq].float()
    return _RopeFunction.apply(t.contiguous(), freqs.contiguous(), tensor_format, interleaved)


def _rotate_from(t: Tensor, freqs: Tensor, tensor_format: str, start_positions, interleaved: bool,
                 seq: int) -> Tensor:
    """Each sequence of the batch rotated by the angles from its own start on: one rotation per
    distinct start (the backend's kernel takes one set of angles for the whole batch). Reading
    the starts waits for the device, as Transformer Engine's own check of them does."""
    batch_dim = 1 if tensor_format == "sbhd" else 0
    batch = t.shape[batch_dim]
    if not isinstance(start_positions, Tensor) or start_positions.dim() != 1 or start_positions.numel() != batch \
            or start_positions.is_floating_point() or start_positions.is_complex():
        got = (f"a {start_positions.dtype} tensor of shape {tuple(start_positions.shape)}"
               if isinstance(start_positions, Tensor) else type(start_positions).__name__)
        raise ValueError(f"apply_rotary_pos_emb: start_positions must be an integer tensor of shape ({batch},), "
                         f"one start per sequence of t {tuple(t.shape)}; got {got}")
    starts = [int(v) for v in start_positions.tolist()]
    if min(starts) < 0 or max(starts) + seq > freqs.shape[0]:
        raise ValueError(
            f"apply_rotary_pos_emb: start_positions reach position {max(starts) + seq - 1} (start {max(starts)} + "
            f"{seq} tokens) and start at {min(starts)}, but freqs hold positions 0..{freqs.shape[0] - 1}: make the "
            "rotary embedding for at least the longest sequence, e.g. RotaryPositionEmbedding(dim)(max_seq_len)")
    out = [None] * batch
    for start in sorted(set(starts)):
        rows = [i for i, s in enumerate(starts) if s == start]
        index = torch.tensor(rows, device=t.device)
        part = apply_rotary_pos_emb(t.index_select(batch_dim, index), freqs[start:], tensor_format,
                                    interleaved=interleaved)
        for j, i in enumerate(rows):
            out[i] = part.narrow(batch_dim, j, 1)
    return torch.cat(out, dim=batch_dim)
