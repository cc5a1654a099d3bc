"""Rotary position embedding: te.RotaryPositionEmbedding (the angles) and apply_rotary_pos_emb."""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from ..ops.packed_sequences import check_on_device, checked_offsets, host_readable, token_positions
from ._common import check_bool, check_choice, check_positive, check_positive_finite


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
        module = "RotaryPositionEmbedding"
        check_positive(dim, name="dim", module=module)
        percent = check_positive_finite(rotary_percent, name="rotary_percent", module=module)
        if percent > 1:
            raise ValueError(f"{module}: rotary_percent must be in (0, 1] (the share of dim rotated), got "
                             f"{rotary_percent!r}")
        rot_dim = int(dim * percent)  # (odd: ceil(rot_dim / 2) frequencies, as Transformer Engine makes them)
        if rot_dim <= 0:
            raise ValueError(f"{module}: dim * rotary_percent = {rot_dim} must be a positive number of channels")
        rotary_base = check_positive_finite(rotary_base, name="rotary_base", module=module)
        if seq_len_interpolation_factor is not None:
            seq_len_interpolation_factor = check_positive_finite(
                seq_len_interpolation_factor, name="seq_len_interpolation_factor", module=module)
        if pretrained_max_position_embeddings is not None:
            check_positive(pretrained_max_position_embeddings, name="pretrained_max_position_embeddings",
                           module=module)
        interleaved = check_bool(interleaved, name="interleaved", module=module)
        self.rotary_base = rotary_base
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        self.register_buffer("inv_freq", inv_freq)  # in the state dict, as Transformer Engine's
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A state dict without inv_freq (te-core's before it was saved) loads: the buffer keeps
        the frequencies the constructor computed from the same arguments."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "inv_freq" in missing_keys:
            missing_keys.remove(prefix + "inv_freq")

    def forward(self, max_seq_len: int, offset: int = 0) -> Tensor:
        module = "RotaryPositionEmbedding"
        # (a SymInt where torch.compile traces dynamic shapes)
        for arg, value, what in (("max_seq_len", max_seq_len, "the positions to make"), ("offset", offset,
                                                                                       "the first position")):
            if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)) or value < 0:
                raise ValueError(f"{module}: {arg} must be a non-negative int ({what}), got {value!r}")
        pos = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        # Transformer Engine interpolates positions only when both are set: by the factor up to
        # pretrained * factor positions, beyond that by max_seq_len / pretrained (dynamic)
        factor, pretrained = self.seq_len_interpolation_factor, self.pretrained_max_position_embeddings
        if factor is not None and pretrained is not None:
            pos = pos * (pretrained / max_seq_len) if max_seq_len > pretrained * factor else pos / factor
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(max_seq_len, 1, 1, emb.shape[-1])


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
    cu_seqlens: Optional[Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> Tensor:
    """Rotate t ((s, b, h, d), (b, s, h, d), or (t, h, d) packed sequences with tensor_format
    "thd") by freqs ((s_max, 1, 1, r) float32), Transformer Engine's arguments in its order.
    `start_positions` (b,): sequence i is rotated from position start_positions[i] on (a KV
    cache's next tokens). "thd": `cu_seqlens` (b + 1 offsets) delimits the sequences, each
    rotated from its own start. `cp_size` > 1: t is context-parallel rank `cp_rank`'s share of
    each sequence, Transformer Engine's load-balanced split (chunks cp_rank and
    2 * cp_size - 1 - cp_rank of 2 * cp_size; for "thd", cu_seqlens are the whole sequences'
    offsets). freqs must hold every position rotated. `fused` is accepted for Transformer
    Engine's signature: the backend's op is always the one used."""
    name = "apply_rotary_pos_emb"
    check_choice(tensor_format, ("sbhd", "bshd", "thd"), name="tensor_format", module=name)
    for arg, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}: {arg} must be an int, got {type(value).__name__}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"{name}: need cp_size >= 1 and 0 <= cp_rank < cp_size, got cp_size={cp_size}, "
                         f"cp_rank={cp_rank}")
    interleaved = check_bool(interleaved, name="interleaved", module=name)
    check_bool(fused, name="fused", module=name)
    for arg, value in (("t", t), ("freqs", freqs)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    if freqs.dim() != 4 or freqs.shape[1:3] != (1, 1) or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(f"{name}: freqs must be (positions, 1, 1, r) with r <= {t.shape[-1]} (t's last dimension), "
                         f"got shape {tuple(freqs.shape)}")
    if tensor_format == "thd":
        return _rotate_packed(t, freqs, cu_seqlens, start_positions, interleaved, cp_size, cp_rank)
    if cu_seqlens is not None:
        raise ValueError(f"{name}: cu_seqlens is for tensor_format='thd' (packed sequences); {tensor_format!r} "
                         "tensors hold their sequences along a dimension of their own")
    if t.dim() != 4:
        raise ValueError(f"{name}: t must be 4-D ({tensor_format}), got shape {tuple(t.shape)}")
    seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    if start_positions is not None:
        return _rotate_from(t, freqs, tensor_format, start_positions, interleaved, seq, cp_size, cp_rank)
    if freqs.shape[0] < seq * cp_size:
        raise ValueError(f"{name}: freqs hold {freqs.shape[0]} positions, fewer than the {seq * cp_size} of t "
                         f"{tuple(t.shape)}" + (f" across {cp_size} context-parallel ranks" if cp_size > 1 else "")
                         + ": make the rotary embedding for the whole sequence")
    if cp_size > 1:
        if seq % 2:
            raise ValueError(f"{name}: with cp_size > 1 each rank holds two equal chunks of the sequence, so its "
                             f"length must be even; got {seq}")
        offsets = torch.arange(seq, device=freqs.device)
        freqs = freqs.index_select(0, _cp_positions(offsets, seq, cp_size, cp_rank))
    # interleaved: the angles as Transformer Engine's RotaryPositionEmbedding lays them out,
    # [f0, f0, f1, f1, ...], which the op contract reads as they are
    freqs = freqs[:seq].float()
    return _RopeFunction.apply(t.contiguous(), freqs.contiguous(), tensor_format, interleaved)


def apply_fused_qkv_rotary_pos_emb(
    qkv: Tensor,
    q_freqs: Tensor,
    k_freqs: Tensor,
    qkv_split_arg_list,
    tensor_format: str = "sbhd",
    start_positions: Optional[Tensor] = None,
    interleaved: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
):
    """Transformer Engine's rotary embedding of a fused QKV projection's output: qkv (s, b, g, c)
    ("sbhd"; (b, s, g, c) for "bshd") holds, per kv group, its query heads, its key head and its
    value head along the last dimension, sized qkv_split_arg_list = [q, k, v] (q a multiple of k,
    the head size). Returns (query (s, b, g * q / k, k) rotated by q_freqs, key (s, b, g, k)
    rotated by k_freqs, value (s, b, g, v)), each a tensor of its own, the rotation as
    apply_rotary_pos_emb's (start_positions, interleaved, cp_size, cp_rank alike). Packed
    sequences ("thd") are not taken, as in Transformer Engine; cu_seqlens is accepted for its
    signature and not read."""
    name = "apply_fused_qkv_rotary_pos_emb"
    check_choice(tensor_format, ("sbhd", "bshd"), name="tensor_format", module=name)
    if qkv.dim() != 4:
        raise ValueError(f"{name}: qkv must be 4-D ({tensor_format}), got shape {tuple(qkv.shape)}")
    split = list(qkv_split_arg_list) if isinstance(qkv_split_arg_list, (list, tuple)) else None
    if (split is None or len(split) != 3 or not all(isinstance(n, int) and n > 0 for n in split)
            or sum(split) != qkv.shape[-1] or split[0] % split[1]):
        raise ValueError(f"{name}: qkv_split_arg_list must be three positive sizes [q, k, v] that add up to qkv's "
                         f"last dimension ({qkv.shape[-1]}), q a multiple of k (the head size); got "
                         f"{qkv_split_arg_list!r}")
    if cp_size > 1 and start_positions is not None:
        raise ValueError(f"{name}: start_positions (inference) and cp_size > 1 (context-parallel training) do not "
                         "go together, as in Transformer Engine")
    query, key, value = qkv.split(split, dim=-1)
    query = query.reshape(*query.shape[:2], -1, split[1])  # the group's query heads, one after another
    kwargs = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
                  cp_size=cp_size, cp_rank=cp_rank)
    return (apply_rotary_pos_emb(query, q_freqs, **kwargs), apply_rotary_pos_emb(key, k_freqs, **kwargs),
            value.contiguous())


