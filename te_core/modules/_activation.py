"""LayerNormMLP's `activation` and `activation_params`, as Transformer Engine takes them.

`activation_params` is a dict of extra parameters of the activation; as in Transformer Engine
only clamped_swiglu has any (`limit`, `alpha`, `glu_linear_offset`). The pair becomes one value handed to the
autograd Function: the name alone, or (name, sorted parameter items) for clamped_swiglu, so the
contract ops receive them only for the kind that takes them.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Optional, Tuple, Union

from ..ops.activation import CLAMPED_SWIGLU_DEFAULTS
from ._common import check_activation

ActivationOp = Union[str, Tuple[str, Tuple[Tuple[str, float], ...]]]


def activation_op(activation: str, activation_params: Optional[dict], module: str) -> ActivationOp:
    """The checked activation with its parameters (TE's defaults filled in)."""
    kind = check_activation(activation, module)
    if activation_params is not None and not isinstance(activation_params, dict):
        raise TypeError(f"{module}: activation_params must be a dict or None, got {type(activation_params).__name__}")
    params = dict(activation_params or {})
    if kind != "clamped_swiglu":
        if params:
            raise ValueError(f"{module}: activation_params {params!r} given for activation={kind!r}, which takes "
                             "none; only 'clamped_swiglu' has parameters (limit, alpha, glu_linear_offset)")
        return kind
    unknown = sorted(set(params) - set(CLAMPED_SWIGLU_DEFAULTS))
    if unknown:
        raise ValueError(f"{module}: activation_params for 'clamped_swiglu' takes limit, alpha and "
                         f"glu_linear_offset, got {unknown}")
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{module}: clamped_swiglu's {name} must be a finite number, got {value!r}")
    merged = {**CLAMPED_SWIGLU_DEFAULTS, **{k: float(v) for k, v in params.items()}}
    if not merged["limit"] > 0:
        raise ValueError(f"{module}: clamped_swiglu's limit must be > 0, got {merged['limit']}")
    return kind, tuple(sorted(merged.items()))


def split_activation(act: ActivationOp) -> Tuple[str, Dict[str, float]]:
    """(kind, keyword arguments of the activation ops) of an activation_op value."""
    if isinstance(act, str):
        return act, {}
    return act[0], dict(act[1])
