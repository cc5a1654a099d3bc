"""Transformer Engine's multi-tensor helpers (apex's interface): `multi_tensor_applier(op,
noop_flag, tensor_lists, *args)` calls `op(chunk_size, noop_flag, tensor_lists, *args)`, and the
ops below are such `op`s. Training frameworks (Megatron-LM's gradient clipping and its copies
between main and model gradients) import them from `transformer_engine.pytorch.optimizers`.

They are torch's foreach operations, a few launches for a whole list on any device, with no host
synchronisation: `noop_flag` (an int tensor) is set to 1 on the device where Transformer Engine's
kernel flags a non-finite value (an input of multi_tensor_scale, a norm of the l2norm ops), and
nothing reads it back. Values are read into float32 as the kernels read them: scaling multiplies
in float32 whatever the tensors' dtypes, and norms accumulate in float32.
"""
from __future__ import annotations

import numbers
from typing import List, Sequence

import torch
from torch import Tensor

__all__ = ["MultiTensorApply", "multi_tensor_applier", "multi_tensor_scale", "multi_tensor_scale_tensor",
           "multi_tensor_l2norm", "multi_tensor_unscale_l2norm"]

CHUNK_SIZE = 2048 * 32  # apex's default; the foreach operations do their own chunking


class MultiTensorListsError(ValueError, RuntimeError):
    """Tensor lists a multi-tensor op cannot take. Transformer Engine raises RuntimeError for
    misaligned lists, so code written for it (`except RuntimeError`) catches this too."""


def _local(t: Tensor) -> Tensor:
    return getattr(t, "_local_tensor", t)  # a sharded (DTensor) tensor's own shard, as Transformer Engine's applier


def _non_empty_slots(name: str, tensor_lists) -> List[List[Tensor]]:
    """The lists (new ones: the caller's stay as they are) without the slots whose tensor in the
    first list is empty, as Transformer Engine's applier drops them before its kernels run."""
    lists = [[_local(t) for t in tensors] for tensors in tensor_lists]
    if not lists or any(len(tensors) != len(lists[0]) for tensors in lists):
        raise MultiTensorListsError(f"{name}: tensor_lists must be one or more lists of equal length (one tensor "
                                    f"per list for each slot), got lengths {[len(t) for t in lists]}")
    keep = [t.numel() > 0 for t in lists[0]]
    return [[t for t, kept in zip(tensors, keep) if kept] for tensors in lists]


class MultiTensorApply:
    """Transformer Engine's applier: `MultiTensorApply(chunk_size)(op, noop_flag, tensor_lists,
    *args)` calls `op(chunk_size, noop_flag, tensor_lists, *args)` with sharded tensors replaced
    by their local shards and the empty slots dropped; it returns None, without calling op, where
    no slot is left."""

    def __init__(self, chunk_size: int):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"MultiTensorApply: chunk_size must be a positive int (Transformer Engine's default "
                             f"is {CHUNK_SIZE}), got {chunk_size!r}")
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer: Tensor, tensor_lists: Sequence[Sequence[Tensor]], *args):
        lists = _non_empty_slots(getattr(op, "__name__", "multi_tensor_applier"), tensor_lists)
        if not lists[0]:
            return None
        return op(self.chunk_size, noop_flag_buffer, lists, *args)


multi_tensor_applier = MultiTensorApply(CHUNK_SIZE)


def _raise_flag(noop_flag: Tensor, bad: Tensor) -> None:
    """noop_flag = max(noop_flag, bad), on the device (an earlier flag stays raised)."""
    noop_flag.copy_(torch.maximum(noop_flag, bad.to(noop_flag.dtype)).reshape(noop_flag.shape))


