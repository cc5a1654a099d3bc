"""Reference activations (plain and gated), their exact derivatives, and the dbias epilogues.

Each kind is a pair (f, f') of float32 closed forms; gated kinds reuse the pair of their
inner activation on the first half of the columns and multiply by the second half.
clamped_swiglu clamps both halves first and has its own closed form (see ops.activation).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..ops.activation import ACTIVATIONS, CLAMPED_SWIGLU_DEFAULTS
from ..backend.types import as_dtype
from .cast import (cast_transpose_fp8, check_choice, check_float, check_ndim, fp8_output, quantize_blockwise,
                   quantize_fp8_current)

_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
_QGELU_K = 1.702


def _gelu(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_GELU_K * (x + _GELU_C * x * x * x)))


def _dgelu(x: Tensor) -> Tensor:
    t = torch.tanh(_GELU_K * (x + _GELU_C * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)


def _relu(x: Tensor) -> Tensor:
    return torch.relu(x)


def _drelu(x: Tensor) -> Tensor:
    return (x > 0).to(x.dtype)


def _silu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def _dsilu(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _qgelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(_QGELU_K * x)


def _dqgelu(x: Tensor) -> Tensor:
    s = torch.sigmoid(_QGELU_K * x)
    return s + _QGELU_K * x * s * (1.0 - s)


def _srelu(x: Tensor) -> Tensor:
    return torch.relu(x).square()


def _dsrelu(x: Tensor) -> Tensor:
    return 2.0 * torch.relu(x)


def _sigmoid(x: Tensor) -> Tensor:
    return torch.sigmoid(x)


def _dsigmoid(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 - s)


Pair = Tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]
# sigmoid is no activation kind of its own: only glu's gate (Transformer Engine has no plain one)
_ELEMENTWISE: Dict[str, Pair] = {
    "sigmoid": (_sigmoid, _dsigmoid),
    "gelu": (_gelu, _dgelu),
    "relu": (_relu, _drelu),
    "silu": (_silu, _dsilu),
    "qgelu": (_qgelu, _dqgelu),
    "srelu": (_srelu, _dsrelu),
}
_GATED_INNER = {"glu": "sigmoid", "swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu",
                "sreglu": "srelu"}
_CLAMPED = "clamped_swiglu"


def _out_columns(x: Tensor, kind: str) -> int:
    if kind not in _GATED_INNER and kind != _CLAMPED:
        return x.shape[-1]
    if x.shape[-1] % 2 != 0:
        raise ValueError(
            f"gated activation {kind!r} splits the last dimension of x in two halves; "
            f"it must be even, got {x.shape[-1]}"
        )
    return x.shape[-1] // 2


def _split_gated(x32: Tensor, kind: str) -> Tuple[Tensor, Tensor]:
    h = _out_columns(x32, kind)
    return x32[..., :h], x32[..., h:]


def _check_kind_and_x(x: Tensor, kind: str, limit: float, alpha: float, offset: float) -> None:
    check_float("x", x)
    check_choice("kind", kind, ACTIVATIONS)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension")
    if kind == _CLAMPED:
        if not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
            raise ValueError(f"clamped_swiglu needs a finite limit > 0, got {limit!r}")
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
            raise ValueError(f"clamped_swiglu needs a finite alpha, got {alpha!r}")
        if not (isinstance(offset, (int, float)) and math.isfinite(offset)):
            raise ValueError(f"clamped_swiglu needs a finite glu_linear_offset, got {offset!r}")
    elif {"limit": limit, "alpha": alpha, "glu_linear_offset": offset} != CLAMPED_SWIGLU_DEFAULTS:
        raise ValueError(f"limit, alpha and glu_linear_offset apply to activation 'clamped_swiglu' only; activation "
                         f"{kind!r} got limit={limit!r}, alpha={alpha!r}, glu_linear_offset={offset!r}: leave them at "
                         "their defaults")


def _clamped_parts(x32: Tensor, limit: float, alpha: float, offset: float):
    """(a', b' + offset, sigmoid(alpha a'), a' sigmoid(alpha a')) of clamped_swiglu's two halves."""
    a, b = _split_gated(x32, _CLAMPED)
    a_c, b_c = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
    s = torch.sigmoid(alpha * a_c)
    return a_c, b_c + offset, s, a_c * s


def _clamped_bwd(dy32: Tensor, x32: Tensor, limit: float, alpha: float, offset: float) -> Tensor:
    a, b = _split_gated(x32, _CLAMPED)
    a_c, b_1, s, g = _clamped_parts(x32, limit, alpha, offset)
    # a clamp passes the gradient only where it is not active (as torch.clamp's backward does)
    da = dy32 * b_1 * (s + alpha * a_c * s * (1.0 - s)) * (a <= limit)
    db = dy32 * g * ((b >= -limit) & (b <= limit))
    return torch.cat([da, db], dim=-1)


def _forward32(x: Tensor, kind: str, limit: float, alpha: float, offset: float) -> Tensor:
    if kind == _CLAMPED:
        _, b_1, _, g = _clamped_parts(x.float(), limit, alpha, offset)
        return g * b_1
    if kind in _GATED_INNER:
        a, b = _split_gated(x.float(), kind)
        return _ELEMENTWISE[_GATED_INNER[kind]][0](a) * b
    return _ELEMENTWISE[kind][0](x.float())


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
    _check_kind_and_x(x, kind, limit, alpha, glu_linear_offset)
    return fp8_output(_forward32(x, kind, limit, alpha, glu_linear_offset), x.dtype, fp8_scale, fp8_dtype, amax_out)


def activation_bwd(dy: Tensor, x: Tensor, kind: str, *, limit: float = 7.0, alpha: float = 1.702,
                   glu_linear_offset: float = 1.0) -> Tensor:
    _check_kind_and_x(x, kind, limit, alpha, glu_linear_offset)
    check_float("dy", dy)
    expected = (*x.shape[:-1], _out_columns(x, kind))
    if tuple(dy.shape) != expected:
        raise ValueError(f"dy has shape {tuple(dy.shape)}; activation {kind!r} of x {tuple(x.shape)} needs {expected}")
    dy32 = dy.float()
    if kind == _CLAMPED:
        dx = _clamped_bwd(dy32, x.float(), limit, alpha, glu_linear_offset)
    elif kind in _GATED_INNER:
        f, df = _ELEMENTWISE[_GATED_INNER[kind]]
        a, b = _split_gated(x.float(), kind)
        dx = torch.cat([dy32 * b * df(a), dy32 * f(a)], dim=-1)
    else:
        dx = dy32 * _ELEMENTWISE[kind][1](x.float())
    return as_dtype(dx, x.dtype)


def dbias(dy: Tensor) -> Tensor:
    check_float("dy", dy)
    if dy.dim() < 1:
        raise ValueError("dy must have at least 1 dimension (dbias sums all but the last)")
    # accumulate in float32 inside the reduction instead of materializing a float32 copy of dy
    # (for an FFN gradient of 16384 x 16384 that copy alone is 1 GiB)
    return as_dtype(dy.reshape(-1, dy.shape[-1]).sum(dim=0, dtype=torch.float32), dy.dtype)


def dbias_cast_transpose(
    dy: Tensor, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    check_float("dy", dy)
    check_ndim("dy", dy, 2)
    data, data_t, amax = cast_transpose_fp8(dy, scale, fp8_dtype, amax_out=amax_out)
    return data, data_t, dbias(dy), amax


def dbias_cast_transpose_parts(
    parts, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return dbias_cast_transpose(join_column_parts(parts), scale, fp8_dtype, amax_out=amax_out)


def dbias_cast_transpose_current(
    parts, fp8_dtype: torch.dtype, *, force_pow2_scales: bool = False, amax_epsilon: float = 0.0
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    dy = join_column_parts(parts)
    data, data_t, scale, scale_inv, amax = quantize_fp8_current(
        dy, fp8_dtype, with_transpose=True, force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon)
    return data, data_t, dbias(dy), scale, scale_inv, amax


def dbias_cast_transpose_blockwise(
    parts, fp8_dtype: torch.dtype, *, force_pow2_scales: bool = True, amax_epsilon: float = 0.0
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dy = join_column_parts(parts)
    data, scale_inv, data_t, scale_inv_t = quantize_blockwise(
        dy, fp8_dtype, with_transpose=True, force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon)
    return data, scale_inv, data_t, scale_inv_t, dbias(dy)


def join_column_parts(parts) -> Tensor:
    """torch.cat(parts, dim=1) after checking that the parts are column blocks of one gradient."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(f"parts must be a non-empty list or tuple of 2-D tensors, got {type(parts).__name__}")
    for i, part in enumerate(parts):
        check_float(f"parts[{i}]", part)
        check_ndim(f"parts[{i}]", part, 2)
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if part.shape[0] != first.shape[0]:
            raise ValueError(f"parts[{i}] has {part.shape[0]} rows but parts[0] has {first.shape[0]}; "
                             "the parts must be column blocks of one gradient")
        if part.dtype != first.dtype or part.device != first.device:
            raise ValueError(f"parts[{i}] is {part.dtype} on {part.device} but parts[0] is {first.dtype} on "
                             f"{first.device}; the parts must share one dtype and device")
    return torch.cat(parts, dim=1)


def activation_bwd_dbias_cast_transpose(
    dy: Tensor, x: Tensor, kind: str, scale: Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[Tensor] = None,
    limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    check_float("x", x)
    check_ndim("x", x, 2)
    dx = activation_bwd(dy, x, kind, limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset)
    return dbias_cast_transpose(dx, scale, fp8_dtype, amax_out=amax_out)
