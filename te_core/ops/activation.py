"""Contract: activations (optionally with FP8 output) and the fused backward epilogues.

`kind` is one of ACTIVATIONS. Formulas, as in Transformer Engine, computed in float32:
gelu = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (tanh approximation);
relu; silu = x sigmoid(x); qgelu = x sigmoid(1.702 x); srelu = relu(x)^2.
Gated kinds split the last dimension of x (2h) into a = x[..., :h] and b = x[..., h:] and
return act(a) * b: glu (sigmoid), swiglu (silu), geglu (gelu), reglu (relu), qgeglu (qgelu),
sreglu (srelu);
their output has h columns. clamped_swiglu (GPT-OSS's) clamps first, a' = min(a, limit) and
b' = clamp(b, -limit, limit), then returns a' sigmoid(alpha a') (b' + glu_linear_offset); its
derivative is zero where a clamp is active. `limit` (> 0), `alpha` and `glu_linear_offset` apply
to clamped_swiglu only: any other kind with values other than the defaults is an error. Callers
pass them only for clamped_swiglu, so a backend whose `supports` does not know them declines the
kind by name.
FP8 output works as in ops.norm: with fp8_scale and fp8_dtype, y is FP8 data of
y * fp8_scale and amax = max|y| (maxed into `amax_out` when given, as in ops.cast); else y in
x's dtype and amax None.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..backend.types import Capabilities
from ._spec import contract_op

ACTIVATIONS = ("gelu", "relu", "silu", "qgelu", "srelu", "glu", "swiglu", "geglu", "reglu", "qgeglu", "sreglu",
               "clamped_swiglu")
GATED_ACTIVATIONS = ("glu", "swiglu", "geglu", "reglu", "qgeglu", "sreglu", "clamped_swiglu")
CLAMPED_SWIGLU_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}
"""Transformer Engine's defaults for clamped_swiglu's `limit`, `alpha` and `glu_linear_offset`."""


def _fp8_out_caps(caps: Capabilities, *args, fp8_dtype=None, **_):
    return None if fp8_dtype is None else caps.check_fp8(fp8_dtype)


def _fp8_arg_caps(caps: Capabilities, dy, *args, **kwargs):
    fp8_dtype = kwargs.get("fp8_dtype", args[-1] if args else None)
    return caps.check_fp8(fp8_dtype)


@contract_op("activation", _fp8_out_caps)
def activation_fwd(
    x: Tensor,
    kind: str,
    *,
    fp8_scale: Optional[Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    amax_out: Optional[Tensor] = None,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Returns (y, amax)."""


@contract_op("activation")
def activation_bwd(dy: Tensor, x: Tensor, kind: str, *, limit: float = 7.0, alpha: float = 1.702,
                   glu_linear_offset: float = 1.0) -> Tensor:
    """d(act)/dx applied to dy; dx has x's shape and dtype (2h columns for gated kinds)."""


@contract_op("activation")
def dbias(dy: Tensor) -> Tensor:
    """Sum of dy over every dimension but the last, accumulated in float32, in dy's dtype."""


@contract_op("activation", _fp8_arg_caps)
def dbias_cast_transpose(
    dy: Tensor, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """For a 2-D gradient dy (M, N): (data, data_t, dbias, amax) = cast_transpose_fp8(dy) and
    dbias(dy), in one pass (`amax_out` as for cast_transpose_fp8)."""


@contract_op("activation", _fp8_arg_caps)
def dbias_cast_transpose_parts(
    parts: Sequence[Tensor], scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dbias_cast_transpose of dy = torch.cat(parts, dim=1) without materializing dy: `parts` are
    2-D gradients of one dtype and device with the same number of rows, dy's column blocks in
    order (the gradients of q, k and v reach a fused QKV projection this way). Returns the
    same (data, data_t, dbias, amax) as dbias_cast_transpose(dy)."""


def _current_caps(caps: Capabilities, parts, fp8_dtype, **_):
    return caps.check_fp8(fp8_dtype)


@contract_op("activation", _current_caps)
def dbias_cast_transpose_current(
    parts: Sequence[Tensor], fp8_dtype: torch.dtype, *, force_pow2_scales: bool = False, amax_epsilon: float = 0.0
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Current scaling's output-gradient epilogue: for dy = torch.cat(parts, dim=1) (`parts` as
    for dbias_cast_transpose_parts; one tensor for a gradient given whole), returns
    (data, data_t, dbias, scale, scale_inv, amax) where (data, data_t, scale, scale_inv, amax)
    are quantize_fp8_current(dy, fp8_dtype, with_transpose=True, force_pow2_scales=...,
    amax_epsilon=...)'s and dbias is dbias(dy): the cast, its transpose and the bias gradient
    in one pass once the amax is known, without materializing dy."""


@contract_op("activation", _current_caps)
def dbias_cast_transpose_blockwise(
    parts: Sequence[Tensor], fp8_dtype: torch.dtype, *, force_pow2_scales: bool = True, amax_epsilon: float = 0.0
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Block scaling's output-gradient epilogue: for dy = torch.cat(parts, dim=1) (`parts` as
    for dbias_cast_transpose_parts; one tensor for a gradient given whole), returns
    (data, scale_inv, data_t, scale_inv_t, dbias) where the first four are
    quantize_blockwise(dy, fp8_dtype, block_2d=False, with_transpose=True,
    force_pow2_scales=..., amax_epsilon=...)'s (1x128 blocks, scale grids laid out column by
    column) and dbias is dbias(dy) (its float32 column sums may add in another order): the
    casts and the bias gradient from one read of dy, without materializing it."""


@contract_op("activation", _fp8_arg_caps)
def activation_bwd_dbias_cast_transpose(
    dy: Tensor, x: Tensor, kind: str, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None,
    limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx = activation_bwd(dy, x, kind, limit=..., alpha=..., glu_linear_offset=...) for 2-D x, then
    (data, data_t, dbias, amax) of dx as dbias_cast_transpose does — the backward epilogue between
    fc2's dgrad and fc1's GEMMs."""
