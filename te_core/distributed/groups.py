"""Checks on the user's process groups, so that a wrong group or ranks that disagree fail
with a message instead of a hang or a wrong result inside a collective."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..quantization.autocast import get_autocast_context
from ..recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling
from .collectives import all_gather_first_dim

_MAX_DIMS = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)
_FORMATS = tuple(Format)
_TRACED_DISAGREE = ("{module}: the tensor-parallel ranks disagree on the input's shape or dtype, or on te.autocast, "
                    "inside a graph compiled by torch.compile; every rank of tp_group must run the same module on a "
                    "tensor of the same shape and dtype under the same recipe (run the step once without "
                    "torch.compile to see each rank's)")


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


def _quantization_code() -> Tuple[int, int, int]:
    """(mode: 0 high precision, 1 calibrating, 2 FP8; the recipe's class, len(_RECIPES) for another;
    its format) of the innermost te.autocast: ranks that quantize differently would exchange
    tensors of other sizes in the collectives, which hangs or aborts instead of failing clearly."""
    context = get_autocast_context()
    if context is None or not (context.enabled or context.calibrating):
        return 0, 0, 0
    recipe = context.recipe
    kind = next((i for i, cls in enumerate(_RECIPES) if type(recipe) is cls), len(_RECIPES))
    fmt = getattr(recipe, "fp8_format", None)
    return (2 if context.enabled else 1), kind, (_FORMATS.index(fmt) if fmt in _FORMATS else -1)


def _signature(x: Tensor) -> Tensor:
    """(dims, dtype code, quantization code, shape padded with -1) as int64: what every rank must
    agree on."""
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"tensor parallelism supports inputs of at most {_MAX_DIMS} dimensions, got {x.dim()}")
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
    padded = list(x.shape) + [-1] * (_MAX_DIMS - x.dim())
    return torch.tensor([x.dim(), code, *_quantization_code(), *padded], dtype=torch.int64, device=x.device)


def _describe(signature) -> str:
    dims, code, mode, kind, fmt = (int(v) for v in signature[:5])
    dtype = _DTYPES[code] if code >= 0 else "another dtype"
    if mode == 0:
        quantization = "no FP8 (outside te.autocast or enabled=False)"
    else:
        name = _RECIPES[kind].__name__ if kind < len(_RECIPES) else "a custom recipe"
        fp8_format = f" {_FORMATS[fmt].name}" if fmt >= 0 else ""
        quantization = f"{'FP8' if mode == 2 else 'calibrating'} with {name}{fp8_format}"
    return f"shape {tuple(int(s) for s in signature[5:5 + dims])} {dtype}, {quantization}"


def check_ranks_agree(x: Tensor, group, module: str, what: str = "tensor-parallel") -> None:
    """ValueError on every rank, naming each rank's shape, dtype and quantization, unless all ranks
    of `group` pass a tensor of the same shape and dtype under the same te.autocast recipe (one
    small all-gather)."""
    mine = _signature(x)
    everyone = all_gather_first_dim(mine.unsqueeze(0), group)
    if torch.compiler.is_compiling():
        # a traced graph cannot branch on the gathered values: it asserts on them when it runs
        torch._assert_async((everyone == mine).all(), _TRACED_DISAGREE.format(module=module))
        return
    if bool((everyone == mine).all()):
        return
    listing = "; ".join(f"rank {r}: {_describe(s.tolist())}" for r, s in enumerate(everyone))
    group_arg = "cp_group" if what == "context-parallel" else "tp_group"
    raise ValueError(f"{module}: the {what} ranks disagree on the input or its quantization ({listing}); every rank "
                     f"of {group_arg} must run the same module on a tensor of the same shape and dtype, under "
                     "te.autocast with the same recipe")
