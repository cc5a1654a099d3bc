"""ops.BasicOperation and ops.FusedOperation: Transformer Engine's two kinds of fusible operation.

A basic operation computes on one tensor (and its extra inputs) and holds its parameters; te-core's
basic operations define forward(input, *extra_inputs) as modules do. An operation written for
Transformer Engine defines op_forward / op_backward instead, which run here as one autograd Function.

A fused operation is a run of basic operations (`basic_ops`, TE's state-dict key) that stands for
them; it holds no state of its own. te-core fuses nothing, so it runs its basic operations in order,
as Sequential does (ops.Linear is one: BasicLinear, Bias and a collective)."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch
from torch import Tensor, nn

from ._op import EmptyExtraState, FusibleOperation
from .sequential import run_in_order


class OperationContext:
    """What Transformer Engine's op_forward gets as `ctx` and op_backward reads back: tensors to
    save (save_for_backward, then saved_tensors), requires_grad, and any attribute set on it."""

    def __init__(self, requires_grad: bool):
        self.requires_grad = requires_grad
        self.to_save: tuple = ()
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors: Optional[Tensor]) -> None:
        self.to_save = tensors


class _OperationFunction(torch.autograd.Function):
    """op.op_forward in the forward, op.op_backward in the backward; the parameters' gradients are
    those op_backward returns, in the order of op.parameters()."""

    @staticmethod
    def forward(ctx, op: "BasicOperation", kwargs: dict, input: Tensor, *params: Tensor) -> Tensor:  # noqa: A002
        context = OperationContext(requires_grad=op._grad_enabled and any(ctx.needs_input_grad[2:]))
        out = op.op_forward(context, input, prev_op_grad_output_quantizer=None, next_op_input_quantizer=None,
                            **kwargs)
        ctx.save_for_backward(*context.to_save)
        context.to_save = ()
        ctx.context, ctx.op, ctx.param_count = context, op, len(params)
        return out

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        context = ctx.context
        context.saved_tensors = ctx.saved_tensors
        grad_input, grad_params = ctx.op.op_backward(context, grad_output)
        grad_params = tuple(grad_params)
        if len(grad_params) not in (0, ctx.param_count):
            raise RuntimeError(f"{ctx.op._name}: op_backward returned {len(grad_params)} parameter gradient(s) for "
                               f"its {ctx.param_count} parameter(s); return one per parameter (None for none), in the "
                               "order of parameters()")
        return None, None, grad_input, *(grad_params or (None,) * ctx.param_count)


class BasicOperation(EmptyExtraState, FusibleOperation, nn.Module):
    """An operation on one tensor, holding its parameters (Transformer Engine's base class). A
    subclass defines forward(input, *extra_inputs), or, as for Transformer Engine,
    op_forward(ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer) and
    op_backward(ctx, grad_output) -> (grad_input, parameter gradients), both quantizers None here
    (te-core hands no quantizer between operations). An operation with extra inputs or outputs
    defines forward: TE's fuser_forward / fuser_backward are not run by te-core."""

    def forward(self, input: Tensor, *extra_inputs: Tensor, **kwargs: Any) -> Tensor:  # noqa: A002 (TE's name)
        if type(self).op_forward is BasicOperation.op_forward:
            raise NotImplementedError(f"{self._name}: a BasicOperation defines forward(input, *extra_inputs), or "
                                      "op_forward and op_backward as for Transformer Engine")
        if self.num_extra_inputs or self.num_extra_outputs or extra_inputs:
            raise NotImplementedError(f"{self._name}: an operation with extra inputs or outputs runs through "
                                      "Transformer Engine's fuser_forward / fuser_backward, which te-core does not "
                                      "call; define forward(input, *extra_inputs) returning (output, *extra_outputs)")
        # read outside the Function: inside its forward grad mode is always off
        self._grad_enabled = torch.is_grad_enabled()
        return _OperationFunction.apply(self, kwargs, input, *self.parameters())

    def op_forward(self, ctx: OperationContext, input_: Tensor, *, prev_op_grad_output_quantizer=None,
                   next_op_input_quantizer=None, **kwargs: Any) -> Tensor:
        raise NotImplementedError(f"{self._name}: op_forward is not defined")

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        raise NotImplementedError(f"{self._name}: op_backward is not defined")


class FusedOperation(FusibleOperation, nn.Module):
    """A run of basic operations, `basic_ops`, that stands for them (Transformer Engine's base
    class). It holds no parameters of its own: they are its basic operations'. Its extra inputs
    are theirs in order, and so are its extra outputs; basic_op_kwargs, where given, holds one
    dict of keyword arguments per basic operation."""

    is_fused_op = True

    def __init__(self, basic_ops: Iterable[FusibleOperation]):
        super().__init__()
        self.basic_ops = nn.ModuleList(basic_ops)
        if len(self.basic_ops) == 0:
            raise ValueError(f"{self._name}: a fused operation needs at least one basic operation (basic_ops)")
        for i, op in enumerate(self.basic_ops):
            if not isinstance(op, FusibleOperation):
                raise TypeError(f"{self._name}: basic_ops[{i}] must be a fusible operation (te_core.modules."
                                f"fusible_ops), got {type(op).__name__}")

    @property
    def num_extra_inputs(self) -> int:
        return sum(op.num_extra_inputs for op in self.basic_ops)

    @property
    def num_extra_outputs(self) -> int:
        return sum(op.num_extra_outputs for op in self.basic_ops)

    def forward(self, input: Tensor, *extra_inputs: Tensor,  # noqa: A002 (TE's name)
                basic_op_kwargs: Optional[List[dict]] = None):
        if basic_op_kwargs is not None and len(basic_op_kwargs) != len(self.basic_ops):
            raise ValueError(f"{self._name}: basic_op_kwargs must hold one dict per basic operation "
                             f"({len(self.basic_ops)}), got {len(basic_op_kwargs)}")
        return run_in_order(self._name, dict(self.basic_ops.named_children()), input, extra_inputs, basic_op_kwargs)
