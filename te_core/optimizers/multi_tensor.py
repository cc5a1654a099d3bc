"""Transformer Engine's multi-tensor helpers (apex's interface): `multi_tensor_applier(op,
noop_flag, tensor_lists, *args)` calls `op(chunk_size, noop_flag, tensor_lists, *args)`, and the
ops below are such `op`s. Training frameworks (Megatron-LM's gradient clipping and its copies
between main and model gradients) import them from `transformer_engine.pytorch.optimizers`.

They are torch's foreach operations, a few launches for a whole list on any device, with no host
synchronisation: `noop_flag` (an int tensor) is set to 1 on the device where an output is not
finite, as apex's kernels flag an overflow, and nothing reads it back. Norms accumulate in
float32 whatever the tensors' dtype.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

__all__ = ["multi_tensor_applier", "multi_tensor_scale", "multi_tensor_scale_tensor", "multi_tensor_l2norm"]

CHUNK_SIZE = 2048 * 32  # apex's default; the foreach operations do their own chunking


def multi_tensor_applier(op, noop_flag_buffer: Tensor, tensor_lists: Sequence[Sequence[Tensor]], *args):
    """op(chunk_size, noop_flag_buffer, tensor_lists, *args), as apex and Transformer Engine call it."""
    return op(CHUNK_SIZE, noop_flag_buffer, tensor_lists, *args)


def _flag_non_finite(noop_flag: Tensor, tensors: List[Tensor]) -> None:
    if not tensors:
        return
    largest = torch.stack(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32))
    bad = (~torch.isfinite(largest)).any()
    noop_flag.copy_(torch.maximum(noop_flag, bad.to(noop_flag.dtype)).reshape(noop_flag.shape))


def _scaled_copy(name: str, noop_flag: Tensor, tensor_lists, scale) -> None:
    if len(tensor_lists) != 2 or len(tensor_lists[0]) != len(tensor_lists[1]):
        raise ValueError(f"{name}: tensor_lists must be [sources, destinations] of equal length, got "
                         f"{[len(t) for t in tensor_lists]} lists")
    sources, destinations = list(tensor_lists[0]), list(tensor_lists[1])
    if not sources:
        return
    scaled = torch._foreach_mul(sources, scale)
    _flag_non_finite(noop_flag, scaled)
    torch._foreach_copy_(destinations, scaled)


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists, scale: float) -> None:
    """destinations[i] = sources[i] * scale (each in its own dtype; the product in the source's)."""
    _scaled_copy("multi_tensor_scale", noop_flag, tensor_lists, scale)


def multi_tensor_scale_tensor(chunk_size: int, noop_flag: Tensor, tensor_lists, scale: Tensor) -> None:
    """multi_tensor_scale with the scale a 1-element tensor on the device (no host read)."""
    _scaled_copy("multi_tensor_scale_tensor", noop_flag, tensor_lists, scale.reshape(()))


def multi_tensor_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists, per_tensor: bool = False, *args):
    """(the L2 norm of all tensors of tensor_lists[0] together, shape (1,), float32; their norms
    one by one with per_tensor=True, else an empty tensor)."""
    if len(tensor_lists) != 1:
        raise ValueError(f"multi_tensor_l2norm: tensor_lists must hold one list of tensors, got {len(tensor_lists)}")
    tensors = list(tensor_lists[0])
    device = tensors[0].device if tensors else noop_flag.device
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device), torch.empty(0, dtype=torch.float32, device=device)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, norms if per_tensor else torch.empty(0, dtype=torch.float32, device=device)
