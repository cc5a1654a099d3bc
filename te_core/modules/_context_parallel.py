"""DotProductAttention's context parallelism (Transformer Engine's cp_group, cp_comm_type, ...).

Each rank of the context-parallel group holds a slice of every sequence, in Transformer Engine's
(and Megatron-LM's) load-balanced layout: the sequence is cut into 2 x cp_size chunks and rank r
holds chunks r and 2 x cp_size - 1 - r, one after the other, so that under a causal mask every
rank has as much work as the others. Attention then needs every rank's keys and values: te-core
all-gathers them along the sequence (the gradient is reduce-scattered back to their ranks) and
masks by the tokens' global positions, so each rank's output, and every gradient, is its share
of the attention over the whole sequence. That is cp_comm_type "all_gather"; "p2p" and "a2a",
which Transformer Engine runs as a ring of key/value exchanges and as a heads all-to-all, give
the same values and are computed this way too (with all_gather's memory: the whole sequence's
keys and values on every rank), with a warning once.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..distributed.collectives import gather_along_first_dim
from ..distributed.groups import group_size

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
MASK_TYPES = ("no_mask", "causal")  # those a context-parallel call takes
_warned = set()


def resolve_hierarchical(cp_group, cp_comm_type: str, module: str):
    """(group, comm type): Transformer Engine's cp_comm_type 'a2a+p2p' takes cp_group = [a2a
    group, p2p group] and runs plain 'p2p' over the second where the first has one rank, plain
    'a2a' over the first where the second has; so does te-core. Both larger (hierarchical
    context parallelism) is not supported."""
    if not isinstance(cp_group, (list, tuple)):
        return cp_group, cp_comm_type
    if cp_comm_type != "a2a+p2p" or len(cp_group) != 2:
        raise ValueError(f"{module}: a list of context-parallel groups goes with cp_comm_type 'a2a+p2p', as "
                         f"[a2a group, p2p group]; got {len(cp_group)} groups with cp_comm_type {cp_comm_type!r}")
    a2a, p2p = cp_group
    if group_size(a2a, module, arg="cp_group[0]") == 1:
        return p2p, "p2p"
    if group_size(p2p, module, arg="cp_group[1]") == 1:
        return a2a, "a2a"
    raise NotImplementedError(f"{module}: cp_comm_type 'a2a+p2p' (hierarchical context parallelism over two groups "
                              "of several ranks each) is not supported by te-core; give one group with cp_comm_type "
                              "'all_gather'")


def cp_size_of(cp_group, module: str) -> int:
    """The context-parallel group's size (1 without a group)."""
    if cp_group is None:
        return 1
    return group_size(cp_group, module, arg="cp_group")


def check_comm_type(cp_comm_type, module: str, active: bool = True) -> str:
    """`active`: a context-parallel group is given (without one, as in Transformer Engine, the
    type is only kept: no communication happens for it to choose)."""
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"{module}: cp_comm_type must be one of {', '.join(map(repr, COMM_TYPES))}, "
                         f"got {cp_comm_type!r}")
    return cp_comm_type


def positions(rank: int, cp_size: int, local: int, device) -> Tensor:
    """The global positions of a rank's `local` tokens in the load-balanced layout."""
    chunk = local // 2
    first, second = rank * chunk, (2 * cp_size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def gathered(query: Tensor, key: Tensor, value: Tensor, fmt: str, mask_type: str, group, cp_size: int,
             rank: int, comm_type: str, module: str) -> Tuple[Tensor, Tensor, str, Optional[Tensor]]:
    """(every rank's keys, every rank's values, the mask type, the attention mask) for this rank's
    queries: the keys and values all-gathered along the sequence, and for a causal mask a bool
    mask (True: masked out) of the keys that come after each query in the whole sequence."""
    if comm_type != "all_gather" and (module, comm_type) not in _warned:
        _warned.add((module, comm_type))
        warnings.warn(f"{module}: cp_comm_type={comm_type!r} is computed by all-gathering the keys and values "
                      "(the same values as Transformer Engine's; its memory and communication are 'all_gather''s)",
                      UserWarning, stacklevel=3)
    seq = 0 if fmt == "sbhd" else 1
    local = query.shape[seq]
    # no_mask attends every query to every key, in any order: cross-attention's keys may be longer
    if mask_type != "no_mask" and (local % 2 or key.shape[seq] != local):
        raise ValueError(f"{module}: under context parallelism with a causal mask each rank holds two equal chunks "
                         f"of every sequence (the load-balanced layout), so queries and keys need the same, even, "
                         f"length; got {local} queries and {key.shape[seq]} keys")

    def gather(t: Tensor) -> Tensor:
        if seq == 0:
            return gather_along_first_dim(t.contiguous(), group)
        return gather_along_first_dim(t.transpose(0, 1).contiguous(), group).transpose(0, 1)

    key, value = gather(key), gather(value)
    if mask_type == "no_mask":
        return key, value, mask_type, None
    q_pos = positions(rank, cp_size, local, query.device)
    k_pos = torch.cat([positions(r, cp_size, local, query.device) for r in range(cp_size)])
    return key, value, "arbitrary", (k_pos[None, :] > q_pos[:, None])[None, None]
