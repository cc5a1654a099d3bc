"""Reference delayed-scaling update: new scales from the amax histories, then roll the histories."""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from .cast import FLOAT32_MAX, check_choice

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _check(amax_histories, scales, fp8_maxes, amax_compute_algo: str) -> None:
    check_choice("amax_compute_algo", amax_compute_algo, AMAX_COMPUTE_ALGOS)
    if not len(amax_histories) == len(scales) == len(fp8_maxes):
        raise ValueError(
            f"amax_histories ({len(amax_histories)}), scales ({len(scales)}) and fp8_maxes "
            f"({len(fp8_maxes)}) must have the same length"
        )
    for i, (history, scale) in enumerate(zip(amax_histories, scales)):
        if history.dim() != 2 or history.shape[0] < 1:
            raise ValueError(f"amax_histories[{i}] must be 2-D (L, n) with L >= 1, got {tuple(history.shape)}")
        if tuple(scale.shape) != (history.shape[1],):
            raise ValueError(
                f"scales[{i}] has shape {tuple(scale.shape)}; amax_histories[{i}] {tuple(history.shape)} "
                f"needs ({history.shape[1]},)"
            )
        if history.dtype != torch.float32 or scale.dtype != torch.float32:
            raise TypeError(f"amax_histories[{i}] and scales[{i}] must be float32, got {history.dtype} and {scale.dtype}")


def _update_one(history: Tensor, scale: Tensor, fp8_max: float, margin: float, algo: str) -> None:
    amax = history.amax(dim=0) if algo == "max" else history[0]
    # full_like divisor: Python's scalar / tensor is reciprocal-then-multiply in torch, not a true quotient.
    new = torch.div(torch.full_like(amax, fp8_max), amax) / (2.0**margin)
    new = torch.where(torch.isinf(new), torch.full_like(new, FLOAT32_MAX), new)
    usable = torch.isfinite(amax) & (amax > 0)
    scale.copy_(torch.where(usable, new, scale))
    history.copy_(torch.roll(history, shifts=-1, dims=0))
    history[0].zero_()


def delayed_scaling_update(
    amax_histories: List[Tensor],
    scales: List[Tensor],
    fp8_maxes: Sequence[float],
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
) -> None:
    _check(amax_histories, scales, fp8_maxes, amax_compute_algo)
    for history, scale, fp8_max in zip(amax_histories, scales, fp8_maxes):
        _update_one(history, scale, float(fp8_max), margin, amax_compute_algo)
