"""The process group of an operation as Transformer Engine's operations take it: the world group
where none is given; for BasicLinear and Bias, no tensor parallelism over a group of one rank."""
from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist

from ...distributed.groups import group_size


def resolve_tensor_parallel_group(group, op: str) -> Tuple[Optional[object], int]:
    """(the group, its number of ranks) of an operation asked to be tensor-parallel; (None, 1)
    for a group of one rank, which TE's operations treat as no parallelism."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{op}: tensor parallelism was asked for without a tensor_parallel_group, whose default "
                               "is the world group, but torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group() first, pass the group, or turn tensor "
                               "parallelism off")
        group = dist.group.WORLD
    size = group_size(group, op, "tensor_parallel_group")
    return (group, size) if size > 1 else (None, 1)


def process_group_size(group, op: str) -> int:
    """The number of ranks of a communication operation's process_group (the world group's where
    it is None, as torch.distributed takes None)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{op}: process_group was not given, whose default is the world group, but "
                           "torch.distributed is not initialized; call torch.distributed.init_process_group() first "
                           "or pass the group")
    return group_size(dist.group.WORLD if group is None else group, op, "process_group")
