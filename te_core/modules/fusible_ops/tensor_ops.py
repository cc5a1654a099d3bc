"""Transformer Engine's parameter-free basic operations on the tensor itself: Identity, Reshape,
ConstantScale, Dropout, and AddExtraInput (a residual connection inside a Sequential, the extra
input being the residual). Each is its torch counterpart, whose autograd gives TE's gradients."""
from __future__ import annotations

import numbers
import operator
from typing import Iterable

import torch
from torch import Tensor

from .._common import check_bool, check_probability
from ._op import check_extra_inputs
from .operation import BasicOperation


def _check_tensor(x, op: str, what: str = "input") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(x).__name__}")


class Identity(BasicOperation):
    """The input, unchanged."""

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        _check_tensor(input, self._name)
        return input


class Reshape(BasicOperation):
    """input.reshape(shape) (one dimension may be -1); the gradient takes the input's shape back."""

    def __init__(self, shape: Iterable[int]):
        super().__init__()
        try:
            dims = tuple(None if isinstance(d, bool) else operator.index(d) for d in shape)
        except TypeError:
            dims = (None,)
        if None in dims or min(dims, default=0) < -1 or dims.count(-1) > 1:
            raise ValueError(f"{self._name}: shape must be an iterable of ints >= 0 with at most one -1 (a dimension "
                             f"inferred from the input), got {shape!r}")
        self._shape = dims

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        _check_tensor(input, self._name)
        try:
            return input.reshape(*self._shape)
        except RuntimeError as error:
            raise ValueError(f"{self._name}: an input of shape {tuple(input.shape)} ({input.numel()} elements) cannot "
                             f"take the shape {self._shape}: {error}") from None

    def extra_repr(self) -> str:
        return f"shape={self._shape}"


class ConstantScale(BasicOperation):
    """input * scale, a constant; the gradient is scaled by it too."""

    def __init__(self, scale: float):
        super().__init__()
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"{self._name}: scale must be a real number, got {scale!r} ({type(scale).__name__})")
        self.scale = scale

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        _check_tensor(input, self._name)
        return input * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class Dropout(BasicOperation):
    """In training, each entry zeroed with probability p and the others scaled by 1 / (1 - p)
    (torch's dropout, its generator torch's); the gradient goes through the same mask. In eval
    mode, the input unchanged."""

    def __init__(self, p: float):
        super().__init__()
        self.dropout_probability = check_probability(p, name="p", module=self._name, closed=True)

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        _check_tensor(input, self._name)
        if not self.training or self.dropout_probability == 0:
            return input
        return torch.nn.functional.dropout(input, self.dropout_probability, training=True)

    def extra_repr(self) -> str:
        return f"p={self.dropout_probability}"


class _AddIntoExtraInput(torch.autograd.Function):
    """extra += x, in place, returned: both get the output's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, extra: Tensor) -> Tensor:
        # Through a detached alias, as Transformer Engine does: the memory holds the sum, while the
        # extra input keeps its autograd identity (torch would refuse marking a leaf that requires grad dirty).
        out = extra.detach()
        out.add_(x)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        return dy, dy


class AddExtraInput(BasicOperation):
    """input + the extra input (a residual), whose shape the input broadcasts to; both get the
    output's gradient. in_place=True adds the input into the extra input's memory and returns it,
    as Transformer Engine does (so that tensor holds the sum afterwards, also for a leaf tensor that
    requires grad)."""

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False):
        super().__init__()
        self._in_place = check_bool(in_place, name="in_place", module=self._name)

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 1, extra_inputs, "the tensor to add")
        extra = extra_inputs[0]
        _check_tensor(input, self._name)
        _check_tensor(extra, self._name, "the extra input")
        if self._in_place:
            if torch.broadcast_shapes(input.shape, extra.shape) != extra.shape:
                raise ValueError(f"{self._name}: in_place=True adds the input (shape {tuple(input.shape)}) into the "
                                 f"extra input (shape {tuple(extra.shape)}), which must hold the sum's shape; pass "
                                 "in_place=False")
            return _AddIntoExtraInput.apply(input, extra)
        return extra + input
