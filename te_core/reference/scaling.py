"""Reference delayed-scaling update: new scales from the amax histories, then roll the histories."""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from .cast import FLOAT32_MAX, check_choice

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # float32's smallest normal number, 2^-126


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


def history_amax(history: Tensor, algo: str) -> Tensor:
    """The amax each column's scale follows, as Transformer Engine's update kernel takes it:
    "max" is C's fmaxf over the history from 0, so a NaN entry is ignored (it never freezes a
    scale for the window) while an inf entry wins; "most_recent" is row 0 as it is."""
    if algo == "most_recent":
        return history[0]
    return torch.where(torch.isnan(history), 0.0, history).amax(dim=0)


def scale_from_amax(amax: Tensor, scale: Tensor, fp8_max: float, margin: float) -> Tensor:
    """(fp8_max * 2^-margin) / amax where amax is finite and positive, else the old scale (0, inf
    and NaN carry no usable range), in Transformer Engine's order: a tiny amax keeps its margin
    where fp8_max / amax alone would overflow first. A scale that is inf (from a tiny amax, or an
    old inf scale) becomes float32 max, as in Transformer Engine; one below float32's smallest
    normal number (a huge amax under a large margin) becomes that number, so that 1 / scale stays
    finite (an inf scale_inv makes every 0 of the FP8 data NaN)."""
    # TE's float32 arithmetic: 2^-margin rounded to float32, times fp8_max, over amax (tensor
    # operands: Python's scalar / tensor is reciprocal-then-multiply in torch, not a true quotient)
    scaled_max = torch.full_like(amax, 2.0**-margin) * fp8_max
    new = torch.where(torch.isfinite(amax) & (amax > 0), torch.div(scaled_max, amax), scale)
    return new.clamp(min=FLOAT32_TINY, max=FLOAT32_MAX)


def roll_history(history: Tensor, stepped: Tensor) -> None:
    """Roll the columns that recorded an amax this step (row 0 != 0; NaN counts) up by one row,
    the last row taking row 0, and zero row 0; a column whose row 0 is 0 (nothing recorded, an
    empty or all-zero tensor) keeps its history, as Transformer Engine's update does."""
    rolled = torch.roll(history, shifts=-1, dims=0)
    rolled[0] = 0.0
    history.copy_(torch.where(stepped, rolled, history))


def _update_one(history: Tensor, scale: Tensor, fp8_max: float, margin: float, algo: str) -> None:
    stepped = history[0] != 0
    amax = torch.where(stepped, history_amax(history, algo), 0.0)  # amax 0 keeps the scale
    scale.copy_(scale_from_amax(amax, scale, fp8_max, margin))
    roll_history(history, stepped)


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
