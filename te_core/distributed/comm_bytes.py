"""Bytes each rank sends through all-gathers: how FSDP2's parameter traffic is measured.

`with AllGatherBytes() as counted: <one training step>` then `counted.sent`: the bytes this
rank contributed to every all-gather issued inside the block (the size of its input), whatever
the caller (FSDP2, DTensor, a user's `dist.all_gather_into_tensor`). It watches torch's c10d
operators as they are dispatched, so it sees the collectives whichever torch.distributed
function issued them (their Python names changed across torch versions) and works on every
process-group backend. The received bytes are `sent` times the group size.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllGatherBytes"]

# c10d operator -> where its input tensor(s) are among the arguments
_ALL_GATHERS = {
    "c10d._allgather_base_.default": 1,  # (output, input, group, ...): all_gather_into_tensor / _single
    "c10d.allgather_.default": 1,  # (output lists, input list, group, ...): all_gather
    "c10d.allgather_into_tensor_coalesced_.default": 1,  # (outputs, inputs, group, ...)
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class AllGatherBytes(TorchDispatchMode):
    """Counts all-gather input bytes (`sent`), calls (`calls`) and bytes by dtype (`by_dtype`)."""

    def __init__(self):
        super().__init__()
        self.sent = 0
        self.calls = 0
        self.by_dtype: Dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = _ALL_GATHERS.get(str(func))
        if where is not None:
            inputs = args[where]
            self.sent += _nbytes(inputs)
            self.calls += 1
            for t in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
                self.by_dtype[t.dtype] = self.by_dtype.get(t.dtype, 0) + _nbytes(t)
        return func(*args, **(kwargs or {}))
