"""Rotary-embedding references for the rope tests: float64 rotations by position."""
from __future__ import annotations

import torch

HEADS, DIM = 2, 16


def rotated(x, positions, interleaved, base=10000.0):
    """(n, h, d) tokens rotated in float64 by the angles of `positions`."""
    x = x.double()
    inv = 1.0 / base ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
    angles = torch.outer(torch.as_tensor(positions, dtype=torch.float64), inv)[:, None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    out = torch.empty_like(x)
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, odd * cos + even * sin
    else:
        a, b = x[..., : DIM // 2], x[..., DIM // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out


def rank_share(length, cp_size, rank):
    """Positions of rank `rank`'s tokens in a sequence of `length`: chunks rank and 2cp-1-rank."""
    chunk = length // (2 * cp_size)
    return list(range(rank * chunk, (rank + 1) * chunk)) + \
        list(range(length - (rank + 1) * chunk, length - rank * chunk))
