"""cache_quantized_input: the option of Transformer Engine's fusible activations that keeps their
input for the backward as FP8 instead of in its own precision (1 byte an element instead of 2 or
4), at the cost of the backward evaluating the derivative at the rounded input.

As in Transformer Engine it applies whenever the option is on, with or without te.autocast and
whatever its recipe: E4M3 with a current (per-tensor) scale, row-wise data only (the backward reads
the input element by element; no GEMM needs its transpose). The output is computed from the
unrounded input, so the option changes only the gradient; the backward dequantizes the saved copy
to the input's dtype."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...quantization import Float8CurrentScalingQuantizer, Role
from ...quantization.tensor import QUANTIZED
from .._common import check_bool
from .._saved import restore_held, save_holding_quantized

# stateless (the scale comes from each tensor's own amax), so one quantizer serves every op
_E4M3_CURRENT = Float8CurrentScalingQuantizer(Role.INPUT, torch.float8_e4m3fn)


def cache_quantized_input_flag(value, op: str) -> bool:
    return check_bool(value, name="cache_quantized_input", module=op)


def save_input(ctx, x: Tensor, cache_quantized: bool) -> None:
    """Save x for the backward, as an FP8 copy where `cache_quantized` and a gradient is needed."""
    saved = _E4M3_CURRENT.quantize(x) if cache_quantized and ctx.needs_input_grad[0] else x
    save_holding_quantized(ctx, [saved])


def saved_input(ctx, op: str) -> Tensor:
    """The input save_input saved, in its own dtype (dequantized where an FP8 copy was saved)."""
    (saved,) = restore_held(ctx, op)  # (QUANTIZED: under torch.compile, a QuantizedOperand)
    return saved.dequantize() if isinstance(saved, QUANTIZED) else saved


class FromCachedInput(torch.autograd.Function):
    """fn(x) for an activation written in torch ops, whose autograd graph would keep float
    intermediates: the forward keeps only x's FP8 copy, and the backward returns grad(dy, x)
    (fn's derivative applied to dy) at the dequantized copy."""

    @staticmethod
    def forward(ctx, x: Tensor, fn: Callable[[Tensor], Tensor], grad: Callable[[Tensor, Tensor], Tensor],
                op: str) -> Tensor:
        ctx.grad, ctx.op = grad, op
        save_input(ctx, x, cache_quantized=True)
        return fn(x)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return ctx.grad(dy, saved_input(ctx, ctx.op)), None, None, None
