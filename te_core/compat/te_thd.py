"""Transformer Engine's extension function for THD-packed sequences under context parallelism that
ported code calls (Megatron-LM splits its packed batches with it): thd_get_partitioned_indices,
in plain torch on cu_seqlens' device.

Context parallelism's load-balanced layout cuts every sequence into 2 x cp_size equal chunks and
gives rank r chunks r and 2 x cp_size - 1 - r (te_core.modules._context_parallel); for a packed
batch that holds for each sequence on its own, and a rank's tokens are its two chunks of the first
sequence, then of the second, and so on.
"""
from __future__ import annotations

import torch
from torch import Tensor

_NAME = "thd_get_partitioned_indices"


def _check_arguments(cu_seqlens, total_tokens, world_size, rank) -> None:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 2:
        got = (f"a {cu_seqlens.dim()}-D {cu_seqlens.dtype} tensor of {cu_seqlens.numel()} elements"
               if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__)
        raise ValueError(f"{_NAME}: cu_seqlens must be a 1-D torch.int32 tensor of the b + 1 sequence offsets "
                         f"(b >= 1), as Transformer Engine requires; got {got}. Convert with .int() or .flatten()")
    for arg, value in (("total_tokens", total_tokens), ("world_size", world_size), ("rank", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{_NAME}: {arg} must be an int, got {type(value).__name__}")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"{_NAME}: need world_size > 0 and 0 <= rank < world_size (the context-parallel size "
                         f"and this rank in it), got world_size={world_size}, rank={rank}")
    if total_tokens <= 0 or total_tokens % (2 * world_size):
        raise ValueError(f"{_NAME}: total_tokens must be a positive multiple of 2 * world_size = {2 * world_size} "
                         f"(each rank holds two equal chunks of every sequence), got {total_tokens}")


def _check_offsets(offsets: list, total_tokens: int, world_size: int) -> None:
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{_NAME}: cu_seqlens must start at 0 and never decrease (the sequences' cumulative "
                         f"lengths), got {offsets}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    odd = [(i, n) for i, n in enumerate(lengths) if n % (2 * world_size)]
    if odd:
        raise ValueError(f"{_NAME}: every sequence length must be a multiple of 2 * world_size = {2 * world_size}, "
                         f"so that each rank gets two equal chunks of it; sequence(s) (index, length) {odd[:8]} "
                         "are not. Pad the sequences and pass the padded offsets (cu_seqlens_padded)")
    if total_tokens > offsets[-1]:
        raise ValueError(f"{_NAME}: total_tokens={total_tokens} exceeds the {offsets[-1]} tokens cu_seqlens "
                         "delimits; the tokens past the last sequence belong to none. Pass total_tokens <= "
                         "cu_seqlens[-1], or offsets that cover the padding (cu_seqlens_padded)")


def thd_get_partitioned_indices(cu_seqlens: Tensor, total_tokens: int, world_size: int, rank: int) -> Tensor:
    """The positions, in the packed batch of sequences delimited by `cu_seqlens`, of the
    total_tokens / world_size tokens context-parallel rank `rank` of `world_size` holds: for each
    sequence of length n in turn, its chunks rank and 2 * world_size - 1 - rank of length
    n / (2 * world_size). A 1-D int32 tensor on cu_seqlens' device, as Transformer Engine's; with
    total_tokens < cu_seqlens[-1], its first total_tokens / world_size entries."""
    _check_arguments(cu_seqlens, total_tokens, world_size, rank)
    _check_offsets(cu_seqlens.tolist(), total_tokens, world_size)  # (host values: the checks need them)
    offsets = cu_seqlens.to(torch.int64)
    starts = offsets // world_size  # each sequence's start among a rank's tokens
    local = torch.arange(total_tokens // world_size, dtype=torch.int64, device=cu_seqlens.device)
    seq = torch.searchsorted(starts, local, right=True) - 1  # the last sequence starting at or before
    half = (starts[seq + 1] - starts[seq]) // 2  # the length of one chunk of that sequence
    within = local - starts[seq]
    first = within < half
    chunk = torch.where(first, rank, 2 * world_size - 1 - rank)
    return (offsets[seq] + chunk * half + torch.where(first, within, within - half)).to(torch.int32)
