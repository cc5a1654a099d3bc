"""Packed variable-length sequences (qkv_format "thd", Transformer Engine's layout): sequence i
holds rows cu_seqlens[i] .. cu_seqlens[i + 1] - 1 of a (t, h, d) tensor. The checks that
ops.attention_varlen's callers and implementations share, and the padded view of a packed
tensor that the reference computes on, written once in plain torch.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor


def host_readable(t: Tensor) -> bool:
    """Whether t's values can be read on the host now: not while torch.compile traces (a read
    would end the graph, and fails under fullgraph) nor while t's device captures a graph (a
    read cannot be captured, and a replay must check the values it is given, not the captured
    ones). Where they cannot, the checks below run on the device (check_on_device)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type in ("cpu", "meta"):
        return True
    capturing = getattr(getattr(torch, t.device.type, None), "is_current_stream_capturing", None)
    return not (callable(capturing) and capturing())


def check_on_device(ok: Tensor, message: str) -> None:
    """Raise `message` (a RuntimeError) where the bool tensor ok holds a False, checked by the
    device in stream order: no host synchronisation, so it can be compiled and captured, but on
    an accelerator the error arrives as a device-side assertion at a later synchronisation."""
    torch._assert_async(ok.all(), message)


def checked_offsets(cu_seqlens, total: int, name: str, where: str = "", tail: bool = False) -> Optional[List[int]]:
    """cu_seqlens' values, read on the host in one wait for the device and checked: b + 1
    integer offsets from 0, never decreasing, ending at `total` packed tokens (at most `total`
    with `tail`: rows after the last sequence, Transformer Engine's tail padding). Read at every
    call, never remembered: a buffer refilled in place (a collective's broadcast, a host write)
    does not always tell torch it changed. None where they cannot be read now (host_readable):
    they are then checked on the device."""
    prefix = f"{where}: " if where else ""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else cu_seqlens
        raise ValueError(f"{prefix}{name} must be a 1-D integer tensor of b + 1 offsets, got {got}")
    end = f"at most the number of rows ({total})" if tail else f"at the number of packed tokens ({total})"
    rule = f"{prefix}{name} must start at 0, never decrease and end {end}"
    if not host_readable(cu_seqlens):
        cu = cu_seqlens.to(torch.long)
        check_on_device(torch.cat([cu[:1] == 0, cu.diff() >= 0, cu[-1:] <= total if tail else cu[-1:] == total]), rule)
        return None
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or (cu[-1] > total if tail else cu[-1] != total):
        raise ValueError(f"{rule}; got {cu}")
    return cu


def check_cu_seqlens(cu_seqlens, max_seqlen: Optional[int], total: int, name: str, where: str = "") -> int:
    """The bound on the sequence lengths that cu_seqlens describes over `total` packed tokens:
    max_seqlen, or the longest length when None (checked_offsets reads the offsets; where they
    cannot be read, max_seqlen must be given and the device checks it)."""
    prefix = f"{where}: " if where else ""
    cu = checked_offsets(cu_seqlens, total, name, where)
    if cu is None:  # not readable now: the bound must be given, and the device checks it
        if max_seqlen is None:
            raise ValueError(f"{prefix}pass {name.replace('cu_seqlens', 'max_seqlen')} (the longest sequence's "
                             f"length) with {name} under torch.compile or graph capture: finding it would read "
                             "the offsets on the host, which a compiled or captured graph cannot do")
        s_max = int(max_seqlen)
        check_on_device(cu_seqlens.diff() <= s_max, f"{prefix}the max_seqlen for {name} is {s_max}, shorter than "
                                                    "one of its sequences")
        return s_max
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    s_max = longest if max_seqlen is None else int(max_seqlen)
    if s_max < longest:
        raise ValueError(f"{prefix}the max_seqlen for {name} is {s_max}, shorter than a sequence of {longest}")
    return s_max


class Padded(NamedTuple):
    """Where each packed token sits in the padded (b, s_max) batch."""

    batch: Tensor  # (t,): the sequence of each token
    position: Tensor  # (t,): its position in that sequence
    padding: Tensor  # (b, 1, 1, s_max) bool, True = padding
    s_max: int


def token_positions(cu_seqlens: Tensor, total: int, device=None) -> Tuple[Tensor, Tensor]:
    """(the sequence of each of `total` packed tokens, its position in that sequence), int64 on
    `device` (cu_seqlens' by default), computed on the device without reading the offsets."""
    cu = cu_seqlens.to(device=device or cu_seqlens.device, dtype=torch.long)
    tokens = torch.arange(total, device=cu.device)
    sequence = torch.searchsorted(cu[1:], tokens, right=True)  # empty sequences own no token
    return sequence, tokens - cu[:-1][sequence]


def padded_layout(cu_seqlens: Tensor, s_max: int, total: int) -> Padded:
    """The padded layout of `total` tokens packed as cu_seqlens says (checked by check_cu_seqlens)."""
    cu = cu_seqlens.to(torch.long)
    batch, position = token_positions(cu, total)
    padding = torch.arange(s_max, device=cu.device)[None, :] >= cu.diff()[:, None]
    return Padded(batch, position, padding.view(cu.numel() - 1, 1, 1, s_max), s_max)


def to_padded(x: Tensor, where: Padded) -> Tensor:
    """(t, h, d) packed -> (b, h, s_max, d), zeros where padded; differentiable."""
    b = where.padding.shape[0]
    padded = x.new_zeros(b, where.s_max, *x.shape[1:])
    return padded.index_put((where.batch, where.position), x).transpose(1, 2)


def to_packed(out: Tensor, where: Padded) -> Tensor:
    """(b, h, s_max, d) padded -> (t, h, d) packed; differentiable."""
    return out.transpose(1, 2)[where.batch, where.position]
