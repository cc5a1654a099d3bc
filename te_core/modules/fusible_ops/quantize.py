"""ops.Quantize: Transformer Engine's operation that casts the tensor reaching it to the autocast
recipe's FP8 format (forward=True), and the gradient leaving it (backward=True), so that the next
operations read FP8 values; outside te.autocast it is the identity.

TE hands the next operation the quantized tensor itself. te-core hands it the quantized values in
the input's precision (quantized, then dequantized): a te-core linear operation after it casts them
again, which for a recipe that scales each tensor (or block) by its own amax gives back the same
FP8 values, and any other operation reads them as TE's reads its dequantized input.

Under DelayedScaling the operation keeps scaling state of its own, as TE's does (its quantizers'
amax histories and scales): it is a quantized module with an input slot (forward=True) and an
output-gradient slot (backward=True), so its histories roll, its scales update, its first casts
scale and its state is checkpointed exactly as a te.Linear's input and output gradient's."""
from __future__ import annotations

import torch
from torch import Tensor

from ...quantization.roles import QuantizerSlot, Role
from ...quantization.tensor import QuantizedTensor
from .._base import QuantizedModule
from .._common import check_bool
from ._op import check_extra_inputs
from .operation import BasicOperation

_NAME = "ops.Quantize"


def _values(cast, like: Tensor) -> Tensor:
    """A cast's values in `like`'s dtype and shape (a step passes a tensor it did not cast through)."""
    if not isinstance(cast, QuantizedTensor):
        return cast
    return cast.dequantize(like.dtype).reshape(like.shape)


class _QuantizeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, step, forward: bool, backward: bool) -> Tensor:
        ctx.step, ctx.backward = step, backward
        return _values(step.operand("input", x.contiguous()), x) if forward else x

    @staticmethod
    def backward(ctx, dy: Tensor):
        step = ctx.step
        dx = _values(step.grad_operand("grad_output", dy.contiguous())[0], dy) if ctx.backward else dy
        step.backward_done()  # (schedules the output gradient's scale update, as a Linear's backward does)
        return dx, None, None, None


class Quantize(QuantizedModule, BasicOperation):
    """Under te.autocast: the input cast to the recipe's forward FP8 format (forward=True) and the
    gradient to its backward format (backward=True, unless the recipe's backward_override keeps the
    backward in high precision), as the recipe casts a linear layer's input and output gradient;
    values returned in the input's dtype. Outside te.autocast: the identity."""

    def __init__(self, forward: bool = True, backward: bool = False):
        forward = check_bool(forward, name="forward", module=_NAME)
        backward = check_bool(backward, name="backward", module=_NAME)
        # one slot per direction that casts, as TE's operation has one quantizer per such direction
        slots = [QuantizerSlot("input", Role.INPUT)] if forward else []
        slots += [QuantizerSlot("grad_output", Role.GRAD_OUTPUT)] if backward else []
        super().__init__(slots)
        self._quantize_forward, self._quantize_backward = forward, backward
        self._input_device = None

    def _initialize(self, **_) -> None:
        """reset_parameters(): no parameters to initialize."""

    def _state_device(self) -> torch.device:
        # no parameters to follow: the scaling state lives where the inputs do
        return self._input_device if self._input_device is not None else self.device

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        if not isinstance(input, Tensor) or not input.is_floating_point():
            got = f"a {input.dtype} tensor" if isinstance(input, Tensor) else type(input).__name__
            raise TypeError(f"{_NAME}: input must be a floating-point tensor, got {got}")
        if not (self._quantize_forward or self._quantize_backward):
            return input
        self._input_device = input.device
        step = self.quantization_step()
        if not step.fp8:  # outside te.autocast (or calibrating): TE's operation casts nothing
            return input
        backward = self._quantize_backward and step.backward_override is None
        return _QuantizeFunction.apply(input, step, self._quantize_forward, backward)

    def extra_repr(self) -> str:
        return f"forward={self._quantize_forward}, backward={self._quantize_backward}"
