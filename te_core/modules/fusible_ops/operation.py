"""ops.BasicOperation and ops.FusedOperation: Transformer Engine's two kinds of fusible operation.

A basic operation computes on one tensor (and its extra inputs) and holds its parameters; te-core's
basic operations define forward(input, *extra_inputs) as modules do. An operation written for
Transformer Engine defines op_forward / op_backward instead, or fuser_forward / fuser_backward where it
has extra inputs or outputs, which run here as one autograd Function.

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
    """op.fuser_forward in the forward, op.fuser_backward in the backward (by default op_forward and
    op_backward), for one basic operation: its output and extra outputs are this Function's outputs,
    and the gradients of its input, parameters (in the order of op.parameters()) and extra inputs are
    those fuser_backward returns."""

    @staticmethod
    def forward(ctx, op: "BasicOperation", kwargs: dict, param_count: int, input: Tensor,  # noqa: A002
                *params_and_extra_inputs: Tensor):
        extra_inputs = params_and_extra_inputs[param_count:]
        context = OperationContext(requires_grad=op._grad_enabled and any(ctx.needs_input_grad[3:]))
        out, extra_outputs = op.fuser_forward([context], input, basic_op_extra_inputs=[extra_inputs],
                                              prev_op_grad_output_quantizer=None, next_op_input_quantizer=None,
                                              basic_op_kwargs=[kwargs])
        extra_outputs = _one_op_slots(op, extra_outputs, op.num_extra_outputs, "fuser_forward", "extra outputs")
        ctx.save_for_backward(*context.to_save)
        context.to_save = ()
        ctx.context, ctx.op, ctx.param_count, ctx.extra_count = context, op, param_count, len(extra_inputs)
        return (out, *extra_outputs) if extra_outputs else out

    @staticmethod
    def backward(ctx, grad_output: Tensor, *grad_extra_outputs: Tensor):
        context, op = ctx.context, ctx.op
        context.saved_tensors = ctx.saved_tensors
        grad_input, grad_params, grad_extra_inputs = op.fuser_backward(
            [context], grad_output, basic_op_grad_extra_outputs=[grad_extra_outputs])
        grad_params = _one_op_slots(op, grad_params, ctx.param_count, "fuser_backward", "parameter gradients",
                                    "one per parameter (None for none), in the order of parameters()")
        grad_extra_inputs = _one_op_slots(op, grad_extra_inputs, ctx.extra_count, "fuser_backward",
                                          "extra input gradients")
        return None, None, None, grad_input, *grad_params, *grad_extra_inputs


def _one_op_slots(op: "BasicOperation", per_op, count: int, method: str, what: str, how: str = "") -> tuple:
    """The one entry of a fuser_* list for this operation (TE's lists hold one per basic operation),
    `count` values; an empty or None entry stands for `count` Nones."""
    entry = per_op[0] if per_op is not None and len(per_op) else None
    entry = () if entry is None else tuple(entry)
    if len(entry) not in (0, count):
        raise RuntimeError(f"{op._name}: {method} returned {len(entry)} {what} for its {count}; return "
                           f"{how or f'a list holding one tuple of {count}'}")
    return entry or (None,) * count


class BasicOperation(EmptyExtraState, FusibleOperation, nn.Module):
    """An operation on one tensor, holding its parameters (Transformer Engine's base class). A
    subclass defines forward(input, *extra_inputs), or writes what Transformer Engine's do:
    op_forward(ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer) and
    op_backward(ctx, grad_output) -> (grad_input, parameter gradients); or, with extra inputs or
    outputs, fuser_forward(basic_op_ctxs, input_, *, basic_op_extra_inputs, ...) -> (output,
    [extra outputs]) and fuser_backward(basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs)
    -> (grad_input, [parameter gradients], [extra input gradients]), each list holding one entry for
    this operation. Both quantizers are None here (te-core hands no quantizer between operations)."""

    def forward(self, input: Tensor, *extra_inputs: Tensor, **kwargs: Any):  # noqa: A002 (TE's name)
        if type(self).op_forward is BasicOperation.op_forward and \
                type(self).fuser_forward is BasicOperation.fuser_forward:
            raise NotImplementedError(f"{self._name}: a BasicOperation defines forward(input, *extra_inputs), or "
                                      "op_forward and op_backward (fuser_forward and fuser_backward with extra inputs "
                                      "or outputs) as for Transformer Engine")
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"{self._name}: takes the input and {self.num_extra_inputs} extra input(s) "
                            f"(num_extra_inputs), got {len(extra_inputs)} extra input(s)")
        # read outside the Function: inside its forward grad mode is always off
        self._grad_enabled = torch.is_grad_enabled()
        params = list(self.parameters())
        return _OperationFunction.apply(self, kwargs, len(params), input, *params, *extra_inputs)

    def op_forward(self, ctx: OperationContext, input_: Tensor, *, prev_op_grad_output_quantizer=None,
                   next_op_input_quantizer=None, **kwargs: Any) -> Tensor:
        raise NotImplementedError(f"{self._name}: op_forward is not defined")

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        raise NotImplementedError(f"{self._name}: op_backward is not defined")

    def fuser_forward(self, basic_op_ctxs: List[OperationContext], input_: Tensor, *, basic_op_extra_inputs,
                      prev_op_grad_output_quantizer=None, next_op_input_quantizer=None, basic_op_kwargs=None):
        """op_forward, for an operation without extra inputs or outputs (TE's default)."""
        self._check_no_extra_slots("fuser_forward", "op_forward")
        out = self.op_forward(basic_op_ctxs[0], input_, prev_op_grad_output_quantizer=prev_op_grad_output_quantizer,
                              next_op_input_quantizer=next_op_input_quantizer, **(basic_op_kwargs or [{}])[0])
        return out, [()]

    def fuser_backward(self, basic_op_ctxs: List[OperationContext], grad_output: Tensor, *,
                       basic_op_grad_extra_outputs):
        """op_backward, for an operation without extra inputs or outputs (TE's default)."""
        self._check_no_extra_slots("fuser_backward", "op_backward")
        grad_input, grad_params = self.op_backward(basic_op_ctxs[0], grad_output)
        return grad_input, [grad_params], [()]

    def _check_no_extra_slots(self, fuser_method: str, op_method: str) -> None:
        if self.num_extra_inputs or self.num_extra_outputs:
            raise NotImplementedError(f"{self._name}: has {self.num_extra_inputs} extra input(s) and "
                                      f"{self.num_extra_outputs} extra output(s), which {op_method} cannot take or "
                                      f"return; define {fuser_method} (or forward(input, *extra_inputs)) instead")


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
        return run_in_order(self._name, dict(self.basic_ops.named_children()), input, extra_inputs, basic_op_kwargs,
                            plan_cache=self.__dict__.setdefault("_plan", []))
