"""ops.MakeExtraOutput: Transformer Engine's operation that hands the tensor reaching it back to the
caller as an extra output of Sequential, and passes it on unchanged. Megatron-LM's fused residual
RMSNorm (`--fused-residual-rmsnorm`) is Sequential(MakeExtraOutput(), RMSNorm(hidden)), which
returns (the normalized input, the input: the residual)."""
from __future__ import annotations

from typing import Tuple

from torch import Tensor, nn

from .._common import check_bool
from ._op import EmptyExtraState, FusibleOperation, check_extra_inputs

_NAME = "ops.MakeExtraOutput"


class MakeExtraOutput(EmptyExtraState, FusibleOperation, nn.Module):
    """(input, input): the input goes on to the next operation and back to the caller as an extra
    output. The input's gradient is the sum of the two outputs' gradients (the next operation's
    alone where the extra output is not used).

    in_place is taken and has no effect: Transformer Engine adds the gradients into the extra
    output's gradient buffer there to save memory; autograd sums them into a new tensor here."""

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False):
        super().__init__()
        self._in_place = check_bool(in_place, name="in_place", module=_NAME)

    def forward(self, input: Tensor, *extra_inputs) -> Tuple[Tensor, Tensor]:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        if not isinstance(input, Tensor):
            raise TypeError(f"{_NAME}: input must be a torch.Tensor, got {type(input).__name__}")
        # a tensor of its own (a view), as TE's extra output is; autograd sums both gradients into the input's
        return input, input.view_as(input)
