"""Transformer Engine's fusible activations: the element-wise GELU, QGELU, ReLU, SReLU and SiLU,
and the gated GLU, GEGLU, QGEGLU, ReGLU and SReGLU, act(a) * b of the input's halves [a, b] (TE's
order: the gate comes first, unlike torch's GLU). SwiGLU, which also takes an interleaved layout,
and the row-scaled ScaledSwiGLU and ScaledSReLU are in swiglu.py.

They run te-core's activation ops in the input's precision (GELU is the tanh approximation, as
TE's); under te.autocast the next linear operation quantizes the result as its input."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ... import ops
from .._common import HP_DTYPES, check_bool
from ._op import EmptyExtraState, FusibleOperation, check_extra_inputs


class ActivationFunction(torch.autograd.Function):
    """ops.activation_fwd(x, kind, **params), its gradient by ops.activation_bwd from the saved
    input (params: clamped_swiglu's limit, alpha and glu_linear_offset, else None)."""

    @staticmethod
    def forward(ctx, x: Tensor, kind: str, params: Optional[dict] = None) -> Tensor:
        ctx.params = params or {}
        y, _ = ops.activation_fwd(x, kind, **ctx.params)
        ctx.save_for_backward(x)
        ctx.kind = kind
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,) = ctx.saved_tensors
        return ops.activation_bwd(dy.contiguous(), x, ctx.kind, **ctx.params), None, None


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


def refuse_cache_quantized_input(cache_quantized_input, op: str) -> None:
    if check_bool(cache_quantized_input, name="cache_quantized_input", module=op):
        raise NotImplementedError(f"{op}: cache_quantized_input=True (an FP8 copy of the input saved for backward) "
                                  "is not supported by te-core; pass False")


class _Activation(EmptyExtraState, FusibleOperation, nn.Module):
    """An activation of te-core's activation ops by the name `kind`; gated ones take an input whose
    last dimension is even, the gate columns first."""

    kind = ""
    gated = False

    def __init__(self, *, cache_quantized_input: bool = False):
        refuse_cache_quantized_input(cache_quantized_input, self._name)
        super().__init__()
        self.cache_quantized_input = False

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        check_activation_input(input, self._name)
        if self.gated:
            check_gate_columns(input, self._name)
        return ActivationFunction.apply(input.contiguous(), self.kind)


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
