"""Transformer Engine's `parallel_cross_entropy`: the cross-entropy loss of logits whose
vocabulary may be split over the ranks of a process group (the output layer of a model with
tensor parallelism keeps vocab / tp_size logits per rank).

On one rank it is the contract's cross_entropy op (the backend's kernel). Over a group, each
rank computes on its shard in float32 and three all-reduces (the largest logit, the sum of the
exponentials, the target's logit; with label smoothing also the logits' sum) give every rank
the whole vocabulary's loss, and the gradient of each shard is its own part of the softmax minus
the one-hot target, as on one rank.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .distributed.collectives import reduce_from_tp_region

__all__ = ["parallel_cross_entropy"]


def parallel_cross_entropy(inp: Tensor, target: Tensor, label_smoothing: float = 0.0, reduce_loss: bool = False,
                           dist_process_group=None, ignore_idx: int = -100, is_cg_capturable: bool = False, *,
                           _input: Optional[Tensor] = None) -> Tensor:
    """The loss per token ((B, SQ) for inp (B, SQ, V) or (SQ, B, V), in float32), or with
    reduce_loss its mean over the tokens whose target is not ignore_idx (shape (1,)). With
    dist_process_group, inp holds this rank's equal share of the vocabulary (rank r's logits
    r x V_r to (r + 1) x V_r) and target indexes the whole vocabulary. is_cg_capturable
    (Transformer Engine's switch to a capturable backward) changes nothing here: no step
    synchronizes with the host except the check of out-of-range targets over a group."""
    name = "parallel_cross_entropy"
    if _input is not None:
        warnings.warn(f"{name}: _input is deprecated; use inp", FutureWarning, stacklevel=2)
        inp = _input
    if not isinstance(inp, Tensor) or inp.dim() < 2 or tuple(target.shape) != tuple(inp.shape[:-1]):
        raise ValueError(f"{name}: inp must be (..., V) logits and target their (...) indices, got "
                         f"{tuple(getattr(inp, 'shape', ()))} and {tuple(getattr(target, 'shape', ()))}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    logits, flat_target = inp.reshape(-1, inp.shape[-1]), target.reshape(-1)
    world = 1 if dist_process_group is None else dist.get_world_size(dist_process_group)
    if world == 1:
        loss = ops.cross_entropy(logits, flat_target, ignore_index=ignore_idx, label_smoothing=label_smoothing,
                                 reduction="none")
    else:
        loss = _vocab_parallel(logits, flat_target, label_smoothing, ignore_idx, dist_process_group, world, name)
    if reduce_loss:  # shape (1,), as Transformer Engine returns it
        counted = (flat_target != ignore_idx).sum().clamp(min=1)
        return (loss.sum() / counted).reshape(1)
    return loss.view(target.shape)


def _vocab_parallel(logits: Tensor, target: Tensor, smoothing: float, ignore_idx: int, group, world: int,
                    name: str) -> Tensor:
    shard = logits.shape[-1]
    first = dist.get_rank(group) * shard
    x = logits.float()
    with torch.no_grad():
        # the shard sizes ride along (largest, and minus the smallest): every rank learns whether
        # they differ from the same reduction, so all raise together instead of some waiting in
        # the next collective (rank * shard would be the wrong offset on some of them)
        peak = torch.cat([x.max(-1).values, x.new_tensor([shard, -shard])])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        peak, sizes = peak[:-2], peak[-2:]
    ignored = target == ignore_idx
    outside = ((target < 0) | (target >= shard * world)) & ~ignored
    uneven, any_outside = torch.stack([sizes[0] != -sizes[1], outside.any()]).tolist()  # (one host read)
    if uneven:
        raise ValueError(f"{name}: the ranks of dist_process_group hold vocabulary shards of different sizes "
                         f"({int(-sizes[1])} to {int(sizes[0])} logits; this rank {shard}); each rank must hold an "
                         "equal share, vocab_size / world_size logits (pad the vocabulary to a multiple of the "
                         "group's size)")
    if any_outside:  # (a finite loss for a target no rank holds would be silently wrong)
        raise ValueError(f"{name}: a target outside [0, {shard * world}) that is not ignore_idx={ignore_idx}: "
                         f"{target[outside][:4].tolist()}")
    shifted = x - peak[:, None]
    lse = reduce_from_tp_region(shifted.exp().sum(-1), group).log()
    mine = (target >= first) & (target < first + shard)
    local = (target - first).clamp(0, shard - 1)
    target_logit = reduce_from_tp_region(torch.where(mine, shifted.gather(1, local[:, None]).squeeze(1), 0.0), group)
    loss = lse - target_logit
    if smoothing:
        mean_logit = reduce_from_tp_region(shifted.sum(-1), group) / (shard * world)
        loss = (1.0 - smoothing) * loss + smoothing * (lse - mean_logit)
    return torch.where(ignored, 0.0, loss)
