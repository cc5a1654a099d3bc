"""ops.Quantize: Transformer Engine's operation that casts the tensor reaching it to the autocast
recipe's FP8 format (forward=True), and the gradient leaving it (backward=True), so that the next
operations read FP8 values; outside te.autocast it is the identity.

TE hands the next operation the quantized tensor itself. te-core hands it the quantized values in
the input's precision (quantized, then dequantized): a te-core linear operation after it casts them
again, which for a recipe that scales each tensor (or block) by its own amax gives back the same
FP8 values, and any other operation reads them as TE's reads its dequantized input. Under a recipe
with amax histories (DelayedScaling) the cast would need scaling state of the operation's own,
which te-core's operations do not keep: it is refused, naming the alternatives."""
from __future__ import annotations

import torch
from torch import Tensor

from ...quantization.autocast import get_autocast_context
from ...quantization.roles import Role
from .._common import check_bool
from ._op import check_extra_inputs
from .operation import BasicOperation

_NAME = "ops.Quantize"


def _fake_quantize(x: Tensor, quantizer) -> Tensor:
    """x's values after a cast by `quantizer`, in x's dtype and shape."""
    return quantizer.quantize(x.contiguous()).dequantize(x.dtype).reshape(x.shape)


class _QuantizeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, forward_quantizer, backward_quantizer) -> Tensor:
        ctx.backward_quantizer = backward_quantizer
        return x if forward_quantizer is None else _fake_quantize(x, forward_quantizer)

    @staticmethod
    def backward(ctx, dy: Tensor):
        quantizer = ctx.backward_quantizer
        return (dy if quantizer is None else _fake_quantize(dy, quantizer)), None, None


class Quantize(BasicOperation):
    """Under te.autocast: the input cast to the recipe's forward FP8 format (forward=True) and the
    gradient to its backward format (backward=True, unless the recipe's backward_override keeps the
    backward in high precision), as the recipe casts a linear layer's input and output gradient;
    values returned in the input's dtype. Outside te.autocast: the identity."""

    def __init__(self, forward: bool = True, backward: bool = False):
        super().__init__()
        self._quantize_forward = check_bool(forward, name="forward", module=_NAME)
        self._quantize_backward = check_bool(backward, name="backward", module=_NAME)

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        if not isinstance(input, Tensor) or not input.is_floating_point():
            got = f"a {input.dtype} tensor" if isinstance(input, Tensor) else type(input).__name__
            raise TypeError(f"{_NAME}: input must be a floating-point tensor, got {got}")
        context = get_autocast_context()
        if context is None or not context.enabled or not (self._quantize_forward or self._quantize_backward):
            return input
        recipe = context.recipe
        backward = self._quantize_backward and getattr(recipe, "backward_override", None) is None
        return _QuantizeFunction.apply(input, self._quantizer(recipe, Role.INPUT, self._quantize_forward),
                                       self._quantizer(recipe, Role.GRAD_OUTPUT, backward))

    def _quantizer(self, recipe, role: Role, wanted: bool):
        if not wanted:
            return None
        try:
            return recipe.quantizer_for(role)
        except NotImplementedError:
            raise NotImplementedError(
                f"{_NAME}: under te.autocast with {type(recipe).__name__}, whose casts scale by amax histories kept "
                "per operation, a Quantize operation would need scaling state of its own, which te-core's operations "
                "do not keep; use a recipe that scales each tensor by its own amax (Float8CurrentScaling, "
                "Float8BlockScaling, MXFP8BlockScaling), or drop the Quantize: te-core's linear operations cast their "
                "input and output gradient themselves") from None

    def extra_repr(self) -> str:
        return f"forward={self._quantize_forward}, backward={self._quantize_backward}"
