"""Transformer Engine's distributed helper functions that Megatron-LM and NeMo call directly
(`transformer_engine.pytorch.distributed`), with TE's signatures and return values.

Unlike te-core's autograd collectives (te_core.distributed.collectives), the gather and the
reduce-scatter here are plain collectives, no gradient flows through them, and they return
(output, handle) as TE does: the handle is torch's Work for async_op=True and None when the
collective has already completed (a group of one rank, a synchronous call).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..quantization.float8_tensor import Float8Tensor
from ..quantization.tensor import QuantizedTensor
from .collectives import _all_gather_single, _reduce_scatter_single
from .fp8_gather import gather_shard_bytes

_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def get_distributed_world_size(group=None) -> int:
    """The number of ranks of `group` (None: the default group); 1 where torch.distributed is not
    initialized, as TE answers for a single-process run."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def set_tensor_model_parallel_attributes(tensor: Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark `tensor` as Megatron-LM reads a tensor-parallel parameter (tensor_model_parallel,
    partition_dim, partition_stride). Setting them twice is an error, as in TE: a second call
    would silently change how checkpoints shard a parameter already marked."""
    for name in _PARALLEL_ATTRIBUTES:
        if hasattr(tensor, name):
            raise RuntimeError(f"set_tensor_model_parallel_attributes: the tensor already has {name!r} set "
                               f"({getattr(tensor, name)!r}); its tensor-parallel attributes can be set only once")
    tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = is_parallel, dim, stride


def _check_output(output: Tensor, shape, dtype: torch.dtype, device: torch.device, what: str) -> None:
    if tuple(output.shape) != tuple(shape) or output.dtype != dtype or output.device != device:
        raise ValueError(f"{what}: the given output tensor is {tuple(output.shape)} {output.dtype} on "
                         f"{output.device}, but the result is {tuple(shape)} {dtype} on {device}; pass a tensor of "
                         "that shape, dtype and device, or None to have one allocated")
    if not output.is_contiguous():
        raise ValueError(f"{what}: the given output tensor must be contiguous (the collective writes it in place)")


def _gather_float8(inp: Float8Tensor, group) -> Float8Tensor:
    """The ranks' FP8 bytes gathered, read with this rank's scale as TE does, after checking that
    every rank quantized with the same scale (else the other ranks' values would come out wrong)."""
    scales = [torch.empty_like(inp._scale_inv) for _ in range(dist.get_world_size(group))]
    dist.all_gather(scales, inp._scale_inv.contiguous(), group=group)
    if any(not torch.equal(s, scales[0]) for s in scales[1:]):
        raise ValueError("gather_along_first_dim: the ranks' Float8Tensors have different scales "
                         f"({[float(s) for s in scales]}), and a gathered Float8Tensor holds one; quantize the shards "
                         "with one scale (current scaling with its amax all-reduced over the group), or gather "
                         "inp.dequantize() and quantize the result")
    return gather_shard_bytes(inp, group)


def gather_along_first_dim(inp: Tensor, process_group, async_op: bool = False, quantizer=None,
                           output_tensor: Optional[Tensor] = None) -> Tuple[Tensor, Optional[dist.Work]]:
    """The ranks' `inp` concatenated along dim 0 in rank order, and the collective's handle.
    A Float8Tensor is gathered as FP8 bytes (its shards must share one scale; the gather is then
    synchronous, handle None); MXFP8 and block-scaled tensors, and `quantizer`, are not supported."""
    if quantizer is not None:
        raise NotImplementedError(
            "gather_along_first_dim: quantizer (quantize while gathering) is not implemented by te-core; gather the "
            "high-precision tensor and quantize the result, or let te-core's modules gather their input under "
            "sequence_parallel=True (they gather FP8 bytes themselves where the recipe allows)")
    world = get_distributed_world_size(process_group)
    if world == 1:
        return inp, None
    if isinstance(inp, Float8Tensor):
        if output_tensor is not None:
            raise NotImplementedError("gather_along_first_dim: output_tensor with a Float8Tensor input is not "
                                      "implemented by te-core; pass output_tensor=None")
        return _gather_float8(inp, process_group), None
    if isinstance(inp, QuantizedTensor):
        raise NotImplementedError(
            f"gather_along_first_dim: te-core gathers high-precision tensors and Float8Tensor, not "
            f"{type(inp).__name__} (its block scales span the shards' rows); gather inp.dequantize() and quantize "
            "the result")
    shape = (inp.shape[0] * world, *inp.shape[1:])
    if output_tensor is None:
        output_tensor = torch.empty(shape, dtype=inp.dtype, device=inp.device)
    else:
        _check_output(output_tensor, shape, inp.dtype, inp.device, "gather_along_first_dim")
    handle = _all_gather_single(output_tensor, inp.contiguous(), group=process_group, async_op=async_op)
    return output_tensor, handle


def reduce_scatter_along_first_dim(inp: Tensor, tp_group, async_op: bool = False,
                                   output: Optional[Tensor] = None) -> Tuple[Tensor, Optional[dist.Work]]:
    """The sum of the ranks' `inp`, of which this rank keeps its block of dim 0 (rank order), and
    the collective's handle. Dim 0 must be divisible by the group's size."""
    world = get_distributed_world_size(tp_group)
    if world == 1:
        return inp, None
    if isinstance(inp, QuantizedTensor):
        raise NotImplementedError(f"reduce_scatter_along_first_dim: a {type(inp).__name__} cannot be summed as it "
                                  "is; reduce-scatter inp.dequantize()")
    if inp.shape[0] % world:
        raise ValueError(f"reduce_scatter_along_first_dim: the first dimension ({inp.shape[0]}) must be divisible by "
                         f"the group's size {world} (remainder {inp.shape[0] % world}); pad it to a multiple of "
                         f"{world}")
    shape = (inp.shape[0] // world, *inp.shape[1:])
    if output is None:
        output = torch.empty(shape, dtype=inp.dtype, device=inp.device)
    else:
        _check_output(output, shape, inp.dtype, inp.device, "reduce_scatter_along_first_dim")
    handle = _reduce_scatter_single(output, inp.contiguous(), op=dist.ReduceOp.SUM, group=tp_group,
                                    async_op=async_op)
    return output, handle