def _scaled_copy(name: str, noop_flag: Tensor, tensor_lists, scale) -> None:
    """destinations[i] = float32(sources[i]) * scale, rounded into the destination's dtype;
    noop_flag raised where a source value is not finite (in float32), as Transformer Engine's
    kernel: a finite value whose product overflows is written as inf, unflagged."""
    if len(tensor_lists) != 2:
        raise MultiTensorListsError(f"{name}: tensor_lists must be [sources, destinations], got "
                                    f"{len(tensor_lists)} list(s)")
    sources, destinations = _non_empty_slots(name, tensor_lists)
    if not sources:
        return
    largest = torch.stack(torch._foreach_norm(sources, float("inf"), dtype=torch.float32))
    _raise_flag(noop_flag, ~torch.isfinite(largest).all())
    # A float32 destination takes the float32 source values and is scaled in place; any other
    # gets a float32 product, rounded once when copied in.
    direct = [(s, d) for s, d in zip(sources, destinations) if d.dtype == torch.float32]
    staged = [(s, d) for s, d in zip(sources, destinations) if d.dtype != torch.float32]
    if direct:
        copied = [(s, d) for s, d in direct if s is not d]  # (a source scaled in place copies nothing)
        if copied:
            torch._foreach_copy_([d for _, d in copied], [s for s, _ in copied])
        torch._foreach_mul_([d for _, d in direct], scale)
    if staged:
        products = torch._foreach_mul([s.float() for s, _ in staged], scale)  # (.float() of a float32 one: itself)
        torch._foreach_copy_([d for _, d in staged], products)


def _one_element(name: str, what: str, value: Tensor) -> Tensor:
    """`value` as a 0-dim float32 tensor (Transformer Engine's kernels read one float from it)."""
    if not torch.is_tensor(value) or value.numel() != 1:
        got = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
        raise TypeError(f"{name}: {what} must be a one-element tensor on the tensors' device, got {got}")
    return value.reshape(()).to(torch.float32)


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists, scale: float) -> None:
    """destinations[i] = sources[i] * scale, in float32 (scale rounded to float32 too), written in
    the destination's dtype; noop_flag set where a source holds an inf or NaN."""
    name = "multi_tensor_scale"
    if torch.is_tensor(scale):  # (Transformer Engine's binding reads one as a float, after a host read)
        scale = _one_element(name, "scale", scale)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name}: scale must be a real number, got {type(scale).__name__} {scale!r}")
    _scaled_copy(name, noop_flag, tensor_lists, scale)


def multi_tensor_scale_tensor(chunk_size: int, noop_flag: Tensor, tensor_lists, scale: Tensor) -> None:
    """multi_tensor_scale with the scale a one-element tensor on the device (no host read)."""
    name = "multi_tensor_scale_tensor"
    _scaled_copy(name, noop_flag, tensor_lists, _one_element(name, "scale", scale))


def _norms(name: str, noop_flag: Tensor, tensor_lists, per_tensor: bool, inv_scale=None):
    if len(tensor_lists) != 1:
        raise MultiTensorListsError(f"{name}: tensor_lists must hold one list of tensors, got {len(tensor_lists)}")
    tensors = [_local(t) for t in tensor_lists[0]]
    device = tensors[0].device if tensors else noop_flag.device
    nothing = torch.empty(0, dtype=torch.float32, device=device)
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device), nothing
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    if inv_scale is not None:  # ||x * s|| = ||x|| * |s|: no scaled copy of the tensors
        norms = norms * inv_scale.abs()
    total = torch.linalg.vector_norm(norms).reshape(1)
    _raise_flag(noop_flag, ~torch.isfinite(total).all())  # (an inf or NaN value, or a norm past float32's range)
    return total, norms if per_tensor else nothing


def multi_tensor_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists, per_tensor: bool = False, *args):
    """(the L2 norm of all tensors of tensor_lists[0] together, shape (1,), float32; their norms
    one by one with per_tensor=True, else an empty tensor). noop_flag is set where the norm is not
    finite."""
    return _norms("multi_tensor_l2norm", noop_flag, tensor_lists, per_tensor)


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists, inv_scale: Tensor,
                                per_tensor: bool = False):
    """multi_tensor_l2norm of the tensors times `inv_scale` (a one-element tensor, e.g. a loss
    scaler's reciprocal scale), the tensors themselves left as they are."""
    name = "multi_tensor_unscale_l2norm"
    return _norms(name, noop_flag, tensor_lists, per_tensor, _one_element(name, "inv_scale", inv_scale))
