"""Transformer Engine's fusible activations: the element-wise GELU, QGELU, ReLU, SReLU and SiLU,
and the gated GLU, GEGLU, QGEGLU, ReGLU and SReGLU, act(a) * b of the input's halves [a, b] (TE's
order: the gate comes first, unlike torch's GLU). SwiGLU, which also takes an interleaved layout,
and the row-scaled ScaledSwiGLU and ScaledSReLU are in swiglu.py.

They run te-core's activation ops in the input's precision (GELU is the tanh approximation, as
TE's); under te.autocast the next linear operation quantizes the result as its input.
cache_quantized_input=True saves their input for the backward as FP8 (see cached_input)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ... import ops
from .._common import HP_DTYPES
from ._op import EmptyExtraState, FusibleOperation, check_extra_inputs
from .cached_input import cache_quantized_input_flag, save_input, saved_input


class ActivationFunction(torch.autograd.Function):
    """ops.activation_fwd(x, kind, **params), its gradient by ops.activation_bwd from the saved
    input (params: clamped_swiglu's limit, alpha and glu_linear_offset, else None); with
    cache_quantized, the saved input is an FP8 copy (cached_input) and `op` names the operation."""

    @staticmethod
    def forward(ctx, x: Tensor, kind: str, params: Optional[dict] = None, cache_quantized: bool = False,
                op: str = "") -> Tensor:
        ctx.params = params or {}
        y, _ = ops.activation_fwd(x, kind, **ctx.params)
        save_input(ctx, x, cache_quantized)
        ctx.kind, ctx.op = kind, op or kind
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x = saved_input(ctx, ctx.op)
        return ops.activation_bwd(dy.contiguous(), x, ctx.kind, **ctx.params), None, None, None, None


def check_activation_input(input: Tensor, op: str) -> None:  # noqa: A002 (TE's name)
    if not isinstance(input, Tensor) or input.dtype not in HP_DTYPES:
        got = input.dtype if isinstance(input, Tensor) else type(input).__name__
        raise TypeError(f"{op}: input must be a float32, bfloat16 or float16 tensor, got {got}")


def check_gate_columns(input: Tensor, op: str, interleave: Optional[int] = None) -> None:  # noqa: A002 (TE's name)
    """A gated activation's input: its last dimension holds gate and linear columns alike (in
    blocks of `interleave` where given)."""
    width, unit = (input.shape[-1] if input.dim() else 0), 2 * (interleave or 1)
    if width == 0 or width % unit:
        what = f"2 * glu_interleave_size = {unit}" if interleave else "2"
        raise ValueError(f"{op}: the input's last dimension must be a positive multiple of {what} (gate and linear "
                         f"columns), got shape {tuple(input.shape)}")


class _Activation(EmptyExtraState, FusibleOperation, nn.Module):
    """An activation of te-core's activation ops by the name `kind`; gated ones take an input whose
    last dimension is even, the gate columns first."""

    kind = ""
    gated = False

    def __init__(self, *, cache_quantized_input: bool = False):
        cache = cache_quantized_input_flag(cache_quantized_input, self._name)
        super().__init__()
        self.cache_quantized_input = cache

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        check_activation_input(input, self._name)
        if self.gated:
            check_gate_columns(input, self._name)
        return ActivationFunction.apply(input.contiguous(), self.kind, None, self.cache_quantized_input, self._name)


class GELU(_Activation):
    """GELU, tanh approximation: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""

    kind = "gelu"


class ReLU(_Activation):
    """max(x, 0)."""

    kind = "relu"


class SiLU(_Activation):
    """x sigmoid(x)."""

    kind = "silu"


class GEGLU(_Activation):
    """GELU(a) * b, a and b the first and second halves of the input's last dimension."""

    kind, gated = "geglu", True


class ReGLU(_Activation):
    """max(a, 0) * b, a and b the first and second halves of the input's last dimension."""

    kind, gated = "reglu", True


class QGELU(_Activation):
    """Quick GELU: x sigmoid(1.702 x)."""

    kind = "qgelu"


class SReLU(_Activation):
    """Squared ReLU: max(x, 0)^2."""

    kind = "srelu"


class GLU(_Activation):
    """sigmoid(a) * b, a and b the first and second halves of the input's last dimension."""

    kind, gated = "glu", True


class QGEGLU(_Activation):
    """QGELU(a) * b, a and b the first and second halves of the input's last dimension."""

    kind, gated = "qgeglu", True


class SReGLU(_Activation):
    """max(a, 0)^2 * b, a and b the first and second halves of the input's last dimension."""

    kind, gated = "sreglu", True
