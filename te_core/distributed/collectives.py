"""The four communication steps of tensor and sequence parallelism, as autograd Functions.

Each is one torch.distributed collective in forward and its transpose in backward; the
sequence dimension is the first one, as in Transformer Engine ((s, b, h) or (tokens, h) inputs).

    copy_to_tp_region          forward: identity        backward: all-reduce (sum)
    reduce_from_tp_region      forward: all-reduce      backward: identity
    gather_along_first_dim     forward: all-gather      backward: reduce-scatter (sum)
    scatter_reduce_first_dim   forward: reduce-scatter  backward: all-gather

The collectives are torch's, on the group the user gave; whatever library backs that group
(NCCL, MCCL, gloo) does the transfer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.10 names the single-tensor collectives *_single and deprecates the older names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """The sum of x over the ranks of `group`, in a new tensor (x itself is left untouched)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_max(x: Tensor, group) -> Tensor:
    """The elementwise max of x over the ranks of `group`, in a new tensor, without a gradient
    (a statistic, such as attention's max logit)."""
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def all_gather_first_dim(x: Tensor, group) -> Tensor:
    """The ranks' x concatenated along dim 0, in rank order."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def reduce_scatter_first_dim(x: Tensor, group) -> Tensor:
    """The sum of x over the ranks, of which this rank keeps its block of dim 0 (rank order)."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce-scatter along the sequence dimension: its size {x.shape[0]} is not divisible by "
                         f"the tensor-parallel size {world}; pad the sequence to a multiple of {world}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group)
    return out


def _identity(x: Tensor, group) -> Tensor:
    return x.view_as(x)


class _Collective(torch.autograd.Function):
    """forward_op(x, group) forward, its transpose backward_op(dy, group) backward."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, dy):
        return ctx.backward_op(dy, ctx.group), None, None, None


def copy_to_tp_region(x: Tensor, group) -> Tensor:
    """x unchanged; its gradient summed over the group (the input of a column-parallel GEMM,
    whose ranks each hold a partial input gradient)."""
    return _Collective.apply(x, group, _identity, all_reduce_sum)


def reduce_from_tp_region(x: Tensor, group) -> Tensor:
    """x summed over the group (the output of a row-parallel GEMM); the gradient passes as is."""
    return _Collective.apply(x, group, all_reduce_sum, _identity)


def gather_along_first_dim(x: Tensor, group) -> Tensor:
    """The sequence shards gathered into the full sequence; the gradient reduce-scattered."""
    return _Collective.apply(x, group, all_gather_first_dim, reduce_scatter_first_dim)


def scatter_reduce_first_dim(x: Tensor, group) -> Tensor:
    """x summed over the group, each rank keeping its sequence shard; the gradient all-gathered."""
    return _Collective.apply(x, group, reduce_scatter_first_dim, all_gather_first_dim)
