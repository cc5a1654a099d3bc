"""Reference cross-entropy with label smoothing and ignore_index, float32, differentiable.

With smoothing e over V classes, as torch.nn.functional.cross_entropy:
loss = (1 - e) * (lse - logit[target]) + e * (lse - mean(logits)).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .cast import check_choice, check_float, check_ndim

REDUCTIONS = ("mean", "sum", "none")


def _check_args(logits: Tensor, target: Tensor, label_smoothing: float, reduction: str) -> None:
    check_float("logits", logits)
    check_ndim("logits", logits, 2)
    if not isinstance(target, Tensor) or target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        got = target.dtype if isinstance(target, Tensor) else type(target).__name__
        raise TypeError(f"target must be an integer (int64) tensor of class indices, got {got}")
    check_ndim("target", target, 1)
    if target.shape[0] != logits.shape[0]:
        raise ValueError(f"target has {target.shape[0]} entries; logits {tuple(logits.shape)} has {logits.shape[0]} rows")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    check_choice("reduction", reduction, REDUCTIONS)


def cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean"
) -> Tensor:
    _check_args(logits, target, label_smoothing, reduction)
    vocab = logits.shape[1]
    valid = target != ignore_index
    outside = valid & ((target < 0) | (target >= vocab))
    # A traced graph cannot branch on values (nor raise: inductor's CPU kernels abort the process
    # on a failed device-side check), so under torch.compile a class outside the vocabulary makes
    # its row's loss and gradient NaN, as the contract allows, instead of a finite wrong number.
    if not torch.compiler.is_compiling() and bool(outside.any()):
        bad = target[outside][0].item()
        raise ValueError(f"target holds class {bad}, outside [0, {vocab}) and not ignore_index={ignore_index}")
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    picked = lf.gather(1, torch.where(valid & ~outside, target, torch.zeros_like(target)).long().unsqueeze(1)).squeeze(1)
    loss = (1.0 - label_smoothing) * (lse - picked)
    if label_smoothing > 0.0:
        loss = loss + label_smoothing * (lse - lf.mean(dim=-1))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if torch.compiler.is_compiling():  # NaN times the row's loss: its gradient is NaN too
        loss = loss * torch.where(outside, float("nan"), 1.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().float()  # 0/0 = NaN when all are ignored, as torch
