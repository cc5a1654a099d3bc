"""Checks on the user's process groups, so that a wrong group or ranks that disagree fail
with a message instead of a hang or a wrong result inside a collective."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import all_gather_first_dim

_MAX_DIMS = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TRACED_DISAGREE = ("{module}: the tensor-parallel ranks disagree on the input's shape or dtype inside a graph "
                    "compiled by torch.compile; every rank of tp_group must run the same module on a tensor of the "
                    "same shape and dtype (run the step once without torch.compile to see each rank's shape)")


def group_size(group, module: str, arg: str = "tp_group") -> int:
    """The number of ranks of `group`, a torch.distributed process group (the argument `arg`)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{module}: a tensor-parallel group was given but torch.distributed is not initialized; "
                           "call torch.distributed.init_process_group() first (torchrun sets up its environment)")
    check_member(group, f"{module}: {arg}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{module}: {arg} must be a torch.distributed ProcessGroup (e.g. from "
                        f"torch.distributed.new_group), got {type(group).__name__}")
    return dist.get_world_size(group)


def check_member(group, what: str) -> None:
    """A clear error for the placeholder torch.distributed.new_group returns on the ranks it leaves
    out: the calling rank is not in that group, and a collective on it would do nothing."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{what} does not contain this rank ({dist.get_rank()}): torch.distributed.new_group "
                         "returned its placeholder for the ranks it leaves out; pass each rank a group it belongs to "
                         "(every rank calls new_group for every group, and keeps the one holding its own rank)")


def _signature(x: Tensor) -> Tensor:
    """(dims, dtype code, shape padded with -1) as int64: what every rank must agree on."""
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"tensor parallelism supports inputs of at most {_MAX_DIMS} dimensions, got {x.dim()}")
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
    padded = list(x.shape) + [-1] * (_MAX_DIMS - x.dim())
    return torch.tensor([x.dim(), code, *padded], dtype=torch.int64, device=x.device)


def _describe(signature) -> str:
    dims, code = int(signature[0]), int(signature[1])
    dtype = _DTYPES[code] if code >= 0 else "another dtype"
    return f"shape {tuple(int(s) for s in signature[2:2 + dims])} {dtype}"


def check_ranks_agree(x: Tensor, group, module: str) -> None:
    """ValueError on every rank, naming each rank's shape and dtype, unless all ranks of `group`
    pass a tensor of the same shape and dtype (one small all-gather)."""
    mine = _signature(x)
    everyone = all_gather_first_dim(mine.unsqueeze(0), group)
    if torch.compiler.is_compiling():
        # a traced graph cannot branch on the gathered values: it asserts on them when it runs
        torch._assert_async((everyone == mine).all(), _TRACED_DISAGREE.format(module=module))
        return
    if bool((everyone == mine).all()):
        return
    listing = "; ".join(f"rank {r}: {_describe(s.tolist())}" for r, s in enumerate(everyone))
    raise ValueError(f"{module}: the tensor-parallel ranks disagree on the input ({listing}); every rank of tp_group "
                     "must run the same module on a tensor of the same shape and dtype")