def _cp_positions(offsets: Tensor, length, cp_size: int, cp_rank: int) -> Tensor:
    """Positions in the whole sequence of a context-parallel rank's tokens at `offsets` in its
    share of `length` tokens: the rank holds chunks cp_rank and 2 * cp_size - 1 - cp_rank of
    the sequence's 2 * cp_size (Transformer Engine's split, which balances causal attention)."""
    chunk = length // 2
    return torch.where(offsets < chunk, cp_rank * chunk + offsets,
                       length * cp_size - (cp_rank + 2) * chunk + offsets)


def _rotate_packed(t: Tensor, freqs: Tensor, cu_seqlens, start_positions, interleaved: bool, cp_size: int,
                   cp_rank: int) -> Tensor:
    """tensor_format="thd": each token rotated by the angle of its position in its own sequence
    (from its sequence's start position, across the context-parallel ranks), through the op as
    one (t, 1, h, d) sequence whose angles are gathered per token. Checking cu_seqlens and the
    starts reads them on the host, as Transformer Engine's attention does, except where they
    cannot be read (torch.compile, graph capture), where the device checks them."""
    name = "apply_rotary_pos_emb"
    if t.dim() != 3:
        raise ValueError(f"{name}: t must be 3-D (thd: tokens, heads, channels), got shape {tuple(t.shape)}")
    if cu_seqlens is None:
        raise ValueError(f"{name}: tensor_format='thd' needs cu_seqlens, the b + 1 offsets of the packed sequences")
    cu = checked_offsets(cu_seqlens, t.shape[0] * cp_size, "cu_seqlens", name)
    if cu is None:  # not readable now (torch.compile, graph capture): the device checks the same
        _packed_checks_on_device(cu_seqlens, freqs, start_positions, cp_size)
    else:
        _packed_checks(cu, freqs, start_positions, cp_size)
    local = cu_seqlens.to(device=t.device, dtype=torch.long) // cp_size  # this rank's share of each sequence
    sequence, offsets = token_positions(local, t.shape[0])
    positions = offsets if cp_size == 1 else _cp_positions(offsets, local.diff()[sequence], cp_size, cp_rank)
    if start_positions is not None:
        positions = positions + start_positions.to(device=t.device, dtype=torch.long)[sequence]
    return rotate_at(t, freqs, positions, interleaved)


