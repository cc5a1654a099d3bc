"""Sequence parallelism of a norm fused with a column-parallel GEMM (LayerNormLinear,
LayerNormMLP), as in Transformer Engine: the norm runs on this rank's sequence shard, and its
output, the GEMM's input, is all-gathered, in FP8 where the recipe allows (see fp8_gather).
The backward reduce-scatters the gradient of the gathered output (high precision) and runs the
norm's backward on the shard.

The module's autograd Function is the one it runs without parallelism: it gets a
SequenceGatherStep in place of its quantization step, which gathers the operand of one slot
after quantizing it (or before, where the gather is in high precision), and hands every other
call to the module's step. `shard_grad` in the Function's backward undoes the gather.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .collectives import all_gather_first_dim, reduce_scatter_first_dim
from .fp8_gather import gather_fp8_now, gather_shard_bytes, gathers_fp8


class SequenceGatherStep:
    """The quantization step `step` of a module whose `slot` operand is all-gathered along the
    sequence over `group` (the step methods are those of te_core.quantization.step)."""

    def __init__(self, step, slot: str, group):
        self._step, self._slot, self._group = step, slot, group
        self._fp8 = gathers_fp8(step, slot, group)

    @property
    def fp8(self) -> bool:
        return self._step.fp8

    def quantizer(self, slot: str):
        return self._step.quantizer(slot)

    def fused_cast_args(self, slot: str) -> Optional[dict]:
        if slot == self._slot and not self._fp8:  # gathered in high precision, quantized after
            return None
        return self._step.fused_cast_args(slot)

    def wrap_fused(self, slot, data, amax, *, nominal_dtype, columnwise=False, data_t=None):
        if slot != self._slot:
            return self._step.wrap_fused(slot, data, amax, nominal_dtype=nominal_dtype, columnwise=columnwise,
                                         data_t=data_t)
        # the norm wrote the shard's FP8 with the group's scale (fused_cast_args): gather its bytes;
        # the column-wise copy is made from the gathered bytes by the GEMM that needs it
        shard = self._step.wrap_fused(slot, data, amax, nominal_dtype=nominal_dtype)
        return gather_shard_bytes(shard, self._group)

    def operand(self, slot: str, x: Tensor, *, columnwise: bool = False):
        if slot != self._slot:
            return self._step.operand(slot, x, columnwise=columnwise)
        if self._fp8:
            return gather_fp8_now(x, self._step, slot, self._group)
        return self._step.operand(slot, all_gather_first_dim(x, self._group), columnwise=columnwise)

    def weight_operand(self, slot: str, weight: Tensor, *, columnwise: bool = False):
        return self._step.weight_operand(slot, weight, columnwise=columnwise)

    def grad_operand(self, slot: str, dy, *, columnwise: bool = False, with_dbias: bool = False):
        return self._step.grad_operand(slot, dy, columnwise=columnwise, with_dbias=with_dbias)

    @property
    def backward_override(self):
        return self._step.backward_override

    def dgrad_weight(self, weight_operand, weight: Tensor, dtype):
        return self._step.dgrad_weight(weight_operand, weight, dtype)

    def check_gemm_dims(self, m: int, n: int, k: int) -> None:
        self._step.check_gemm_dims(m, n, k)

    def backward_done(self) -> None:
        self._step.backward_done()

    def reduce_scatter(self, grad: Tensor) -> Tensor:
        """The gradient of the gathered operand summed over the ranks, this rank's rows kept."""
        return reduce_scatter_first_dim(grad, self._group)


def shard_grad(step, grad: Tensor) -> Tensor:
    """The gradient of the norm's output, for the norm's backward: this rank's shard of it, summed
    over the ranks, under a SequenceGatherStep; as it is otherwise."""
    return step.reduce_scatter(grad) if isinstance(step, SequenceGatherStep) else grad