def rotate_at(t: Tensor, freqs: Tensor, positions: Tensor, interleaved: bool = False) -> Tensor:
    """Packed tokens t (t, h, d), each rotated by the angle of its own position (positions:
    (t,) integers, checked by the caller), through the op as one (t, 1, h, d) sequence."""
    angles = freqs.index_select(0, positions.to(freqs.device)).float().contiguous()  # (t, 1, 1, r)
    out = _RopeFunction.apply(t.unsqueeze(1).contiguous(), angles, "sbhd", interleaved)
    return out.squeeze(1)


_CP_LENGTHS = ("with cp_size={cp} every sequence's length in cu_seqlens must be a multiple of 2 * cp_size = {two} "
               "(pad the sequences)")
_REACH = ("but freqs hold positions 0..{last}: make the rotary embedding for the longest sequence (plus its start "
          "position)")


def _packed_checks(cu: list, freqs: Tensor, start_positions, cp_size: int) -> None:
    """The packed sequences' lengths (their offsets read on the host) and starts, checked against
    the context-parallel split and the positions freqs hold."""
    name = "apply_rotary_pos_emb"
    whole = [b - a for a, b in zip(cu, cu[1:])]  # the whole sequences' lengths
    if cp_size > 1 and any(n % (2 * cp_size) for n in whole):
        raise ValueError(f"{name}: {_CP_LENGTHS.format(cp=cp_size, two=2 * cp_size)}; got {cu}")
    starts = [0] * len(whole)
    if start_positions is not None:
        starts = _check_starts(start_positions, len(whole), f"cu_seqlens' {len(whole)} sequences")
    reach = max((s + n - 1 for s, n in zip(starts, whole)), default=-1)  # the last position rotated
    if reach >= freqs.shape[0]:
        last = freqs.shape[0] - 1
        raise ValueError(f"{name}: the packed sequences reach position {reach}, {_REACH.format(last=last)}")


def _packed_checks_on_device(cu_seqlens: Tensor, freqs: Tensor, start_positions, cp_size: int) -> None:
    """_packed_checks with nothing read on the host (check_on_device)."""
    name = "apply_rotary_pos_emb"
    whole = cu_seqlens.to(torch.long).diff()
    if cp_size > 1:
        check_on_device(whole % (2 * cp_size) == 0, f"{name}: {_CP_LENGTHS.format(cp=cp_size, two=2 * cp_size)}")
    if start_positions is not None:
        _check_starts_shape(start_positions, whole.numel(), f"cu_seqlens' {whole.numel()} sequences")
        starts = start_positions.to(device=whole.device, dtype=torch.long)
        check_on_device(starts >= 0, f"{name}: start_positions must not be negative")
        whole = whole + starts  # one past the last position rotated, per sequence
    check_on_device(whole <= freqs.shape[0], f"{name}: the packed sequences reach past their rotary positions, "
                                             f"{_REACH.format(last=freqs.shape[0] - 1)}")


def _check_starts_shape(start_positions, count: int, what: str) -> None:
    """start_positions checked to be an integer tensor of `count` values, one per sequence."""
    if not isinstance(start_positions, Tensor) or start_positions.dim() != 1 or start_positions.numel() != count \
            or start_positions.is_floating_point() or start_positions.is_complex():
        got = (f"a {start_positions.dtype} tensor of shape {tuple(start_positions.shape)}"
               if isinstance(start_positions, Tensor) else type(start_positions).__name__)
        raise ValueError(f"apply_rotary_pos_emb: start_positions must be an integer tensor of shape ({count},), "
                         f"one start per sequence of {what}; got {got}")


def _check_starts(start_positions, count: int, what: str) -> list:
    """start_positions' values (read on the host), checked to be `count` non-negative integers."""
    _check_starts_shape(start_positions, count, what)
    starts = start_positions.tolist()
    if starts and min(starts) < 0:
        raise ValueError(f"apply_rotary_pos_emb: start_positions must not be negative, got {starts}")
    return starts


def _rotate_from(t: Tensor, freqs: Tensor, tensor_format: str, start_positions, interleaved: bool,
                 seq: int, cp_size: int, cp_rank: int) -> Tensor:
    """Each sequence of the batch rotated by the angles from its own start on, gathered per
    token, in one call of the op (as _rotate_packed). Eagerly the starts are read and checked
    on the host, as Transformer Engine's own check of them does; where they cannot be read
    (torch.compile, graph capture: a KV-cache decode step) the device checks them."""
    name = "apply_rotary_pos_emb"
    batch_dim = 1 if tensor_format == "sbhd" else 0
    batch, reach = t.shape[batch_dim], seq * cp_size
    if cp_size > 1 and seq % 2:
        raise ValueError(f"{name}: with cp_size > 1 each rank holds two equal chunks of the sequence, so its "
                         f"length must be even; got {seq}")
    if not isinstance(start_positions, Tensor) or host_readable(start_positions):  # (a non-tensor: its error)
        starts = _check_starts(start_positions, batch, f"t {tuple(t.shape)}")
        if max(starts) + reach > freqs.shape[0]:
            raise ValueError(
                f"{name}: start_positions reach position {max(starts) + reach - 1} (start {max(starts)} + {reach} "
                f"tokens), but freqs hold positions 0..{freqs.shape[0] - 1}: make the rotary embedding for at least "
                "the longest sequence, e.g. RotaryPositionEmbedding(dim)(max_seq_len)")
    else:
        _check_starts_shape(start_positions, batch, f"t {tuple(t.shape)}")
        check_on_device((start_positions >= 0) & (start_positions + reach <= freqs.shape[0]),
                        f"{name}: start_positions must not be negative, and a start plus the {reach} tokens must stay "
                        f"within freqs' positions 0..{freqs.shape[0] - 1} (make the rotary embedding for at least the "
                        "longest sequence)")
    offsets = torch.arange(seq, device=freqs.device)
    if cp_size > 1:
        offsets = _cp_positions(offsets, seq, cp_size, cp_rank)
    positions = start_positions.to(device=freqs.device, dtype=torch.long)[:, None] + offsets[None, :]  # (b, s)
    if tensor_format == "sbhd":
        positions = positions.t()
    angles = freqs.index_select(0, positions.reshape(-1)).float().contiguous()  # (b * s, 1, 1, r)
    flat = t.reshape(-1, 1, *t.shape[2:]).contiguous()  # one sequence of b * s tokens, as _rotate_packed
    return _RopeFunction.apply(flat, angles, "sbhd", interleaved).view(t.shape)
